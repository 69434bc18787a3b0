"""Benchmark: two draft heads through the baselines a user would run, tuned EAGLE-3 and Sequoia, paired.

    PATH=.venv/bin:$PATH python benchmarks/bench_heads.py --head today=DIR --head new=results/cpu/drafter [--write]

Per head, as the workflow does it for its own head (default config, same calib prompts): posterior
records on the calib prompts (`stages.collect_records.collect_records`, both temperatures), Sequoia's tree
from them (`stages.build_sequoia.build_sequoia`, with the run's latency.json), and the EAGLE-3 grid tuned
with Sequoia beside it (`stages.tune_eagle.tune_eagle`). Then, on the eval prompts, autoregressive decoding
and every head's tuned EAGLE-3 tree and Sequoia tree, in mirrored seeded orders per pair of prompts
(`methods.harness.slot_order`), every request the same length: the paired per-request ratio of the
second head to the first for each baseline, with 95% bootstrap intervals (`analysis.compare`), and the
tuned trees side by side. Records, trees and tunings land in --out and are reused when present.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

import polars as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchdoc import REPO, cpu_model, head_dirs, write_section  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    res = REPO / "results" / "cpu"
    ap.add_argument("--model", type=Path, default=res / "model")
    ap.add_argument("--workloads", type=Path, default=res / "workloads")
    ap.add_argument("--latency", type=Path, default=res / "latency" / "latency.json")
    ap.add_argument("--kernels", type=Path, default=res / "kernels" / "kernels.json")
    ap.add_argument("--head", action="append", required=True, help="NAME=DIR, twice: the first is the reference")
    ap.add_argument("--prompts", type=int, default=8, help="eval prompts per workload")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=REPO / "results" / "bench_heads")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    heads = head_dirs(args.head, ap.error)
    if len(heads) != 2:
        ap.error("give exactly two --head NAME=DIR")

    from ogspo.analysis.compare import ratio_intervals
    from ogspo.artifacts.records import temperature_tag
    from ogspo.artifacts.settings import default_settings
    from ogspo.artifacts.structure import load_structure
    from ogspo.engine.kernels import read_kernel_table
    from ogspo.engine.model import load_target, model_checksum
    from ogspo.engine.policies import Autoregressive, DynamicTree
    from ogspo.engine.tree import Structure
    from ogspo.methods.harness import make_method_engine, pair_seed, run_request, slot_order, slot_seed
    from ogspo.methods.registry import MethodSpec, make_drafter, make_target, structure_policy
    from ogspo.stages.build_sequoia import build_sequoia
    from ogspo.stages.collect_records import collect_records, read_calib_table
    from ogspo.stages.evaluate import load_prompts
    from ogspo.stages.tune_eagle import tune_eagle, write_tuning

    rc, ev = default_settings("records"), default_settings("evaluate")
    temps = [float(t) for t in rc["temperatures"]]
    model, tok = load_target(args.model)
    checksum = model_checksum(args.model)
    kernels = read_kernel_table(args.kernels) if args.kernels.is_file() else None
    drafters = {h: make_drafter("eagle", target_model=model, max_len=2048, path=p, target_checksum=checksum, kernels=kernels)
                for h, p in heads.items()}
    target = make_target(model, max_len=2048, drafter=next(iter(drafters.values())), kernels=kernels)
    files = sorted(args.workloads.glob("*.parquet"))
    t0 = time.perf_counter()

    tuned: dict[str, dict[str, dict]] = {}  # head -> T tag -> tune json
    sequoia: dict[str, dict[str, Path]] = {}
    for h, drafter in drafters.items():
        tuned[h], sequoia[h] = {}, {}
        for t in temps:
            tag = temperature_tag(t)
            rec_dirs = []
            for f in files:
                out = args.out / h / "records" / f.stem / tag
                rec_dirs.append(out)
                table = read_calib_table(f, rc["prompts_per_workload"])
                collect_records(target=target, drafter=drafter, template=Structure.full(rc["template"]["widths"]),
                                prompts=[tok(p, add_special_tokens=False).input_ids for p in table["prompt"]],
                                request_ids=[f"{w}/{i}" for w, i in zip(table["workload"], table["prompt_id"])], temperature=t,
                                seed=0, max_new_tokens=rc["max_new_tokens"], out_dir=out, shard_size=rc["shard_size"],
                                model_checksum=checksum, drafter_id=drafter.drafter_id or h, eos_token_id=tok.eos_token_id)
            seq_dir = args.out / h / "sequoia" / tag
            if not (seq_dir / "structure.json").is_file():
                build_sequoia(records_dirs=rec_dirs, latency_path=args.latency, config=default_settings("baselines.sequoia"),
                              out_dir=seq_dir)
            sequoia[h][tag] = seq_dir / "structure.json"
            tune_path = args.out / h / f"tune_{tag}.json"
            if not tune_path.is_file():
                r = tune_eagle(target=target, drafter=drafter, prompts=load_prompts(files, tok, split="calib",
                                                                                    n=ev["tune_prompts_per_workload"]),
                               grid=ev["eagle_grid"], temperature=t, max_new_tokens=ev["tune_max_new_tokens"], seed=0,
                               static=structure_policy(sequoia[h][tag], "sequoia"))
                write_tuning(r, tune_path)
            tuned[h][tag] = json.loads(tune_path.read_text())
    prep_s = time.perf_counter() - t0

    evals = load_prompts(files, tok, split="eval", n=args.prompts)
    rows = []
    for t in temps:
        tag = temperature_tag(t)
        for w, plist in evals.items():
            engines = [make_method_engine(MethodSpec(name="ar", kind="ar"), Autoregressive(), target=target, drafter=None,
                                          temperature=t)]
            for h, drafter in drafters.items():
                a, b, c = tuned[h][tag]["winners"][w]
                pol = Autoregressive(name="eagle0-0-0") if a == 0 else DynamicTree(total_tokens=a, depth=b, top_k=c)
                engines.append(make_method_engine(MethodSpec(name=f"eagle-tuned/{h}", kind="eagle-tuned"), pol, target=target,
                                                  drafter=drafter, temperature=t))
                engines.append(make_method_engine(MethodSpec(name=f"sequoia/{h}", kind="sequoia"),
                                                  structure_policy(sequoia[h][tag], "sequoia"), target=target, drafter=drafter,
                                                  temperature=t))
            for index, (pid, prompt) in enumerate(plist):
                seed = slot_seed(0, w, pid, 0)
                target.prefill(prompt)  # untimed: the slot's first method meets warm shapes
                for j in slot_order(len(engines), pair_seed(0, t, w, index, 0), index):
                    r, _ = run_request(engines[j], prompt, max_new_tokens=args.tokens, seed=seed, latency=None)
                    rows.append({"workload": w, "temperature": t, "prompt_id": pid, "repeat": 0,
                                 "method": engines[j].spec.name, "throughput": r.throughput, "tau": r.tau})
            print(f"{tag} {w}: done", flush=True)
    df = pl.DataFrame(rows)
    first, second = list(heads)
    lines = [
        "## Two draft heads through tuned EAGLE-3 and Sequoia (`benchmarks/bench_heads.py`)",
        "",
        f"- date: {dt.datetime.now().strftime('%Y-%m-%d %H:%M')}; machine: {os.cpu_count()} CPUs ({cpu_model()}), torch "
        f"{torch.__version__}",
        f"- reproduce: `PATH=.venv/bin:$PATH python benchmarks/bench_heads.py {' '.join(sys.argv[1:])}`",
        f"- heads: {', '.join(f'{h} = `{p}`' for h, p in heads.items())}; per head, records, Sequoia and EAGLE-3 tuning on the "
        f"calib prompts as the workflow makes them ({prep_s / 60:.1f} min); then {args.prompts} eval prompts per workload, "
        f"{args.tokens} new tokens, all methods interleaved in mirrored seeded orders",
        f"- ratio = {second} / {first}, geometric mean of paired per-request throughput ratios, 95% bootstrap interval",
        "",
        "| baseline | T | pooled ratio | cells (workload: ratio) | tuned tree " + f"{first} -> {second} |",
        "|---|---:|---|---|---|",
    ]
    for kind in ("eagle-tuned", "sequoia"):
        iv = ratio_intervals(df, f"{kind}/{second}", f"{kind}/{first}")
        for t in temps:
            tag = temperature_tag(t)
            pooled = iv["by_temperature"].get(t)
            cells = ", ".join(f"{w}: {i.ratio:.3f} [{i.low:.3f}, {i.high:.3f}]" for (w, tt), i in iv["cells"].items() if tt == t)
            if kind == "eagle-tuned":
                trees = "; ".join(f"{w}: {tuned[first][tag]['winners'][w]} -> {tuned[second][tag]['winners'][w]}" for w in evals)
            else:
                trees = "; ".join(f"{h}: {len(load_structure(sequoia[h][tag]))} nodes" for h in heads)
            lines.append(f"| {kind} | {t:g} | {pooled.text() if pooled else '-'} | {cells} | {trees} |")
        lines.append(f"| {kind} | all | {iv['pooled'].text() if iv['pooled'] else '-'} | | |")
    med = df.group_by(["temperature", "workload",
                       "method"]).agg(pl.col("throughput").median()).sort(["temperature", "workload", "method"])
    lines += ["", "Median tokens/s per cell:", "", "| T | workload | " + " | ".join(sorted(set(df["method"]))) + " |",
              "|---:|---|" + "---:|" * len(set(df["method"]))]
    for (t, w), g in med.group_by(["temperature", "workload"], maintain_order=True):
        by = dict(zip(g["method"], g["throughput"]))
        lines.append(f"| {t:g} | {w} | " + " | ".join(f"{by.get(m, float('nan')):.1f}" for m in sorted(set(df["method"]))) + " |")
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section("bench_heads", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
