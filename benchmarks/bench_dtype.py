"""Benchmark: the default run's best method and AR on the fp32 and the bf16 target, interleaved.

    PATH=.venv/bin:$PATH python benchmarks/bench_dtype.py [--prompts 3] [--repeats 2] [--write]

Needs a finished default run (results/cpu: the prepared model, the eval prompts, the trained head,
the tuned EAGLE-3 trees, Sequoia's tree and the OGSPO policy) and a CPU with the native bf16 kernel
(AVX512-BF16). The same weights run twice: as bf16 (the prepared model when `dtype` resolved to
bfloat16; else rounded to it) and as fp32 (those bf16 values widened, exact: the same model, fp32
arithmetic and bytes), each with its own kernel table (calibrated, cached per machine) and the
head on that table in that dtype. Per eval request slot the two dtypes run in a mirrored seeded
order (`methods.harness.slot_order`), each through `stages.evaluate.evaluate_methods` with `ar`
and the DAG's best method for the workload (fastest speculative method at T=0 in
evaluate/summary.json, picked before this run): complete-request throughput, paired ratios with
95% bootstrap intervals (`analysis.compare`), and whether each dtype's tokens equal its own AR.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import os
import sys
import time
from pathlib import Path

import polars as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import SPEC_METHODS, dag_best, run_head  # noqa: E402
from benchdoc import REPO, cpu_model, git_commit, paired_tables, require_run, write_section  # noqa: E402

from ogspo.engine import native  # noqa: E402
from ogspo.engine.kernels import read_kernel_table  # noqa: E402
from ogspo.engine.model import load_target, read_manifest  # noqa: E402
from ogspo.methods.harness import pair_seed, slot_order  # noqa: E402
from ogspo.methods.registry import (
    make_target,  # noqa: E402
    method_specs,  # noqa: E402
)
from ogspo.stages.calibrate_kernels import calibrate_device_kernels  # noqa: E402
from ogspo.stages.config import load_config  # noqa: E402
from ogspo.stages.evaluate import evaluate_methods, load_prompts  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=REPO / "results" / "cpu")
    ap.add_argument("--prompts", type=int, default=3, help="eval prompts per workload")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", action="store_true", help="rewrite this section of docs/BENCHMARKS.md")
    args = ap.parse_args()
    res = args.results
    require_run(res, ap.error)
    if not native.bf16_available():
        ap.error(f"no native bf16 kernel on this machine ({native.unavailable_reason() or 'no avx512_bf16'})")

    manifest = read_manifest(res / "model")
    checksum = manifest["checksum_sha256"]
    base, tok = load_target(res / "model")
    models = {"bf16": base.to(torch.bfloat16)}
    models["fp32"] = copy.deepcopy(models["bf16"]).to(torch.float32)  # the bf16 values, exact in fp32
    kcfg = load_config(REPO / "config" / "default.yaml")["kernels"]
    run_table = read_kernel_table(res / "kernels" / "kernels.json")
    tables = {k: run_table if run_table.key.get("dtype") == str(DTYPES[k]).removeprefix("torch.")
              else calibrate_device_kernels(m, kcfg)[0]
              for k, m in models.items()}
    drafters = {k: run_head(res, m, checksum, tables[k]) for k, m in models.items()}
    targets = {k: make_target(m, max_len=4096, drafter=drafters[k], kernels=tables[k]) for k, m in models.items()}
    artifacts = {"eagle-tuned": str(res / "evaluate" / "tune_{T}.json"),
                 "sequoia": str(res / "sequoia" / "{T}" / "structure.json"),
                 "ogspo": str(res / "ogspo" / "{T}")}
    best = dag_best(res / "evaluate" / "summary.json", SPEC_METHODS)
    prompts = load_prompts(sorted((res / "workloads").glob("*.parquet")), tok, split="eval", n=args.prompts)
    units = list(models)

    rows, t0 = [], time.perf_counter()
    for repeat in range(args.repeats):
        for workload, plist in prompts.items():
            specs = method_specs(methods=["ar", best[workload]], chains=[], eagle_default=[]) if workload in best else \
                method_specs(methods=["ar"], chains=[], eagle_default=[])
            for index, (pid, ids) in enumerate(plist):
                order = slot_order(len(units), pair_seed(args.seed, 0.0, workload, index, repeat), index)
                for unit in (units[j] for j in order):
                    ev = evaluate_methods(target=targets[unit], drafter=drafters[unit], prompts={workload: [(pid, ids)]},
                                          methods=specs,
                                          temperatures=[0.0], max_new_tokens=args.max_new_tokens, repeats=1,
                                          seed=args.seed + 7919 * index + repeat, artifacts=artifacts)
                    for r in ev.rows:
                        method = "ar" if r.method == "ar" else "best"
                        rows.append({"workload": workload, "temperature": 0.0, "prompt_id": pid, "repeat": repeat,
                                     "method": f"{unit}-{method}", "best": r.method, "seconds": r.wall_seconds,
                                     "throughput": r.throughput, "tau": r.tau, "tokens": r.tokens})
                print(f"r{repeat} {workload} {pid}: "
                      + ", ".join(f"{r['method']} {r['throughput']:.1f}" for r in rows[-2 * len(specs):]),
                      flush=True)
    seconds = time.perf_counter() - t0
    df = pl.DataFrame(rows)
    out = res / "bench_dtype"
    out.mkdir(parents=True, exist_ok=True)
    df.write_parquet(out / "requests.parquet")
    section = render(df, best, tables, args=args, seconds=seconds, manifest=manifest)
    print(section)
    if args.write:
        write_section("bench_dtype", section)
    return 0


RATIOS = (("bf16-best", "fp32-best"), ("bf16-ar", "fp32-ar"), ("bf16-best", "fp32-ar"), ("bf16-best", "bf16-ar"),
          ("fp32-best", "fp32-ar"))


def render(df: pl.DataFrame, best: dict, tables: dict, *, args, seconds: float, manifest: dict) -> str:
    tables, _, _ = paired_tables(df, RATIOS, seed=args.seed)
    same = {}
    for unit in DTYPES:
        ref = {(r["workload"], r["prompt_id"],
                r["repeat"]): r["tokens"] for r in df.filter(pl.col("method") == f"{unit}-ar").iter_rows(named=True)}
        mine = df.filter(pl.col("method") == f"{unit}-best")
        same[unit] = (sum(r["tokens"] == ref[(r["workload"], r["prompt_id"], r["repeat"])] for r in mine.iter_rows(named=True)),
                      mine.height)
    commit = git_commit()
    cmd = "PATH=.venv/bin:$PATH python benchmarks/bench_dtype.py " + " ".join(sys.argv[1:])
    n_req = df.filter(pl.col("method") == "fp32-ar").height
    lines = [
        "## The default run's best method on the fp32 and the bf16 target (`benchmarks/bench_dtype.py`)",
        "",
        f"- date: {dt.datetime.now().strftime('%Y-%m-%d %H:%M')}, commit {commit}; machine: {os.cpu_count()} CPUs "
        f"({cpu_model()}), "
        f"torch threads {torch.get_num_threads()}",
        f"- the run's model prepared in {manifest.get('dtype')} (requested "
        f"`{manifest.get('dtype_requested', manifest.get('dtype'))}`"
        + (f"; {manifest['dtype_choice']['why']}" if manifest.get("dtype_choice") else "") + ")",
        f"- command: `{cmd}`; {seconds / 60:.1f} min of requests",
        f"- {n_req} request slots per dtype ({args.prompts} eval prompts per workload x {args.repeats} repeats), "
        f"{args.max_new_tokens} new "
        "tokens each, T=0; per slot the two dtypes in a mirrored seeded order, each running `ar` and the workload's best method",
        f"- best method per workload (the DAG's evaluate, T=0): {', '.join(f'{w}: {m}' for w, m in best.items())}",
        "- kernel tables: " + "; ".join(f"{k}: {t.key.get('dtype')}, {t.meta.get('seconds', '?')} s of timing" for k,
                                        t in tables.items()),
        "",
        *tables,
    ]
    lines += ["",
              "Lossless: " + "; ".join(f"{k} best method = {k} AR token for token on {a}/{n} requests" for k,
                                       (a, n) in same.items())]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
