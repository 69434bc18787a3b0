"""OGSPO rounds: same-trace executions, the control-variate acceptance, alternation, outputs.

Tiny float64 models and records collected from them (fast)."""

import json

import numpy as np
import polars as pl
import pytest
from engine_helpers import hf_greedy, tiny_model
from policy_helpers import threshold_head
from solve_helpers import synthetic_latency

import ogspo.learn.rounds as rounds_mod
from ogspo.artifacts.oracle import StructureResult
from ogspo.artifacts.records import load_records
from ogspo.engine.decode import SpeculativeEngine
from ogspo.engine.drafters import LMDrafter
from ogspo.engine.target import LlamaTreeLM, build_tree_lm
from ogspo.engine.tree import Structure
from ogspo.learn.export import export_policy
from ogspo.learn.policy import load_head, offline_states, policy_depths
from ogspo.learn.rounds import (
    SameTraceSetup,
    SameTraceSummary,
    improves,
    propensity,
    run_rounds,
    same_trace,
    summarize_same_trace,
)
from ogspo.learn.size import fit_size_decision
from ogspo.methods.features import N_FEATURES
from ogspo.methods.ogspo import load_policy_dir
from ogspo.methods.registry import make_policy
from ogspo.stages.collect_records import collect_records
from ogspo.stages.export_policy import run_export_policy
from ogspo.stages.ogspo_rounds import run_rounds_stage, write_rounds

PROMPTS = [[5, 9, 13, 2, 7], [3, 3, 3, 3, 3, 3, 40, 41], [17, 22, 60, 1, 8, 33, 12, 5, 9, 13]]
TEMPLATE = Structure.full([3, 2, 2])
SUB = Structure([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)])
MAX_NEW = 14
POLICY = {"hidden": 16, "sweeps": 0, "steps_per_sweep": 60, "lr": 0.003, "weight_decay": 0.0, "rounds": 2,
          "holdout_fraction": 0.25}
SOLVE = {"time_limit": 10, "mip_gap": 1e-6, "dinkelbach_tol": 1e-7, "max_iterations": 10, "min_depth": 1,
         "max_depth": None, "context_buckets": 1}


def _setup() -> SameTraceSetup:
    target = build_tree_lm(tiny_model(0), max_len=256)
    drafter = LMDrafter(LlamaTreeLM(tiny_model(0), max_len=256, n_layers=1))  # early exit: partial acceptance
    return SameTraceSetup(target=target, drafter=drafter, prompts={f"p{i}": p for i, p in enumerate(PROMPTS)})


@pytest.fixture(scope="module", params=[0.0, 1.0], ids=["T0", "T1"])
def records(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"records-T{request.param:g}")
    st = _setup()
    collect_records(target=st.target, drafter=st.drafter, template=TEMPLATE, prompts=PROMPTS, temperature=request.param,
                    seed=0, max_new_tokens=MAX_NEW, out_dir=out, shard_size=3, model_checksum="m" * 64, drafter_id="ee1")
    return out


def _run(records_dir, decide, *, epsilon, structure=SUB, max_new_tokens=MAX_NEW, requests=("p0", "p1", "p2")):
    rec = load_records(records_dir)
    data = offline_states(records=rec, structure=structure, latency=synthetic_latency())
    frame = same_trace(setup=_setup(), records=rec, data=data, decide=decide, latency=synthetic_latency(),
                       epsilon=epsilon, seed=3, request_ids=list(requests), max_new_tokens=max_new_tokens)
    return rec, data, frame


def test_same_trace_without_exploration_reproduces_the_records(records):
    """eps = 0: every executed cycle stops where the offline policy stops and commits what the replay says
    (tokens too at T=0; the accepted drafted tokens at T=1, where the bonus depends on the tree)."""
    head = threshold_head("max_cum_prob", 0.3)
    rec, data, frame = _run(records, lambda f: bool(head.advantage(f)[0] <= 0), epsilon=0.0)
    assert frame.height == rec.cycles.height  # every cycle of the 3 requests is within MAX_NEW tokens
    assert frame["tokens_agree"].all()
    assert (frame["realised_accepted"] == frame["predicted_accepted"]).all()
    want = policy_depths(head, data)  # records.cycles order = frame order (requests sorted, cycles in order)
    got = frame["depth"].to_numpy()
    np.testing.assert_array_equal(got, want)
    assert 1 < len(set(got.tolist()))  # the policy does stop at different depths
    assert not any(any(e) for e in frame["explored"].to_list())
    assert all(p == 1.0 for ps in frame["propensity"].to_list() for p in ps)
    s = summarize_same_trace(frame)
    assert s.token_agreement == 1.0 and s.n_explored == 0
    assert s.ipw_J == pytest.approx(s.realised_J)  # all weights 1 without exploration
    # a cap on generated tokens keeps only the first cycles of each request
    _, _, short = _run(records, lambda f: False, epsilon=0.0, max_new_tokens=3, requests=("p1",))
    assert 1 <= short.height < (rec.cycles["request_id"] == "p1").sum()


