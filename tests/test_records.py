"""Latency model, posterior records, replay: tiny float64 models (fast)."""

import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from engine_helpers import tiny_model

from ogspo.artifacts.latency import LatencyModel
from ogspo.artifacts.records import load_records, read_shard_meta, summarize_records, template_index
from ogspo.engine.decode import SpeculativeEngine
from ogspo.engine.drafters import LMDrafter
from ogspo.engine.policies import StaticTree
from ogspo.engine.target import LlamaTreeLM, build_tree_lm
from ogspo.engine.tree import Structure
from ogspo.methods.harness import probe_seconds
from ogspo.offline.replay import ReplayCycles, accepted_lengths, cycle_times, replay, replay_cycles, structure_mask
from ogspo.stages.calibrate_latency import bushy_tree, calibrate_latency, write_calibration
from ogspo.stages.collect_records import collect_records

PROMPTS = [[5, 9, 13, 2, 7], [3, 3, 3, 3, 3, 3, 40, 41], [17, 22, 60, 1, 8, 33, 12, 5, 9, 13]]
TEMPLATE = Structure.full([3, 2, 2])
TIMING = ["draft_seconds", "verify_seconds", "cycle_seconds"]


def _setup(max_len=256):
    target = build_tree_lm(tiny_model(0), max_len=max_len)
    # early-exit drafter: the target's first layer, so acceptance is neither ~0 nor ~1
    drafter = LMDrafter(LlamaTreeLM(tiny_model(0), max_len=max_len, n_layers=1))
    return target, drafter


def _collect(out, *, temperature=0.0, shard_size=2, prompts=PROMPTS, template=TEMPLATE, seed=0, model="m" * 64, minutes=None,
             verify="tree"):
    target, drafter = _setup()
    return collect_records(
        target=target, drafter=drafter, template=template, prompts=prompts, temperature=temperature, seed=seed,
        max_new_tokens=14, out_dir=out, shard_size=shard_size, model_checksum=model, drafter_id="ee1", minutes=minutes,
        verify=verify,
    )


def _model(**over):
    m = dict(
        sizes=[1, 4, 16], contexts=[100, 200], verify_table=[[1.0, 2.0], [2.0, 3.0], [4.0, 6.0]],
        verify_intercept=[0.0, 1.0, 2.0], verify_slope=[0.01, 0.01, 0.02], slope_mode="per-size",
        draft_widths=[1, 4], draft_table=[0.5, 1.0], fixed=0.1, fixed_ar=0.1, fixed_slope=0.0, catchup=[],
        meta={"model_checksum": "abc", "drafter": "d"},
    )
    m.update(over)
    return LatencyModel(**m)


# ---------------------------------------------------------------- latency model


def test_latency_model_interpolates_and_round_trips(tmp_path):
    m = _model()
    assert float(m.t_verify(1, 100)) == pytest.approx(1.0)
    # between table sizes: piecewise linear in a(n) and b(n)
    a10, b10 = 1.0 + 0.5 * 1.0, 0.01 + 0.5 * 0.01
    assert float(m.t_verify(10, 300)) == pytest.approx(a10 + b10 * 300)
    assert float(m.t_draft(0)) == 0.0 and float(m.t_draft(2)) == pytest.approx(0.5 + 0.5 / 3)
    assert m.t_cycle([1, 4], 16, 100) == pytest.approx(0.5 + 1.0 + 4.0 + 0.1)
    np.testing.assert_allclose(m.t_verify(np.array([1, 4]), np.array([100, 200])), [1.0, 3.0])
    f = tmp_path / "latency.json"
    f.write_text(json.dumps({"model": m.to_json()}))
    assert LatencyModel.from_json(f, expect_model="abc", expect_drafter="d") == m
    with pytest.raises(ValueError, match="calibrated for model"):
        LatencyModel.from_json(f, expect_model="xyz")
    with pytest.raises(ValueError, match="calibrated for drafter 'd'"):
        LatencyModel.from_json(f, expect_drafter="eagle")
    bad = m.to_json()
    bad["typo"] = 1
    with pytest.raises(ValueError, match="wrong keys"):
        LatencyModel.from_json(bad)


