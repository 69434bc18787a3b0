"""Learning curve of the OGSPO stop policy: how much of the oracle's gain it captures on held-out
requests as the records grow. Replay only (records + latency model of a finished run), no decoding.

For each temperature: the oracle's structure S (solve/oracle_T*.json), every workload's records; a
fixed quarter of the requests is held out. The policy is trained (train_policy, Dinkelbach rounds of
backward induction) on a growing share of the other requests, several seeds each, and scored on the
held-out cycles:

    share of the oracle's gain = (J_policy - J_best_fixed_depth) / (J_posterior_bound - J_best_fixed_depth)

where J_best_fixed_depth stops every cycle at the best single depth of S and J_posterior_bound stops
every cycle at its own best depth (the stop-only oracle for S), both on the same held-out cycles.
Writes its section of docs/BENCHMARKS.md.

    .venv/bin/python benchmarks/bench_learning.py [--results results/cpu] [--fractions 0.25 0.5 0.75 1] [--seeds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchdoc import REPO, cpu_model, write_section  # noqa: E402

from ogspo.artifacts.latency import LatencyModel  # noqa: E402
from ogspo.artifacts.oracle import read_oracle  # noqa: E402
from ogspo.artifacts.records import load_records  # noqa: E402
from ogspo.artifacts.settings import default_settings  # noqa: E402
from ogspo.learn.policy import (  # noqa: E402
    combine_data,
    evaluate_policy,
    offline_states,
    policy_depths,
    split_requests,
    train_policy,
)


def curve(results: Path, tag: str, fractions: list[float], seeds: int) -> tuple[list[dict], dict]:
    latency = LatencyModel.from_json(results / "latency" / "latency.json")
    S, _ = read_oracle(results / "solve" / f"oracle_{tag}.json")
    if len(S) == 0:
        return [], {"structure": 0}
    records = [load_records(d) for d in sorted((results / "records").glob(f"*/{tag}")) if (d / "complete.flag").is_file()]
    data = combine_data([offline_states(records=r, structure=S, latency=latency) for r in records])
    tr, ho = split_requests(data.requests, fraction=0.25, seed=100)
    hold = data.subset(ho)
    names = np.array(sorted(set(data.requests[tr].tolist())), dtype=object)
    cfg = {**default_settings("policy"), "holdout_fraction": 0.0}
    rows = []
    for f in fractions:
        n = max(1, int(round(f * len(names))))
        shares, js, cycles = [], [], []
        for s in range(seeds):
            pick = set(np.random.default_rng(s).permutation(names)[:n].tolist())
            rows_ = np.array([i for i in tr if data.requests[i] in pick])
            res = train_policy(data=data.subset(rows_), seed=s, config=cfg)
            ev = evaluate_policy(data=hold, depths=policy_depths(res.head, hold))
            gain = ev.posterior_bound - ev.best_fixed_throughput
            shares.append((ev.throughput - ev.best_fixed_throughput) / gain if gain > 0 else float("nan"))
            js.append(ev.throughput)
            cycles.append(len(rows_))
        rows.append({"fraction": f, "requests": n, "cycles": int(np.median(cycles)), "share": shares, "J": js})
    ev0 = evaluate_policy(data=hold, depths=np.ones(len(ho), dtype=np.int64))
    info = {"structure": len(S), "held_out_requests": len(set(data.requests[ho].tolist())), "held_out_cycles": len(ho),
            "best_fixed": ev0.best_fixed_throughput, "bound": ev0.posterior_bound, "train_requests": len(names)}
    return rows, info


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", type=Path, default=REPO / "results" / "cpu")
    ap.add_argument("--temperatures", nargs="+", default=["T0", "T1"])
    ap.add_argument("--fractions", nargs="+", type=float, default=[0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--write", action="store_true", help="write the section of docs/BENCHMARKS.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    lines = ["## Learning curve of the stop policy (bench_learning)", "",
             f"CPU: {cpu_model()}. Records and latency model of "
             f"`{args.results.relative_to(REPO) if args.results.is_relative_to(REPO) else args.results}`; "
             f"the oracle's structure; a fixed 25% of the record requests held out; {args.seeds} seeds per share. "
             "Share = (J_policy - J_best_fixed_depth) / (J_posterior_bound - J_best_fixed_depth) on the held-out cycles "
             "(1 = the stop-only oracle for S, 0 = no better than the best fixed depth).", ""]
    for tag in args.temperatures:
        rows, info = curve(args.results, tag, args.fractions, args.seeds)
        if not rows:
            lines += [f"{tag}: the oracle's structure is empty (autoregressive decoding); no policy to learn.", ""]
            continue
        lines += [f"### {tag}: |S| = {info['structure']}, {info['train_requests']} train requests, held out "
                  f"{info['held_out_requests']} requests / {info['held_out_cycles']} cycles; best fixed depth "
                  f"{info['best_fixed']:.2f} tok/s, stop-only bound {info['bound']:.2f} tok/s "
                  f"({info['bound'] / info['best_fixed']:.3f}x)", "",
                  "| share of train requests | requests | cycles | held-out J (median) | share of the oracle's gain: median "
                  "[min, max] |",
                  "|---:|---:|---:|---:|---|"]
        for r in rows:
            sh = [x for x in r["share"] if np.isfinite(x)]
            med = statistics.median(sh) if sh else float("nan")
            lines.append(f"| {r['fraction']:.2f} | {r['requests']} | {r['cycles']} | {statistics.median(r['J']):.2f} | "
                         f"{med:.2f} [{min(sh, default=float('nan')):.2f}, {max(sh, default=float('nan')):.2f}] |")
        lines.append("")
    lines.append(f"Measured in {time.perf_counter() - t0:.0f} s.")
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section("bench_learning", text)


if __name__ == "__main__":
    main()
