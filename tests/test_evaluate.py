"""Stages tune_eagle / evaluate / report on tiny float64 models and synthetic inputs (fast)."""

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from engine_helpers import hf_greedy, tiny_model
from policy_helpers import threshold_head
from solve_helpers import synthetic_latency

from ogspo.analysis.summary import summarize_requests
from ogspo.artifacts.structure import write_structure
from ogspo.engine import decode
from ogspo.engine.drafters import LMDrafter
from ogspo.engine.policies import Autoregressive, chain
from ogspo.engine.target import LlamaTreeLM, build_tree_lm
from ogspo.engine.tree import Structure
from ogspo.engine.verify import Verdict
from ogspo.learn.export import export_policy
from ogspo.methods.harness import engine_handles, make_method_engine, run_interleaved, slot_order
from ogspo.methods.registry import method_specs, structure_policy
from ogspo.stages.config import RUN_STARTED, run_elapsed_minutes
from ogspo.stages.evaluate import LosslessError, evaluate_methods, evaluate_minutes, write_evaluation
from ogspo.stages.tune_eagle import tune_eagle, write_tuning

PROMPTS = {
    "alpha": [("a0", [5, 9, 13, 2, 7]), ("a1", [3, 3, 3, 3, 3, 3, 40, 41])],
    "beta": [("b0", [17, 22, 60, 1, 8, 33, 12, 5, 9, 13])],
}
MAX_NEW = 12


@pytest.fixture(scope="module")
def models():
    target_model = tiny_model(0)
    target = build_tree_lm(target_model, max_len=256)
    drafter = LMDrafter(LlamaTreeLM(tiny_model(0), max_len=256, n_layers=1))  # early exit: partial acceptance
    return target_model, target, drafter


def _artifacts(tmp_path, *, tuned=True):
    (tmp_path / "T0").mkdir(exist_ok=True)
    (tmp_path / "T1").mkdir(exist_ok=True)
    for tag in ("T0", "T1"):
        (tmp_path / tag / "structure.json").write_text(json.dumps({"structure": Structure([(0,), (1,), (0, 0)]).to_list()}))
        if tuned:
            (tmp_path / f"tune_{tag}.json").write_text(json.dumps({"winners": {"alpha": [6, 3, 2], "beta": [4, 2, 2]},
                                                                   "best_baseline": {"alpha": "sequoia", "beta": "ar"}}))
        # an OGSPO policy folder: the structure plus a head that continues while max_cum_prob > 0.5
        pol = tmp_path / "policy" / tag
        pol.mkdir(parents=True, exist_ok=True)
        export_policy(head=threshold_head("max_cum_prob", 0.5), path=pol / "policy.onnx", structure=OGSPO_S, lam=1.0)
        write_structure(OGSPO_S, pol / "structure.json")
    return {"sequoia": str(tmp_path / "{T}" / "structure.json"), "eagle-tuned": str(tmp_path / "tune_{T}.json"),
            "ogspo": str(tmp_path / "policy" / "{T}"), "ogspo-structure": str(tmp_path / "policy" / "{T}" / "structure.json")}


OGSPO_S = Structure([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)])
SPECS = method_specs(methods=["ar", "chain", "eagle-default", "eagle-tuned", "sequoia", "ogspo", "ogspo-structure"],
                     chains=[2, 3], eagle_default=[8, 3, 3])


def test_slot_orders_come_in_mirrored_pairs():
    first, second = slot_order(5, 3, 0), slot_order(5, 3, 1)
    assert sorted(first) == list(range(5)) and first == slot_order(5, 3, 2) and second == first[::-1]
    assert {slot_order(4, s, 0)[0] for s in range(40)} == {0, 1, 2, 3}  # every method runs first in some slot
    # over a pair every method's mean position is the middle, and each runs before each other once
    for m in range(5):
        assert first.index(m) + second.index(m) == 4
    for i in range(5):
        for j in range(5):
            if i != j:
                assert (first.index(i) < first.index(j)) + (second.index(i) < second.index(j)) == 1


