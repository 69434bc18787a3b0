"""Benchmark: EAGLE-3 with the same head before and after the per-device kernel table, side by side.

    .venv/bin/python benchmarks/bench_kernels.py --kernels results/cpu/kernels/kernels.json \
        --drafter results/cpu/drafter [--write]

"before" is the kernel choice the engine hard-coded until the kernel table existed, written as a
table (layer matmuls: `F.linear` for 2-3 rows, `x @ Wt` otherwise; LM head: `(W @ h.T).T` for 5-32
rows, `F.linear` otherwise); "after" is the calibrated table. On held-out eval prompts, every
request runs autoregressive decoding and each EAGLE-3 dynamic tree of the grid under both
tables, interleaved in rotated order. Per workload and temperature: each table's fastest tree
(on these prompts), its tau and its speedup over the faster autoregressive decoder, as the median
per-prompt ratio with a 95% bootstrap interval.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchdoc import REPO, cpu_model, write_section  # noqa: E402

GRID = ["1,1,1", "2,1,2", "3,2,2", "4,2,2", "6,3,2", "8,3,3", "12,4,3", "16,4,4", "24,5,4"]


def legacy_table(shapes: dict[str, list[int]]):
    from ogspo.engine.kernels import KernelTable, device_key

    layers = {c: ["matmul_t", "linear", "linear", "matmul_t"] for c in ("qkv", "o", "gate_up", "down")}
    # lookup takes the next entry's kernel between entries and the last one past the table:
    # layer rows 2-3 -> linear, 1 and >= 4 -> matmul_t; LM head 5-32 -> wx_t, else linear
    rows = [1, 2, 3, 4, 32, 33]
    choice = {c: ks + ["matmul_t", "matmul_t"] for c, ks in layers.items()}
    choice["lm_head"] = ["linear", "linear", "linear", "linear", "wx_t", "linear"]
    return KernelTable(key=device_key("cpu", torch.float32), shapes=shapes, rows=rows, choice=choice,
                       pad_to={c: list(rows) for c in choice}, meta={"what": "the hard-coded choice before the kernel table"})


def bootstrap(x: np.ndarray, n: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    meds = np.median(x[rng.integers(0, len(x), (n, len(x)))], axis=1)
    return float(np.quantile(meds, 0.025)), float(np.quantile(meds, 0.975))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=REPO / "results" / "cpu" / "model")
    ap.add_argument("--drafter", type=Path, default=REPO / "results" / "cpu" / "drafter")
    ap.add_argument("--workloads", type=Path, default=REPO / "results" / "cpu" / "workloads")
    ap.add_argument("--kernels", type=Path, default=REPO / "results" / "cpu" / "kernels" / "kernels.json")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--trees", nargs="+", default=GRID, help="EAGLE-3 dynamic trees as total_tokens,depth,top_k")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()

    from ogspo.engine.decode import SpeculativeEngine
    from ogspo.engine.kernels import describe, read_kernel_table
    from ogspo.engine.model import load_target, model_checksum
    from ogspo.engine.policies import Autoregressive, DynamicTree
    from ogspo.methods.registry import make_drafter, make_target
    from ogspo.stages.measure_drafter import eval_prompts

    trees = [tuple(int(v) for v in t.split(",")) for t in args.trees]
    model, tok = load_target(args.model)
    after = read_kernel_table(args.kernels)
    tables = {"before": legacy_table(after.shapes), "after": after}
    drafter = make_drafter("eagle", target_model=model, max_len=2048, path=args.drafter,
                           target_checksum=model_checksum(args.model))
    targets = {k: make_target(model, max_len=2048, drafter=drafter, kernels=t) for k, t in tables.items()}
    prompts = eval_prompts(args.workloads, tok, args.prompts)
    methods = [("ar", None)] + [(f"eagle {a}/{b}/{c}", DynamicTree(total_tokens=a, depth=b, top_k=c)) for a, b, c in trees]
    runs = [(k, name, pol) for k in tables for name, pol in methods]
    # (T, workload, table, method) -> per-prompt [throughput], [tau]
    tps: dict[tuple, list[float]] = {}
    taus: dict[tuple, list[float]] = {}
    for temp in args.temperatures:
        for w, plist in prompts.items():
            for i, prompt in enumerate(plist):
                order = runs[i % len(runs):] + runs[: i % len(runs)]
                for k, name, pol in order:
                    engine = SpeculativeEngine(target=targets[k], policy=pol or Autoregressive(),
                                               drafter=drafter if pol else None,
                                               temperature=temp, eos_token_id=tok.eos_token_id)
                    res = engine.generate(prompt, max_new_tokens=args.tokens, seed=1000 + i)
                    tps.setdefault((temp, w, k, name), []).append(res.throughput)
                    taus.setdefault((temp, w, k, name), []).append(res.tau)
            print(f"T={temp:g} {w}: done", flush=True)
    cmd = "PATH=.venv/bin:$PATH python benchmarks/bench_kernels.py " + " ".join(sys.argv[1:])
    L = [
        "## EAGLE-3 before/after the kernel table, same head (`benchmarks/bench_kernels.py`)",
        "",
        f"- date: {dt.datetime.now().strftime('%Y-%m-%d %H:%M')}; machine: {os.cpu_count()} CPUs ({cpu_model()}), torch "
        f"{torch.__version__}",
        f"- reproduce: `{cmd.strip()}` (after `make run`)",
        f"- {args.prompts} eval prompts per workload x {args.tokens} new tokens; AR and {len(trees)} EAGLE-3 trees under both "
        "tables, "
        "interleaved in rotated order per request; speedup = median per-prompt throughput ratio to the faster AR decoder "
        "of the two, [95% bootstrap interval]; fastest tree chosen on these prompts for each table",
        "",
        "| workload | T | AR tok/s before | AR tok/s after | fastest tree before | tau | speedup | fastest tree after | tau | "
        "speedup |",
        "|---|---:|---:|---:|---|---:|---:|---|---:|---:|",
    ]
    for temp in args.temperatures:
        for w in prompts:
            ar = np.maximum(np.array(tps[(temp, w, "before", "ar")]), np.array(tps[(temp, w, "after", "ar")]))
            cells = []
            for k in tables:
                best = max((n for n, _ in methods[1:]), key=lambda n: np.median(np.array(tps[(temp, w, k, n)]) / ar))
                ratio = np.array(tps[(temp, w, k, best)]) / ar
                lo, hi = bootstrap(ratio)
                cells.append(f"{best.removeprefix('eagle ')} | {np.median(taus[(temp, w, k, best)]):.2f} | "
                             f"{np.median(ratio):.2f}x [{lo:.2f}, {hi:.2f}]")
            L.append(f"| {w} | {temp:g} | {np.median(tps[(temp, w, 'before', 'ar')]):.1f} | "
                     f"{np.median(tps[(temp, w, 'after', 'ar')]):.1f} | "
                     + " | ".join(cells) + " |")
    L += ["", "Every tree, median speedup over the faster AR (before -> after):", "",
          "| tree | " + " | ".join(f"{w} T={t:g}" for t in args.temperatures for w in prompts) + " |",
          "|---|" + "---:|" * (len(args.temperatures) * len(prompts))]
    for name, _ in methods[1:]:
        row = []
        for temp in args.temperatures:
            for w in prompts:
                ar = np.maximum(np.array(tps[(temp, w, "before", "ar")]), np.array(tps[(temp, w, "after", "ar")]))
                b, a = (np.median(np.array(tps[(temp, w, k, name)]) / ar) for k in ("before", "after"))
                row.append(f"{b:.2f} -> {a:.2f}")
        L.append(f"| {name.removeprefix('eagle ')} | " + " | ".join(row) + " |")
    L += ["", "Kernel table (after):", "", "```", describe(after), "```"]
    text = "\n".join(L)
    print(text)
    if args.write:
        write_section("bench_kernels", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