def test_latency_lines_never_go_negative():
    """A noisy grid (a large tree timed much slower at the long context, a small one faster) gives no
    negative slope and no time below the smallest calibrated context other than the time there: a
    short prompt's cycles are never priced below what was measured (once a 64-token forward at 30
    tokens of context read 0.03 s against 0.13 s measured at 128, and a negative one tipped SCIP)."""
    from ogspo.artifacts.latency import fit_verify

    table = np.array([[0.020, 0.019], [0.13, 1.50]])  # [sizes 1, 64] x [contexts 128, 768]
    a, b, _ = fit_verify([1, 64], [128, 768], table)
    assert min(b) >= 0 and b[0] == 0.0 and a[0] == pytest.approx(0.0195)
    m = _model(sizes=[1, 64], contexts=[128, 768], verify_table=table.tolist(), verify_intercept=a, verify_slope=b)
    assert float(m.t_verify(64, 30)) == pytest.approx(float(m.t_verify(64, 128))) == pytest.approx(0.13)
    assert float(m.t_verify(64, 768)) == pytest.approx(1.50) and float(m.t_verify(1, 5000)) == pytest.approx(0.0195)


def test_bushy_tree_is_a_tree():
    pos, attend, depths = bushy_tree(20, 7, torch.device("cpu"))
    assert attend.shape == (20, 20) and bool(attend.diagonal().all()) and int(pos[0]) == 7
    assert depths.max() >= 2 and (depths == 1).sum() >= 4  # bushy, not a chain


def test_calibrate_latency_runs_and_writes(tmp_path):
    target, drafter = _setup(max_len=512)
    cal = calibrate_latency(
        target=target, drafter=drafter, tree_sizes=[1, 2, 4, 8, 16], context_lengths=[32, 64, 128],
        draft_widths=[1, 2, 4], reps=2, warmup=1, seed=0, held_out_sizes=(3, 11), held_out_contexts=(48,),
        fixed_tokens=6, meta={"model_checksum": "abc", "drafter": "ee1"},
    )
    m = cal.model
    assert np.asarray(m.verify_table).shape == (5, 3) and len(m.draft_table) == 3 and m.fixed >= 0
    assert len(cal.validation) == 2 and np.isfinite(cal.mdape)
    write_calibration(cal, json_path=tmp_path / "latency.json", png_path=tmp_path / "latency.png")
    assert (tmp_path / "latency.png").stat().st_size > 1000
    assert LatencyModel.from_json(tmp_path / "latency.json", expect_model="abc", expect_drafter="ee1").sizes == [1, 2, 4, 8, 16]


def test_decode_loop_level_scales_the_grid_to_the_decode_loop_in_each_requests_state():
    from ogspo.offline.latency_fit import decode_loop_level

    sizes = [1, 2, 4]
    a, b = [0.020, 0.022, 0.024], [1e-5, 1e-5, 2e-5]
    elasticity = [1.0, 0.5, 0.0]
    table = np.array([[ai + bi * L for L in (100, 300)] for ai, bi in zip(a, b)])
    grid = lambda n, L: a[sizes.index(n)] + b[sizes.index(n)] * L  # noqa: E731
    # the decode loop runs 0.9x the grid moved to each request's state: n = 1 follows the state, n = 2 half
    # of it, n = 4 none; one AR request was timed across a state flip its probes missed (1.3x)
    forwards = [(r, n, L, f, 0.9 * (1 + e * (f - 1)) * grid(n, L))
                for r, (n, e, f) in enumerate([(1, 1.0, 1.2), (1, 1.0, 0.8), (2, 0.5, 1.3), (4, 0.0, 0.7), (2, 0.5, 1.0)])
                for L in (120, 200)]
    forwards += [(5, 1, L, 1.0, 1.3 * grid(1, L)) for L in (120, 200)]
    out = decode_loop_level(sizes, a, b, table, elasticity, forwards)
    assert out["scale"] == pytest.approx(0.9) and out["probe_level"] == pytest.approx(1 / 0.9) and out["requests"] == 6
    assert out["one_row_ratio"] == pytest.approx(0.9) and out["tree_ratio"] == pytest.approx(0.9)
    assert a[0] == pytest.approx(0.018) and b[2] == pytest.approx(1.8e-5)
    assert table[1, 0] == pytest.approx(0.9 * (0.022 + 1e-5 * 100))


