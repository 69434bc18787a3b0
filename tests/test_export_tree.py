"""`ogspo export-tree`: static trees as vLLM's `speculative_token_tree`, EAGLE-3 dynamic trees as
SGLang's three settings, read from a run's results folder; the exports round-trip into `Structure`."""

import json

import numpy as np
import pytest

from ogspo.cli import main
from ogspo.engine.tree import Structure
from ogspo.offline.replay import ReplayCycles, _node_depths, replay, replay_dynamic
from ogspo.stages.export_tree import export_trees, parse_vllm_tree, sglang_nearest, sglang_settings, vllm_tree

# vLLM's own spelling (its tests and docs): str() of a level-ordered list of rank-path tuples
VLLM_FIXTURE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"


def test_a_static_tree_is_vllms_token_tree_and_back():
    s = Structure([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    v = vllm_tree(s)
    assert v == {"speculation": True, "num_speculative_tokens": 7, "speculative_token_tree": VLLM_FIXTURE}
    assert parse_vllm_tree(VLLM_FIXTURE).paths == s.paths
    assert vllm_tree(Structure([])) == {"speculation": False}
    with pytest.raises(ValueError, match="not a list of int tuples"):
        parse_vllm_tree("[(0,), [1]]")


def test_eagle_trees_are_sglangs_three_settings():
    assert sglang_settings(60, 5, 10) == {"speculation": True, "speculative_num_steps": 5, "speculative_eagle_topk": 10,
                                          "speculative_num_draft_tokens": 61}  # SGLang counts the root
    near = sglang_nearest(Structure([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]))
    assert (near["speculative_num_steps"], near["speculative_eagle_topk"], near["speculative_num_draft_tokens"]) == (3, 3, 8)
    assert near["exact"] is False and "dynamic" in near["why"]


def test_export_reads_a_results_folder(tmp_path, capsys):
    res = tmp_path / "results"
    (res / "policy" / "T0").mkdir(parents=True)
    (res / "policy" / "T0" / "structure.json").write_text(json.dumps({"structure": [[0], [1], [0, 0]]}))
    (res / "policy" / "T0" / "export.json").write_text(json.dumps({"static": True, "autoregressive": False}))
    (res / "evaluate").mkdir()
    (res / "evaluate" / "tune_T0.json").write_text(json.dumps({"winners": {"mtbench": [8, 3, 2], "fortunes": [0, 0, 0]}}))
    doc = export_trees(res, ["T0"])
    t0 = doc["temperatures"]["T0"]
    assert parse_vllm_tree(t0["ogspo"]["*"]["vllm"]["speculative_token_tree"]).to_list() == [[0], [1], [0, 0]]
    assert t0["eagle_tuned"]["mtbench"]["sglang"]["speculative_num_draft_tokens"] == 9
    assert t0["eagle_tuned"]["fortunes"]["sglang"] == {"speculation": False}
    assert doc["missing"] == [f"{res}/latency/latency.json (no replayed tokens/s)", f"{res}/sequoia/T0/structure.json"]
    assert "replayed" not in t0["ogspo"]["*"]  # no records, no latency model: nothing to replay
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
