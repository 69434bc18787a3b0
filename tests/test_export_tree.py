"""`ogspo export-tree`: static trees as vLLM's `speculative_token_tree`, EAGLE-3 dynamic trees as
SGLang's three settings, read from a run's results folder; the exports round-trip into `Structure`."""

import ast
import json

import numpy as np
import pytest

from ogspo.cli import main
from ogspo.engine.tree import Structure
from ogspo.offline.replay import ReplayCycles, _node_depths, replay, replay_dynamic
from ogspo.offline.serving import (
    best_uniform,
    parse_vllm_tree,
    replay_tps,
    replayed,
    sglang_nearest,
    sglang_settings,
    uniform_candidates,
    vllm_children,
    vllm_tree,
)
from ogspo.stages.export_tree import export_trees


def vllm_drafts(settings: dict) -> list[tuple[int, ...]]:
    """The tree vLLM's tree proposer drafts for `speculative_config` entries: an independent reading of
    `vllm/v1/spec_decode/eagle.py` (commit f7eef1b6987f) and `vllm/config/speculative.py`. The tree is
    sorted breadth-first; per level, children = nodes at the level // nodes at the level above, and the
    proposer takes that many top-k tokens under every node of the level above, parent by parent."""
    choices = sorted(ast.literal_eval(settings["speculative_token_tree"]), key=lambda t: (len(t), t))
    counts = [0] * len(choices[-1])
    for c in choices:
        counts[len(c) - 1] += 1
    children = [counts[0], *(b // a for a, b in zip(counts, counts[1:]))]
    drafted, level = [], [()]
    for c in children:
        level = [p + (r,) for p in level for r in range(c)]
        drafted += level
    return drafted


def assert_vllm_drafts_it(settings: dict) -> None:
    """An export marked exact is the very tree vLLM drafts, and K is its size."""
    assert settings["exact"] is True
    if not settings["speculation"]:
        return
    written = ast.literal_eval(settings["speculative_token_tree"])
    assert vllm_drafts(settings) == written
    assert settings["num_speculative_tokens"] == len(written)


# vLLM's own test trees (tests/v1/spec_decode/test_eagle.py, test_propose_tree): a single token, a chain,
# three siblings, three siblings with two children each
VLLM_TEST_TREES = ([(0,)], [(0,), (0, 0), (0, 0, 0)], [(0,), (1,), (2,)],
                   [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)])
# trees vLLM does not draft as written: 2 children under (0,), 1 under (1,), none under (2,); Sequoia's T=0 shape
NOT_UNIFORM = ([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)], [(0,), (1,), (0, 0)])


@pytest.mark.parametrize("paths", VLLM_TEST_TREES)
def test_a_uniform_tree_is_exported_exactly_as_vllm_drafts_it(paths):
    v = vllm_tree(Structure(paths))
    assert_vllm_drafts_it(v)
    assert parse_vllm_tree(v["speculative_token_tree"]).paths == Structure(paths).paths
    assert vllm_children(Structure(paths)) is not None


@pytest.mark.parametrize("paths", NOT_UNIFORM)
def test_a_tree_vllm_cannot_draft_is_marked_with_a_uniform_one_beside_it(paths):
    v = vllm_tree(Structure(paths))
    assert v["exact"] is False and "every node of a level" in v["why"]
    assert vllm_drafts({"speculative_token_tree": str(paths)}) != paths  # the rule drafts another tree
    assert_vllm_drafts_it(v["uniform"])
    assert set(ast.literal_eval(v["uniform"]["speculative_token_tree"])) <= set(paths)  # the largest uniform one inside
    assert vllm_tree(Structure([])) == {"speculation": False, "exact": True}
    with pytest.raises(ValueError, match="not a list of int tuples"):
        parse_vllm_tree("[(0,), [1]]")