def test_decode_loop_draft_scale_and_level_widths():
    """Draft levels past the first of static-tree requests against the draft table (median per request,
    then over requests: one request's outlier moves nothing); a static tree's frontier widths per level."""
    from ogspo.offline.latency_fit import decode_loop_draft_scale
    from ogspo.stages.calibrate_latency import FIXED_TREES, level_widths

    widths, table = [1, 2, 4], [0.001, 0.0012, 0.0016]
    levels = [(r, w, 1.3 * t) for r in range(3) for w, t in zip(widths, table)] + [(3, 2, 0.01)]
    assert decode_loop_draft_scale(widths, table, levels) == pytest.approx(1.3)
    assert decode_loop_draft_scale(widths, table, []) == 1.0
    assert [level_widths(S) for S in FIXED_TREES] == [[1, 1], [1, 2, 4], [1, 4, 8]]


def test_state_fit_separates_the_machine_state_from_the_shape():
    """Timings seen in two machine states (each with its probe's state): a shape's level at the mean state
    and its slope, with one preempted timing that a mean would follow; the elasticity of a flat shape is
    ~0, that of a one-row shape 1."""
    from ogspo.offline.latency_fit import fit_elasticity, state_fit

    x = np.array([0.75, 0.75, 1.1, 1.1, 0.75, 1.1, 0.75, 1.1])  # the probes' states
    mean = float(x.mean())
    one = {(1, L): list(0.010 * x * (1 + L / 1000)) for L in (100, 300)}
    flat = list(0.012 + 0.0005 * (x - mean))
    flat[2] = 0.050  # preempted
    level, slope = state_fit(flat + [0.012] * 2, np.concatenate([x, [mean, mean]]), mean)
    assert level == pytest.approx(0.012, rel=0.02) and slope == pytest.approx(0.0005, rel=0.05)
    assert state_fit(one[(1, 100)], x, mean)[0] == pytest.approx(0.010 * 1.1 * mean)
    # two modes, five timings in each: the level is their mean, not one mode (as a median would give)
    assert state_fit([0.008] * 5 + [0.011] * 5, np.ones(10), 1.0)[0] == pytest.approx(0.0095)
    samples = {**one, (8, 100): flat, (8, 300): flat}
    fits = {s: state_fit(v, x, mean) for s, v in samples.items()}
    e = fit_elasticity({s: f[0] for s, f in fits.items()}, {s: f[1] for s, f in fits.items()}, [1, 8], [100, 300])
    assert e[0] == 1.0 and 0.0 <= e[1] < 0.15


def test_elasticity_is_one_curve_through_every_shape():
    """Relative slopes scattered around n ** -0.2 (one shape far off, one one-row slope at 0 for another L):
    the fitted curve is n ** -c with c near 0.2, 1 at n = 1 and non-increasing; a steady one-row forward
    gives all 1. A draft level's elasticity is its relative slope over the one-row forward's, in [0, 1]."""
    from ogspo.offline.latency_fit import fit_draft_elasticity, fit_elasticity

    sizes, contexts = [1, 2, 4, 8, 16], [100, 300]
    rng = np.random.default_rng(0)
    levels = {(n, L): 0.01 * n ** 0.5 for n in sizes for L in contexts}
    slopes = {(n, L): levels[(n, L)] * n ** -0.2 * (1 + 0.2 * rng.standard_normal()) for n in sizes for L in contexts}
    slopes[(1, 100)], slopes[(1, 300)] = levels[(1, 100)], levels[(1, 300)]
    slopes[(4, 300)] = -5 * levels[(4, 300)]  # a preempted shape: clipped, it moves the curve little
    e = fit_elasticity(levels, slopes, sizes, contexts)
    assert e[0] == 1.0 and all(a >= b for a, b in zip(e, e[1:]))
    assert e[-1] == pytest.approx(16 ** -0.2, abs=0.12)
    assert fit_elasticity(levels, {s: 0.0 for s in slopes}, sizes, contexts) == [1.0] * len(sizes)
    assert fit_draft_elasticity({1: 0.002, 4: 0.003}, {1: 0.0016, 4: 0.0024}, 1.0) == pytest.approx(0.8)
    assert fit_draft_elasticity({1: 0.002}, {1: 0.004}, 1.0) == 1.0 and fit_draft_elasticity({1: 0.002}, {1: 0.001}, 0.0) == 0.0


