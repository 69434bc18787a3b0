"""Benchmark: the GTO head against its control run and the train_drafter head, on held-out prompts.

    PATH=.venv/bin:$PATH python benchmarks/bench_gto.py [--write]      (after `make run` trained the base head)

1. Fine-tunes the train_drafter head (results/cpu/drafter) twice from the same start, with the
   default `drafter.gto` settings: GTO (omega as configured) and the control (omega = 0: the same
   steps, token batches and learning rate on the token loss alone), each timed. Both land in
   results/cpu/bench_gto/ and are reused while their settings match (--retrain forces).
2. tau per request on the eval prompts at T=0 and T=1 with one EAGLE-3 dynamic tree (--tree), the
   three heads interleaved prompt by prompt; paired per-request ratios GTO/control and GTO/base with
   bootstrap 95% intervals.
3. Tuned EAGLE-3 per head: `tune_eagle` on the calib prompts over a small grid, then each head's
   tuned trees on the eval prompts beside autoregressive decoding (interleaved, rotated); paired
   per-request throughput ratios GTO/base.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchdoc import REPO, cpu_model, write_section  # noqa: E402

from ogspo.artifacts.settings import default_settings  # noqa: E402
from ogspo.drafter.train_gto import train_gto  # noqa: E402
from ogspo.engine.decode import SpeculativeEngine  # noqa: E402
from ogspo.engine.kernels import read_kernel_table  # noqa: E402
from ogspo.engine.model import load_target, model_checksum  # noqa: E402
from ogspo.engine.policies import Autoregressive, DynamicTree  # noqa: E402
from ogspo.methods.harness import slot_order, slot_seed  # noqa: E402
from ogspo.methods.registry import make_drafter, make_target  # noqa: E402
from ogspo.stages.evaluate import load_prompts  # noqa: E402
from ogspo.stages.tune_eagle import tune_eagle  # noqa: E402

HEADS = ("base", "control", "gto")


def paired(ratios: list[float], seed: int = 0) -> tuple[float, float, float]:
    """Mean of per-request ratios and its bootstrap 95% interval."""
    x = np.asarray(ratios)
    rng = np.random.default_rng(seed)
    boots = x[rng.integers(0, len(x), (10000, len(x)))].mean(1)
    return float(x.mean()), float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975))


def fmt(m: tuple[float, float, float]) -> str:
    return f"{m[0]:.3f} [{m[1]:.3f}, {m[2]:.3f}]"


def fine_tune(label: str, omega: float, args, model, tok) -> tuple[Path, dict]:
    out = args.out / label
    drafter_cfg = default_settings("drafter")
    drafter_cfg["gto"]["omega"] = omega
    if args.steps:
        drafter_cfg["gto"]["steps"] = args.steps
    meta_path = out / "drafter.json"
    if meta_path.is_file() and not args.retrain:
        meta = json.loads(meta_path.read_text())
        if {k: v for k, v in meta.get("gto", {}).items() if k != "seed"} == drafter_cfg["gto"]:
            return out, meta
    fortunes = default_settings("workloads")["fortunes"]["dir"]
    train_gto(model=model, tokenizer=tok, base_dir=args.drafter, target_checksum=model_checksum(args.model),
              workloads_dir=args.workloads, out_dir=out, fortunes_dir=Path(fortunes), config=drafter_cfg, seed=0)
    return out, json.loads(meta_path.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    res = REPO / "results" / "cpu"
    ap.add_argument("--model", type=Path, default=res / "model")
    ap.add_argument("--drafter", type=Path, default=res / "drafter", help="the train_drafter head")
    ap.add_argument("--workloads", type=Path, default=res / "workloads")
    ap.add_argument("--kernels", type=Path, default=res / "kernels" / "kernels.json", help="the device's kernel table")
    ap.add_argument("--out", type=Path, default=res / "bench_gto")
    ap.add_argument("--steps", type=int, default=0, help="GTO steps (0 = drafter.gto.steps)")
    ap.add_argument("--retrain", action="store_true")
    ap.add_argument("--prompts", type=int, default=10, help="eval prompts per workload")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--tree", default="32,6,4", help="EAGLE-3 dynamic tree total_tokens,depth,top_k for the tau comparison")
    ap.add_argument("--tune-prompts", type=int, default=3, help="calib prompts per workload for tuning")
    ap.add_argument("--grid", default="1,1,1 2,1,2 2,2,1 3,2,2 4,3,2 6,3,2")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--tau-only", action="store_true", help="skip the tuned EAGLE-3 speed comparison")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    tree = tuple(int(x) for x in args.tree.split(","))
    temps = tuple(float(t) for t in args.temperatures.split(","))
    grid = [[int(x) for x in g.split(",")] for g in args.grid.split()]

    torch.manual_seed(0)
    model, tok = load_target(args.model)
    heads: dict[str, Path] = {"base": args.drafter}
    metas: dict[str, dict] = {"base": json.loads((args.drafter / "drafter.json").read_text())}
    for label, omega in (("gto", default_settings("drafter.gto")["omega"]), ("control", 0.0)):
        heads[label], metas[label] = fine_tune(label, omega, args, model, tok)

    checksum = model_checksum(args.model)
    drafters = {h: make_drafter("eagle", target_model=model, max_len=2048, path=heads[h],
                                target_checksum=checksum) for h in HEADS}
    target = make_target(model, max_len=2048, drafter=drafters["base"], kernels=read_kernel_table(args.kernels))
    files = sorted(args.workloads.glob("*.parquet"))
    evals = load_prompts(files, tok, split="eval", n=args.prompts)
    calib = load_prompts(files, tok, split="calib", n=args.tune_prompts)

    t0 = time.perf_counter()
    taus: dict[float, dict[str, dict[str, list[float]]]] = {}
    for temp in temps:
        engines = {h: SpeculativeEngine(target=target, policy=DynamicTree(total_tokens=tree[0], depth=tree[1], top_k=tree[2]),
                                        drafter=drafters[h], temperature=temp, eos_token_id=tok.eos_token_id) for h in HEADS}
        taus[temp] = {w: {h: [] for h in HEADS} for w in evals}
        slot = 0
        for w, plist in evals.items():
            for pid, prompt in plist:
                for j in slot_order(len(HEADS), slot // 2, slot):
                    h = HEADS[j]
                    r = engines[h].generate(prompt, max_new_tokens=args.tokens, seed=slot_seed(0, w, pid, 0))
                    taus[temp][w][h].append(r.tau)
                slot += 1
    tau_s = time.perf_counter() - t0
    print(f"tau measured in {tau_s / 60:.1f} min", file=sys.stderr)

    t1 = time.perf_counter()
    tuned: dict[float, dict[str, dict[str, list[int]]]] = {}
    speed: dict[float, dict[str, dict[str, list[float]]]] = {}
    for temp in () if args.tau_only else temps:
        tuned[temp] = {h: tune_eagle(target=target, drafter=drafters[h], prompts=calib, grid=grid, temperature=temp,
                                     max_new_tokens=args.tokens, seed=0).winners
                       for h in ("base", "gto")}
        print(f"T={temp:g} tuned trees: {tuned[temp]}", file=sys.stderr)
        speed[temp] = {w: {m: [] for m in ("ar", "base", "gto")} for w in evals}
        slot = 0
        for w, plist in evals.items():
            engines = {"ar": SpeculativeEngine(target=target, policy=Autoregressive(), drafter=None, temperature=temp,
                                               eos_token_id=tok.eos_token_id)}
            for h in ("base", "gto"):
                a, b, c = tuned[temp][h][w]
                engines[h] = SpeculativeEngine(target=target, policy=DynamicTree(total_tokens=a, depth=b, top_k=c),
                                               drafter=drafters[h], temperature=temp, eos_token_id=tok.eos_token_id)
            names = list(engines)
            for pid, prompt in plist:
                for j in slot_order(len(names), slot // 2, slot):
                    r = engines[names[j]].generate(prompt, max_new_tokens=args.tokens, seed=slot_seed(0, w, pid, 0))
                    speed[temp][w][names[j]].append(r.throughput)
                slot += 1
    speed_s = time.perf_counter() - t1

    g = {h: metas[h].get("gto_metrics", {}) for h in ("gto", "control")}
    gcfg = metas["gto"]["gto"]
    cmd = "PATH=.venv/bin:$PATH python benchmarks/bench_gto.py " + " ".join(sys.argv[1:])
    lines = [
        "## GTO head vs its control and the train_drafter head (`benchmarks/bench_gto.py`)",
        "",
        f"- date: {dt.datetime.now().strftime('%Y-%m-%d %H:%M')}; machine: {os.cpu_count()} CPUs ({cpu_model()}), torch "
        f"{torch.__version__}",
        f"- reproduce: `{cmd.strip()}` (after `make run` has trained the base head and cached its data)",
        "- decoding with the kernel table "
        f"{args.kernels.relative_to(REPO) if args.kernels.is_relative_to(REPO) else args.kernels}",
        f"- base head: {metas['base']['train']['steps']} steps; held-out TTT top-1 "
        f"{[round(a, 3) for a in metas['base']['metrics']['val_top1']]}",
        f"- fine-tuning from it, {gcfg['steps']} steps each, lr {gcfg['lr']}, token batch {gcfg['batch_size']} windows, "
        f"{gcfg['groups']} group(s) of m = {gcfg['group']} positions per step, trees {gcfg['tree']} [total_tokens, depth, "
        "top_k], "
        f"eps {gcfg['eps']}, delta {gcfg['delta']}, eta {gcfg['eta']}:",
        f"  - GTO (omega {gcfg['omega']}): {g['gto']['seconds'] / 60:.1f} min; held-out Draft Tree Reward "
        f"{g['gto']['reward_before']:.3f} -> {g['gto']['reward_after']:.3f}, greedy-accepted tokens per tree "
        f"{g['gto']['accepted_before']:.3f} -> {g['gto']['accepted_after']:.3f}",
        f"  - control (omega 0): {g['control']['seconds'] / 60:.1f} min; held-out Draft Tree Reward "
        f"{g['control']['reward_before']:.3f} -> {g['control']['reward_after']:.3f}, accepted tokens per tree "
        f"{g['control']['accepted_before']:.3f} -> {g['control']['accepted_after']:.3f}",
        f"- tau: {args.prompts} eval prompts per workload, {args.tokens} new tokens, tree {list(tree)}, heads interleaved "
        f"(rotated) per prompt, same request seed; {tau_s / 60:.1f} min",
        "",
        "Mean per-request tau ratio [bootstrap 95% interval]:",
        "",
        "| T | workload | tau base | tau control | tau GTO | GTO / control | GTO / base |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    summary = {}
    for temp, per in taus.items():
        all_c, all_b = [], []
        for w, d in per.items():
            rc = [a / b for a, b in zip(d["gto"], d["control"])]
            rb = [a / b for a, b in zip(d["gto"], d["base"])]
            all_c += rc
            all_b += rb
            lines.append(f"| {temp:g} | {w} | {np.mean(d['base']):.3f} | {np.mean(d['control']):.3f} | {np.mean(d['gto']):.3f} "
                         f"| {fmt(paired(rc))} | {fmt(paired(rb))} |")
        summary[temp] = (paired(all_c), paired(all_b))
        lines.append(f"| {temp:g} | **all** | | | | **{fmt(summary[temp][0])}** | {fmt(summary[temp][1])} |")
    lines += [] if args.tau_only else ["",
                                       f"Tuned EAGLE-3 per head (grid {grid} on {args.tune_prompts} calib prompts per workload), "
                                       "then on the eval "
              f"prompts beside autoregressive decoding, interleaved; {speed_s / 60:.1f} min. Median tokens/s and mean "
              "per-request throughput ratio [95%]:", "",
              "| T | workload | tuned tree base | tuned tree GTO | ar | base | GTO | GTO / base |",
              "|---:|---|---|---|---:|---:|---:|---:|"]
    for temp, per in speed.items():
        allr = []
        for w, d in per.items():
            r = [a / b for a, b in zip(d["gto"], d["base"])]
            allr += r
            lines.append(f"| {temp:g} | {w} | {tuned[temp]['base'][w]} | {tuned[temp]['gto'][w]} | {np.median(d['ar']):.1f} | "
                         f"{np.median(d['base']):.1f} | {np.median(d['gto']):.1f} | {fmt(paired(r))} |")
        lines.append(f"| {temp:g} | **all** | | | | | | **{fmt(paired(allr))}** |")
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section("bench_gto", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