def test_logged_propensities(records):
    rec, data, frame = _run(records, lambda f: False, epsilon=0.5, structure=TEMPLATE)  # policy: always continue
    levels, stops, pols, expl, props = (frame[k].to_list() for k in ("levels", "stop", "policy_stop", "explored", "propensity"))
    n = sum(len(x) for x in levels)
    assert n > 10 and 0 < sum(map(sum, expl)) < n
    for lv, st, po, ex, pr, depth in zip(levels, stops, pols, expl, props, frame["depth"].to_list()):
        assert not any(po)
        assert lv == list(range(1, len(lv) + 1))
        for s, e, p in zip(st, ex, pr):
            assert s <= e  # only an explored decision can stop an always-continue policy
            assert p == pytest.approx(0.25 if s else 0.75)  # (1 - eps) [a = policy's] + eps / 2
        assert depth == (lv[st.index(True)] if any(st) else TEMPLATE.max_depth)
    assert propensity(stop=True, policy_stop=True, epsilon=0.1) == pytest.approx(0.95)
    assert propensity(stop=False, policy_stop=True, epsilon=0.1) == pytest.approx(0.05)
    assert propensity(stop=True, policy_stop=False, epsilon=1.0) == pytest.approx(0.5)
    s = summarize_same_trace(frame)
    assert s.n_explored == sum(map(sum, expl)) and s.n_decisions == n


def test_improves():
    assert improves(1.0, None, 0.01)
    assert improves(1.02, 1.0, 0.01)
    assert not improves(1.005, 1.0, 0.01)
    assert not improves(0.9, 1.0, 0.0)


def _config(**rounds):
    return {"rounds": {"max_rounds": 3, "epsilon": 0.2, "prompts_per_workload": 2, "max_new_tokens": 10,
                       "tolerance": 0.0, **rounds}, "policy": POLICY, "solve": SOLVE}


def test_rounds_run_and_outputs_load(records, tmp_path):
    """A real run (tiny models): J of accepted rounds never decreases; the written folder exports to a
    policy folder that the lossless `ogspo` method loads."""
    lat = synthetic_latency()
    out = tmp_path / "rounds"
    rec = load_records(records)
    res = run_rounds(records=[rec], latency=lat, structure=SUB, oracle_throughput=9.5, setup=_setup, config=_config(), seed=0)
    assert res.rows and res.rows[0].accepted and res.structures[0] == SUB.to_list()
    js = [r.corrected_J for r in res.rows if r.accepted]
    assert js == sorted(js)
    inc = [r.incumbent_J for r in res.rows]
    assert inc == sorted(inc)
    r0 = res.rows[0]
    assert r0.corrected_J == pytest.approx(r0.surrogate_J + r0.same_trace_J - r0.predicted_J)
    assert r0.surrogate_J <= r0.posterior_bound + 1e-9
    assert r0.token_agreement == 1.0  # the same engine and numbers as the records
    assert res.same_trace.height == sum(r.same_trace_cycles for r in res.rows)
    # the size decision on top (tolerance -1: kept whatever it gains, so the whole path is exercised)
    size = fit_size_decision(records=[rec], structure=res.structure, head=res.head, latency=lat, lam=res.lam, seed=0,
                             holdout_fraction=0.25, tolerance=-1.0)
    f = size.figures
    assert size.rule is not None and f["kept"]
    assert f["extended_bound_J"] >= f["stop_bound_J"] - 1e-9  # verifying everything is one of its actions
    assert f["all"]["size_J"] <= f["extended_bound_J"] + 1e-9 and f["all"]["full_J"] <= f["stop_bound_J"] + 1e-9
    write_rounds(res, out, seed=0, records_dirs=[str(records)], size=size)
    assert (out / "size.json").is_file()
    table = pl.read_parquet(out / "rounds.parquet")
    assert table.height == len(res.rows) and table["accepted"].to_list() == [r.accepted for r in res.rows]
    report = json.loads((out / "rounds.json").read_text())
    assert report["structure"] == res.structure.to_list() and not report["autoregressive"]
    assert (out / "rounds.png").stat().st_size > 1000
    head, meta = load_head(out / "policy.pt")
    assert meta["structure"] == res.structure.to_list() and meta["round"] == res.incumbent_round
    exp = run_export_policy(rounds_dir=out, out_dir=tmp_path / "policy")
    assert exp.export is not None and (tmp_path / "policy" / "export.json").is_file()
    S, pol, rule = load_policy_dir(tmp_path / "policy")
    assert S.paths == res.structure.paths and rule is not None and rule.lam == pytest.approx(size.rule.lam)
    X = offline_states(records=rec, structure=S, latency=lat).features.reshape(-1, N_FEATURES)
    np.testing.assert_array_equal(pol.advantage(X) <= 0, head.advantage(X) <= 0)
    method = make_policy("ogspo", policy_path=tmp_path / "policy")
    target_model = tiny_model(0)
    target = build_tree_lm(target_model, max_len=256)
    engine = SpeculativeEngine(target=target, policy=method,
                               drafter=LMDrafter(LlamaTreeLM(tiny_model(0), max_len=256, n_layers=1)))
    for prompt in PROMPTS:
        assert engine.generate(prompt, max_new_tokens=20).tokens == hf_greedy(target_model, prompt, 20)