def test_latency_model_follows_the_machine_state():
    """t_verify(n, L, speed): the one-row forward moves with the state, a size of elasticity 0 does not;
    speed_ratio reads a probe against probe_level x t_verify(1, L)."""
    m = _model(drift_elasticity=[1.0, 0.5, 0.0], probe_level=1.25)
    assert float(m.t_verify(1, 100, 1.4)) == pytest.approx(1.4 * 1.0)
    assert float(m.t_verify(16, 100, 1.4)) == pytest.approx(4.0)
    assert float(m.t_verify(4, 100, 1.4)) == pytest.approx(2.0 * 1.2)
    assert m.speed_ratio(1.25 * 1.4, 100) == pytest.approx(1.4)
    assert m.t_cycle([1, 4], 16, 100, speed=2.0) == pytest.approx(0.5 + 1.0 + 0.1 + 4.0)  # draft_elasticity 0: the target only
    half = _model(drift_elasticity=[1.0, 0.5, 0.0], draft_elasticity=0.5)
    assert half.t_cycle([1, 4], 16, 100, speed=2.0) == pytest.approx((0.5 + 1.0 + 0.1) * 1.5 + 4.0)
    with pytest.raises(ValueError, match="draft_elasticity must be in"):
        LatencyModel.from_json({**half.to_json(), "draft_elasticity": 1.5})
    with pytest.raises(ValueError, match="drift_elasticity has 2 values for 3"):
        LatencyModel.from_json({**m.to_json(), "drift_elasticity": [1.0, 0.5]})


def test_a_sampled_cycle_books_what_sampling_adds():
    """at_temperature(T > 0) adds fixed_sampled to both cycle kinds' overhead, once; T = 0 is the model."""
    m = _model(fixed_sampled=0.02)
    hot = m.at_temperature(1.0)
    assert m.at_temperature(0.0) is m and hot.at_temperature(1.0) == hot
    assert float(hot.t_fixed(1)) == pytest.approx(0.12) and float(hot.t_fixed(4)) == pytest.approx(0.12)
    assert hot.t_cycle([1], 4, 100) == pytest.approx(m.t_cycle([1], 4, 100) + 0.02)
    with pytest.raises(ValueError, match="fixed_sampled must be >= 0"):
        LatencyModel.from_json({**m.to_json(), "fixed_sampled": -1.0})


def test_latency_model_predicts_real_autoregressive_steps(tmp_path):
    """The calibrated model's time of an autoregressive step (t_verify(1, L) + fixed_ar) against real AR
    requests on the tiny model, in the machine state a probe reads before each (as evaluate predicts): median
    predicted / realised per step within [0.6, 1.5]. The overhead of a
    speculative cycle (`fixed`) is several times an AR step's, so booking it on AR steps, as one t_fixed
    for every cycle kind did, overpredicts them."""
    from ogspo.engine.decode import SpeculativeEngine
    from ogspo.engine.policies import Autoregressive

    target, drafter = _setup(max_len=512)
    cal = calibrate_latency(
        target=target, drafter=drafter, tree_sizes=[1, 2, 4, 8], context_lengths=[16, 64, 128],
        draft_widths=[1, 2, 4], reps=5, warmup=1, seed=0, held_out_sizes=(), held_out_contexts=(), fixed_tokens=24,
        meta={"model_checksum": "abc", "drafter": "ee1"},
    )
    m = cal.model
    assert m.fixed_ar < m.fixed and cal.fixed_ar_samples
    engine = SpeculativeEngine(target=target, policy=Autoregressive())
    prompt = [int(x) for x in np.random.default_rng(1).integers(3, 60, 20)]
    ratios = []
    for _ in range(5):
        speed = m.speed_ratio(probe_seconds(target), target.cache.length)  # the machine's state, as evaluate reads it
        res = engine.generate(prompt, max_new_tokens=40, seed=0)
        realised = res.wall_seconds - res.prefill_seconds
        L = np.arange(len(prompt), len(prompt) + len(res.cycles))
        ratios.append((sum(float(m.t_cycle([], 1, x, speed=speed)) for x in L)) / realised)
    # sub-millisecond steps on a shared 2-core machine: the band is wide
    assert 0.6 < float(np.median(ratios)) < 1.5, ratios


# ---------------------------------------------------------------- engine hook


