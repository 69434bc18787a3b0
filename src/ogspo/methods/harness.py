"""Timed requests of a decoding method, as the evaluation and the EAGLE-3 tuning run them.

One engine per method (`make_method_engine`: no EOS, so every method of a request slot generates the
same tokens), its stop hook timed apart (`TimedHook`), its cycles logged for the latency model's
prediction (`CycleLog`, `predicted_seconds`), the machine's state probed around each request
(`probe_seconds`, `SpeedProbe`) and the garbage collector kept out of the timing (`quiet_gc`).
A slot's methods either advance side by side, cycle by cycle, each on its own cache (`run_interleaved`:
the machine's drift slows them alike), or run one request after another (`run_request`); either way in
mirrored seeded orders per pair of request slots (`slot_order`), so a position effect linear in the
position cancels in every paired ratio.
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from ogspo.artifacts.records import request_seed, temperature_tag
from ogspo.engine.decode import CycleTrace, GenerationResult, SpeculativeEngine
from ogspo.engine.policies import CycleContext, StopHook, TreePolicy
from ogspo.engine.target import TreeLM, synchronize
from ogspo.engine.tree import DraftTree
from ogspo.methods.registry import MethodSpec


def probe_seconds(target: TreeLM, reps: int = 3) -> float:
    """The machine's state now: median seconds of `reps` one-token target forwards after the committed
    rows (the rows are dropped again). `LatencyModel.speed_ratio` turns it into a speed."""
    dev, L = target.device, target.cache.length
    times = []
    for _ in range(reps):
        tok = torch.zeros(1, dtype=torch.int64, device=dev)  # [1]
        synchronize(dev)
        t0 = time.perf_counter()
        target.forward(tok, torch.tensor([L], device=dev), None)
        synchronize(dev)
        times.append(time.perf_counter() - t0)
        target.cache.commit(None)
    return float(np.median(times))


def gmean(x) -> float:
    """Geometric mean of request throughputs (how tuning and the on-device choice rank methods); 0 when
    there are none or one is not positive."""
    x = np.asarray(x, dtype=np.float64)
    return float(np.exp(np.log(x).mean())) if len(x) and (x > 0).all() else 0.0


def slot_order(n: int, seed: int, index: int) -> list[int]:
    """Method order of the index-th request slot of a cell: slots come in mirrored pairs. Slot 2k runs
    a seeded random permutation (`seed` = the pair's seed), slot 2k+1 the same permutation reversed.
    So over a pair every method's mean position is exactly (n-1)/2 and every method runs before every
    other exactly once: a position effect linear in the position (drift, a warm-up the first method
    pays) cancels in every paired ratio, and no two methods are neighbours in every slot."""
    order = np.random.default_rng(seed).permutation(n).tolist()
    return order[::-1] if index % 2 else order


def pair_seed(seed: int, temperature: float, workload: str, index: int, repeat: int) -> int:
    """The seed of the order of slot pair index // 2 of a cell (per temperature, workload and repeat)."""
    return request_seed(seed, f"order/{temperature_tag(temperature)}/{workload}/{index // 2}/{repeat}")


def slot_seed(seed: int, workload: str, prompt_id: str, repeat: int) -> int:
    """One seed per request slot (workload, prompt, repeat), shared by all methods (common random
    numbers): the records' `request_seed` of the slot's id."""
    return request_seed(seed, f"{workload}/{prompt_id}/{repeat}")


class TimedHook:
    """A stop hook wrapper that adds up the seconds spent deciding."""

    def __init__(self, hook: StopHook):
        self.hook = hook
        self.seconds = 0.0

    def __call__(self, tree: DraftTree, level: int, ctx: CycleContext) -> bool:
        t0 = time.perf_counter()
        try:
            return self.hook(tree, level, ctx)
        finally:
            self.seconds += time.perf_counter() - t0


class CycleLog:
    """Engine `cycle_observer`: per cycle (frontier widths per drafted level, verified nodes with the
    root, committed context length, committed tokens) — what the latency model needs to predict the
    cycle's time."""

    def __init__(self):
        self.cycles: list[tuple[list[int], int, int, int]] = []

    def __call__(self, trace: CycleTrace) -> None:
        d = trace.drafted
        widths = [int(np.unique(d.parents[d.depths == lvl]).size) for lvl in range(1, int(d.depths.max()) + 1)]
        self.cycles.append((widths, int(len(trace.verified)), int(trace.context_length), len(trace.committed)))


def predicted_seconds(cycles: list[tuple[list[int], int, int, int]], latency, speed: float = 1.0) -> float:
    """Sum over cycles of t_draft per level + t_verify(n, L) + t_fixed(n) + t_catchup(A) (docs/DESIGN.md §4),
    in the machine state `speed` (`LatencyModel.t_cycle`)."""
    return float(sum(float(latency.t_cycle(w, n, L, accepted=a, speed=speed)) for w, n, L, a in cycles))


INTERLEAVE = ("cycles", "requests")  # a slot's methods side by side per cycle (`run_interleaved`), or one request after another


def engine_handles(target: TreeLM, drafter, n: int, *, interleave: str) -> list[tuple]:
    """The (target, drafter) each of `n` method engines runs on: forks of their own to be interleaved
    cycle by cycle ("cycles"), or the shared pair ("requests")."""
    if interleave not in INTERLEAVE:
        raise ValueError(f"evaluate.interleave is '{interleave}'; allowed: {', '.join(INTERLEAVE)}")
    if interleave == "requests":
        return [(target, drafter)] * n
    return [(target.fork(), None if drafter is None else drafter.fork()) for _ in range(n)]


@dataclass
class MethodEngine:
    spec: MethodSpec
    engine: SpeculativeEngine
    log: CycleLog
    hook: TimedHook | None


def make_method_engine(spec: MethodSpec, policy: TreePolicy, *, target, drafter, temperature: float) -> MethodEngine:
    """One method's engine. It has no EOS token: every method of a slot generates the request's full
    `max_new_tokens`, so paired ratios compare the same work (at T > 0 methods sample different texts,
    and one stopping at an early EOS would be timed mostly on its prefill)."""
    hook = TimedHook(policy.hook) if policy.hook is not None else None
    log = CycleLog()
    engine = SpeculativeEngine(
        target=target, policy=policy, drafter=None if policy.max_nodes == 1 else drafter, temperature=temperature,
        eos_token_id=None, stop_hook=hook, cycle_observer=log,
    )
    return MethodEngine(spec=spec, engine=engine, log=log, hook=hook)


@contextmanager
def quiet_gc():
    """Collect garbage before a timed request and keep the cyclic collector off during it (as `timeit`
    does), so a collection the previous method's garbage triggers is not timed in the next method."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def probe_speed(target, latency, *, reps: int = 3) -> float:
    """The machine's state now against the latency model's mean state (`LatencyModel.speed_ratio` of
    `calibrate.probe_seconds`: `reps` one-token forwards after the committed rows, untimed for the request)."""
    return latency.speed_ratio(probe_seconds(target, reps), target.cache.length)


class SpeedProbe:
    """The machine's state during a request, for the latency model's predictions. `probe` measures it
    now (`probe_speed`); a request's state (`state_since`) is the mean of the probe just before it and
    every probe taken since (for a request run alone: the previous request's probe and its own after
    it). A shared CPU drifts between states over seconds to tens of seconds (on the 2-core AMD EPYC a
    one-row forward between ~7.5 and ~11 ms), so probes next to and during a request tell its state;
    how each shape follows the state is the model's `drift_elasticity`. Measured on a probe, never on
    the requests' own times."""

    def __init__(self):
        self.samples: list[float] = []

    def probe(self, target, latency) -> None:
        self.samples.append(probe_speed(target, latency))

    def state_since(self, mark: int) -> float:
        """The mean of the probes from the one before sample `mark` (a `len(samples)` taken before the
        request) to the last."""
        return float(np.mean(self.samples[max(mark - 1, 0):]))


def _figures(me: MethodEngine, res: GenerationResult, *, latency, factor: float) -> dict:
    """A request's timing and prediction figures: the time split (the stop hook's time out of "other")
    and the measured prefill plus the latency model's cycles in machine state `factor`."""
    split = res.time_split()
    policy_s = me.hook.seconds if me.hook is not None else 0.0
    pred = (split["prefill"] + predicted_seconds(me.log.cycles, latency.at_temperature(me.engine.temperature), factor)
            if latency is not None else float("nan"))
    return {
        "prefill_seconds": split["prefill"], "draft_seconds": split["draft"], "policy_seconds": policy_s,
        "verify_seconds": split["verify"], "other_seconds": max(split["other"] - policy_s, 0.0),
        "predicted_seconds": pred, "speed_factor": factor if latency is not None else float("nan"),
        "predicted_throughput": len(res.tokens) / pred if pred > 0 else float("nan"),
    }


def _reset(me: MethodEngine) -> None:
    me.log.cycles.clear()
    if me.hook is not None:
        me.hook.seconds = 0.0


def run_request(me: MethodEngine, prompt: list[int], *, max_new_tokens: int, seed: int, latency,
                speed: SpeedProbe | None = None) -> tuple[GenerationResult, dict]:
    """Decode one request with one method alone; returns the result and its timing/prediction figures
    (the prediction is the measured prefill plus the latency model's cycles in the machine state
    `speed` reads around the request, when given)."""
    _reset(me)
    mark = len(speed.samples) if speed is not None else 0
    with quiet_gc():
        res = me.engine.generate(prompt, max_new_tokens=max_new_tokens, seed=seed)
    factor = 1.0
    if latency is not None and speed is not None:
        speed.probe(me.engine.target, latency)
        factor = speed.state_since(mark)
    return res, _figures(me, res, latency=latency, factor=factor)


def run_slot(engines: list[MethodEngine], prompt: list[int], *, interleave: str, max_new_tokens: int, seed: int, latency,
             speed: SpeedProbe | None = None) -> list[tuple[GenerationResult, dict]]:
    """One request slot, every engine in the given order: side by side (`run_interleaved`, "cycles") or
    one request after another (`run_request`, "requests"); a result and its figures per engine."""
    if interleave == "cycles":
        return run_interleaved(engines, prompt, max_new_tokens=max_new_tokens, seed=seed, latency=latency, speed=speed)
    return [run_request(me, prompt, max_new_tokens=max_new_tokens, seed=seed, latency=latency, speed=speed) for me in engines]


def run_interleaved(engines: list[MethodEngine], prompt: list[int], *, max_new_tokens: int, seed: int, latency,
                    speed: SpeedProbe | None = None, probe_every: int = 16) -> list[tuple[GenerationResult, dict]]:
    """Decode one request with every method at once, cycle by cycle: each engine's request is
    started in the given order, then the one that has generated the fewest tokens so far runs its
    next cycle (ties: the given order), until all are done. Every method's tokens are thus spread
    over the same stretch of wall time, so a drift of the machine's speed (seconds to tens of seconds
    on a shared CPU, longer than a cycle, often shorter than a slot of requests run one after
    another) slows all of them alike and cancels in their paired ratios. A request's time is its own
    prefill and cycles (`Generation.seconds`), so each figure is what the method costs alone, bar
    the caches the others' cycles evict (the target's weights do not fit in any cache here, and are
    read again every forward anyway). The engines need targets and drafters of their own
    (`TreeLM.fork`, `TreeDrafter.fork`): a shared cache would be overwritten between cycles.
    With `speed`, the machine is probed every `probe_every` tokens of the slowest request, and every
    request of the slot gets the mean state (`SpeedProbe.state_since`)."""
    targets = [id(me.engine.target) for me in engines]
    drafters = [id(me.engine.drafter) for me in engines if me.engine.drafter is not None]
    if len(set(targets)) < len(targets) or len(set(drafters)) < len(drafters):
        raise ValueError("run_interleaved needs a target and a drafter of its own per engine (TreeLM.fork, TreeDrafter.fork)")
    for me in engines:
        _reset(me)
    probing = latency is not None and speed is not None
    mark = len(speed.samples) if probing else 0
    with quiet_gc():
        gens = [me.engine.start(prompt, max_new_tokens=max_new_tokens, seed=seed) for me in engines]
        next_probe = probe_every
        while True:
            live = [i for i, g in enumerate(gens) if not g.done]
            if not live:
                break
            i = min(live, key=lambda j: len(gens[j].tokens))  # the first of the least advanced
            engines[i].engine.step(gens[i])
            slowest = min(len(g.tokens) for g in gens)
            if probing and slowest >= next_probe and slowest < max_new_tokens:
                speed.probe(engines[i].engine.target, latency)
                next_probe += probe_every
    factor = 1.0
    if probing:
        speed.probe(engines[0].engine.target, latency)
        factor = speed.state_since(mark)
    out = []
    for me, g in zip(engines, gens):
        res = g.result()
        out.append((res, _figures(me, res, latency=latency, factor=factor)))
    return out