def test_worse_candidate_is_rejected(records, monkeypatch):
    """Same-trace corrections +0, +5, -1000 over rounds whose structure updates alternate SUB -> T -> SUB:
    rounds 0 and 1 are accepted (corrected J rises), round 2's candidate is rejected although the surrogate
    alone cannot tell, the rounds stop and round 1's policy and structure stay the result."""
    rec = load_records(records)
    corrections = iter([0.0, 5.0, -1000.0])
    updates = iter([TEMPLATE, SUB])
    real = summarize_same_trace

    def fake_summary(frame):
        s = real(frame)
        return SameTraceSummary(**{**s.__dict__, "realised_J": s.predicted_J + next(corrections)})

    def fake_structure(**kw):
        return StructureResult(structure=next(updates).to_list(), throughput=1.0, accepted=1.0, seconds_total=1.0,
                               lambdas=[1.0], iterations=1, gaps=[0.0], statuses=["optimal"], solve_seconds=0.01,
                               ratio_upper_bound=1.0, n_cycles=1)

    monkeypatch.setattr(rounds_mod, "summarize_same_trace", fake_summary)
    monkeypatch.setattr(rounds_mod, "solve_structure", fake_structure)
    res = run_rounds(records=[rec], latency=synthetic_latency(), structure=SUB, oracle_throughput=None, setup=_setup,
                     config=_config(max_rounds=5), seed=0)
    assert [r.accepted for r in res.rows] == [True, True, False]
    assert res.structures == [SUB.to_list(), TEMPLATE.to_list(), SUB.to_list()]
    assert res.incumbent_round == 1 and res.structure.paths == TEMPLATE.paths
    inc = [r.incumbent_J for r in res.rows]
    assert inc[0] < inc[1] == inc[2] > res.rows[2].corrected_J
    for r in res.rows:
        assert r.corrected_J == pytest.approx(r.surrogate_J + r.same_trace_J - r.predicted_J)
    assert "does not beat" in res.stop_reason
    assert res.rows[0].structure_solve_seconds == pytest.approx(0.01)
    rows = [rounds_mod.RoundRow(**{**res.rows[0].__dict__, "corrected_J": j}) for j in (2.0, 1.0)]
    with pytest.raises(RuntimeError, match="decreased"):
        rounds_mod.check_monotone(rows)