def test_cycle_observer_and_cycle_from_match_generate():
    target, drafter = _setup()
    traces = []
    engine = SpeculativeEngine(target=target, policy=StaticTree(TEMPLATE), drafter=drafter, temperature=1.0,
                               cycle_observer=traces.append)
    res = engine.generate(PROMPTS[0], max_new_tokens=12, seed=5)
    assert [t.stats for t in traces] == res.cycles
    engine.cycle_observer = None
    done = [res.tokens[0]]
    for t in traces:
        assert t.context_length == len(PROMPTS[0]) + len(done) - 1 and t.root == done[-1]
        assert len(t.tree) == len(TEMPLATE) + 1 and t.logits.shape[0] == len(t.tree)
        again, committed = engine.cycle_from(PROMPTS[0] + done[:-1], done[-1], request_seed=5, index=t.index)
        assert committed == t.committed and again.seed == t.stats.seed
        done += t.committed
    assert done[: len(res.tokens)] == res.tokens


# ---------------------------------------------------------------- records


def test_records_round_trip_and_summary(tmp_path):
    r = _collect(tmp_path / "r", temperature=1.0)
    assert r.computed == [0, 1] and len(r.shards) == 2
    rec = load_records(tmp_path / "r", expect_model="m" * 64, expect_drafter="ee1", expect_template=TEMPLATE)
    assert rec.cycles.height == r.n_cycles and rec.nodes.height == r.n_cycles * len(TEMPLATE)
    assert rec.cycles["request_id"].unique().sort().to_list() == ["p0", "p1", "p2"]
    # the accepted path is the chain of matched nodes, in template ids
    tidx = template_index(TEMPLATE)
    for row in rec.cycles.iter_rows(named=True):
        nodes = rec.nodes.filter((pl.col("request_id") == row["request_id"]) & (pl.col("cycle") == row["cycle"]))
        matched = nodes.filter(pl.col("match")).sort("depth")["tnode"].to_list()
        assert matched == row["accepted_tnodes"]
        assert row["accepted_length"] == len(matched) + 1 == len(row["committed"])
        assert [tidx[tuple(int(x) for x in p.split("."))] for p in row["accepted_paths"]] == matched
    assert np.all(rec.nodes["target_logp"].to_numpy() <= 0)
    s = summarize_records(rec)
    assert s.n_cycles == rec.cycles.height and s.tau == pytest.approx(rec.cycles["accepted_length"].mean())
    assert 0 <= s.off_top1 <= 1 and "| depth |" in s.to_markdown("x")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_records_verified_by_path_equal_a_tree_pass_where_either_decides(tmp_path, temperature):
    """Forwarding the accepted path one row at a time (`verify="path"`) commits the same tokens along the
    same template paths as one pass over the whole template, with the same drafts, the same target
    values for every child of a path node, and the same summary; only the nodes under a rejected
    parent are left undecided (null), at T=0 their match and at any T their target log-prob."""
    t = _collect(tmp_path / "tree", temperature=temperature)
    p = _collect(tmp_path / "path", temperature=temperature, verify="path")
    rt, rp = load_records(tmp_path / "tree"), load_records(tmp_path / "path")
    assert rp.cycles.drop(TIMING).equals(rt.cycles.drop(TIMING)) and p.n_cycles == t.n_cycles
    drafts = ["request_id", "cycle", "node", "tnode", "rank_path", "depth", "parent", "token", "logq", "cum_logq", "entropy"]
    assert rp.nodes.select(drafts).equals(rt.nodes.select(drafts))
    # the nodes a path verification decides: depth 1 and the children of accepted nodes
    on_path = {(r, c, q) for r, c, ps in rt.cycles.select("request_id", "cycle", "accepted_paths").iter_rows() for q in ps}
    parent = [q.rsplit(".", 1)[0] if "." in q else "" for q in rt.nodes["rank_path"].to_list()]
    decided = np.array([q == "" or (r, c, q) in on_path
                        for r, c, q in zip(rt.nodes["request_id"].to_list(), rt.nodes["cycle"].to_list(), parent)])
    assert decided.any() and not decided.all()
    tl_t, tl_p = rt.nodes["target_logp"].to_numpy(), rp.nodes["target_logp"].to_numpy()
    assert np.isnan(tl_p[~decided]).all() and not np.isnan(tl_t).any()
    np.testing.assert_allclose(tl_p[decided], tl_t[decided], rtol=0, atol=1e-9)
    m_t, m_p = rt.nodes["match"].to_list(), rp.nodes["match"].to_list()
    assert [m for m, d in zip(m_p, decided) if d] == [m for m, d in zip(m_t, decided) if d]
    assert all((m is None) == (temperature == 0) for m, d in zip(m_p, decided) if not d)
    st, sp = summarize_records(rt), summarize_records(rp)
    assert sp.match_by_depth == pytest.approx(st.match_by_depth) and sp.accept_by_depth == st.accept_by_depth
    assert [read_shard_meta(f)["verify"] for f in p.shards] == ["path", "path"]


