"""Benchmark: the latency model against real requests, per method and cell (calib prompts only, never eval).

    .venv/bin/python benchmarks/bench_prediction.py [--results results/cpu] [--prompts 3] [--tokens 96] [--repeats 2]
                                                    [--temperatures 0 1] [--write]

Loads the run's model, EAGLE head, kernel table and latency.json, then decodes the first `--prompts`
calib prompts of every workload with the methods evaluate compares: autoregressive decoding, tuned
EAGLE-3 (the run's tune_eagle winner of the cell), Sequoia's tree and `ogspo` (the exported policy
folder), plus a 2-token chain, interleaved in mirrored orders, `--repeats` times, at each temperature.
Per request the prediction is what evaluate computes: the measured prefill plus the latency model's
t_draft + t_verify + t_fixed + t_catchup of the cycles that ran, in the machine state probed around the
request (`SpeedProbe`). Prints the median of predicted / realised throughput per method pooled and per
cell (workload x temperature), against the bands of issue #36 (pooled 0.95-1.05, cells 0.90-1.10), and
with --write puts the tables into docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchdoc import REPO, cpu_model, git_commit, load_run, write_section  # noqa: E402

POOLED_BAND = (0.95, 1.05)
CELL_BAND = (0.90, 1.10)


def main() -> None:
    from ogspo.artifacts.latency import LatencyModel
    from ogspo.artifacts.records import temperature_tag
    from ogspo.methods.harness import SpeedProbe, make_method_engine, pair_seed, run_request, slot_order, slot_seed
    from ogspo.methods.registry import MethodSpec, build_policy
    from ogspo.stages.evaluate import load_prompts

    ap = argparse.ArgumentParser()
    ap.add_argument("--results", type=Path, default=REPO / "results/cpu")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    res = args.results
    checksum, tok, target, drafter = load_run(res)
    latency = LatencyModel.from_json(res / "latency/latency.json", expect_model=checksum, expect_drafter=drafter.drafter_id)
    prompts = load_prompts(sorted((res / "workloads").glob("*.parquet")), tok, split="calib", n=args.prompts)
    artifacts = {"eagle-tuned": str(res / "evaluate/tune_{T}.json"), "sequoia": str(res / "sequoia/{T}/structure.json"),
                 "ogspo": str(res / "ogspo/{T}")}
    specs = [MethodSpec(name="ar", kind="ar"), MethodSpec(name="chain2", kind="chain", k=2),
             MethodSpec(name="eagle-tuned", kind="eagle-tuned"), MethodSpec(name="sequoia", kind="sequoia"),
             MethodSpec(name="ogspo", kind="ogspo")]
    ratios: dict[tuple[str, str], list[float]] = {}  # (method, cell) -> predicted / realised throughput
    per_cycle: dict[str, list[tuple[float, float]]] = {s.name: [] for s in specs}
    speed = SpeedProbe()
    for temp in args.temperatures:
        for w, plist in prompts.items():
            cell = f"{w} T={temp:g}"
            engines = [make_method_engine(s, build_policy(s, temperature=temp, workload=w, artifacts=artifacts),
                                          target=target, drafter=drafter, temperature=temp) for s in specs]
            for repeat in range(args.repeats):
                for index, (pid, prompt) in enumerate(plist):
                    target.prefill(prompt)
                    for j in slot_order(len(engines), pair_seed(0, temp, w, index, repeat), index):
                        me = engines[j]
                        r, fig = run_request(me, prompt, max_new_tokens=args.tokens, seed=slot_seed(0, w, pid, repeat),
                                             latency=latency, speed=speed)
                        ratios.setdefault((me.spec.name, cell), []).append(fig["predicted_throughput"] / r.throughput)
                        n = len(r.cycles)
                        per_cycle[me.spec.name].append(((r.wall_seconds - r.prefill_seconds) / n,
                                                        (fig["predicted_seconds"] - r.prefill_seconds) / n))
        print(f"T={temp:g} done", flush=True)
    cells = sorted({c for _, c in ratios}, key=lambda c: (c.split(" T=")[1], c))
    lines = ["| method | requests | pooled predicted / realised (median) | in 0.95-1.05 | cells (median) | all cells in "
             "0.90-1.10 "
             "| realised ms/cycle | modelled ms/cycle |", "|---|---:|---:|---|---|---|---:|---:|"]
    for s in specs:
        pooled = [v for (m, _), vs in ratios.items() if m == s.name for v in vs]
        meds = [float(np.median(ratios[(s.name, c)])) for c in cells if (s.name, c) in ratios]
        pc = np.array(per_cycle[s.name])
        ok_p = POOLED_BAND[0] <= np.median(pooled) <= POOLED_BAND[1]
        ok_c = all(CELL_BAND[0] <= x <= CELL_BAND[1] for x in meds)
        lines.append(f"| {s.name} | {len(pooled)} | {np.median(pooled):.3f} | {'yes' if ok_p else 'no'} | "
                     f"{min(meds):.3f}-{max(meds):.3f} | {'yes' if ok_c else 'no'} | "
                     f"{1e3 * np.median(pc[:, 0]):.1f} | {1e3 * np.median(pc[:, 1]):.1f} |")
    cell_lines = ["| method | " + " | ".join(cells) + " |", "|---|" + "---:|" * len(cells)]
    for s in specs:
        cell_lines.append(f"| {s.name} | " + " | ".join(
            f"{np.median(ratios[(s.name, c)]):.3f}" if (s.name, c) in ratios else "-" for c in cells) + " |")
    tags = ", ".join(temperature_tag(t) for t in args.temperatures)
    text = f"""## Latency model against real requests (`benchmarks/bench_prediction.py`)

{dt.date.today()}, commit {git_commit()}, {cpu_model()}, {torch.get_num_threads()} torch threads, torch {torch.__version__},
target in {target.dtype}; the run's model, head, kernel table, latency.json and method artifacts ({tags});
{args.prompts} calib prompts per workload x {args.tokens} tokens x {args.repeats} repeats per temperature, methods
interleaved in mirrored orders, each request predicted in the machine state probed around it. Reproduce:
`PATH=.venv/bin:$PATH python benchmarks/bench_prediction.py --write`. Model: t_fixed {1e3 * latency.fixed:.2f} ms
(speculative cycle), {1e3 * latency.fixed_ar:.2f} ms (autoregressive step); t_verify(1, 256)
{1e3 * float(latency.t_verify(1, 256)):.1f} ms, t_verify(8, 256) / t_verify(1, 256)
{float(latency.t_verify(8, 256) / latency.t_verify(1, 256)):.2f}; elasticity at n = 2, 4, 8:
{", ".join(f"{float(latency.elasticity(n)):.2f}" for n in (2, 4, 8))}.

{chr(10).join(lines)}

Median predicted / realised per cell:

{chr(10).join(cell_lines)}
"""
    print(text)
    if args.write:
        write_section("bench_prediction", text)


if __name__ == "__main__":
    main()