def test_empty_oracle_structure_writes_autoregressive_rounds(tmp_path):
    oracle = tmp_path / "oracle.json"
    oracle.write_text(json.dumps({"structure": [], "throughput": 25.0}))

    def no_engine():
        raise AssertionError("no model is needed for an empty structure")

    res = run_rounds_stage(records_dirs=[], latency_path=tmp_path / "unused.json", oracle_path=oracle,
                           out_dir=tmp_path / "rounds", load_engine=no_engine, workloads_dir=tmp_path, config=None, seed=0)
    assert res.autoregressive and res.rows == []
    assert pl.read_parquet(tmp_path / "rounds" / "rounds.parquet").height == 0
    report = json.loads((tmp_path / "rounds" / "rounds.json").read_text())
    assert report["autoregressive"] and "empty" in report["stop_reason"]
    assert not (tmp_path / "rounds" / "policy.pt").exists()
    run_export_policy(rounds_dir=tmp_path / "rounds", out_dir=tmp_path / "policy")
    S, pol, _ = load_policy_dir(tmp_path / "policy")
    assert len(S) == 0 and pol is None
    assert make_policy("ogspo", policy_path=tmp_path / "policy").max_nodes == 1


def test_policy_only_ablation_and_export_cli(records, tmp_path):
    """`train-policy --template` (the policy-only ablation: the full records template as structure) and
    `export-policy` write policy folders that the `ogspo` method loads; bad input is one error line."""
    import contextlib
    import io

    from ogspo.cli import main

    (tmp_path / "latency.json").write_text(json.dumps(synthetic_latency().to_json()))
    cfg = json.dumps({"seed": 0, "policy": POLICY})
    rc = main(["train-policy", "--config-json", cfg, "--records", str(records), "--latency", str(tmp_path / "latency.json"),
               "--template", "--out", str(tmp_path / "ablation")])
    assert rc == 0
    S, pol, _ = load_policy_dir(tmp_path / "ablation")
    assert S.paths == TEMPLATE.paths and pol.structure.paths == TEMPLATE.paths
    assert json.loads((tmp_path / "ablation" / "export.json").read_text())["structure_source"] == "records template"
    assert make_policy("ogspo", policy_path=tmp_path / "ablation").structure.paths == TEMPLATE.paths

    oracle = tmp_path / "oracle.json"
    oracle.write_text(json.dumps({"structure": [], "throughput": 25.0}))
    run_rounds_stage(records_dirs=[], latency_path=tmp_path / "latency.json", oracle_path=oracle, out_dir=tmp_path / "rounds",
                     load_engine=None, workloads_dir=tmp_path, config=None, seed=0)
    assert main(["export-policy", "--rounds", str(tmp_path / "rounds"), "--out", str(tmp_path / "policy")]) == 0
    assert json.loads((tmp_path / "policy" / "export.json").read_text())["autoregressive"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["export-policy", "--rounds", str(tmp_path / "missing"), "--out", str(tmp_path / "p2")])
    assert rc == 2 and err.getvalue().count("\n") == 1 and "has no structure.json" in err.getvalue()


# ---------------------------------------------------------------- keep/drop rule (learn.ship)


def test_compare_to_static_keeps_a_clear_win_and_not_a_tie():
    from ogspo.learn.ship import compare_to_static

    rng = np.random.default_rng(0)
    C = 120
    requests = np.array([f"r{i % 12}" for i in range(C)], dtype=object)
    t = np.full((3, C), 0.1) * np.exp(0.05 * rng.standard_normal((3, C)))
    A = np.vstack([np.full(C, 2.2), np.full(C, 2.0), np.full(C, 1.9)])  # the policy commits 10% more per second
    win = compare_to_static(A=A, t=t, requests=requests, names=["S<=1", "sequoia"], seed=0)
    assert win["best_static"] == "S<=1" and win["interval"][0] > 1.0
    A_tie = np.vstack([np.full(C, 2.0), np.full(C, 2.0), np.full(C, 1.9)])
    tie = compare_to_static(A=A_tie, t=np.repeat(t[:1], 3, axis=0), requests=requests, names=["S<=1", "sequoia"], seed=0)
    assert tie["ratio"] == pytest.approx(1.0) and not tie["interval"][0] > 1.0


def test_stop_only_bound_is_each_cycles_best_depth_over_the_best_fixed_depth():
    """Two kinds of cycles: half commit 3 tokens at depth 2 (depth 1: 2), half gain nothing past depth 1.
    Depth 1 for all: 2 tokens per 1 s; depth 2 for all: 2.5 per 1.5 s; each cycle at its own best depth
    (the outcome known): 2 per 1 s and 3 per 1.5 s alike, J = 2.0 — the bound equals the best fixed depth
    here, and exceeds it once depth 2 is cheaper for the cycles that gain from it."""
    from ogspo.learn.ship import stop_only_bound

    A = np.array([[2.0, 3.0], [2.0, 2.0]] * 5)  # [C, D]
    t = np.array([[1.0, 1.5], [1.0, 1.5]] * 5)
    out = stop_only_bound(A, t)
    assert out["best_fixed_depth"] == 1 and out["best_fixed_J"] == pytest.approx(2.0)
    assert out["bound_J"] == pytest.approx(2.0) and out["bound_gain"] == pytest.approx(0.0)
    t2 = np.array([[1.0, 1.2], [1.0, 1.5]] * 5)  # 3 tokens per 1.2 s beats 2 per 1 s
    out2 = stop_only_bound(A, t2)
    assert out2["bound_J"] == pytest.approx((2.0 + 3.0) / (1.0 + 1.2)) and out2["bound_gain"] > 0.1