def test_records_auto_verification_weighs_the_timed_forwards_per_shard(tmp_path, monkeypatch):
    """`auto` times a template forward and a one-row forward once, then picks for each shard the mode
    that is cheaper at the accepted length of the shards before it (2 before any); shards verified
    either way load together, and the mode is each shard's metadata."""
    from ogspo.stages import collect_records as cr

    assert cr.choose_verify({"tree_seconds": 5.0, "row_seconds": 2.0}, None) == "path"  # 2 x 2 < 5
    assert cr.choose_verify({"tree_seconds": 5.0, "row_seconds": 2.0}, 3.0) == "tree"  # 3 x 2 > 5
    assert cr.choose_verify({"tree_seconds": 1.0, "row_seconds": 0.9}, 1.0) == "path"
    seen = []
    monkeypatch.setattr(cr, "time_verification", lambda *a, **k: {"tree_seconds": 1.0, "row_seconds": 0.4, "tree_rows": 16})
    real = cr.choose_verify
    monkeypatch.setattr(cr, "choose_verify", lambda timing, a: seen.append(a) or real(timing, a))
    r = _collect(tmp_path / "a", shard_size=1, verify="auto")
    assert seen[0] is None and all(a >= 1 for a in seen[1:]) and len(seen) == 3
    modes = [read_shard_meta(f)["verify"] for f in r.shards]
    assert modes == [real({"tree_seconds": 1.0, "row_seconds": 0.4}, a) for a in seen]
    assert r.verify["shards"] == dict(enumerate(modes)) and r.verify["asked"] == "auto"
    tree = _collect(tmp_path / "b", shard_size=1)
    assert load_records(tmp_path / "a").cycles.drop(TIMING).equals(load_records(tmp_path / "b").cycles.drop(TIMING))
    assert tree.verify["shards"] == {0: "tree", 1: "tree", 2: "tree"}
    with pytest.raises(ValueError, match="records verify must be one of tree, path, auto; got 'fast'"):
        _collect(tmp_path / "c", verify="fast")


def test_time_verification_leaves_the_cache_empty():
    from ogspo.stages.collect_records import time_verification

    target, _ = _setup()
    timing = time_verification(target, TEMPLATE, PROMPTS[0], reps=1)
    assert timing["tree_rows"] == len(TEMPLATE) + 1 and timing["tree_seconds"] > 0 and timing["row_seconds"] > 0
    assert target.cache.length == 0 and target.cache.pending == 0


def test_records_refuse_corrupt_and_foreign(tmp_path):
    _collect(tmp_path / "r")
    with pytest.raises(ValueError, match="is for model"):
        load_records(tmp_path / "r", expect_model="x" * 64)
    with pytest.raises(ValueError, match="is for drafter"):
        load_records(tmp_path / "r", expect_drafter="eagle")
    with pytest.raises(ValueError, match="another template"):
        load_records(tmp_path / "r", expect_template=Structure.full([3, 2]))
    f = tmp_path / "r" / "shard-0001.cycles.parquet"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        load_records(tmp_path / "r")
    f.unlink()
    with pytest.raises(ValueError, match="incomplete shard"):
        load_records(tmp_path / "r")
    pl.DataFrame({"a": [1]}).write_parquet(f)  # a parquet file without our metadata
    with pytest.raises(ValueError, match="no 'ogspo_records' metadata"):
        load_records(tmp_path / "r")


def test_records_deterministic_and_resumable(tmp_path):
    a = _collect(tmp_path / "a", temperature=1.0, shard_size=1)
    _collect(tmp_path / "b", temperature=1.0, shard_size=1)
    ra, rb = load_records(tmp_path / "a"), load_records(tmp_path / "b")
    assert ra.nodes.equals(rb.nodes)
    assert ra.cycles.drop(TIMING).equals(rb.cycles.drop(TIMING))
    assert a.computed == [0, 1, 2]
    d = tmp_path / "a"
    mtimes = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}
    (d / "shard-0001.cycles.parquet").unlink()
    again = _collect(d, temperature=1.0, shard_size=1)
    assert again.computed == [1]
    for name in ("shard-0000.cycles.parquet", "shard-0002.nodes.parquet"):
        assert (d / name).stat().st_mtime_ns == mtimes[name]
    assert load_records(d).cycles.drop(TIMING).equals(ra.cycles.drop(TIMING))
    # different settings (another seed) are not "complete": everything is recomputed
    assert _collect(d, temperature=1.0, shard_size=1, seed=1).computed == [0, 1, 2]


