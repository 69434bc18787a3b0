"""Stage `tune_eagle`: the fair EAGLE-3 baseline, and the best baseline of each cell.

A grid of (total_tokens, depth, top_k) decoded for real on calib prompts, per workload, at one
temperature; the winner (geometric-mean throughput) is the `eagle-tuned` method of `evaluate`.
Sequoia's static tree runs beside the grid, so the best baseline of each cell (ar, eagle-tuned or
sequoia) is picked on calib prompts too, never on the eval requests it is compared on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ogspo.analysis.summary import SEQUOIA, quantile
from ogspo.artifacts.io import write_json
from ogspo.engine.policies import Autoregressive, DynamicTree, TreePolicy
from ogspo.methods.harness import engine_handles, gmean, make_method_engine, pair_seed, run_slot, slot_order, slot_seed
from ogspo.methods.registry import REFERENCE, TUNED, MethodSpec


@dataclass
class TunePoint:
    workload: str
    total_tokens: int
    depth: int
    top_k: int
    throughput: float  # geometric mean of complete-request tokens/s over the tuning prompts
    throughput_q25: float
    throughput_q75: float
    tau: float
    n_requests: int


@dataclass
class TuneResult:
    temperature: float
    points: list[TunePoint]
    winners: dict[str, list[int]]  # workload -> [total_tokens, depth, top_k]
    winner_stability: dict[str, float]  # workload -> share of bootstrap resamples of the prompts with the same winner
    best_baseline: dict[str, str]  # workload -> ar | eagle-tuned | sequoia: the fastest on these prompts
    static_throughput: dict[str, float]  # workload -> the static tree's geometric-mean tokens/s (when given)
    max_new_tokens: int
    prompts: dict[str, list[str]]
    seconds: float


def tune_eagle(
    *,
    target,
    drafter,
    prompts: Mapping[str, list[tuple[str, list[int]]]],
    grid: list[list[int]],
    temperature: float,
    max_new_tokens: int,
    seed: int,
    static: TreePolicy | None = None,
    n_boot: int = 1000,
    progress: Callable[[str], None] | None = None,
    interleave: str = "cycles",
) -> TuneResult:
    """Grid search of EAGLE-3 dynamic trees by real decoding (mirrored orders per pair of prompts, every
    request `max_new_tokens` long; `interleave` as `evaluate`'s: "cycles" runs a prompt's trees side by
    side, cycle by cycle, each on its own fork of the caches); per workload the tree with the highest geometric-mean
    throughput wins. A grid entry [0, 0, 0] is "do not speculate" (autoregressive decoding), so the tuned
    baseline is never slower than AR on the tuning prompts. `static` (Sequoia's tree) runs side by side,
    so the best baseline of each workload (ar, eagle-tuned or sequoia) is picked here, on calib prompts,
    not on the eval requests it is compared on. `winner_stability`: how often the winner stays the same
    when the tuning prompts are resampled with replacement."""
    if not grid:
        raise ValueError("evaluate.eagle_grid is empty: give [total_tokens, depth, top_k] triples")
    for g in grid:
        if len(g) != 3 or not (min(g) >= 1 or list(g) == [0, 0, 0]):
            raise ValueError(f"evaluate.eagle_grid entry {g} is not [total_tokens, depth, top_k] with positive values "
                             "(or [0, 0, 0]: do not speculate)")
    t_start = time.perf_counter()
    trees = [tuple(int(x) for x in g) for g in grid]

    def tree_policy(a: int, b: int, c: int) -> TreePolicy:
        return Autoregressive(name="eagle0-0-0") if a == 0 else DynamicTree(total_tokens=a, depth=b, top_k=c)

    handles = engine_handles(target, drafter, len(trees) + (static is not None), interleave=interleave)  # engine j's
    engines = [make_method_engine(MethodSpec(name=f"eagle{a}-{b}-{c}", kind="eagle-default", tree=(a, b, c)),
                                  tree_policy(a, b, c), target=t, drafter=d, temperature=temperature)
               for (a, b, c), (t, d) in zip(trees, handles)]
    if static is not None:
        t, d = handles[-1]
        engines.append(make_method_engine(MethodSpec(name=SEQUOIA, kind=SEQUOIA), static, target=t, drafter=d,
                                          temperature=temperature))
    rng = np.random.default_rng(seed)
    points: list[TunePoint] = []
    winners: dict[str, list[int]] = {}
    stability: dict[str, float] = {}
    best_baseline: dict[str, str] = {}
    static_tps: dict[str, float] = {}
    for workload, plist in prompts.items():
        tps = np.zeros((len(engines), len(plist)))  # [methods, prompts]
        taus: list[list[tuple[float, int]]] = [[] for _ in engines]
        for index, (prompt_id, prompt) in enumerate(plist):
            rseed = slot_seed(seed, workload, prompt_id, 0)
            order = slot_order(len(engines), pair_seed(seed, temperature, workload, index, 0), index)
            timed = run_slot([engines[j] for j in order], prompt, interleave=interleave, max_new_tokens=max_new_tokens,
                             seed=rseed, latency=None)
            for j, (res, _) in zip(order, timed):
                tps[j, index] = res.throughput
                taus[j].append((res.tau, len(res.cycles)))
        logs = np.log(np.maximum(tps[: len(trees)], 1e-12))  # [grid, prompts]
        for (a, b, c), t, tu in zip(trees, tps, taus):
            cyc = sum(n for _, n in tu)
            points.append(TunePoint(workload=workload, total_tokens=a, depth=b, top_k=c, throughput=gmean(t),
                                    throughput_q25=quantile(t, 0.25), throughput_q75=quantile(t, 0.75),
                                    tau=float(sum(v * n for v, n in tu) / cyc) if cyc else 1.0, n_requests=len(t)))
        win = int(np.argmax(logs.mean(1)))
        winners[workload] = list(trees[win])
        pick = rng.integers(0, len(plist), size=(n_boot, len(plist)))  # [B, prompts]
        stability[workload] = float((logs[:, pick].mean(2).argmax(0) == win).mean())
        ar = next((i for i, t in enumerate(trees) if t == (0, 0, 0)), None)
        cands = {TUNED: gmean(tps[win])}
        if ar is not None:
            cands[REFERENCE] = gmean(tps[ar])  # ties (the tuned tree is AR) go to ar
        if static is not None:
            static_tps[workload] = cands[SEQUOIA] = gmean(tps[-1])
        best_baseline[workload] = max(cands, key=lambda k: (cands[k], k == REFERENCE))
        if progress:
            progress(f"{workload}: best eagle{'-'.join(map(str, trees[win]))} {cands[TUNED]:.1f} tok/s "
                     f"(winner in {100 * stability[workload]:.0f}% of resamples); best baseline {best_baseline[workload]}")
    return TuneResult(temperature=float(temperature), points=points, winners=winners, winner_stability=stability,
                      best_baseline=best_baseline, static_throughput=static_tps, max_new_tokens=max_new_tokens,
                      prompts={w: [p for p, _ in v] for w, v in prompts.items()}, seconds=time.perf_counter() - t_start)


def write_tuning(result: TuneResult, path: Path) -> None:
    write_json(path, {"temperature": result.temperature, "winners": result.winners,
                      "winner_stability": result.winner_stability, "best_baseline": result.best_baseline,
                      "static_throughput": result.static_throughput,
                      "grid": [asdict(p) for p in result.points], "max_new_tokens": result.max_new_tokens,
                      "prompts": result.prompts, "seconds": result.seconds})