def test_interleaved_methods_advance_together(models, monkeypatch):
    """`run_interleaved` steps the least advanced request next (so every method's tokens spread over the
    same stretch of time), refuses engines sharing a cache, and gives each method its tokens alone."""
    target_model, target, drafter = models
    specs = method_specs(methods=["ar", "chain"], chains=[2, 4], eagle_default=[8, 3, 3])
    pols = [Autoregressive(), chain(2), chain(4)]
    shared = [make_method_engine(s, p, target=target, drafter=drafter, temperature=0.0) for s, p in zip(specs, pols)]
    with pytest.raises(ValueError, match="a target and a drafter of its own"):
        run_interleaved(shared, PROMPTS["alpha"][0][1], max_new_tokens=MAX_NEW, seed=1, latency=None)
    handles = engine_handles(target, drafter, len(specs), interleave="cycles")
    engines = [make_method_engine(s, p, target=t, drafter=d, temperature=0.0) for s, p, (t, d) in zip(specs, pols, handles)]
    gens, stepped = [], []
    real_start, real_step = decode.SpeculativeEngine.start, decode.SpeculativeEngine.step

    def start(self, *args, **kwargs):
        gens.append(real_start(self, *args, **kwargs))
        return gens[-1]

    def step(self, gen):
        stepped.append((len(gen.tokens), min(len(g.tokens) for g in gens if not g.done)))
        return real_step(self, gen)

    monkeypatch.setattr(decode.SpeculativeEngine, "start", start)
    monkeypatch.setattr(decode.SpeculativeEngine, "step", step)
    out = run_interleaved(engines, PROMPTS["alpha"][0][1], max_new_tokens=MAX_NEW, seed=1, latency=None)
    assert stepped and all(mine == least for mine, least in stepped)
    ref = hf_greedy(target_model, PROMPTS["alpha"][0][1], MAX_NEW)
    assert all(res.tokens == ref and res.wall_seconds > res.prefill_seconds > 0 for res, _ in out)
    assert max(res.tau for res, _ in out) > 1.0


def test_evaluate_rows_lossless_and_summary(models, tmp_path):
    target_model, target, drafter = models
    res = evaluate_methods(
        target=target, drafter=drafter, prompts=PROMPTS, methods=SPECS, temperatures=[0.0, 1.0],
        max_new_tokens=MAX_NEW, repeats=2, seed=0, artifacts=_artifacts(tmp_path), latency=synthetic_latency(),
        oracle={"T0": 50.0, "T1": 40.0}, reference_model=target_model,
    )
    names = ["ar", "chain2", "chain3", "eagle-default", "eagle-tuned", "sequoia", "ogspo", "ogspo-structure"]
    df = res.frame()
    assert df.height == len(names) * 2 * 3 * 2  # methods x temperatures x prompts x repeats
    assert set(df["method"]) == set(names)
    # every request of every method at T=0 equals greedy decoding; all T=0 comparisons are identical
    for row in df.filter(pl.col("temperature") == 0).iter_rows(named=True):
        prompt = dict(PROMPTS["alpha"] + PROMPTS["beta"])[row["prompt_id"]]
        assert row["tokens"] == hf_greedy(target_model, prompt, MAX_NEW)
    assert res.checked == (len(names) - 1) * 3 * 2 and not res.near_ties
    t0 = df.filter((pl.col("temperature") == 0) & (pl.col("method") != "ar"))
    assert set(t0["lossless"]) == {"identical"}
    # within one request slot the orders are a permutation; across slots the first method changes
    slots = df.group_by(["temperature", "workload", "prompt_id", "repeat"]).agg(pl.col("order").sort())
    assert all(o.to_list() == list(range(len(names))) for o in slots["order"])
    assert df.filter(pl.col("order") == 0)["method"].n_unique() > 1
    # equal work: every method of every slot generated the same number of new tokens (EOS does not stop one)
    per_slot = df.group_by(["temperature", "workload", "prompt_id", "repeat"]).agg(pl.col("new_tokens").unique())
    assert all(v.to_list() == [MAX_NEW] for v in per_slot["new_tokens"])
    assert res.calib_best["T0"] == {"alpha": "sequoia", "beta": "ar"}
    # drafting methods committed more than one token per cycle somewhere; ar exactly one
    assert df.filter(pl.col("method") == "ar")["tau"].max() == 1.0
    assert df.filter(pl.col("method") == "chain3")["tau"].max() > 1.0
    # time split adds up; surrogate prediction present
    parts = df.select(pl.sum_horizontal("prefill_seconds", "draft_seconds", "policy_seconds", "verify_seconds",
                                        "other_seconds"))
    assert np.all(parts.to_numpy()[:, 0] <= df["wall_seconds"].to_numpy() + 1e-9)
    assert (df["predicted_throughput"] > 0).all()
    # the OGSPO stop hook is timed (and only OGSPO has one); it stopped early somewhere
    assert (df.filter(pl.col("method") == "ogspo")["policy_seconds"] > 0).all()
    assert (df.filter(pl.col("method") != "ogspo")["policy_seconds"] == 0).all()
    og = df.filter(pl.col("method") == "ogspo")["mean_tree_size"].mean()
    assert og < df.filter(pl.col("method") == "ogspo-structure")["mean_tree_size"].mean()
    assert res.tuned == {"T0": {"alpha": [6, 3, 2], "beta": [4, 2, 2]}, "T1": {"alpha": [6, 3, 2], "beta": [4, 2, 2]}}
    # summary: one row per method x workload x temperature, paired speedups, oracle by temperature
    rows = res.summary
    assert len(rows) == len(names) * 2 * 2
    ar_rows = [r for r in rows if r["method"] == "ar"]
    assert all(r["speedup"] == 1.0 and r["tau"] == 1.0 for r in ar_rows)
    tuned = [r for r in rows if r["method"] == "eagle-tuned"]
    assert all(r["vs_eagle_tuned"] == 1.0 for r in tuned)
    assert {r["oracle_throughput"] for r in rows if r["temperature"] == 1.0} == {40.0}
    split = rows[0]["time_split"]
    assert set(split) == {"prefill", "draft", "policy", "verify", "other"} and sum(split.values()) <= 1 + 1e-9
    write_evaluation(res, requests_path=tmp_path / "ev" / "requests.parquet", summary_path=tmp_path / "ev" / "summary.json")
    doc = json.loads((tmp_path / "ev" / "summary.json").read_text())
    assert doc["lossless"]["checked"] == res.checked and len(doc["rows"]) == len(rows)
    assert pl.read_parquet(tmp_path / "ev" / "requests.parquet").height == df.height