def test_threshold_policy_reproduces_every_fixed_depth_and_its_head_decides_as_the_search():
    """Thresholds that never stop before level d and always stop there are S<=d, for the numpy rule and
    for the PolicyHead that ships (float32 network, ONNX-exportable) alike; fitted thresholds too."""
    from ogspo.learn.policy import PolicyData, policy_depths
    from ogspo.learn.threshold import ALWAYS, NEVER, fit_thresholds, threshold_depths, threshold_head
    from ogspo.methods.features import FEATURE_NAMES, N_FEATURES

    rng = np.random.default_rng(0)
    C, D = 200, 4
    feats = rng.random((C, D, N_FEATURES)).astype(np.float32)
    feats[:, :, FEATURE_NAMES.index("level")] = np.arange(1, D + 1)
    data = PolicyData(Structure.chain(D), feats, rng.random((C, D)) + np.arange(D), 1 + rng.random((C, D)),
                      np.array([f"w/r{i % 10}" for i in range(C)], dtype=object))
    x = feats[:, :, FEATURE_NAMES.index("max_cum_prob")].astype(np.float64)
    level = feats[:, :, FEATURE_NAMES.index("level")].astype(np.float64)
    for d in range(1, D + 1):
        theta = np.array([NEVER if j < d else ALWAYS for j in range(1, D)])
        assert (threshold_depths(x, level, theta) == d).all()
        assert (policy_depths(threshold_head("max_cum_prob", theta), data) == d).all()
    theta = fit_thresholds(x, level, data.accepted, data.seconds)
    assert np.array_equal(policy_depths(threshold_head("max_cum_prob", theta), data), threshold_depths(x, level, theta))


def test_one_levels_candidates_scored_together_equal_each_replayed_alone():
    """`_scan` scores every threshold of a level from sorted partial sums; each must equal the policy
    replayed with that threshold, cycles whose drafter ran out of candidates (a repeated state) included."""
    from ogspo.learn.threshold import ALWAYS, NEVER, _ratio, _scan, threshold_depths

    rng = np.random.default_rng(3)
    C, D = 300, 5
    x = np.round(rng.random((C, D)), 2)
    level = np.tile(np.arange(1, D + 1, dtype=float), (C, 1))
    for c in np.nonzero(rng.random(C) < 0.2)[0]:  # ran out after level r: the level-r state repeats
        r = int(rng.integers(1, D))
        level[c, r:], x[c, r:] = r, x[c, r - 1]
    A = np.cumsum(rng.random((C, D)) * 2 * (rng.random((C, 1)) < 0.6), 1) + 1
    t = 1 + np.cumsum(0.2 + 0.1 * rng.random((C, D)), 1)
    theta = np.array([0.3, NEVER, 0.6, ALWAYS])
    cands = np.array([NEVER, ALWAYS, 0.105, 0.455, 0.895])
    for d in range(1, D):
        want = []
        for v in cands:
            th = theta.copy()
            th[d - 1] = v
            want.append(_ratio(A, t, threshold_depths(x, level, th)))
        np.testing.assert_allclose(_scan(x, level, A, t, theta, d, cands), want, rtol=1e-12)


