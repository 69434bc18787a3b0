"""Benchmark: the draft head's learning curve, acceptance on fixed eval prompts against training tokens.

    .venv/bin/python benchmarks/bench_drafter.py [--budgets 25000 50000 100000 0] [--head today=DIR] [--write]

Builds the default recipe's training data (`drafter.train.build_data`: read from the user's cache
after `make run`), trains one head per token budget on a seeded prefix of its sequences (same
epochs, so a larger budget trains on more tokens, not longer on the same), then measures every
head, and any `--head` given (e.g. the head of an earlier recipe), with a top-1 chain on the same
eval prompts, interleaved prompt by prompt (`stages.measure_drafter`, acceptance only); `--exclude sharegpt`
leaves a source out first (the mix without ShareGPT at the same epochs). Prints the
table and, with --write, puts it in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchdoc import REPO, cpu_model, head_dirs, write_section  # noqa: E402


def prefix_by_tokens(seqs: list, budget: int, seed: int) -> list:
    """A seeded shuffle of `seqs` cut where it reaches `budget` tokens (0: all of them)."""
    order = np.random.default_rng(seed).permutation(len(seqs))
    out, total = [], 0
    for i in order:
        if budget and total >= budget:
            break
        out.append(seqs[i])
        total += len(seqs[i].tokens)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=REPO / "results" / "cpu" / "model")
    ap.add_argument("--workloads", type=Path, default=REPO / "results" / "cpu" / "workloads")
    ap.add_argument("--kernels", type=Path, default=REPO / "results" / "cpu" / "kernels" / "kernels.json",
                    help="the device's kernel table (the target builds missing data with it; the measurement decodes with it)")
    ap.add_argument("--config", type=Path, nargs="*", default=[], help="YAML files merged over config/default.yaml")
    ap.add_argument("--budgets", type=int, nargs="*", default=[25_000, 50_000, 100_000, 0],
                    help="training tokens of each head trained here (0 = all; none: only measure the --head heads)")
    ap.add_argument("--head", action="append", default=[], help="NAME=DIR: another trained head measured beside them")
    ap.add_argument("--exclude", nargs="*", default=[], choices=["generated", "answered", "sharegpt", "stdlib", "fortunes"],
                    help="leave the data of these sources out before the budgets are cut (a mix without ShareGPT, say)")
    ap.add_argument("--prompts", type=int, default=12, help="eval prompts per workload")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=REPO / "results" / "bench_drafter")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()

    from ogspo.artifacts.settings import settings
    from ogspo.drafter.head import HeadConfig
    from ogspo.drafter.train import build_data, train_head
    from ogspo.engine.kernels import read_kernel_table
    from ogspo.engine.model import load_target, model_checksum
    from ogspo.stages.config import load_config
    from ogspo.stages.measure_drafter import measure_drafter

    full = load_config([REPO / "config" / "default.yaml", *args.config], sections=("drafter", "workloads"), check_paths=False)
    cfg = settings("drafter", full["drafter"])
    cfg.pop("gto")
    fortunes = full["workloads"].get("fortunes") or {}
    heads = head_dirs(args.head, ap.error)

    model, tok = load_target(args.model)
    checksum = model_checksum(args.model)
    kernels = read_kernel_table(args.kernels) if args.kernels.is_file() else None
    t0 = time.perf_counter()
    seqs, stats = build_data(model=model, tokenizer=tok, target_checksum=checksum, workloads_dir=args.workloads,
                             fortunes_dir=Path(fortunes["dir"]) if fortunes.get("dir") else None, cfg=cfg,
                             head_cfg=HeadConfig.for_target(model, draft_vocab=cfg["draft_vocab"]), seed=0, kernels=kernels) \
        if args.budgets else ([], None)
    data_s = time.perf_counter() - t0
    seqs = [s for s in seqs if s.source not in args.exclude]
    rows = []
    for budget in args.budgets:
        subset = prefix_by_tokens(seqs, budget, seed=0)
        label = f"{sum(len(s.tokens) for s in subset) // 1000}k" + "".join(f" without {x}" for x in args.exclude)
        with tempfile.TemporaryDirectory() as work:
            r = train_head(model=model, tokenizer=tok, target_checksum=checksum, seqs=subset, cfg=cfg, seed=0,
                           out_dir=args.out / f"head-{label}".replace(" ", "-"), work_dir=Path(work))
        rows.append((label, r))
        heads[label] = r.path
    res = measure_drafter(model_dir=args.model, drafter_dirs=heads, workloads_dir=args.workloads,
                          prompts_per_workload=args.prompts, max_new_tokens=args.tokens, trees=(), chain_depth=4,
                          speed_prompts_per_workload=0, kernels=kernels)

    acc = {(f.head, f.workload, f.temperature): f for f in res.figures}
    cells = sorted({(f.workload, f.temperature) for f in res.figures}, key=lambda c: (c[1], c[0]))
    cmd = "PATH=.venv/bin:$PATH python benchmarks/bench_drafter.py " + " ".join(sys.argv[1:])
    lines = [
        "## Draft head: learning curve (`benchmarks/bench_drafter.py`)",
        "",
        f"- date: {dt.datetime.now().strftime('%Y-%m-%d %H:%M')}; machine: {os.cpu_count()} CPUs ({cpu_model()}), torch "
        f"{torch.__version__}",
        f"- reproduce: `{cmd.strip()}` (after `make run`, whose data it reads from the cache)",
        (f"- data: {stats.tokens} tokens ({stats.generated_tokens} written by the target; prompts by source {stats.prompts}; "
         f"{stats.near_held_out} dropped as near an eval/calib prompt), "
         + ("read from the cache" if stats.cached else
            f"built in {data_s / 60:.1f} min: {stats.generation_tokens_per_second:.0f} tokens/s of generation, "
            f"{stats.annotation_tokens_per_second:.0f} tokens/s of reading text")
         if stats else "- no heads trained here: the heads given are measured side by side"),
        f"- each head: {cfg['epochs']:g} epochs of batches of {cfg['batch_size']} x {cfg['seq_len']} positions, TTT depth "
        f"{cfg['ttt_steps']}; acceptance: a top-1 chain of 4 on the same {args.prompts} eval prompts per workload, "
        f"{args.tokens} new tokens, heads interleaved prompt by prompt; first-token acceptance [cycles behind it]",
        "",
        "| head | train tokens | steps | train min | held-out top-1 (TTT 1/2/3) | "
        + " | ".join(f"{w} T={t:g}" for w, t in cells) + " |",
        "|---|---:|---:|---:|---|" + "---:|" * len(cells),
    ]
    trained = dict(rows)
    for name in heads:
        r = trained.get(name)
        first = [acc[(name, w, t)] for w, t in cells]
        fig = " | ".join(f"{f.accept_by_depth[0]:.3f} [{f.depth_trials[0]}]" for f in first)
        if r is None:
            lines.append(f"| {name} | - | - | - | - | {fig} |")
        else:
            lines.append(f"| {name} | {r.train_tokens} | {r.steps} | {r.train_seconds / 60:.1f} | "
                         f"{'/'.join(f'{a:.3f}' for a in r.val_top1)} | {fig} |")
    # the target's own bound on a point-mass first token, averaged over the heads' paths (1 at T = 0)
    ceil = [np.mean([acc[(name, w, t)].first_token_ceiling for name in heads]) for w, t in cells]
    lines.append("| first-token ceiling (the target's mean largest probability) | - | - | - | - | "
                 + " | ".join(f"{c:.3f}" for c in ceil) + " |")
    lines += ["", "Acceptance by depth (P(depth d accepted | d-1 reached)) of each head:", "",
              "| head | " + " | ".join(f"{w} T={t:g}" for w, t in cells) + " |", "|---|" + "---|" * len(cells)]
    for name in heads:
        lines.append(f"| {name} | " + " | ".join(", ".join(f"{a:.2f}" for a in acc[(name, w, t)].accept_by_depth)
                                              for w, t in cells) + " |")
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section("bench_drafter", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