def test_records_within_a_budget_take_a_prefix_of_the_shards_and_a_rerun_takes_the_same(tmp_path):
    """A budget too small for a second shard takes the first only (always taken) and removes an earlier,
    longer run's shards past the cut; complete shards count the seconds they recorded, so a rerun with a
    budget that held two shards takes those two again without computing anything."""
    d = tmp_path / "r"
    full = _collect(d, temperature=1.0, shard_size=1)
    assert full.computed == [0, 1, 2] and full.budget["seconds"] is None
    seconds = [read_shard_meta(d / f"shard-000{i}.cycles.parquet")["seconds"] for i in range(3)]
    assert all(x > 0 for x in seconds)
    # minutes that hold two shards and not a third: a shard is taken while the seconds spent plus the next one's at
    # the mean rate so far fit (the first shard, warming up, may take longer than the others: 2 x its seconds)
    two = max(2 * seconds[0], seconds[0] + seconds[1]) * 1.01 / 60
    assert two * 60 < 1.5 * (seconds[0] + seconds[1])  # (at the mean rate, a third would not fit)
    again = _collect(d, temperature=1.0, shard_size=1, minutes=two)
    assert again.computed == [] and len(again.shards) == 2 and again.budget["taken"] == {"prompts": 2}
    assert not (d / "shard-0002.cycles.parquet").exists() and not (d / "shard-0002.nodes.parquet").exists()
    rec = load_records(d)
    assert sorted(set(rec.cycles["request_id"].to_list())) == ["p0", "p1"]
    one = _collect(tmp_path / "one", temperature=1.0, shard_size=1, minutes=1e-6)
    assert one.computed == [0] and sorted((tmp_path / "one").glob("shard-*.cycles.parquet")) == [
        tmp_path / "one" / "shard-0000.cycles.parquet"]


# ---------------------------------------------------------------- replay