def test_the_marginal_gain_rule_sets_its_thresholds_from_the_latency_model():
    """No search: theta_d = J of the best fixed depth x the median extra seconds of depth d + 1; a cycle
    continues past level d exactly while its next_gain beats that, and the head that ships agrees."""
    from ogspo.learn.policy import PolicyData, policy_depths
    from ogspo.learn.threshold import STOP_CLASSES, marginal_thresholds, threshold_depths, threshold_head
    from ogspo.methods.features import FEATURE_NAMES

    rng = np.random.default_rng(2)
    C, D = 400, 3
    A = np.stack([np.full(C, 1.5), np.full(C, 2.0), np.full(C, 2.2)], 1)  # [C, D]
    t = np.stack([np.full(C, 0.10), 0.12 + 0.01 * rng.random(C), np.full(C, 0.15)], 1)
    J_ref = max(A[:, d].sum() / t[:, d].sum() for d in range(D))
    theta = marginal_thresholds(None, None, A, t)
    want = J_ref * np.median(np.diff(t, axis=1), axis=0)
    np.testing.assert_allclose(theta, want, rtol=1e-6)
    feats = np.zeros((C, D, N_FEATURES), dtype=np.float32)
    feats[:, :, FEATURE_NAMES.index("level")] = np.arange(1, D + 1)
    feats[:, :, FEATURE_NAMES.index("next_gain")] = rng.random((C, D))
    data = PolicyData(Structure.chain(D), feats, A, t, np.array([f"w/r{i % 8}" for i in range(C)], dtype=object))
    marginal = next(c for c in STOP_CLASSES if c.fit is marginal_thresholds)
    g = feats[:, :, FEATURE_NAMES.index("next_gain")].astype(np.float64)
    d = marginal.depths(data, marginal.thresholds(data))
    expect = np.where(g[:, 0] <= theta[0], 1, np.where(g[:, 1] <= theta[1], 2, 3))
    assert np.array_equal(d, expect) and len(set(d.tolist())) == 3
    assert np.array_equal(policy_depths(threshold_head("next_gain", theta), data), threshold_depths(g, feats[:, :, 0], theta))


def test_the_class_is_chosen_inside_each_fold_and_the_informative_one_ships():
    """Only `top4_cum_prob` tells the cycles whose second level pays: the class chosen on each fold's
    other requests is that one in every fold, its held-out policy beats the static trees, and the ship
    figures score every class alone beside it (what the report's table shows)."""
    from ogspo.analysis.markdown import render_stop_classes
    from ogspo.learn.policy import PolicyData
    from ogspo.learn.ship import compare_to_static, stop_only_bound
    from ogspo.learn.threshold import STOP_CLASSES, nested_depths
    from ogspo.methods.features import FEATURE_NAMES

    rng = np.random.default_rng(1)
    C = 600
    requests = np.array([f"w/r{i % 20}" for i in range(C)], dtype=object)
    good = rng.random(C) < 0.5
    A = np.stack([np.full(C, 1.5), np.where(good, 3.5, 1.5)], 1)
    t = np.stack([np.full(C, 1.0), np.full(C, 1.4)], 1)
    feats = rng.random((C, 2, N_FEATURES)).astype(np.float32) * 0.5  # uninformative everywhere ...
    feats[:, :, FEATURE_NAMES.index("level")] = [1, 2]
    top4 = (np.where(good, 0.6, 0.2) + 0.1 * rng.random(C)).astype(np.float32)
    feats[:, :, FEATURE_NAMES.index("top4_cum_prob")] = top4[:, None]  # ... but here
    data = PolicyData(Structure.chain(2), feats, A, t, requests)
    d, chosen = nested_depths(data, STOP_CLASSES, folds=5, seed=0)
    assert chosen == ["threshold on top4_cum_prob"] * 5
    rows = np.arange(C)
    cmp = compare_to_static(A=np.vstack([A[rows, d - 1], A[:, 0], A[:, 1]]), t=np.vstack([t[rows, d - 1], t[:, 0], t[:, 1]]),
                            requests=requests, names=["S<=1", "S<=2"], seed=0)
    assert cmp["interval"][0] > 1.0
    so = stop_only_bound(A, t)
    v = {**cmp, "detectable_gain": 0.01, "gain_over_best_fixed": 0.1, "share_of_bound": 0.5}
    md = render_stop_classes("T0", {"stop_only": so, "threshold": {**v, "folds": 5, "class": chosen[0],
                                                                    "classes": {c.name: v for c in STOP_CLASSES}}})
    assert sum(line.startswith("  | ") for line in md) == 1 + len(STOP_CLASSES) + 1 and "chosen in each fold" in "\n".join(md)