def _broken_verify_greedy(tree, logits):
    """Accept the first drafted child whatever the target says (a deliberately broken verifier)."""
    v = _REAL_VERIFY(tree, logits)
    if len(tree) > 1 and len(v.path) == 1:
        child = 1
        return Verdict(path=[0, child], bonus=int(logits[child].argmax()), matches=v.matches)
    return v


_REAL_VERIFY = decode.verify_greedy


def test_ogspo_static_runs_only_where_a_stop_policy_ships(models, tmp_path):
    """`ogspo-static` (the static tree a shipped stop policy replaces, from workloads.json) runs in the
    cells where `ogspo` ships its policy and is skipped where `ogspo` is that static tree itself; the
    report's pooled comparison of ogspo with it covers the cells where it ran."""
    from ogspo.analysis.summary import pooled_comparisons

    target_model, target, drafter = models
    arts = _artifacts(tmp_path)
    arts["ogspo-static"] = arts["ogspo"]
    for tag in ("T0", "T1"):  # alpha: the policy ships and replaces S<=1; beta: S<=2 ships (no policy)
        (tmp_path / "policy" / tag / "workloads.json").write_text(json.dumps({
            "alpha": {"shipped": "policy", "structure": None, "static": "S<=1", "static_structure": [[0], [1]]},
            "beta": {"shipped": "S<=2", "structure": [[0], [0, 0]], "static": "S<=2", "static_structure": [[0], [0, 0]]}}))
    specs = method_specs(methods=["ar", "ogspo", "ogspo-static"], chains=[], eagle_default=[8, 3, 3])
    res = evaluate_methods(target=target, drafter=drafter, prompts=PROMPTS, methods=specs, temperatures=[0.0],
                           max_new_tokens=MAX_NEW, repeats=1, seed=0, artifacts=arts, reference_model=target_model)
    df = res.frame()
    assert set(df.filter(pl.col("method") == "ogspo-static")["workload"]) == {"alpha"}
    assert res.settings["skipped"] == {"T0/beta": ["ogspo-static (the same tree as ogspo)"]}
    assert set(df.filter(pl.col("temperature") == 0)["lossless"]) <= {"identical", "n/a"}
    static = df.filter(pl.col("method") == "ogspo-static")
    assert (static["policy_seconds"] == 0).all() and static["mean_tree_size"].max() <= 2
    vs = pooled_comparisons(df, method="ogspo")["vs_static"]
    assert vs["pooled"]["n"] == len(PROMPTS["alpha"]) and [c["workload"] for c in vs["cells"]] == ["alpha"]
    (tmp_path / "policy" / "T0" / "workloads.json").write_text(json.dumps({"alpha": {"shipped": "policy", "structure": None}}))
    with pytest.raises(ValueError, match="names no static tree for workload 'alpha'"):
        evaluate_methods(target=target, drafter=drafter, prompts=PROMPTS, methods=specs, temperatures=[0.0],
                         max_new_tokens=MAX_NEW, repeats=1, seed=0, artifacts=arts, reference_model=target_model)


