"""Solve time of the OGSPO MIFPs (oracle and structure update) for config/default.yaml's template.

Uses real records at results/cpu/records/*/T0 with results/cpu/latency/latency.json when both exist,
otherwise synthetic-but-realistic cycles (acceptance decaying with depth and rank, tests/solve_helpers.py)
and a CPU-shaped synthetic latency model. Writes its section of docs/BENCHMARKS.md.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_solve.py [--cycles 300]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchdoc import cpu_model, write_section  # noqa: E402

from ogspo.engine.tree import Structure  # noqa: E402
from ogspo.offline.solve import combine_cycles, solve_oracle, solve_structure
from ogspo.stages.config import load_config


def _cells(r) -> str:
    """A solve's table cells from the iterations to the lambda history."""
    lambdas = ", ".join(f"{x:.4f}" for x in r.lambdas)
    return (f"{r.iterations} | {r.solve_seconds:.1f} | {r.throughput:.4f} | {r.ratio_upper_bound:.4f} | {len(r.structure)} "
            f"| {lambdas}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=300)
    args = ap.parse_args()
    cfg = load_config(REPO / "config" / "default.yaml")
    tcfg = cfg["records"]["template"]
    T = Structure.full(tcfg["widths"][: tcfg["depth"]])
    rec_dirs = sorted((REPO / "results" / "cpu" / "records").glob("*/T0"))
    lat_path = REPO / "results" / "cpu" / "latency" / "latency.json"
    if rec_dirs and lat_path.exists():
        from ogspo.artifacts.latency import LatencyModel
        from ogspo.artifacts.records import load_records
        from ogspo.offline.replay import replay_cycles

        cycles = combine_cycles([replay_cycles(load_records(d)) for d in rec_dirs])
        latency = LatencyModel.from_json(lat_path)
        source = f"real records ({', '.join(d.parent.name for d in rec_dirs)}, T=0) and the measured latency model"
    else:
        from solve_helpers import synthetic_cycles, synthetic_latency

        cycles = synthetic_cycles(T, args.cycles, seed=0)
        latency = synthetic_latency()
        source = (f"**synthetic** records ({args.cycles} cycles, acceptance 0.75·0.93^(depth-1)·0.45^rank; no real records "
                  "at results/cpu/records yet) and a synthetic CPU-shaped latency model (1 token 110 ms, 4-16 tokens ~180 ms)")
    res = solve_oracle(cycles=cycles, latency=latency, config=cfg["solve"])
    D = T.max_depth
    C = len(cycles.context_lengths)
    # structure update under a simple fixed policy: stop at depth d with probability ~ geometric(0.35), d >= 1
    p = 0.35 * 0.65 ** np.arange(D)
    P = np.zeros((C, D + 1))
    P[:, 1:] = p / p.sum()
    st = solve_structure(cycles=cycles, latency=latency, stop_probs=P, config=cfg["solve"])
    text = f"""## bench_solve — OGSPO MIFP solve time (`benchmarks/bench_solve.py`)

CPU: {cpu_model()}, 1 thread (SCIP via pyscipopt). Template: config/default.yaml, {len(T)} nodes, depth {D}.
Inputs: {source}.

| MIFP | cycles | groups | Dinkelbach iterations | solve s (total) | ratio (tokens/s) | upper bound | |S| | lambda history |
|---|---|---|---|---|---|---|---|---|
| oracle (per-group depths) | {res.n_cycles} | {res.n_groups} | {_cells(res)} |
| structure update (fixed geometric stop policy) | {st.n_cycles} | – | {_cells(st)} |

Oracle start: {res.start}; mean stop depth {res.mean_depth:.2f}, mean accepted {res.mean_accepted:.2f} tokens/cycle;
SCIP statuses {res.statuses}. Acceptance target: at most 30 s per MIFP on this CPU
(time_limit {cfg['solve']['time_limit']} s per subproblem).
"""
    write_section("bench_solve", text)
    print(text)


if __name__ == "__main__":
    main()