SUBS = [
    TEMPLATE,
    Structure.chain(3),
    Structure([(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (0, 0, 1)]),
    Structure([(0,), (1,), (2,), (0, 0), (0, 1), (2, 0), (2, 0, 0)]),
]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_replay_equals_reality(tmp_path, temperature):
    """Replay equals reality, exactly, for every recorded cycle, sub-structure S and stop depth d.

    Each recorded cycle c of a request is re-run for real as one engine cycle (`cycle_from`) from the
    same committed context and root token, with the same cycle random numbers (request seed, cycle
    index), drafting `StaticTree(S.up_to(d))`. Its committed length must equal A_c(S, d) from the
    records, and its accepted drafted tokens must be the first A_c - 1 tokens committed in the
    record. At T=0 the bonus token matches too (the target argmax after the same text); at T>0 only
    under S_{<=d} = T, since the bonus is drawn from the residual left by the end node's children
    in S, which differ from T's. Re-running single cycles from the
    recorded contexts avoids comparing whole generations, whose contexts diverge at T > 0.
    """
    _collect(tmp_path / "r", temperature=temperature, shard_size=3)
    rec = load_records(tmp_path / "r")
    cyc = replay_cycles(rec)
    depths = [1, 2, 3]
    res = replay(cycles=cyc, structures=[S for S in SUBS for _ in depths], depths=np.array(depths * len(SUBS)))
    assert res.accepted.max() >= 3 and res.accepted.min() == 1  # the check covers short and long acceptances
    target, drafter = _setup()
    n_checked = 0
    for k, (S, d) in enumerate((S, d) for S in SUBS for d in depths):
        engine = SpeculativeEngine(target=target, policy=StaticTree(S.up_to(d)), drafter=drafter, temperature=temperature)
        out: dict[str, list[int]] = {}
        for c, row in enumerate(rec.cycles.iter_rows(named=True)):
            prompt = PROMPTS[int(row["request_id"][1:])]
            done = out.setdefault(row["request_id"], [row["root_token"]])
            assert row["context_length"] == len(prompt) + len(done) - 1
            stats, committed = engine.cycle_from(prompt + done[:-1], done[-1], request_seed=row["request_seed"],
                                                 index=row["cycle"])
            A = int(res.accepted[k, c])
            assert stats.accepted == A, (S, d, row["request_id"], row["cycle"])
            assert committed[: A - 1] == row["committed"][: A - 1]
            if temperature == 0 or S.up_to(d).paths == TEMPLATE.paths:
                assert committed == row["committed"][:A]
            done += row["committed"]
            n_checked += 1
    assert n_checked == len(SUBS) * len(depths) * rec.cycles.height


def _random_structure(rng, T: Structure) -> Structure:
    keep = set()
    for p in T.to_list():
        p = tuple(p)
        parent_ok = len(p) == 1 or p[:-1] in keep
        sib_ok = p[-1] == 0 or p[:-1] + (p[-1] - 1,) in keep
        if parent_ok and sib_ok and rng.random() < 0.7:
            keep.add(p)
    return Structure(keep or {(0,)})


def test_replay_vectorised_matches_naive_loop():
    rng = np.random.default_rng(0)
    T = Structure.full([4, 3, 2, 2, 1])
    tl = [tuple(p) for p in T.to_list()]
    tidx = template_index(T)
    C = 300
    paths = np.full((C, T.max_depth), len(T) + 1, dtype=np.int64)
    walks = []
    for c in range(C):
        p, walk = (), []
        for _ in range(rng.integers(0, T.max_depth + 1)):
            kids = [q for q in tl if len(q) == len(p) + 1 and q[:-1] == p]
            p = kids[rng.integers(len(kids))]
            walk.append(p)
        walks.append(walk)
        paths[c, : len(walk)] = [tidx[q] for q in walk]
    L = rng.integers(10, 900, C).astype(np.float64)
    node_depth = np.array([0] + [len(p) for p in tl] + [T.max_depth + 1])
    cyc = ReplayCycles(template=T, paths=paths, context_lengths=L, node_depth=node_depth)
    structs = [_random_structure(rng, T) for _ in range(20)]
    depths = rng.integers(0, T.max_depth + 1, len(structs))
    m = _model(sizes=[1, 8, 32, 128], contexts=[0, 1], verify_table=[[1, 1]] * 4,
               verify_intercept=[0.04, 0.1, 0.15, 0.3], verify_slope=[1e-5, 2e-5, 3e-5, 5e-5])
    res = replay(cycles=cyc, structures=structs, depths=depths, model=m)
    for k, (S, d) in enumerate(zip(structs, depths)):
        Sd = S.up_to(int(d)) if d > 0 else None
        widths = []
        for lvl in range(1, int(d) + 1):
            widths.append(len({p[:-1] for p in S.paths if len(p) == lvl}))
        n = (len(Sd) if Sd is not None else 0) + 1
        for c in range(C):
            k_in = 0
            for q in walks[c]:
                if q not in S or len(q) > d:
                    break
                k_in += 1
            assert res.accepted[k, c] == 1 + k_in
            assert res.seconds[k, c] == pytest.approx(m.t_cycle(widths, n, L[c]), rel=1e-12)
    # masks: root always in, padding never
    mask = structure_mask(structs[0], T)
    assert mask[0] and not mask[-1]
    assert accepted_lengths(mask[None], paths, np.array([0])).max() == 1
    assert cycle_times(mask[None], T, np.array([0]), L[:2], m).shape == (1, 2)


def test_cli_summarize_records(tmp_path):
    from ogspo.cli import build_parser, main

    _collect(tmp_path / "mtbench" / "T0")
    rc = main(["summarize-records", str(tmp_path / "mtbench" / "T0"), "--drafter", "ee1",
               "--out-json", str(tmp_path / "s.json"), "--out-md", str(tmp_path / "s.md")])
    assert rc == 0
    assert json.loads((tmp_path / "s.json").read_text())["mtbench/T0"]["n_requests"] == 3
    assert main(["summarize-records", str(tmp_path / "mtbench" / "T0"), "--drafter", "eagle",
                 "--out-json", str(tmp_path / "s.json"), "--out-md", str(tmp_path / "s.md")]) == 2
    args = build_parser().parse_args(["collect-records", "--config-json", "{}", "--model", "m", "--drafter", "eagle",
                                      "--drafter-path", "d", "--workload-file", "w.parquet", "--temperature", "1", "--out", "o"])
    assert args.drafter_path == Path("d") and args.temperature == 1.0