@pytest.mark.parametrize("interleave", ["cycles", "requests"])
def test_lossless_check_catches_a_broken_verifier(models, monkeypatch, interleave):
    target_model, target, drafter = models
    specs = method_specs(methods=["ar", "chain"], chains=[3], eagle_default=[8, 3, 3])
    run = dict(target=target, drafter=drafter, prompts=PROMPTS, methods=specs, temperatures=[0.0], max_new_tokens=MAX_NEW,
               repeats=1, seed=0, reference_model=target_model, interleave=interleave)
    assert evaluate_methods(**run).checked == 3  # chain3 on every prompt, identical
    monkeypatch.setattr(decode, "verify_greedy", _broken_verify_greedy)
    with pytest.raises(LosslessError, match=r"method 'chain3' on alpha prompt a\d \(T=0, repeat 0\): MISMATCH"):
        evaluate_methods(**run)
    with pytest.raises(ValueError, match="evaluate.interleave is 'cycle'; allowed: cycles, requests"):
        evaluate_methods(**{**run, "interleave": "cycle"})


def test_near_ties_are_reported_not_failed(models, monkeypatch):
    """A divergence that compare_greedy calls a near-tie is listed, and the run goes on."""
    from ogspo.engine.lossless import LosslessReport
    from ogspo.stages import evaluate as ev

    target_model, target, drafter = models
    monkeypatch.setattr(decode, "verify_greedy", _broken_verify_greedy)
    monkeypatch.setattr(ev, "compare_greedy", lambda m, p, r, c, tie_margin: LosslessReport(
        equal=False, first_mismatch=3, margin=5e-5, candidate_is_runner_up=True, near_tie=True))
    specs = method_specs(methods=["ar", "chain"], chains=[3], eagle_default=[8, 3, 3])
    res = evaluate_methods(target=target, drafter=drafter, prompts=PROMPTS, methods=specs, temperatures=[0.0],
                           max_new_tokens=MAX_NEW, repeats=1, seed=0, reference_model=target_model)
    assert len(res.near_ties) >= 1 and res.near_ties[0].method == "chain3"
    assert sum(r["near_ties"] for r in res.summary) == len(res.near_ties)


def test_tune_eagle_picks_the_fastest_grid_point(models, tmp_path):
    _, target, drafter = models
    grid = [[0, 0, 0], [4, 2, 2], [8, 3, 3]]
    write_structure(Structure([(0,), (0, 0)]), tmp_path / "sequoia.json")
    res = tune_eagle(target=target, drafter=drafter, prompts=PROMPTS, grid=grid, temperature=0.0,
                     max_new_tokens=MAX_NEW, seed=0, static=structure_policy(tmp_path / "sequoia.json", "sequoia"))
    assert len(res.points) == len(grid) * len(PROMPTS)
    for w in PROMPTS:
        pts = [p for p in res.points if p.workload == w]
        best = max(pts, key=lambda p: p.throughput)
        assert res.winners[w] == [best.total_tokens, best.depth, best.top_k]
        assert 0 < res.winner_stability[w] <= 1
        # the best baseline on the calib prompts is the fastest of AR, the winner and the static tree
        cands = {"ar": next(p.throughput for p in pts if p.total_tokens == 0), "eagle-tuned": best.throughput,
                 "sequoia": res.static_throughput[w]}
        assert cands[res.best_baseline[w]] == max(cands.values())
    write_tuning(res, tmp_path / "tune_T0.json")
    doc = json.loads((tmp_path / "tune_T0.json").read_text())
    assert set(doc["winners"]) == set(PROMPTS) and len(doc["grid"]) == len(res.points)
    assert set(doc["best_baseline"]) == set(PROMPTS)
    with pytest.raises(ValueError, match=r"eagle_grid entry \[4, 2\]"):
        tune_eagle(target=target, drafter=drafter, prompts=PROMPTS, grid=[[4, 2]], temperature=0.0,
                   max_new_tokens=MAX_NEW, seed=0)