def test_the_uniform_candidates_are_the_uniform_trees_inside_the_template():
    cands = uniform_candidates(Structure.full([3, 2, 1]))
    assert [3] in cands and [3, 2, 1] in cands and [2, 2] in cands and [1, 1, 1] in cands
    assert all(set(Structure.full(c).paths) <= set(Structure.full([3, 2, 1]).paths) for c in cands)
    assert len(cands) == 3 + 3 * 2 + 3 * 2 * 1


def test_eagle_trees_are_sglangs_three_settings():
    assert sglang_settings(60, 5, 10) == {"speculation": True, "speculative_num_steps": 5, "speculative_eagle_topk": 10,
                                          "speculative_num_draft_tokens": 61}  # SGLang counts the root
    near = sglang_nearest(Structure(list(NOT_UNIFORM[0])))
    assert (near["speculative_num_steps"], near["speculative_eagle_topk"], near["speculative_num_draft_tokens"]) == (3, 3, 8)
    assert near["exact"] is False and "dynamic" in near["why"]


def test_export_reads_a_results_folder(tmp_path, capsys):
    res = tmp_path / "results"
    (res / "ogspo" / "T0").mkdir(parents=True)
    (res / "ogspo" / "T0" / "structure.json").write_text(json.dumps({"structure": [[0], [1], [0, 0]]}))
    (res / "ogspo" / "T0" / "workloads.json").write_text(json.dumps({
        "code": {"shipped": "policy", "structure": None}, "chat": {"shipped": "static", "structure": [[0], [1]]}}))
    (res / "ogspo" / "T0" / "export.json").write_text(json.dumps({"static": True, "autoregressive": False}))
    (res / "evaluate").mkdir()
    (res / "evaluate" / "tune_T0.json").write_text(json.dumps({"winners": {"mtbench": [8, 3, 2], "fortunes": [0, 0, 0]}}))
    doc = export_trees(res, ["T0"])
    t0 = doc["temperatures"]["T0"]
    code, chat = t0["ogspo"]["code"], t0["ogspo"]["chat"]  # the policy ships for code: its whole structure is exported
    assert code["structure"] == [[0], [1], [0, 0]] and "not exported" in code["stop_policy"]
    assert code["vllm"]["exact"] is False and code["vllm"]["uniform"]["children_per_level"] == [2]
    assert_vllm_drafts_it(code["vllm"]["uniform"])
    assert_vllm_drafts_it(chat["vllm"]) and "stop_policy" not in chat
    assert any("TREE_ATTN" in n for n in doc["vllm_notes"]) and any("T > 0" in n for n in doc["vllm_notes"])
    assert t0["eagle_tuned"]["mtbench"]["sglang"]["speculative_num_draft_tokens"] == 9
    assert t0["eagle_tuned"]["fortunes"]["sglang"] == {"speculation": False}
    assert doc["missing"] == [f"{res}/latency/latency.json (no replayed tokens/s)", f"{res}/sequoia/T0/structure.json"]
    assert "replayed" not in code  # no records, no latency model: nothing to replay
    assert main(["export-tree", "--results", str(res), "--temperatures", "T0", "--out", str(tmp_path / "x.json")]) == 0
    assert json.loads((tmp_path / "x.json").read_text()) == json.loads(capsys.readouterr().out)


WIDE = Structure([(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)])  # ids: root 0, (0) 1, (1) 2, (0,0) 3, (0,1) 4, (1,0) 5, (1,1) 6


def _cycles(paths, template=WIDE):
    pad = len(template) + 1
    arr = np.full((len(paths), template.max_depth), pad, dtype=np.int64)
    for c, p in enumerate(paths):
        arr[c, : len(p)] = p
    return ReplayCycles(template=template, paths=arr, context_lengths=np.full(len(paths), 200.0),
                        node_depth=_node_depths(template))


