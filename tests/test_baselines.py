"""Baselines from records: the Sequoia-style static tree and pre-drafting routing (docs/DESIGN.md §7).

Tiny float64 models and synthetic records only (fast)."""

import itertools
import json

import numpy as np
import polars as pl
import pytest
from engine_helpers import hf_greedy, tiny_model
from solve_helpers import synthetic_cycles, synthetic_latency

from ogspo.artifacts.latency import LatencyModel
from ogspo.artifacts.records import Records, template_index
from ogspo.artifacts.router import ROUTER_FEATURES, Router, load_router, template_name, write_router
from ogspo.artifacts.structure import load_structure
from ogspo.engine.decode import SpeculativeEngine
from ogspo.engine.drafters import LMDrafter
from ogspo.engine.target import LlamaTreeLM, build_tree_lm
from ogspo.engine.tree import Structure
from ogspo.learn.routing import RoutingData, check_templates, routing_data, simulate_router, train_router
from ogspo.methods.registry import make_policy
from ogspo.methods.routing import RoutedTree
from ogspo.offline.replay import replay
from ogspo.offline.sequoia import best_trees, estimate_acceptance, expected_accepted, sequoia_tree

# ---------------------------------------------------------------- Sequoia


def _all_structures(depth: int, width: int, prefix=()) -> list[list[tuple[int, ...]]]:
    """Every left- and ancestor-closed set of descendants of `prefix` within depth/width limits."""
    if len(prefix) == depth:
        return [[]]
    out: list[list[tuple[int, ...]]] = [[]]
    for k in range(1, width + 1):  # exactly the first k children, each with any subtree below it
        kids = [prefix + (r,) for r in range(k)]
        for below in itertools.product(*(_all_structures(depth, width, c) for c in kids)):
            out.append(kids + [p for sub in below for p in sub])
    return out


def test_sequoia_dp_equals_brute_force():
    """DP value per size equals the best over every left/ancestor-closed tree (depth 4, 2 ranks), with
    acceptance that is not monotone in rank, and its tree is of that size and worth that value."""
    probs = np.array([[0.5, 0.3], [0.2, 0.6], [0.7, 0.1], [0.4, 0.35]])
    trees = best_trees(probs, max_nodes=30)
    reach = {p: float(np.prod([probs[l, r] for l, r in enumerate(p)])) for p in Structure.full([2, 2, 2, 2]).paths}
    best: dict[int, float] = {}
    for s in _all_structures(4, 2):
        value = 1.0 + sum(reach[p] for p in s)
        best[len(s)] = max(best.get(len(s), -1.0), value)
    assert len(best) == 31 and best[30] == pytest.approx(expected_accepted(Structure.full([2, 2, 2, 2]), probs))
    for n in range(31):
        S = trees.structures[n]
        assert len(S) == n and S.max_depth <= 4 and max((max(p) for p in S.paths), default=0) < 2
        assert trees.expected[n] == pytest.approx(best[n], abs=1e-12)
        assert expected_accepted(S, probs) == pytest.approx(trees.expected[n], abs=1e-12)
    # a depth limit of 1 with 2 ranks: no tree of 3 nodes exists
    shallow = best_trees(probs[:1], max_nodes=3)
    assert shallow.structures[3] is None and shallow.expected[3] == -np.inf