def test_bad_method_config_gives_one_clear_line():
    with pytest.raises(ValueError, match="must include 'ar'"):
        method_specs(methods=["chain"], chains=[4], eagle_default=[60, 5, 10])
    with pytest.raises(ValueError, match=r"unknown method 'eagel'; allowed: ar, ar-aa, chain, eagle-default"):
        method_specs(methods=["ar", "eagel"], chains=[4], eagle_default=[60, 5, 10])
    from ogspo.stages.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"config error at 'evaluate.methods\[1\]': 'eagel' is not allowed; allowed values: ar"):
        load_config({"evaluate": _evaluate_config(methods=["ar", "eagel"])}, sections=("evaluate",))
    with pytest.raises(ConfigError, match=r"config error at 'evaluate.eagle_grid\[0\]'"):
        load_config({"evaluate": _evaluate_config(eagle_grid=[[60, 5]])}, sections=("evaluate",))
    # through the CLI: one `ogspo: error:` line, exit status 2
    from ogspo.cli import main
    from ogspo.stages.registry import STAGES

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        cfg = {**_default_config(), "evaluate": _evaluate_config(repeats=0)}
        rc = main(["evaluate", "--config-json", json.dumps({k: cfg[k] for k in STAGES["evaluate"].sections}),
                   "--model", "nowhere", "--drafter", "lookup", "--workloads", "x.parquet",
                   "--out-requests", "r.parquet", "--out-summary", "s.json"])
    assert rc == 2 and err.getvalue().count("\n") == 1 and "evaluate.repeats" in err.getvalue()


def _default_config() -> dict:
    import yaml

    return yaml.safe_load((Path(__file__).resolve().parents[1] / "config" / "default.yaml").read_text())


def _evaluate_config(**over):
    return {**_default_config()["evaluate"], **over}


def test_summary_of_synthetic_rows():
    rows = []
    for pid, (a, e, o) in enumerate([(10.0, 12.0, 15.0), (20.0, 20.0, 30.0), (10.0, 25.0, 20.0)]):
        for m, tp in (("ar", a), ("eagle-tuned", e), ("ogspo", o)):
            rows.append({"workload": "w", "temperature": 0.0, "method": m, "prompt_id": str(pid), "repeat": 0,
                         "throughput": tp, "wall_seconds": 1.0, "prefill_seconds": 0.1, "draft_seconds": 0.2,
                         "policy_seconds": 0.05, "verify_seconds": 0.5, "other_seconds": 0.15, "cycles": 4, "tau": 2.0,
                         "mean_tree_size": 3.0, "predicted_throughput": tp * 1.1, "new_tokens": int(tp),
                         "predicted_seconds": 1.0 / 1.1, "lossless": "identical"})
    out = summarize_requests(pl.DataFrame(rows), oracle={"T0": 33.0}, calib_best={"T0": {"w": "ar"}})
    og = next(r for r in out if r["method"] == "ogspo")
    assert og["throughput"] == 20.0 and og["throughput_min"] == 15.0 and og["throughput_max"] == 30.0
    assert og["speedup"] == pytest.approx(1.5)  # median of 1.5, 1.5, 2.0
    assert og["vs_eagle_tuned"] == pytest.approx(1.25)  # median of 1.25, 1.5, 0.8
    assert og["predicted_over_realised"] == pytest.approx(1.1) and og["oracle_throughput"] == 33.0
    assert og["time_split"]["verify"] == pytest.approx(0.5)
    # geometric means of the paired ratios; the calib-picked best baseline (ar here) is measured as given,
    # the eval-picked one is the faster of ar and eagle-tuned (geometric mean) on these requests
    assert og["speedup_gm"]["ratio"] == pytest.approx((1.5 * 1.5 * 2.0) ** (1 / 3))
    assert og["best_baseline"] == "ar" and og["vs_best"]["ratio"] == pytest.approx(og["speedup_gm"]["ratio"])
    assert og["best_baseline_eval"] == "eagle-tuned"
    assert og["vs_best_eval"]["ratio"] == pytest.approx((1.25 * 1.5 * 0.8) ** (1 / 3))
    assert og["vs_best_eval"]["low"] <= og["vs_best_eval"]["ratio"] <= og["vs_best_eval"]["high"]
    assert og["latency_p50"] == 1.0 and og["ttft_p50"] == pytest.approx(0.1)