def test_a_dynamic_tree_is_replayed_cycle_by_cycle_with_its_rerank():
    from solve_helpers import synthetic_latency

    model = synthetic_latency(catchup=(0.001, 0.0005))
    cycles = _cycles([[1, 3], [1, 3]])  # both cycles accepted (0) then (0, 0)
    cum = np.array([[0, -0.1, -2.0, -0.2, -3.0, -2.1, -4.0],  # keeps (0), (0,0), (1): accepts 2
                    [0, -1.0, -0.5, -1.1, -5.0, -0.6, -5.0]])  # keeps (1), (1,0), (0): accepts (0) only
    r = replay_dynamic(cycles=cycles, cum_logq=cum, total_tokens=3, depth=2, top_k=2, model=model)
    assert r.accepted.tolist() == [[3, 2]]
    expect = model.t_draft(np.array([1, 2])).sum() + model.t_verify(np.array([4, 4]), cycles.context_lengths) + \
        model.t_fixed(np.array([4, 4])) + model.t_catchup(np.array([3, 2]))
    np.testing.assert_allclose(r.seconds[0], expect)
    with pytest.raises(ValueError, match=r"no node \[2\]"):
        replay_dynamic(cycles=cycles, cum_logq=cum, total_tokens=3, depth=2, top_k=3, model=model)


def test_a_dynamic_tree_that_keeps_a_static_one_replays_to_the_same_throughput():
    from solve_helpers import synthetic_cycles, synthetic_latency

    model = synthetic_latency()
    cycles = synthetic_cycles(WIDE, 200, seed=3)
    rng = np.random.default_rng(0)
    step = np.log(rng.uniform(0.05, 1.0, (200, len(WIDE) + 1)))
    cum = np.zeros_like(step)
    cum[:, 1:3] = step[:, 1:3]
    cum[:, 3:5] = cum[:, [1]] + step[:, 3:5]
    cum[:, 5:7] = cum[:, [2]] + step[:, 5:7]
    dyn = replay_dynamic(cycles=cycles, cum_logq=cum, total_tokens=2, depth=1, top_k=2, model=model)
    static = replay(cycles=cycles, structures=[Structure([(0,), (1,)])], depths=[1], model=model)
    np.testing.assert_array_equal(dyn.accepted, static.accepted)
    np.testing.assert_allclose(dyn.throughput, static.throughput)


def test_the_best_uniform_tree_is_chosen_on_the_records():
    from solve_helpers import synthetic_cycles, synthetic_latency

    model = synthetic_latency()
    template = Structure.full([3, 2, 1])
    records = [(synthetic_cycles(template, 300, seed=4), None)]
    best = best_uniform(records, model)
    scored = {tuple(c): replay(cycles=records[0][0], structures=[Structure.full(c)], depths=[len(c)], model=model)
              for c in uniform_candidates(template)}
    tps = {c: float(r.accepted.sum() / r.seconds.sum()) for c, r in scored.items()}
    if best["speculation"]:
        assert_vllm_drafts_it(best)
        assert tuple(best["children_per_level"]) == max(tps, key=tps.get)
        assert best["replayed_tokens_per_second"] == pytest.approx(max(tps.values()))
    else:
        assert max(tps.values()) <= best["replayed_tokens_per_second"]


def test_a_tree_that_leaves_the_records_template_is_named_not_replayed():
    """Sequoia builds its tree from acceptance by rank and may leave the template (the quick DAG's
    Sequoia tree held [1, 2, 1] once): the export names the node and keeps AR's figure, never fails."""
    from solve_helpers import synthetic_cycles, synthetic_latency

    model = synthetic_latency()
    records = [(synthetic_cycles(WIDE, 100, seed=5), None)]
    out = replayed(Structure([(0,), (1,), (1, 0), (1, 1), (1, 2)]), records, model)
    assert out["tokens_per_second"] is None and out["not_replayed"] == "node [1, 2] is not in the records' template"
    assert out["ar_tokens_per_second"] == replay_tps([Structure([])], records, model)[0] > 0