@pytest.mark.parametrize("informative", [True, False])
def test_kfold_ship_test_keeps_a_planted_winning_policy_and_drops_a_planted_useless_one(informative):
    """Cycles whose second level pays only when a confidence feature is high: thresholds fitted on the
    other folds find that, and the keep/drop test over all requests (every one held out once) excludes
    1; with a feature carrying no information about it, the test does not keep the policy."""
    from ogspo.learn.ship import compare_to_static
    from ogspo.learn.threshold import kfold_depths

    rng = np.random.default_rng(1)
    C = 600
    requests = np.array([f"w/r{i % 20}" for i in range(C)], dtype=object)
    good = rng.random(C) < 0.5  # depth 2 commits 2 more tokens in these cycles, nothing in the others
    A = np.stack([np.full(C, 1.5), np.where(good, 3.5, 1.5)], 1)  # [C, 2]
    t = np.stack([np.full(C, 1.0), np.full(C, 1.4)], 1)
    conf = np.where(good, 0.6, 0.2) + 0.1 * rng.random(C) if informative else rng.random(C)
    x = np.stack([conf, conf], 1)
    level = np.tile([1.0, 2.0], (C, 1))
    d = kfold_depths(x, level, A, t, requests, folds=5, seed=0)
    rows = np.arange(C)
    As = np.vstack([A[rows, d - 1], A[:, 0], A[:, 1]])
    ts = np.vstack([t[rows, d - 1], t[:, 0], t[:, 1]])
    cmp = compare_to_static(A=As, t=ts, requests=requests, names=["S<=1", "S<=2"], seed=0)
    assert (cmp["interval"][0] > 1.0) is informative, cmp


def test_a_sequoia_tree_outside_the_records_template_is_left_out_not_fatal(records):
    """Sequoia may size a tree with nodes the template never drafted (seen in the quick run: [2, 2] in a
    template of width 2 at depth 2); the keep/drop rule cannot replay it, so it leaves it out and says so."""
    from ogspo.learn.ship import decide_shipping

    rec = load_records(records)
    outside = Structure.chain(rec.template.max_depth + 1)  # one level deeper than the template drafts
    assert not all(p in rec.template for p in outside.paths)
    ship = decide_shipping(records=[rec], structure=SUB, head=threshold_head("max_cum_prob", 2.0), latency=synthetic_latency(),
                           sequoia=outside, seed=0, holdout_fraction=0.34)
    assert "sequoia" not in ship.figures["candidates"] and ship.figures["sequoia_outside_template"] is True
    inside = decide_shipping(records=[rec], structure=SUB, head=threshold_head("max_cum_prob", 2.0), latency=synthetic_latency(),
                             sequoia=Structure([(0,)]), seed=0, holdout_fraction=0.34)
    assert "sequoia" in inside.figures["candidates"] and inside.figures["sequoia_outside_template"] is False