def _synthetic_requests() -> pl.DataFrame:
    rng = np.random.default_rng(0)
    rows = []
    for t in (0.0, 1.0):
        for w in ("alpha", "beta"):
            for pid in range(3):
                for m, base in (("ar", 20.0), ("chain4", 18.0), ("eagle-tuned", 24.0), ("ogspo", 27.0)):
                    tp = base * (1 + 0.1 * rng.standard_normal())
                    rows.append({
                        "workload": w, "temperature": t, "method": m, "prompt_id": f"{w}{pid}", "repeat": 0,
                        "throughput": tp, "wall_seconds": 48 / tp, "prefill_seconds": 0.1, "draft_seconds": 0.3,
                        "policy_seconds": 0.02 if m == "ogspo" else 0.0, "verify_seconds": 1.0, "other_seconds": 0.1,
                        "cycles": 20, "tau": 2.4 if m != "ar" else 1.0, "mean_tree_size": 0.0 if m == "ar" else 5.0,
                        "predicted_throughput": tp * 1.05, "lossless": "n/a" if m == "ar" or t else "identical",
                        "new_tokens": 48, "predicted_seconds": 48 / (tp * 1.05),
                    })
    return pl.DataFrame(rows)


def test_report_writes_summary_markdown_and_plots(tmp_path):
    from ogspo.stages.report import write_report

    ev = tmp_path / "evaluate"
    ev.mkdir()
    _synthetic_requests().write_parquet(ev / "requests.parquet")
    (ev / "summary.json").write_text(json.dumps({
        "rows": [], "oracle": {"T0": 35.0, "T1": 30.0}, "eagle_tuned": {"T0": {"alpha": [16, 4, 4]}},
        "lossless": {"checked": 36, "mismatches": 0, "near_ties": [
            {"method": "ogspo", "workload": "beta", "prompt_id": "beta1", "repeat": 0, "token": 7, "margin": 3e-5}]},
    }))
    lat = synthetic_latency()
    (tmp_path / "latency.json").write_text(json.dumps({
        "model": lat.to_json(), "validation": [{"n": 3, "L": 256, "measured": 0.19, "predicted": 0.18, "ape": 0.05}],
        "mdape": 0.05, "fixed_samples": [0.004], "seconds": 1.0}))
    (tmp_path / "records.json").write_text(json.dumps({
        "alpha/T0": {"tau": 2.1, "accept_by_depth": [0.6, 0.3, 0.1]},
        "alpha/T1": {"tau": 1.7, "accept_by_depth": [0.5, 0.2, 0.0]}}))
    write_structure(OGSPO_S, tmp_path / "structure_T0.json")
    write_structure(Structure([]), tmp_path / "structure_T1.json")
    pl.DataFrame({"round": [0, 1, 2], "surrogate_J": [20.0, 22.0, 22.5], "oracle_bound": [35.0] * 3,
                  "same_trace_J": [19.0, 21.0, 21.5], "corrected_J": [19.5, 21.5, 22.0], "accepted": [True, True, False],
                  "structure_size": [7, 8, 8]}).write_parquet(tmp_path / "rounds_T0.parquet")
    figs = [{"workload": "alpha", "temperature": 0.0, "method": "ar", "head": "", "tau": 1.0, "throughput": 30.0, "speedup": 1.0,
             "tokens": 10, "accept_by_depth": []}]
    for head, acc, tau in (("base", [0.4, 0.3], 1.6), ("gto", [0.5, 0.35], 1.9)):
        figs += [{"workload": "alpha", "temperature": 0.0, "method": "chain2", "head": head, "tau": 1.5, "throughput": 31.0,
                  "speedup": 1.03, "tokens": 10, "accept_by_depth": acc, "first_token_ceiling": 1.0},
                 {"workload": "alpha", "temperature": 0.0, "method": "eagle8-3-2", "head": head, "tau": tau, "throughput": 33.0,
                  "speedup": 1.1, "tokens": 10, "accept_by_depth": []}]
        (tmp_path / head).mkdir()
        meta = {"metrics": {"val_top1": [0.45, 0.3]}}
        if head == "gto":
            meta["gto_metrics"] = {"steps": 100, "seconds": 120.0, "reward_before": 2.5, "reward_after": 2.75,
                                   "accepted_before": 0.8, "accepted_after": 0.9}
        (tmp_path / head / "drafter.json").write_text(json.dumps(meta))
    recall = {"base": {"alpha": {"ks": [1, 2, 4, 8], "recall": [[0.4, 0.5, 0.6, 0.7], [0.3, 0.4, 0.5, 0.6]],
                                 "positions": [100, 99]}}}  # the gto head measured none: "-"
    (tmp_path / "acceptance.json").write_text(json.dumps({"figures": figs, "recall": recall}))
    out = tmp_path / "report"
    r = write_report(
        evaluate_summary=ev / "summary.json", requests=ev / "requests.parquet", out_dir=out,
        latency=tmp_path / "latency.json", records_summary=tmp_path / "records.json",
        structures={"T0": tmp_path / "structure_T0.json", "T1": tmp_path / "structure_T1.json"},
        rounds={"T0": tmp_path / "rounds_T0.parquet", "T1": tmp_path / "absent.parquet"},
        drafter_eval=tmp_path / "acceptance.json", heads={"base": tmp_path / "base", "gto": tmp_path / "gto"},
    )
    doc = json.loads((out / "summary.json").read_text())
    assert len(doc["rows"]) == 4 * 2 * 2  # methods x workloads x temperatures
    need = {"method", "workload", "temperature", "throughput", "throughput_q25", "throughput_q75", "tau", "speedup",
            "vs_eagle_tuned", "predicted_throughput", "oracle_throughput", "time_split"}
    assert all(need <= set(row) for row in doc["rows"])
    og = [row for row in doc["rows"] if row["method"] == "ogspo"]
    assert all(row["vs_eagle_tuned"] > 1 and row["oracle_throughput"] in (35.0, 30.0) for row in og)
    ratios = doc["ogspo_vs_eagle_tuned"]
    assert set(ratios["by_temperature"]) == {"T0", "T1"} and ratios["mean"] == pytest.approx(
        np.mean([v for per in ratios["by_temperature"].values() for v in per.values()]))
    for name in ("throughput", "latency", "rounds", "acceptance", "structure"):
        png = out / f"{name}.png"
        assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG", name
    md = (out / "report.md").read_text()
    assert "OGSPO / tuned EAGLE-3" in md and "Mean over workloads and temperatures" in md
    assert "beta1" in md and "1 float near-ties" in md  # the near-tie is reported
    assert "absent.parquet not found" in md and any("absent.parquet" in m for m in r.missing)
    assert "What limits it" in md and "T1: the OGSPO structure has 0 nodes" in md
    # both heads side by side, with GTO's reward before and after
    assert "| alpha | 0 | base | 0.40, 0.30 | 1.000 | 0.40/0.50/0.60/0.70 | eagle8-3-2 | 1.60 | 1.10x |" in md
    assert "| alpha | 0 | gto | 0.50, 0.35 | 1.000 | - | eagle8-3-2 | 1.90 | 1.10x |" in md
    assert "Draft Tree Reward 2.500 -> 2.750" in md
    # without rounds tables at all, the plot is left out and said so
    r2 = write_report(evaluate_summary=ev / "summary.json", requests=ev / "requests.parquet", out_dir=tmp_path / "r2")
    assert [p.name for p in r2.plots] == ["throughput.png"] and len(r2.missing) == 3


