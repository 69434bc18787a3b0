"""Benchmark: latency calibration (DESIGN §4) on the run's target, kernel table and EAGLE head.

    .venv/bin/python benchmarks/bench_latency.py [--results results/cpu] [--reps N] [--write]

Runs `calibrate_latency` with the default config's shapes, as rule `calibrate_latency` does, and prints
the held-out MdAPE of t_verify (n in {5, 11, 20, 40, 80} at L in {256, 600}, none in the table), the
machine states the grid saw (each timing's one-row probe over the probes' median), the elasticity per
size and the decode-loop scale; with --write, writes the plot to docs/latency.png and this script's
section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchdoc import REPO, cpu_model, git_commit, load_run, write_section  # noqa: E402


def main() -> None:
    from ogspo.stages.calibrate_latency import CALIBRATION_TEXT, calibrate_latency, plot_calibration
    from ogspo.stages.config import load_config

    ap = argparse.ArgumentParser()
    ap.add_argument("--results", type=Path, default=REPO / "results/cpu")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    lat = load_config([REPO / "config/default.yaml"], sections=("latency",))["latency"]
    reps = args.reps or lat["reps"]
    res = args.results
    checksum, tok, target, drafter = load_run(res)
    cal = calibrate_latency(
        target=target, drafter=drafter, tree_sizes=lat["tree_sizes"], context_lengths=lat["context_lengths"],
        draft_widths=lat["draft_widths"], reps=reps, warmup=lat["warmup"], seed=0, fixed_tokens=lat["fixed_tokens"],
        text_prompt=tok(CALIBRATION_TEXT, add_special_tokens=False).input_ids,
        meta={"model_checksum": checksum, "drafter": drafter.drafter_id},
    )
    m = cal.model
    level = m.meta["decode_loop_level"]
    st = level["grid_states"]
    rows = "\n".join(
        f"| {v['n']} | {v['L']} | {1e3 * v['measured']:.1f} | {1e3 * v['predicted']:.1f} | {100 * v['ape']:.1f}% |"
        for v in cal.validation
    )
    table = "\n".join(
        f"| {n} | {e:.2f} | " + " | ".join(f"{1e3 * t:.1f}" for t in row) + " |"
        for n, e, row in zip(m.sizes, m.drift_elasticity, m.verify_table)
    )
    ratios = ", ".join(f"n={n}: {float(m.t_verify(n, 256) / m.t_verify(1, 256)):.2f}" for n in (2, 4, 8, 16))
    text = f"""## Latency calibration (`benchmarks/bench_latency.py`)

{dt.date.today()}, commit {git_commit()}, {cpu_model()}, {torch.get_num_threads()} torch threads, torch {torch.__version__};
the run's target ({target.dtype}, kernel table {res / 'kernels/kernels.json'}) and EAGLE head; {reps} reps,
{lat['warmup']} warm-up round, shuffled interleaved shapes, each timing after a one-row probe; calibration took
{cal.seconds:.0f} s. Reproduce: `PATH=.venv/bin:$PATH python benchmarks/bench_latency.py --write` after `make run`.

**Held-out MdAPE of t_verify: {100 * cal.mdape:.1f}%** (target <= 10%) over {len(cal.validation)} shapes
not in the table; slope in L: {m.slope_mode}. Machine states seen by the grid (probe / median probe of
{1e3 * st['probe_seconds']:.1f} ms): mean {st['mean']:.2f}, 10th-90th percentile {st['p10']:.2f}-{st['p90']:.2f}.
Decode-loop scale {level['scale']:.3f} over {level['requests']} requests (AR requests alone {level['one_row_ratio']:.3f},
static trees alone {level['tree_ratio']:.3f}). t_verify(n, 256) / t_verify(1, 256) at the mean state: {ratios}.
t_fixed {1e3 * m.fixed:.2f} ms + {1e3 * m.fixed_slope:.3f} ms per node (AR step {1e3 * m.fixed_ar:.2f} ms), a sampled
cycle (T > 0) {1e3 * m.fixed_sampled:.2f} ms more; t_draft(1) {1e3 * float(m.t_draft(1)):.2f} ms, t_draft({m.draft_widths[-1]})
{1e3 * m.draft_table[-1]:.2f} ms; the draft levels and overheads follow the state with elasticity {m.draft_elasticity:.2f}.

![latency](latency.png)

| n | L | measured ms | predicted ms | APE |
|---|---|---|---|---|
{rows}

t_verify table at the mean state (ms), rows n with their elasticity (how the size follows the one-row
forward's state), columns L = {m.contexts}:

| n | elasticity | {' | '.join(str(L) for L in m.contexts)} |
|---|---|{'---|' * len(m.contexts)}
{table}
"""
    print(text)
    if args.write:
        plot_calibration(cal, png_path=REPO / "docs/latency.png", dpi=60)
        write_section("bench_latency", text)


if __name__ == "__main__":
    main()