def test_a_policy_no_better_than_a_static_tree_is_dropped_and_the_static_tree_ships(records, tmp_path):
    """A head that always stops after level 1 is S<=1 itself: it cannot beat that static tree, so the rule
    ships the best static tree instead; the rounds folder exports to a static policy folder that the
    lossless `ogspo` method decodes with (a StaticTree, no ONNX head)."""
    from ogspo.engine.policies import Autoregressive, StaticTree
    from ogspo.learn.ship import decide_shipping, static_candidates

    lat = synthetic_latency()
    rec = load_records(records)
    stop_now = threshold_head("max_cum_prob", 2.0)  # max_cum_prob <= 1 < 2: stop at every decision
    sequoia = Structure([(0,), (0, 0)])
    ship = decide_shipping(records=[rec], structure=SUB, head=stop_now, latency=lat, sequoia=sequoia, seed=0,
                           holdout_fraction=0.34)
    cands = static_candidates(SUB, sequoia)
    assert not ship.keep_policy and ship.shipped in cands and "ships" in ship.reason and "ar" in cands
    J = ship.figures["J_all"]
    assert J["policy"] == pytest.approx(J["S<=1"])  # the policy is S<=1
    assert ship.shipped == max(cands, key=lambda n: J[n]) and ship.structure.paths == cands[ship.shipped].paths
    # per workload (request id prefix): the fastest static tree on that workload's cycles, never the dropped policy
    assert set(ship.workloads) == {r.split("/", 1)[0] for r in rec.cycles["request_id"].to_list()}
    for w, v in ship.workloads.items():
        assert v["shipped"] != "policy" and v["shipped"] == max(cands, key=lambda n: v["J"][n])
        assert v["structure"] == cands[v["shipped"]].to_list()
        assert v["static"] == v["shipped"] and v["static_structure"] == v["structure"]  # no policy: the static tree is it
        so = v["stop_only"]  # the bound of S over its best fixed depth, which is one of the static trees
        assert so["best_fixed_J"] == pytest.approx(v["J"][f"S<={so['best_fixed_depth']}"]) and so["bound_gain"] >= 0
    # the tests' power is said: the threshold policy's K-fold test on every request, the MLP's on its split
    kf, ho = ship.figures["threshold"], ship.figures["holdout"]
    assert kf["n_requests"] == len(set(rec.cycles["request_id"].to_list())) and kf["detectable_gain"] > 0
    assert "smallest gain this test detects" in ship.reason and "of which it captures" in ship.reason
    assert (ho["detectable_gain"] or 0) > 0 or (ho["n_requests"] == 1 and "detects no gain" in ship.reason)
    # through the stage outputs: no policy.pt, the static tree as structure.json, a static policy folder
    res = rounds_mod.RoundsResult(rows=[], structure=SUB, head=stop_now, lam=1.0, incumbent_round=0, stop_reason="test",
                                  oracle_throughput=None, same_trace=pl.DataFrame())
    out = tmp_path / "rounds"
    write_rounds(res, out, seed=0, records_dirs=[str(records)], ship=ship)
    assert not (out / "policy.pt").exists()
    written = json.loads((out / "rounds.json").read_text())["ship"]
    assert written["keep_policy"] is False
    from ogspo.analysis.markdown import render_shipping  # the report's table of every class, from rounds.json as written
    table = [line for line in render_shipping({"T0": written}) if line.startswith("  | ")]
    assert len(table) == 1 + len(written["threshold"]["classes"]) + 1 and len(written["threshold"]["classes"]) >= 4
    exp = run_export_policy(rounds_dir=out, out_dir=tmp_path / "policy")
    assert exp.export is None and not (tmp_path / "policy" / "policy.onnx").exists()
    method = make_policy("ogspo", policy_path=tmp_path / "policy")
    if len(ship.structure):
        assert isinstance(method, StaticTree) and method.structure.paths == ship.structure.paths
    else:  # autoregressive decoding was the best static tree
        assert isinstance(method, Autoregressive)
    target_model = tiny_model(0)
    engine = SpeculativeEngine(target=build_tree_lm(target_model, max_len=256), policy=method,
                               drafter=LMDrafter(LlamaTreeLM(tiny_model(0), max_len=256, n_layers=1)))
    assert engine.generate(PROMPTS[0], max_new_tokens=12).tokens == hf_greedy(target_model, PROMPTS[0], 12)
    # per workload, `ogspo-static` (what a shipped policy would replace) is the same tree as `ogspo` here
    from ogspo.methods.ogspo import same_tree
    for w in ship.workloads:
        static = make_policy("ogspo-static", policy_path=tmp_path / "policy", workload=w)
        assert same_tree(static, make_policy("ogspo", policy_path=tmp_path / "policy", workload=w))


def test_the_ogspo_method_takes_its_workloads_choice(tmp_path):
    from ogspo.artifacts.structure import write_structure
    from ogspo.engine.policies import Autoregressive, StaticTree

    folder = tmp_path / "policy"
    folder.mkdir()
    export_policy(head=threshold_head("max_cum_prob", 0.3), path=folder / "policy.onnx", structure=SUB, lam=1.0)
    write_structure(SUB, folder / "structure.json")
    (folder / "workloads.json").write_text(json.dumps({
        "chat": {"shipped": "ar", "structure": []}, "code": {"shipped": "S<=1", "structure": [[0], [1]]},
        "text": {"shipped": "policy", "structure": None}}))
    assert isinstance(make_policy("ogspo", policy_path=folder, workload="chat"), Autoregressive)
    code = make_policy("ogspo", policy_path=folder, workload="code")
    assert isinstance(code, StaticTree) and code.structure.paths == Structure([(0,), (1,)]).paths
    for w in ("text", None, "unseen"):  # the policy, where it was chosen or nothing was said
        pol = make_policy("ogspo", policy_path=folder, workload=w)
        assert pol.hook is not None and pol.structure.paths == SUB.paths


def test_a_policy_folder_without_a_head_must_say_it_is_static(tmp_path):
    from ogspo.artifacts.structure import write_structure

    write_structure(SUB, tmp_path / "structure.json")
    with pytest.raises(FileNotFoundError, match="policy.onnx"):
        load_policy_dir(tmp_path)