def test_the_throughput_plot_reads_speedups_and_falls_back_to_tokens_per_second(tmp_path):
    from ogspo.analysis.plots import plot_throughput

    def row(m, w, t, v, paired):
        return {"method": m, "workload": w, "temperature": t, "throughput": 50 * v, "throughput_q25": 45 * v,
                "throughput_q75": 55 * v, "speedup_gm": {"ratio": v, "low": v - 0.1, "high": v + 0.1, "n": 4} if paired else None}

    for paired in (True, False):  # paired ratios over AR where AR ran; else the median tokens/s and IQR
        rows = [row(m, w, t, 1.0 + 0.1 * i, paired and m != "ar") for i, m in enumerate(("ar", "eagle", "ogspo"))
                for w in ("alpha", "beta") for t in (0.0, 1.0)]
        png = plot_throughput(rows, tmp_path / f"tp-{paired}.png")
        assert png.read_bytes()[:4] == b"\x89PNG"


def test_report_refuses_a_bad_requests_table(tmp_path):
    from ogspo.cli import main

    pl.DataFrame({"workload": ["a"], "throughput": [1.0]}).write_parquet(tmp_path / "requests.parquet")
    (tmp_path / "summary.json").write_text("{}")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["report", "--evaluate-summary", str(tmp_path / "summary.json"), "--requests",
                   str(tmp_path / "requests.parquet"), "--out", str(tmp_path / "report")])
    assert rc == 2 and err.getvalue().count("\n") == 1 and "missing columns temperature, method" in err.getvalue()


