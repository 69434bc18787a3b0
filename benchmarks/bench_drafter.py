"""Benchmark: acceptance and speed of the trained EAGLE-3-style head on held-out eval prompts.

    .venv/bin/python benchmarks/bench_drafter.py --drafter results/cpu/drafter [--write]

Runs `ogspo.drafter.measure.measure_drafter` (methods interleaved prompt by prompt: autoregressive,
a top-1 chain, EAGLE-3 dynamic trees of several sizes; T=0 and T=1) and writes the table, the
training figures from the head's metadata, and the cost of one head level to docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchdoc import REPO, cpu_model, write_section  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=REPO / "results" / "cpu" / "model")
    ap.add_argument("--drafter", type=Path, default=REPO / "results" / "cpu" / "drafter")
    ap.add_argument("--workloads", type=Path, default=REPO / "results" / "cpu" / "workloads")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--trees", nargs="+", default=["60,5,10", "2,1,2", "1,1,1"],
                    help="EAGLE-3 dynamic trees as total_tokens,depth,top_k")
    ap.add_argument("--chain-depth", type=int, default=4)
    ap.add_argument("--from-json", type=Path, help="render a measurement the workflow already made "
                    "(results/cpu/drafter_eval/acceptance.json) instead of measuring again")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()

    from ogspo.stages.measure_drafter import MeasureResult, MethodFigures, measure_drafter, render_markdown

    if args.from_json:
        d = json.loads(args.from_json.read_text())
        res = MeasureResult(figures=[MethodFigures(**({"head": "base"} | f)) for f in d["figures"]],
                            expand_ms={int(k): v for k, v in d["expand_ms"].items()}, seconds=d["seconds"])
        args.prompts, args.tokens = d.get("prompts_per_workload", args.prompts), d.get("max_new_tokens", args.tokens)
    else:
        try:
            trees = tuple(tuple(int(x) for x in t.split(",")) for t in args.trees)
        except ValueError:
            ap.error(f"--trees takes total_tokens,depth,top_k triples such as 60,5,10; got {args.trees}")
        if any(len(t) != 3 or min(t) < 1 for t in trees):
            ap.error(f"--trees takes total_tokens,depth,top_k triples of positive integers; got {args.trees}")
        res = measure_drafter(model_dir=args.model, drafter_dirs={"base": args.drafter}, workloads_dir=args.workloads,
                              prompts_per_workload=args.prompts, max_new_tokens=args.tokens, trees=trees,
                              chain_depth=args.chain_depth)
    meta = json.loads((args.drafter / "drafter.json").read_text())
    m, tr = meta["metrics"], meta["train"]
    best, fastest = {}, {}
    for f in res.figures:
        if f.method.startswith("eagle"):
            key = (f.workload, f.temperature)
            if key not in best or f.tau > best[key].tau:
                best[key] = f
            if key not in fastest or f.speedup > fastest[key].speedup:
                fastest[key] = f
    cmd = "PATH=.venv/bin:$PATH python benchmarks/bench_drafter.py " + " ".join(sys.argv[1:])
    lines = [
        "## EAGLE-3-style head on held-out prompts (`benchmarks/bench_drafter.py`)",
        "",
        f"- date: {dt.datetime.now().strftime('%Y-%m-%d %H:%M')}; machine: {os.cpu_count()} CPUs ({cpu_model()}), torch {torch.__version__}",
        f"- reproduce: `{cmd.strip()}` (after `make run` has trained the head)",
        f"- head: draft vocabulary {meta['head']['draft_vocab']}, feature layers {meta['head']['feature_layers']}, "
        f"{tr['steps']} steps x batch {tr['batch_size']} x {tr['seq_len']} positions, TTT depth {tr['ttt_steps']}",
        f"- training data: {m['train_tokens']} tokens (train prompts, the target's own answers, stdlib source); "
        f"data {m['data_seconds'] / 60:.1f} min + training {m['train_seconds'] / 60:.1f} min on this CPU",
        f"- held-out (train-split windows) top-1 agreement with the target by TTT step: {[round(a, 3) for a in m['val_top1']]}",
        f"- {args.prompts} eval prompts per workload, {args.tokens} new tokens, methods interleaved prompt by prompt",
        "",
        "Best EAGLE-3 dynamic tree per workload and temperature (tau includes the bonus token):",
        "",
        "| workload | T | best tree | tau | speedup vs ar |",
        "|---|---:|---|---:|---:|",
    ]
    for (w, t), f in sorted(best.items()):
        lines.append(f"| {w} | {t:g} | {f.method} | {f.tau:.2f} | {f.speedup:.2f}x |")
    lines += ["", "Fastest EAGLE-3 dynamic tree per workload and temperature (median per-prompt throughput ratio "
              "to autoregressive decoding, side by side):", "",
              "| workload | T | fastest tree | tau | tokens/s | ar tokens/s | speedup vs ar |", "|---|---:|---|---:|---:|---:|---:|"]
    ar = {(f.workload, f.temperature): f for f in res.figures if f.method == "ar"}
    for (w, t), f in sorted(fastest.items()):
        lines.append(f"| {w} | {t:g} | {f.method} | {f.tau:.2f} | {f.throughput:.1f} | {ar[(w, t)].throughput:.1f} | {f.speedup:.2f}x |")
    lines += ["", "All methods:", "", render_markdown(res)]
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section("bench_drafter", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
