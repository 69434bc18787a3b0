"""Benchmark: evaluate's two ways of timing a slot's methods, side by side on the same requests.

    PATH=.venv/bin:$PATH python benchmarks/bench_interleave.py [--prompts 3] [--write]

Needs a finished default run (results/cpu). Per eval request slot (workload, prompt, temperature)
`stages.evaluate.evaluate_methods` runs the comparison's methods (ar, ar-aa, eagle-tuned, sequoia,
ogspo) twice, once per `evaluate.interleave` mode, the two modes in a mirrored seeded order per pair
of slots (`methods.harness.slot_order`), with the same seeds: "cycles" (the methods advance side by
side, cycle by cycle, each on its own fork of the caches) and "requests" (one request after another).
Per mode: the spread of the per-request A/A log ratio (`ar-aa` / `ar`: only timing noise, the two
decode the same tokens), the A/A interval, `ogspo` against the calib-picked best baseline and AR with
their intervals, and the latency model's predicted / realised throughput; across modes, each
method's throughput under "cycles" over "requests" on the same slots (does interleaving cost a
method anything, e.g. caches the others evict?).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchdoc import REPO, git_commit, machine, require_run, write_section  # noqa: E402

from ogspo.analysis.compare import ratio_intervals  # noqa: E402
from ogspo.analysis.summary import calib_best_table  # noqa: E402
from ogspo.artifacts.latency import LatencyModel  # noqa: E402
from ogspo.artifacts.records import temperature_tag  # noqa: E402
from ogspo.engine.kernels import read_kernel_table  # noqa: E402
from ogspo.methods.harness import INTERLEAVE, pair_seed, slot_order  # noqa: E402
from ogspo.methods.registry import load_engine, method_specs  # noqa: E402
from ogspo.stages.evaluate import evaluate_methods, load_prompts, read_calib_best  # noqa: E402

METHODS = ["ar", "ar-aa", "eagle-tuned", "sequoia", "ogspo"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=REPO / "results" / "cpu")
    ap.add_argument("--prompts", type=int, default=3, help="eval prompts per workload")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", action="store_true", help="rewrite this section of docs/BENCHMARKS.md")
    args = ap.parse_args()
    res = args.results
    require_run(res, ap.error)

    e = load_engine(res / "model", drafter="eagle", drafter_path=res / "drafter",
                    kernels=read_kernel_table(res / "kernels" / "kernels.json"), max_len=2048)
    latency = LatencyModel.from_json(res / "latency" / "latency.json", expect_model=e.model_checksum,
                                     expect_drafter=e.drafter_id)
    artifacts = {"eagle-tuned": str(res / "evaluate" / "tune_{T}.json"),
                 "sequoia": str(res / "sequoia" / "{T}" / "structure.json"), "ogspo": str(res / "ogspo" / "{T}")}
    specs = method_specs(methods=METHODS, chains=[], eagle_default=[])
    prompts = load_prompts(sorted((res / "workloads").glob("*.parquet")), e.tokenizer, split="eval", n=args.prompts)
    calib = {temperature_tag(t): read_calib_best(Path(artifacts["eagle-tuned"].format(T=temperature_tag(t))))[0]
             for t in args.temperatures}

    frames, t0 = [], time.perf_counter()
    for temp in args.temperatures:
        for workload, plist in prompts.items():
            for index, (pid, ids) in enumerate(plist):
                order = slot_order(len(INTERLEAVE), pair_seed(args.seed, temp, workload, index, 0), index)
                for mode in (INTERLEAVE[j] for j in order):
                    ev = evaluate_methods(target=e.target, drafter=e.drafter, prompts={workload: [(pid, ids)]}, methods=specs,
                                          temperatures=[temp], max_new_tokens=args.max_new_tokens, repeats=1, seed=args.seed,
                                          artifacts=artifacts, latency=latency, interleave=mode)
                    frames.append(ev.frame().drop("tokens").with_columns(pl.lit(mode).alias("mode")))
                    print(f"T{temp:g} {workload} {pid} {mode}: "
                          + ", ".join(f"{r.method} {r.throughput:.1f}" for r in ev.rows), flush=True)
    seconds = time.perf_counter() - t0
    df = pl.concat(frames)
    out = res / "bench_interleave"
    out.mkdir(parents=True, exist_ok=True)
    df.write_parquet(out / "requests.parquet")
    section = render(df, calib, args=args, seconds=seconds, dtype=str(e.target.dtype).removeprefix("torch."))
    print(section)
    if args.write:
        write_section("bench_interleave", section)
    return 0


def _iv(iv) -> str:
    return f"{iv.ratio:.3f} [{iv.low:.3f}, {iv.high:.3f}]" if iv else "-"


def _half(iv) -> str:
    return f"{100 * (iv.high - iv.low) / 2:.1f}%" if iv else "-"


def render(df: pl.DataFrame, calib: dict, *, args, seconds: float, dtype: str) -> str:
    rows = []
    for mode in INTERLEAVE:
        d = df.filter(pl.col("mode") == mode)
        tps = {m: d.filter(pl.col("method") == m).sort(["temperature", "workload", "prompt_id"])["throughput"].to_numpy()
               for m in ("ar", "ar-aa")}
        aa_lr = np.log(tps["ar-aa"] / tps["ar"])
        aa = ratio_intervals(d, "ar-aa", "ar", seed=args.seed)["pooled"]
        best = ratio_intervals(d, "ogspo", calib_best_table(calib, d), seed=args.seed)["pooled"]
        vs_ar = ratio_intervals(d, "ogspo", "ar", seed=args.seed)["pooled"]
        pr = d.group_by("method").agg((pl.col("predicted_throughput") / pl.col("throughput")).median().alias("pr"))
        pr = {m: v for m, v in pr.iter_rows()}
        rows.append(f"| {mode} | {aa_lr.std(ddof=1):.3f} | {_iv(aa)} | {_half(aa)} | {_iv(best)} | {_half(best)} | "
                    f"{_iv(vs_ar)} | "
                    + ", ".join(f"{m} {pr[m]:.3f}" for m in METHODS if m in pr) + " |")
    keys = ["workload", "temperature", "prompt_id", "repeat", "method"]
    both = (df.filter(pl.col("mode") == "cycles").select([*keys, pl.col("throughput").alias("cycles")])
            .join(df.filter(pl.col("mode") == "requests").select([*keys, pl.col("throughput").alias("requests")]), on=keys))
    cross = []
    for m in METHODS:
        x = both.filter(pl.col("method") == m)
        lr = np.log((x["cycles"] / x["requests"]).to_numpy())
        boot = np.random.default_rng(args.seed).choice(lr, size=(2000, len(lr))).mean(1)
        lo, hi = np.exp(np.quantile(boot, [0.025, 0.975]))
        cross.append(f"{m} {np.exp(lr.mean()):.3f} [{lo:.3f}, {hi:.3f}]")
    n = df.filter((pl.col("mode") == "cycles") & (pl.col("method") == "ar")).height
    cmd = "PATH=.venv/bin:$PATH python benchmarks/bench_interleave.py " + " ".join(sys.argv[1:])
    return "\n".join([
        "## Timing a slot's methods side by side or one after another (`benchmarks/bench_interleave.py`)",
        "",
        f"- date: {dt.datetime.now().strftime('%Y-%m-%d %H:%M')}, commit {git_commit()}; machine: {machine()}, torch threads "
        f"{torch.get_num_threads()}; the default run's target ({dtype}), head, tuned trees and policy",
        f"- reproduce: `make run`, then `{cmd.strip()}` ({seconds / 60:.1f} min)",
        f"- {n} request slots per mode ({args.prompts} eval prompts per workload x T = "
        f"{', '.join(f'{t:g}' for t in args.temperatures)}, {args.max_new_tokens} new tokens), methods {', '.join(METHODS)}; "
        "per slot the two modes in a mirrored seeded order, the same seeds",
        "",
        "| `evaluate.interleave` | sd of per-request log(ar-aa / ar) | A/A pooled | its half-width | ogspo / best baseline "
        "(calib-picked) | its half-width | ogspo / ar | predicted / realised (median per method) |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
        *rows,
        "",
        "Each method's throughput side by side over one after another, same slots (geometric mean, 95% bootstrap): "
        + "; ".join(cross) + ".",
        "",
        "Reading: A/A is pure timing noise (both decode the same tokens); its spread per request is what every paired "
        "ratio inherits. The cross-mode ratios carry the drift between the two runs of a slot, so they are wide; a "
        "method that interleaving slowed (caches the others evict) would stand out from the rest.",
    ])


if __name__ == "__main__":
    raise SystemExit(main())