def test_records_figures_leave_out_a_sequoia_tree_outside_the_template():
    """sequoia.json's replayed_throughput is None when its tree leaves the records' template (the quick
    run met it): the records figures leave the static tree out, and the report's statements still form."""
    from ogspo.analysis.markdown import records_figures

    rounds = {"T0": pl.DataFrame({"accepted": [True], "surrogate_J": [21.0]})}
    inside = {"replayed_autoregressive": 18.0, "replayed_throughput": 20.0}
    outside = {"replayed_autoregressive": 18.0, "replayed_throughput": None}
    figs = records_figures(oracle={"T0": 25.0, "T1": 24.0}, sequoia={"T0": inside, "T1": outside}, rounds=rounds)
    assert figs["T0"] == {"oracle": 25.0, "ar": 18.0, "static": 20.0, "policy": 21.0}
    assert figs["T1"] == {"oracle": 24.0, "ar": 18.0}


def test_auto_budget_fills_what_is_left_of_the_runs_hour():
    """`evaluate.minutes: auto` takes what the stages before it left of run.minutes (less the tail), never less
    than min_minutes (also where the run's start is unknown); a number or null is used as given."""
    run = {"minutes": 60, "tail_minutes": 2}
    auto = {"minutes": "auto", "min_minutes": 8}
    assert evaluate_minutes(auto, run, elapsed=30.0) == pytest.approx(28.0)  # a fast machine: the rest of the hour
    assert evaluate_minutes(auto, run, elapsed=55.0) == 8  # a slow one keeps its floor
    assert evaluate_minutes(auto, run, elapsed=None) == 8  # a stage run on its own
    assert evaluate_minutes({"minutes": 5, "min_minutes": 8}, run, elapsed=10.0) == 5
    assert evaluate_minutes({"minutes": None, "min_minutes": 8}, run, elapsed=10.0) is None
    assert run_elapsed_minutes({}, now=1000.0) is None
    assert run_elapsed_minutes({RUN_STARTED: "1000"}, now=1600.0) == pytest.approx(10.0)
    with pytest.raises(ValueError, match=f"\\${RUN_STARTED} is 'noon': it must be the run's start in Unix seconds"):
        run_elapsed_minutes({RUN_STARTED: "noon"})


def test_evaluate_runs_rounds_of_slot_pairs_within_its_budget(models):
    """With a budget that holds no round, the round holding the light methods (slots 0 and 1) and the
    first round without them (slots 2 and 3) still run in every cell, and the settings name the prompts
    taken and those asked; without a budget, every prompt."""
    target_model, target, drafter = models
    prompts = {w: [(f"{w}{i}", [5 + i, 9, 13, 2 + len(w)]) for i in range(6)] for w in ("alpha", "beta")}
    specs = method_specs(methods=["ar", "chain"], chains=[2], eagle_default=[8, 3, 3])
    run = dict(target=target, drafter=drafter, prompts=prompts, methods=specs, temperatures=[0.0, 1.0], max_new_tokens=4,
               repeats=1, seed=0, reference_model=target_model, light_methods=("chain",), light_prompts=1)
    cut = evaluate_methods(**run, minutes=1e-6)
    df = cut.frame()
    assert sorted(set(df["prompt_id"])) == [f"{w}{i}" for w in ("alpha", "beta") for i in range(4)]
    assert df.filter(pl.col("method") == "chain2")["prompt_id"].sort().to_list() == ["alpha0", "alpha0", "beta0", "beta0"]
    assert df.height == 2 * 2 * (4 + 1)  # temperatures x workloads x (ar on 4 slots, chain on the first)
    assert cut.settings["prompts"] == {w: [f"{w}{i}" for i in range(4)] for w in ("alpha", "beta")}
    assert cut.settings["prompts_asked"] == 6 and cut.settings["budget"]["taken"] == {"rounds": 1}
    whole = evaluate_methods(**run, minutes=None)
    assert whole.frame().filter(pl.col("method") == "ar").height == 2 * 2 * 6
    assert whole.settings["prompts"]["beta"] == [f"beta{i}" for i in range(6)]