def test_acceptance_estimates_recover_synthetic_rates():
    T = Structure.full([3, 2, 2, 1])
    cyc = synthetic_cycles(T, 6000, seed=1, p0=0.7, decay=0.9, rank_decay=0.5)
    acc = estimate_acceptance(cyc, by_depth=True)
    # depth 1: rank 0 with 0.7; rank 1 when rank 0 fails, with 0.7 * 0.5
    assert acc.probs[0, 0] == pytest.approx(0.7, abs=0.02)
    assert acc.probs[0, 1] == pytest.approx(0.3 * 0.35, abs=0.02)
    assert acc.probs[1, 0] == pytest.approx(0.63, abs=0.03)
    assert np.isnan(acc.probs[3, 1]) and acc.trials[3, 1] == 0  # depth 4 has one child per node in T
    pooled = estimate_acceptance(cyc, by_depth=False)
    assert (pooled.probs == pooled.probs[0]).all() and pooled.max_rank == 3
    # E[A] from the by-depth estimates matches the records' mean committed tokens for a tree inside T
    S = Structure([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
    mean_A = replay(cycles=cyc, structures=[S], depths=np.array([3])).accepted.mean()
    assert expected_accepted(S, np.nan_to_num(acc.probs)) == pytest.approx(mean_A, rel=0.02)


def _latency(verify_at_128: float, draft: float = 0.0) -> LatencyModel:
    return LatencyModel(
        sizes=[1, 128], contexts=[100, 1000], verify_table=[[0.1, 0.1], [verify_at_128, verify_at_128]],
        verify_intercept=[0.1, verify_at_128], verify_slope=[0.0, 0.0], slope_mode="global", draft_widths=[1, 16],
        draft_table=[draft, draft], fixed=0.0, fixed_ar=0.0, fixed_slope=0.0, catchup=[], meta={"synthetic": True},
    )


def test_sequoia_size_follows_the_latency_model(tmp_path):
    T = Structure.full([3, 2, 2, 1, 1, 1])
    cyc = synthetic_cycles(T, 400, seed=0)
    flat = sequoia_tree(cycles=cyc, latency=_latency(0.1), config={"max_nodes": 20, "by_depth": True})
    assert flat.size == 20 and flat.inside_template  # free verification and drafting: the biggest tree
    assert flat.replayed[20] == pytest.approx(max(r for r in flat.replayed if r is not None))
    mid = sequoia_tree(cycles=cyc, latency=synthetic_latency(), config={"max_nodes": 20, "by_depth": True})
    assert 0 < mid.size < 20 and mid.inside_template
    steep = sequoia_tree(cycles=cyc, latency=_latency(30.0, draft=0.01), config={"max_nodes": 20})
    assert steep.size == 0 and len(steep.structure) == 0  # verification cost rises too fast: autoregressive
    assert steep.throughput == pytest.approx(steep.replayed_autoregressive)
    # the replay figure of the chosen tree is the records' own
    res = replay(cycles=cyc, structures=[mid.structure], depths=np.array([mid.structure.max_depth]), model=synthetic_latency())
    assert mid.replayed[mid.size] == pytest.approx(float(res.throughput[0]))
    # deeper than the template with pooled ranks: the tree leaves T and gets no replay figure
    deep = sequoia_tree(cycles=cyc, latency=_latency(0.1), config={"max_nodes": 40, "max_depth": 9})
    assert deep.structure.max_depth > T.max_depth and not deep.inside_template and deep.replayed[deep.size] is None
    with pytest.raises(ValueError, match="by_depth"):
        sequoia_tree(cycles=cyc, latency=_latency(0.1), config={"max_depth": 9, "by_depth": True})


@pytest.fixture(scope="module")
def tiny_stage_inputs(tmp_path_factory):
    """Real record shards of tiny models (template [3, 2, 1]) and a synthetic latency.json."""
    from ogspo.stages.collect_records import collect_records

    out = tmp_path_factory.mktemp("baseline_records")
    target = build_tree_lm(tiny_model(0), max_len=128)
    drafter = LMDrafter(LlamaTreeLM(tiny_model(0), max_len=128, n_layers=1))
    prompts = [[5, 9, 13, 2, 7], [3, 3, 3, 3, 3, 3, 40, 41], [17, 22, 60, 1, 8, 33, 12, 5, 9, 13], [4, 8, 15, 16, 23, 42]]
    collect_records(target=target, drafter=drafter, template=Structure.full([3, 2, 1]), prompts=prompts, temperature=0.0,
                    seed=0, max_new_tokens=12, out_dir=out / "records", shard_size=2, model_checksum="m" * 64, drafter_id="ee1")
    latency = out / "latency.json"
    latency.write_text(json.dumps(synthetic_latency().to_json()))
    return out / "records", latency


def test_baseline_stages_on_record_shards(tiny_stage_inputs, tmp_path, capsys):
    """build-sequoia and train-routing through the CLI: files the static / routing methods read."""
    from ogspo.cli import main

    records, latency = tiny_stage_inputs
    cfg = {"baselines": {"sequoia": {"max_nodes": 12, "max_depth": None, "by_depth": True},
                         "routing": {"templates": [[], [[0]], [[0], [0, 0]], [[0], [1], [0, 0]]], "hidden": 4, "steps": 30,
                                     "lr": 0.01, "weight_decay": 0.0, "rounds": 2, "holdout_fraction": 0.25}}, "seed": 0}
    rc = main(["build-sequoia", "--config-json", json.dumps(cfg), "--records", str(records), "--latency", str(latency),
               "--out", str(tmp_path / "sequoia")])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "sequoia" / "sequoia.json").read_text())
    S = load_structure(tmp_path / "sequoia" / "structure.json")
    assert S.to_list() == report["structure"] and report["inside_template"] and len(report["per_size"]["expected_accepted"]) == 13
    assert report["replayed_throughput"] == report["per_size"]["replayed_throughput"][report["size"]] > 0
    assert report["modelled_throughput"] == max(report["per_size"]["modelled_throughput"])
    if len(S):
        assert make_policy("static", structure=tmp_path / "sequoia" / "structure.json").structure.paths == S.paths
    rc = main(["train-routing", "--config-json", json.dumps(cfg), "--records", str(records), "--latency", str(latency),
               "--out", str(tmp_path / "routing")])
    assert rc == 0, capsys.readouterr().err
    train = json.loads((tmp_path / "routing" / "train.json").read_text())
    assert train["n_holdout_requests"] == 1 and train["template_names"] == ["ar", "chain1", "chain2", "tree3d2"]
    assert isinstance(make_policy("routing", router_path=tmp_path / "routing" / "router.json"), RoutedTree)
    bad = {**cfg,
           "baselines": {**cfg["baselines"],
                         "routing": {**cfg["baselines"]["routing"], "templates": [[], [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]]}}}
    rc = main(["train-routing", "--config-json", json.dumps(bad), "--records", str(records), "--latency", str(latency),
               "--out", str(tmp_path / "bad")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "templates[1]: node [0, 0, 0, 0] is not in the records template" in err and "\n" not in err
    rc = main(["build-sequoia", "--config-json", json.dumps(cfg), "--records", str(tmp_path / "none"),
               "--latency", str(latency), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("ogspo: error:") and "none" in err and "\n" not in err


def test_sequoia_structure_file_round_trips(tmp_path):
    from ogspo.artifacts.structure import write_structure

    S = Structure([(0,), (1,), (0, 0)])
    write_structure(S, tmp_path / "structure.json")
    policy = make_policy("static", structure=tmp_path / "structure.json")
    assert policy.structure.paths == S.paths
    write_structure(Structure([]), tmp_path / "empty.json")
    assert len(load_structure(tmp_path / "empty.json")) == 0
    (tmp_path / "bad.json").write_text('{"structure": [[1]]}')
    with pytest.raises(ValueError, match="elder sibling"):
        make_policy("static", structure=tmp_path / "bad.json")


# ---------------------------------------------------------------- routing

TEMPLATE = Structure.full([3, 2, 1, 1])
TEMPLATES = [[], [[0]], [[0], [0, 0]], [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]], [[0], [1], [0, 0]]]


def _synthetic_records(n_requests=40, cycles=25, seed=0) -> Records:
    """Easy requests (short contexts) accept the whole top-1 chain of T, hard ones (long contexts) nothing."""
    rng = np.random.default_rng(seed)
    idx = template_index(TEMPLATE)
    chain = [idx[(0,) * d] for d in range(1, 5)]
    rows = {"request_id": [], "cycle": [], "context_length": [], "accepted_tnodes": []}
    for r in range(n_requests):
        easy = r % 2 == 0
        L = int(rng.integers(40, 200) if easy else rng.integers(700, 1000))
        for c in range(1, cycles + 1):
            acc = chain if easy and rng.random() < 0.95 else ([] if rng.random() < 0.9 else chain[:1])
            rows["request_id"].append(f"w/{r}")
            rows["cycle"].append(c)
            rows["context_length"].append(L)
            rows["accepted_tnodes"].append(acc)
            L += len(acc) + 1
    cyc = pl.DataFrame(rows, schema={"request_id": pl.Utf8, "cycle": pl.Int64, "context_length": pl.Int64,
                                     "accepted_tnodes": pl.List(pl.Int32)})
    return Records(nodes=pl.DataFrame(), cycles=cyc, meta={}, template=TEMPLATE)


def test_routing_picks_the_template_the_context_determines():
    templates = check_templates(TEMPLATES, TEMPLATE)
    data = routing_data(records=_synthetic_records(), templates=templates, latency=synthetic_latency())
    res = train_router(data=data, seed=0, config={"hidden": 8, "steps": 300, "rounds": 2, "holdout_fraction": 0.25})
    ho = res.holdout
    assert ho is not None and res.n_holdout_requests == 10
    assert ho.throughput > max(ho.fixed_throughputs.values()) * 1.05
    assert ho.throughput >= 0.97 * ho.per_cycle_bound
    # per cycle: chain4 on easy (short-context) requests, autoregressive on hard ones
    _, choice = simulate_router(data, lambda f: res.router.choose(f)[0])
    easy = np.array([int(r.split("/")[1]) % 2 == 0 for r in data.requests])
    names = np.array([template_name(S) for S in templates])
    assert (names[choice[easy]] == "chain4").mean() > 0.95
    assert (names[choice[~easy]] == "ar").mean() > 0.95


def test_check_templates_errors():
    with pytest.raises(ValueError, match=r"templates\[1\]: node \[0, 0, 0, 0, 0\] is not in the records template"):
        check_templates([[], [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]]], TEMPLATE)
    with pytest.raises(ValueError, match=r"templates\[1\].*elder sibling"):
        check_templates([[], [[0], [2]]], TEMPLATE)
    with pytest.raises(ValueError, match="repeats"):
        check_templates([[[0]], [[0]]], TEMPLATE)
    with pytest.raises(ValueError, match="at least 2"):
        check_templates([[[0]]], TEMPLATE)


def _context_router() -> Router:
    """ar for short contexts, chain2 in between, a 5-node tree for long contexts (score linear in log_context)."""
    templates = [Structure([]), Structure.chain(2), Structure([(0,), (1,), (0, 0), (0, 1), (1, 0)])]
    F = len(ROUTER_FEATURES)
    W = np.zeros((3, F))
    W[1, 0], W[2, 0] = 2.0, 4.0
    b = np.array([0.0, -4.6, -12.0])
    return Router(templates=templates, mean=np.zeros(F), scale=np.ones(F), layers=[(W, b)], lam=1.0)


class _Spy:
    """Records each cycle's features and choice (online) and the committed tokens (engine observer)."""

    def __init__(self, router: Router):
        self.router, self.features, self.choices, self.traces = router, [], [], []
        self.inner = router.choose

    def choose(self, f):
        k = self.inner(f)
        self.features.append(np.asarray(f).copy())
        self.choices.append(int(k[0]))
        return k

    def observe(self, trace):
        self.traces.append((trace.context_length, len(trace.committed)))


def test_routing_method_is_lossless_and_features_match_offline(tmp_path):
    write_router(_context_router(), tmp_path / "router.json")
    target_model = tiny_model(0)
    target = build_tree_lm(target_model, max_len=256)
    drafter = LMDrafter(LlamaTreeLM(tiny_model(0), max_len=256, n_layers=1))  # early exit: partial acceptance
    policy = make_policy("routing", router_path=tmp_path)  # the folder
    assert isinstance(policy, RoutedTree) and policy.max_nodes == 6 and policy.max_depth == 2
    spy = _Spy(policy.router)
    policy.router.choose = spy.choose
    engine = SpeculativeEngine(target=target, policy=policy, drafter=drafter, cycle_observer=spy.observe)
    used = set()
    for prompt in ([5, 9, 13, 2, 7], [17, 22, 60, 1, 8, 33, 12, 5, 9, 13]):
        spy.features.clear(), spy.choices.clear(), spy.traces.clear()
        res = engine.generate(prompt, max_new_tokens=40, seed=0)
        assert res.tokens == hf_greedy(target_model, prompt, 40)
        used |= set(spy.choices)
        # offline simulation with the same commits and choices gives the same features
        C, K = len(spy.choices), 3
        acc = np.zeros((C, K))
        acc[np.arange(C), spy.choices] = [n for _, n in spy.traces]
        data = RoutingData(policy.router.templates, acc, np.ones((C, K)), np.array([L for L, _ in spy.traces], float),
                           np.array(["r"] * C, dtype=object), np.arange(1, C + 1))
        X, ch = simulate_router(data, lambda f, it=iter(spy.choices): next(it))
        np.testing.assert_allclose(X, np.stack(spy.features), atol=1e-12)
    assert used == {0, 1, 2} and (policy.counts > 0).all()  # every template is used


def test_router_json_round_trips(tmp_path):
    templates = check_templates(TEMPLATES, TEMPLATE)
    data = routing_data(records=_synthetic_records(n_requests=8, cycles=6), templates=templates, latency=synthetic_latency())
    router = train_router(data=data, seed=0, config={"hidden": 4, "steps": 20, "rounds": 1}).router
    write_router(router, tmp_path / "router.json")
    back = load_router(tmp_path / "router.json")
    X = np.random.default_rng(0).normal(size=(50, len(ROUTER_FEATURES)))
    np.testing.assert_allclose(back.scores(X), router.scores(X))
    assert [S.paths for S in back.templates] == [S.paths for S in templates] and back.lam == router.lam
    linear = train_router(data=data, seed=0, config={"hidden": 0, "steps": 20, "rounds": 1}).router
    assert len(linear.layers) == 1  # multinomial logistic regression
    write_router(linear, tmp_path / "lin.json")
    np.testing.assert_allclose(load_router(tmp_path / "lin.json").scores(X), linear.scores(X))


def test_bad_router_files_give_one_line_errors(tmp_path, capsys):
    from ogspo.cli import main

    good = _context_router().to_json()
    cases = {
        "missing": None,
        "text": "not json",
        "foreign": json.dumps({"structure": [[0]]}),
        "version": json.dumps({**good, "features_version": 99}),
        "shapes": json.dumps({**good, "mean": [0.0, 1.0]}),
        "templates": json.dumps({**good, "templates": [[], [[1]], [[0]]]}),
    }
    messages = {
        "missing": "does not exist", "text": "is not JSON", "foreign": "not a router written by train-routing",
        "version": "features version 99", "shapes": "weight shapes", "templates": "elder sibling",
    }
    for name, text in cases.items():
        path = tmp_path / f"{name}.json"
        if text is not None:
            path.write_text(text)
        with pytest.raises((ValueError, FileNotFoundError), match=messages[name]):
            load_router(path)
        rc = main(["generate", "x", "--model", str(tmp_path), "--method", "routing", "--router", str(path)])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and err.startswith("ogspo: error:") and messages[name] in err and "\n" not in err
    rc = main(["generate", "x", "--model", str(tmp_path), "--method", "routing"])
    assert rc == 2 and "needs a router" in capsys.readouterr().err
