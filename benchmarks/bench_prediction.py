"""Benchmark: the latency model against real requests, per cycle kind (no eval prompts: calib prompts only).

    .venv/bin/python benchmarks/bench_prediction.py [--results results/cpu] [--prompts 3] [--tokens 96] [--repeats 2] [--write]

Loads the run's model, EAGLE head, kernel table and latency.json, then decodes the first `--prompts`
calib prompts of every workload with autoregressive decoding, a 2-token chain, the T=0 Sequoia tree of
the run and the EAGLE-3 tree [2, 1, 2], interleaved in mirrored orders, `--repeats` times, at T=0. Per
method it prints the median of predicted / realised throughput per request (prefill measured, every
cycle replaced by the latency model's t_draft + t_verify + t_fixed) and the per-cycle split realised vs
modelled, and with --write puts the table into docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchdoc import REPO, cpu_model, write_section  # noqa: E402


def main() -> None:
    from ogspo.artifacts.latency import LatencyModel
    from ogspo.engine.kernels import read_kernel_table
    from ogspo.engine.policies import Autoregressive, DynamicTree, chain
    from ogspo.methods.registry import make_drafter, make_target
    from ogspo.stages.evaluate import (
        MethodSpec,
        SpeedProbe,
        load_prompts,
        make_method_engine,
        pair_seed,
        run_request,
        slot_order,
        slot_seed,
        structure_policy,
    )
    from ogspo.stages.model import load_target, read_manifest

    ap = argparse.ArgumentParser()
    ap.add_argument("--results", type=Path, default=REPO / "results/cpu")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    res = args.results
    checksum = read_manifest(res / "model")["checksum_sha256"]
    model, tok = load_target(res / "model")
    kernels = read_kernel_table(res / "kernels/kernels.json")
    drafter = make_drafter("eagle", target_model=model, max_len=2048, path=res / "drafter", target_checksum=checksum,
                           kernels=kernels)
    target = make_target(model, max_len=2048, drafter=drafter, kernels=kernels)
    latency = LatencyModel.from_json(res / "latency/latency.json", expect_model=checksum, expect_drafter=drafter.drafter_id)
    prompts = load_prompts(sorted((res / "workloads").glob("*.parquet")), tok, split="calib", n=args.prompts)
    policies = {"ar": Autoregressive(), "chain2": chain(2), "eagle2-1-2": DynamicTree(total_tokens=2, depth=1, top_k=2)}
    if (res / "sequoia/T0/structure.json").is_file():
        policies["sequoia"] = structure_policy(res / "sequoia/T0/structure.json", "sequoia")
    engines = [make_method_engine(MethodSpec(name=n, kind="eagle-default"), p, target=target, drafter=drafter, temperature=0.0)
               for n, p in policies.items()]
    ratios: dict[str, list[float]] = {n: [] for n in policies}
    speed = SpeedProbe()
    per_cycle: dict[str, list[tuple[float, float]]] = {n: [] for n in policies}
    for repeat in range(args.repeats):
        for w, plist in prompts.items():
            for index, (pid, prompt) in enumerate(plist):
                target.prefill(prompt)
                for j in slot_order(len(engines), pair_seed(0, 0.0, w, index, repeat), index):
                    me = engines[j]
                    r, fig = run_request(me, prompt, max_new_tokens=args.tokens, seed=slot_seed(0, w, pid, repeat),
                                         latency=latency, speed=speed)
                    ratios[me.spec.name].append(fig["predicted_throughput"] / r.throughput)
                    n = len(r.cycles)
                    per_cycle[me.spec.name].append(((r.wall_seconds - r.prefill_seconds) / n,
                                                    (fig["predicted_seconds"] - r.prefill_seconds) / n))
    lines = ["| method | requests | predicted / realised (median) | [min, max] | realised ms/cycle | modelled ms/cycle |",
             "|---|---:|---:|---|---:|---:|"]
    for n, v in ratios.items():
        pc = np.array(per_cycle[n])
        lines.append(f"| {n} | {len(v)} | {np.median(v):.3f} | [{min(v):.3f}, {max(v):.3f}] | "
                     f"{1e3 * np.median(pc[:, 0]):.1f} | {1e3 * np.median(pc[:, 1]):.1f} |")
    table = "\n".join(lines)
    text = f"""## Latency model against real requests (`benchmarks/bench_prediction.py`)

{dt.date.today()}, {cpu_model()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}; the run's
model, head, kernel table and latency.json ({res}); {args.prompts} calib prompts per workload x {args.tokens}
tokens x {args.repeats} repeats at T=0, methods interleaved in mirrored orders. t_fixed {1e3 * latency.fixed:.2f} ms
(speculative cycle), {1e3 * latency.fixed_ar:.2f} ms (autoregressive step); t_verify(1, 256)
{1e3 * float(latency.t_verify(1, 256)):.1f} ms.

{table}
"""
    print(text)
    if args.write:
        write_section("bench_prediction", text)


if __name__ == "__main__":
    main()
