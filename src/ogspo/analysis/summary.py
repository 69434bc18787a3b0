"""Aggregates of an evaluation (stage `evaluate`, and `report` recomputing them from
requests.parquet): per-cell medians, spreads and paired-ratio intervals of every method against
autoregressive decoding, tuned EAGLE-3 and the best baseline of the cell (`analysis.compare`)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import polars as pl

from ogspo.analysis.compare import best_of_intervals, intervals_json, ratio_intervals
from ogspo.artifacts.records import temperature_tag
from ogspo.methods.registry import AA_CHECK, OGSPO_STATIC, REFERENCE, TUNED


def quantile(x: np.ndarray, q: float) -> float:
    return float(np.quantile(x, q)) if len(x) else float("nan")


def _paired_ratio(df: pl.DataFrame, method: str, baseline: str) -> np.ndarray:
    keys = ["workload", "temperature", "prompt_id", "repeat"]
    a = df.filter(pl.col("method") == method).select(keys + ["throughput"])
    b = df.filter(pl.col("method") == baseline).select(keys + [pl.col("throughput").alias("base")])
    j = a.join(b, on=keys, how="inner").filter(pl.col("base") > 0)
    return (j["throughput"] / j["base"]).to_numpy()


SEQUOIA = "sequoia"
BASELINES = (REFERENCE, TUNED, SEQUOIA)  # the best of these per cell is what a user would otherwise run


def calib_best_table(calib_best: Mapping[str, Mapping[str, str]] | None, df: pl.DataFrame) -> pl.DataFrame:
    """The calib-picked best baseline per cell (tag -> workload -> method) as a `ratio_intervals`
    baseline table, for the cells of `df` whose pick ran there; empty when none was given."""
    present = set(df["method"].to_list()) if df.height else set()
    rows = [{"workload": w, "temperature": float(t), "baseline": b}
            for t in (sorted({float(x) for x in df["temperature"].to_list()}) if df.height else [])
            for w, b in (calib_best or {}).get(temperature_tag(t), {}).items() if b in present]
    return pl.DataFrame(rows, schema={"workload": pl.String, "temperature": pl.Float64, "baseline": pl.String})


def summarize_requests(df: pl.DataFrame, *, oracle: Mapping[str, float] | None = None,
                       calib_best: Mapping[str, Mapping[str, str]] | None = None,
                       reference: str = REFERENCE, baseline: str = TUNED) -> list[dict]:
    """One row per method x workload x temperature: medians and spreads (IQR and min/max) of
    throughput, tau, paired speedup over `reference` and ratio to `baseline` (medians of per-request
    ratios), the geometric means of the paired ratios to `reference`, to `baseline` and to the cell's
    best baseline (`analysis.compare`: picked on the calib prompts, `vs_best`, and picked on these
    requests with a re-pick in every resample, `vs_best_eval`) with 95% bootstrap intervals, time to
    first token and request latency percentiles, surrogate-predicted throughput, oracle bound and time
    split (shares of wall time)."""
    oracle = oracle or {}
    out = []
    if df.height == 0:
        return out
    methods = list(dict.fromkeys(df["method"].to_list()))
    best = calib_best_table(calib_best, df)
    best_of = {(w, float(t)): b for w, t, b in best.iter_rows()}
    present = set(methods)
    gm = {m: {"vs_ar": ratio_intervals(df, m, reference)["cells"] if reference in present else {},
              "vs_tuned": ratio_intervals(df, m, baseline)["cells"] if baseline in present else {},
              "vs_best": ratio_intervals(df, m, best)["cells"] if best.height else {}} for m in methods}
    eval_best = {m: best_of_intervals(df, m, BASELINES) for m in methods if m not in BASELINES}
    for (workload, temp), g in df.group_by(["workload", "temperature"], maintain_order=True):
        cell = (workload, float(temp))
        for m in methods:
            r = g.filter(pl.col("method") == m)
            if r.height == 0:
                continue
            tps = r["throughput"].to_numpy()
            wall = float(r["wall_seconds"].sum())
            split = {k: float(r[f"{k}_seconds"].sum()) / wall if wall > 0 else float("nan")
                     for k in ("prefill", "draft", "policy", "verify", "other")}
            cycles = int(r["cycles"].sum())
            tau = float((r["tau"] * r["cycles"]).sum() / cycles) if cycles else 1.0
            speed = _paired_ratio(g, m, reference) if reference in g["method"] else np.array([])
            vs_tuned = _paired_ratio(g, m, baseline) if baseline in g["method"] else np.array([])
            pred = r["predicted_throughput"].to_numpy()
            pred = pred[np.isfinite(pred)]
            ratio = (r["predicted_throughput"] / r["throughput"]).to_numpy()
            ratio = ratio[np.isfinite(ratio)]
            lat = r["wall_seconds"].to_numpy()
            # cycles only (prefill out), sum of tokens / sum of seconds as J is: realised and in the latency model's units
            after_first = float((r["new_tokens"] - 1).sum())
            cyc_s = float((r["wall_seconds"] - r["prefill_seconds"]).sum())
            cyc_pred = float((r["predicted_seconds"] - r["prefill_seconds"]).sum())
            ivs = {k: gm[m][k].get(cell) for k in ("vs_ar", "vs_tuned", "vs_best")}
            out.append({
                "method": m, "workload": workload, "temperature": float(temp), "n_requests": r.height,
                "throughput": float(np.median(tps)), "throughput_q25": quantile(tps, 0.25), "throughput_q75": quantile(tps, 0.75),
                "throughput_min": float(tps.min()), "throughput_max": float(tps.max()),
                "tau": tau, "mean_tree_size": float(r["mean_tree_size"].mean()),
                "speedup": float(np.median(speed)) if len(speed) else None,
                "speedup_q25": quantile(speed, 0.25) if len(speed) else None,
                "speedup_q75": quantile(speed, 0.75) if len(speed) else None,
                "vs_eagle_tuned": float(np.median(vs_tuned)) if len(vs_tuned) else None,
                "speedup_gm": ivs["vs_ar"].to_dict() if ivs["vs_ar"] else None,
                "vs_eagle_tuned_gm": ivs["vs_tuned"].to_dict() if ivs["vs_tuned"] else None,
                "best_baseline": best_of.get(cell),
                "vs_best": ivs["vs_best"].to_dict() if ivs["vs_best"] else None,
                "best_baseline_eval": eval_best[m]["picked"].get(cell) if m in eval_best else None,
                "vs_best_eval": (eval_best[m]["cells"][cell].to_dict()
                                 if m in eval_best and cell in eval_best[m]["cells"] else None),
                "ttft_p50": quantile(r["prefill_seconds"].to_numpy(), 0.5),
                "latency_p50": quantile(lat, 0.5), "latency_p90": quantile(lat, 0.9),
                "cycles_throughput": after_first / cyc_s if cyc_s > 0 else None,
                "predicted_cycles_throughput": after_first / cyc_pred if np.isfinite(cyc_pred) and cyc_pred > 0 else None,
                "predicted_throughput": float(np.median(pred)) if len(pred) else None,
                "predicted_over_realised": float(np.median(ratio)) if len(ratio) else None,
                "oracle_throughput": oracle.get(temperature_tag(temp)),
                "time_split": split,
                "identical": int((r["lossless"] == "identical").sum()),
                "near_ties": int((r["lossless"] == "near-tie").sum()),
            })
    return out


def pooled_comparisons(df: pl.DataFrame, *, method: str, calib_best: Mapping[str, Mapping[str, str]] | None = None,
                       seed: int = 0) -> dict:
    """Pooled (all cells) and per-temperature intervals of `method` against autoregressive decoding,
    tuned EAGLE-3, Sequoia and the best baseline per cell (picked on the calib prompts: `vs_best`; picked
    on these requests, re-picked per resample: `vs_best_eval`), the static tree its stop policy replaced
    where one ships (`vs_static`), and the A/A check (`ar-aa` against `ar`)
    when it ran."""
    present = set(df["method"].to_list()) if df.height else set()
    out: dict = {}
    if method in present:
        if REFERENCE in present:
            out["vs_ar"] = intervals_json(ratio_intervals(df, method, REFERENCE, seed=seed))
        if TUNED in present:
            out["vs_eagle_tuned"] = intervals_json(ratio_intervals(df, method, TUNED, seed=seed))
        if SEQUOIA in present:
            out["vs_sequoia"] = intervals_json(ratio_intervals(df, method, SEQUOIA, seed=seed))
        if OGSPO_STATIC in present and method != OGSPO_STATIC:  # only the cells where a stop policy ships run it
            out["vs_static"] = intervals_json(ratio_intervals(df, method, OGSPO_STATIC, seed=seed))
        best = calib_best_table(calib_best, df)
        if best.height:
            out["vs_best"] = intervals_json(ratio_intervals(df, method, best, seed=seed))
            out["best_baselines"] = best.to_dicts()
        if present & set(BASELINES):
            out["vs_best_eval"] = intervals_json(best_of_intervals(df, method, BASELINES, seed=seed))
    if AA_CHECK in present and REFERENCE in present:
        out["aa_check"] = intervals_json(ratio_intervals(df, AA_CHECK, REFERENCE, seed=seed))
    return out


def render_summary(rows: list[dict]) -> str:
    lines = ["| T | workload | method | tok/s (median) | IQR | tau | speedup vs ar | predicted tok/s |",
             "|---:|---|---|---:|---|---:|---:|---:|"]
    for r in rows:
        sp = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        pr = f"{r['predicted_throughput']:.1f}" if r["predicted_throughput"] is not None else "-"
        lines.append(f"| {r['temperature']:g} | {r['workload']} | {r['method']} | {r['throughput']:.1f} | "
                     f"{r['throughput_q25']:.1f}-{r['throughput_q75']:.1f} | {r['tau']:.2f} | {sp} | {pr} |")
    return "\n".join(lines)
