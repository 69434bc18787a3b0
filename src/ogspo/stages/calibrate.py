"""Stages `calibrate_kernels` and `calibrate_latency`: what this device is fast at, measured.

`calibrate_device_kernels`: the kernel table of `engine.kernels` for the target's weight shapes
(cached per machine, so a rerun of the workflow does not time it again).

`calibrate_latency`: the per-device latency model of docs/DESIGN.md §4, measured on real shapes.

- t_verify(n, L): one target tree forward of n tree tokens (root included, ancestor mask of a bushy
  tree) over a KV cache holding L committed tokens, through the engine's own code path
  (`target.forward`, then `target.cache.commit(None)` to drop the pending rows). Stored as a table
  over n x L; the model is piecewise linear in n (between table sizes) and linear in L (per-size or
  global slope, whichever predicts the table better by leave-one-L-out). A shared CPU changes state
  for tens of seconds, and not uniformly: on the 2-core AMD EPYC a one-row forward flips between ~7.5
  and ~11 ms while an 8-row forward stays near 12 ms. So each timing is preceded by a probe (a one-row
  forward) that gives its state, and each shape is fitted against its timings' states (`state_fit`):
  its time at the mean state over the whole grid goes into the table, and how it moves with the
  one-row forward is the size's `drift_elasticity` (`fit_elasticity`). The table's level is then set
  where decoding runs it (`decode_loop_level`): one scale from the target forwards of real requests
  (autoregressive and static trees), each request compared in its state (the probes around it,
  `probe_seconds`).
- t_draft(w): one drafter level (`drafter.expand`) over a frontier of w nodes at depth 1 of a real
  drafting state (request begun, root expanded); the drafter state is discarded between
  repetitions by beginning the request again. Piecewise linear in w, t_draft(0) = 0. Then scaled to
  the levels past the first of the static-tree requests below (`decode_loop_draft_scale`): in
  decoding a level follows a target pass.
- t_catchup: a drafted cycle that commits A tokens leaves A - 1 of them for the EAGLE head to re-encode
  at the next cycle's first level. From the same static-tree requests as t_fixed: the first level's
  time of each cycle against the tokens the previous cycle committed b: the increments of its median
  over b = 2, 3, ... are `catchup` (`fit_catchup`; measured: 5 ms at b = 1, 9 ms at b = 2..4, AMD EPYC).
- t_fixed: per-cycle overhead from real `SpeculativeEngine` requests, everything of a request that is
  neither prefill, drafting nor the target's forward (sampling, cache compaction, drafter bookkeeping,
  the decode loop between cycles), per cycle. One value per cycle kind, because they differ by an order
  of magnitude: `fixed_ar` from autoregressive requests (no drafter, median over steps), and for tree
  cycles a line in the verified nodes n, `fixed + fixed_slope * (n - 1)`, through the median overhead of
  static trees of three sizes (the 2-token chain, 10 and 28 nodes: `fit_fixed`). The autoregressive and
  tree requests run in shuffled rounds, so both kinds see the same mix of machine states.

    t_cycle(level_widths, n, L, A) = sum_l t_draft(w_l) + t_verify(n, L) + t_fixed(n) + t_catchup(A)

Shapes are timed in a shuffled, interleaved order after a warm-up, each `reps` times; each timing is
the second call of a burst of two of the same shape, because decoding runs a shape after similar
shapes (an autoregressive step after a step), never cold after a 128-token forward.
Held-out shapes (n and L outside the table) give the validation error (MdAPE).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ogspo.artifacts.latency import LatencyCalibration, LatencyModel, fit_verify, write_latency
from ogspo.engine import kernels as K
from ogspo.engine.decode import SpeculativeEngine
from ogspo.engine.drafters import TreeDrafter
from ogspo.engine.policies import Autoregressive, StaticTree
from ogspo.engine.target import LlamaTreeLM, TreeLM, fast_path_refusal, synchronize
from ogspo.engine.tree import DraftTree, Structure, ancestor_matrix

# Rank-path order of the bushy trees timed for t_verify: the first n-1 nodes of this template in
# (depth, rank path) order are ancestor-closed, so any n up to its size is a realistic tree.
BUSHY_TEMPLATE = Structure.full([8, 4, 3, 2, 2, 2, 1, 1])
HELD_OUT_SIZES = (5, 11, 20, 40, 80)
HELD_OUT_CONTEXTS = (256, 600)


def bushy_tree(n: int, context_length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(positions [n], attend [n, n] ancestor mask or None, depths) of a bushy tree of n nodes."""
    if n < 1 or n - 1 > len(BUSHY_TEMPLATE):
        raise ValueError(f"tree size {n} outside 1..{len(BUSHY_TEMPLATE) + 1}")
    paths = [()] + BUSHY_TEMPLATE.to_list()[: n - 1]
    index = {tuple(p): i for i, p in enumerate(paths)}
    parents = np.array([-1] + [index[tuple(p[:-1])] for p in paths[1:]], dtype=np.int64)
    depths = np.array([len(p) for p in paths], dtype=np.int64)
    attend = None if n == 1 else torch.as_tensor(ancestor_matrix(parents, depths), device=device)  # [n, n]
    return torch.as_tensor(context_length + depths, device=device), attend, depths


def _device_name(device) -> str:
    if str(device).startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


def _time_verify(target: TreeLM, n: int, L: int, rng: np.random.Generator) -> float:
    dev = target.device
    positions, attend, _ = bushy_tree(n, L, dev)
    tokens = torch.as_tensor(rng.integers(0, target.vocab_size, n), device=dev)  # [n]
    cache = target.cache
    cache.length, cache.pending = L, 0  # the committed rows hold a real prefix (see _fill_cache)
    synchronize(dev)
    t0 = time.perf_counter()
    target.forward(tokens, positions, attend)
    synchronize(dev)
    dt = time.perf_counter() - t0
    cache.commit(None)
    return dt


def _fill_cache(target: TreeLM, L: int, seed: int) -> None:
    """Write L real committed rows (a random-token prefill) so timings read real cache contents."""
    rng = np.random.default_rng(seed)
    cache = target.cache
    cache.reset()
    dev = target.device
    toks = torch.as_tensor(rng.integers(0, target.vocab_size, L), device=dev)  # [L]
    for s in range(0, L, 256):  # chunked prefill keeps the mask small
        e = min(L, s + 256)
        target.forward(toks[s:e], torch.arange(s, e, device=dev), None, logits_rows=torch.tensor([e - s - 1], device=dev))
        cache.commit_prefix(e - s)


def _measure_grid(fn, shapes: list[tuple], *, reps: int, warmup: int, rng: np.random.Generator, burst: int = 1,
                  probe=None) -> tuple[dict[tuple, list[float]], dict[tuple, list[float]]]:
    """(samples, probes): `reps` timings of fn(*shape) per shape, shapes interleaved in a shuffled order
    each pass; with `burst` > 1 each shape runs `burst` times in a row and only the last call is kept
    (the state a shape meets in decoding: after itself or a similar one, not after any shape of the
    grid). With `probe` (a timed call), each burst is preceded by one, and probes[s][r] is the probe
    time of samples[s][r]: the machine's state tens of milliseconds before it (empty lists without)."""
    for _ in range(warmup):
        for s in shapes:
            fn(*s)
    samples: dict[tuple, list[float]] = {s: [] for s in shapes}
    probes: dict[tuple, list[float]] = {s: [] for s in shapes}
    for _ in range(reps):
        order = rng.permutation(len(shapes))
        for i in order:
            if probe is not None:
                probes[shapes[i]].append(probe())
            for _ in range(burst - 1):
                fn(*shapes[i])
            samples[shapes[i]].append(fn(*shapes[i]))
    return samples, probes


def state_fit(times, state, mean_state: float) -> tuple[float, float]:
    """(time at `mean_state`, d time / d state) of one shape's timings against the machine state of each
    (its probe over the probes' median): the slope is the median of pairwise slopes (Theil-Sen, robust to
    a preempted timing), 0 when its timings saw one state (spread under 3%); the level is the mean of the
    timings moved to the mean state, the highest and lowest tenth left out (a preempted timing). A mean,
    not a median: the machine's states are two modes, and a median picks one."""
    t = np.asarray(times, dtype=np.float64)
    x = np.asarray(state, dtype=np.float64)
    slope = 0.0
    if np.ptp(x) > 0.03:
        i, j = np.triu_indices(len(x), 1)
        keep = np.abs(x[j] - x[i]) > 0.01
        if keep.any():
            slope = float(np.median((t[j] - t[i])[keep] / (x[j] - x[i])[keep]))
    moved = np.sort(t - slope * (x - mean_state))
    cut = len(moved) // 10
    return float(moved[cut: len(moved) - cut].mean()), slope


def _non_increasing(y: list[float]) -> list[float]:
    """The least-squares non-increasing fit of y (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in y:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            (m2, c2), (m1, c1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(int(c))]


def fit_elasticity(levels: dict[tuple, float], slopes: dict[tuple, float], sizes: list[int], contexts: list[int]) -> list[float]:
    """Per table size, the relative change of t_verify(n, L) per relative change of t_verify(1, L), median
    over L; then non-increasing in n within [0, 1] (a forward over more rows is less bound by the memory
    bandwidth a neighbour takes), 1 at n = 1; all 1 when the one-row forwards did not move."""
    raw = []
    for n in sizes:
        e = [(slopes[(n, L)] / levels[(n, L)]) / (slopes[(1, L)] / levels[(1, L)]) for L in contexts if slopes[(1, L)] > 0]
        raw.append(float(np.median(e)) if e else 1.0)
    if sizes[0] != 1 or not any(slopes[(1, L)] > 0 for L in contexts):
        return [1.0] * len(sizes)
    return [1.0] + [float(np.clip(v, 0.0, 1.0)) for v in _non_increasing([min(v, 1.0) for v in raw[1:]])]


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


# English prose for the requests that measure t_fixed and the catch-up: after random tokens the drafter
# accepts nothing, and the catch-up of accepted tokens would never be seen
CALIBRATION_TEXT = (
    "Speculative decoding makes a large language model generate text faster without changing what it "
    "writes. A small drafter proposes a few tokens ahead, arranged as a tree of alternatives, and the large "
    "model checks the whole tree in one forward pass. Every proposed token that the large model would have "
    "chosen itself is kept, and the first one it disagrees with is replaced by its own choice. The speed-up "
    "depends on how often the drafter guesses right, on how much more a pass over many tokens costs than a "
    "pass over one, and on the time spent between passes."
)


def decode_loop_level(sizes: list[int], a: list[float], b: list[float], table: np.ndarray, elasticity: list[float],
                      forwards: list[tuple[int, int, int, float, float]]) -> dict:
    """Set the verify model's level where decoding runs it (in place; the grid keeps its shape in n and L).
    The grid times each shape in a burst of two after a probe, shuffled among the others; the decode loop
    runs a one-row forward after another (an autoregressive step) and a tree forward after drafting
    levels. Each decode-loop forward comes with the state of its request (`speed`: the probes around it
    over the grid's one-row time, `probe_seconds`) and is compared with the grid's model moved to that
    state through the elasticity; a request's ratio is its forwards' median, and every row is scaled by
    the median over all requests. One scale: per request the ratio did not depend on the tree size
    (0.87-1.03 over 1, 3, 11 and 29 rows in one calibration on the AMD EPYC), while a scale per kind
    rests on 4 autoregressive requests and moved from run to run (tree / one-row 0.94-1.34).
    forwards: (request, n, L, speed, seconds). Returns the figures (the per-kind medians for the
    record), with `probe_level`: what a probe reads over the new one-row table in the mean state."""
    xs = np.asarray(sizes, dtype=np.float64)
    req, n, L, f, sec = np.array(forwards, dtype=np.float64).T
    grid = (np.interp(n, xs, np.asarray(a)) + np.interp(n, xs, np.asarray(b)) * L) * (1.0 + np.interp(n, xs, np.asarray(elasticity)) * (f - 1.0))
    ratio = sec / grid
    per_request = [(int(n[req == r][0]), float(np.median(ratio[req == r]))) for r in np.unique(req)]
    scale = float(np.median([v for _, v in per_request]))
    for i in range(len(sizes)):
        a[i], b[i] = a[i] * scale, b[i] * scale
    table *= scale
    one = [v for k, v in per_request if k == 1]
    tree = [v for k, v in per_request if k > 1]
    return {"scale": scale, "probe_level": 1.0 / scale, "requests": len(per_request),
            "one_row_ratio": float(np.median(one)) if one else None, "tree_ratio": float(np.median(tree)) if tree else None}


def decode_loop_draft_scale(widths: list[int], table: list[float], levels: list[tuple[int, int, float]]) -> float:
    """The ratio of the decode loop's drafting levels to the draft table: the median over requests of
    the median over their levels past the first of seconds / t_draft(width) (a head level in decoding
    follows a target pass that took the caches; the table times it right after `begin`). levels:
    (request, frontier width, seconds); 1 without any."""
    if not levels:
        return 1.0
    req, w, sec = np.array(levels, dtype=np.float64).T
    ratio = sec / np.interp(w, np.asarray(widths, dtype=np.float64), np.asarray(table))
    return float(np.median([np.median(ratio[req == r]) for r in np.unique(req)]))


# static trees whose real cycles give t_fixed of a speculative cycle: a 2-token chain, a small and a bushy tree
FIXED_TREES = (Structure.chain(2), Structure.full([2, 2, 1]), Structure.full([4, 2, 2]))


def _overhead_per_cycle(res) -> list[tuple[int, float]]:
    """Per cycle of a request: (verified nodes, the cycle's time outside drafting and the target forward
    plus an equal share of the decode loop's time between cycles, wall - prefill - cycles)."""
    if not res.cycles:
        return []
    loop = (res.wall_seconds - res.prefill_seconds - sum(c.cycle_seconds for c in res.cycles)) / len(res.cycles)
    return [(c.tree_size + 1, c.other_seconds + loop) for c in res.cycles]


def fit_fixed(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """(fixed, fixed_slope): t_fixed(n) = fixed + fixed_slope * (n - 1) through the median overhead of each
    tree size (least squares over the sizes, slope >= 0); one size gives a constant."""
    by_n: dict[int, list[float]] = {}
    for n, s in samples:
        by_n.setdefault(int(n), []).append(float(s))
    ns = np.array(sorted(by_n), dtype=np.float64)
    med = np.array([np.median(by_n[int(n)]) for n in ns])
    if len(ns) < 2:
        return (float(med[0]) if len(med) else 0.0), 0.0
    slope = max(float(np.polyfit(ns - 1, med, 1)[0]), 0.0)
    return float(np.mean(med - slope * (ns - 1))), slope


def level_widths(structure: Structure) -> list[int]:
    """Frontier width of each drafting level of a static tree: level l expands the nodes of depth l - 1
    that have children in it."""
    paths = structure.to_list()
    return [len({tuple(p[:-1]) for p in paths if len(p) == lvl}) for lvl in range(1, structure.max_depth + 1)]


def _deeper_levels(res, widths: list[int]) -> list[tuple[int, float]]:
    """(frontier width, seconds) of every drafting level past the first of a static tree's request (the
    first level re-encodes the accepted tokens: the catch-up's measurement)."""
    return [(widths[i], sec) for c in res.cycles for i, sec in enumerate(c.draft_seconds) if 0 < i < len(widths)]


def _first_levels(res) -> list[tuple[int, float]]:
    """(tokens the previous cycle committed, seconds of this cycle's first draft level), from the 2nd cycle on."""
    return [(prev.accepted, c.draft_seconds[0]) for prev, c in zip(res.cycles, res.cycles[1:]) if c.draft_seconds]


def fit_catchup(samples: list[tuple[int, float]], min_samples: int = 3) -> list[float]:
    """Seconds the j-th accepted token adds to the next first draft level, j = 1..: increments of the
    running maximum of median(first level | b) - median(first level | b = 1) over b = 2, 3, ... with at
    least `min_samples` cycles each (the first b without them ends the table: nothing is added past it)."""
    by_b: dict[int, list[float]] = {}
    for b, s in samples:
        by_b.setdefault(int(b), []).append(float(s))
    if len(by_b.get(1, [])) < min_samples:
        return []
    base, cum, out = float(np.median(by_b[1])), 0.0, []
    b = 2
    while len(by_b.get(b, [])) >= min_samples:
        new = max(cum, float(np.median(by_b[b])) - base)
        out.append(new - cum)
        cum, b = new, b + 1
    return out


def measure_fixed(target: TreeLM, drafter: TreeDrafter, prompt: list[int], *, tokens: int, seed: int,
                  speed: Callable[[TreeLM], float], rounds: int = 4):
    """([(verified nodes, overhead)] of speculative cycles, [overhead] of autoregressive steps, [(previous
    cycle's committed tokens, first draft level seconds)], [(request, verified nodes, context length,
    speed, target forward seconds)] of every cycle), in seconds, from real requests of `tokens` new
    tokens: `rounds` rounds of autoregressive decoding without a drafter and each of `FIXED_TREES`, in a
    shuffled order per round; a request's state is the mean of the probes before and after it
    (`speed(target)`), so the kinds are compared in the states they met."""
    rng = np.random.default_rng(seed)
    ar = SpeculativeEngine(target=target, policy=Autoregressive())
    trees = [SpeculativeEngine(target=target, policy=StaticTree(S), drafter=drafter) for S in FIXED_TREES]
    ar_samples: list[float] = []
    tree_samples: list[tuple[int, float]] = []
    first: list[tuple[int, float]] = []
    forwards: list[tuple[int, int, int, float, float]] = []
    levels: list[tuple[int, int, float]] = []
    ar.generate(prompt, max_new_tokens=4, seed=seed)  # warm-up of the one-row shapes
    own = ar.generate(prompt, max_new_tokens=tokens, seed=seed)
    # the trees continue the target's own text, where the drafter guesses as it does on real text (given a
    # text prompt, `CALIBRATION_TEXT`): cycles commit 1..4 tokens, so the catch-up is seen at several sizes
    text = list(prompt) + own.tokens
    for eng in trees:
        eng.generate(text, max_new_tokens=4, seed=seed)
    before = speed(target)
    order = [int(j) for _ in range(rounds) for j in rng.permutation(len(trees) + 1)]
    for request, j in enumerate(order):
        if j == 0:
            res = ar.generate(prompt, max_new_tokens=tokens, seed=seed)
            ar_samples += [s for _, s in _overhead_per_cycle(res)]
        else:
            res = trees[j - 1].generate(text, max_new_tokens=tokens, seed=seed)
            tree_samples += _overhead_per_cycle(res)
            first += _first_levels(res)
            levels += [(request, w, sec) for w, sec in _deeper_levels(res, level_widths(FIXED_TREES[j - 1]))]
        after = speed(target)
        f = 0.5 * (before + after)
        L = len(prompt) if j == 0 else len(text)
        for c in res.cycles:  # (request, verified nodes, committed context, state, forward seconds) in the decode loop
            forwards.append((request, c.tree_size + 1, L, f, c.verify_seconds))
            L += c.accepted
        before = after
    return tree_samples, ar_samples, first, forwards, levels


def _measure_draft(target: TreeLM, drafter: TreeDrafter, prompt: list[int], pre, widths: list[int], *, reps: int, warmup: int,
                   rng: np.random.Generator, dev) -> dict[tuple, float]:
    """t_draft(w): one drafter level over a frontier of w depth-1 nodes of a real drafting state."""
    kmax = max(widths)

    def time_draft(w: int) -> float:
        drafter.begin(list(prompt), pre)  # discards any pending drafter state of the previous rep
        tree = DraftTree.from_root(int(prompt[-1]))
        exp = drafter.expand(tree, np.zeros(1, dtype=np.int64), kmax)
        toks = exp.tokens[0]
        toks = np.where(toks < 0, rng.integers(0, target.vocab_size, kmax), toks)  # model-free drafters may run short
        kids = tree.add_children(
            parents=np.zeros(kmax, dtype=np.int64), tokens=toks, ranks=np.arange(kmax),
            logq=np.zeros(kmax), entropy=np.zeros(kmax),
        )
        synchronize(dev)
        t0 = time.perf_counter()
        drafter.expand(tree, kids[:w], kmax)
        synchronize(dev)
        return time.perf_counter() - t0

    return _measure_grid(time_draft, [(w,) for w in widths], reps=reps, warmup=warmup, rng=rng)


def calibrate_latency(
    *,
    target: TreeLM,
    drafter: TreeDrafter,
    tree_sizes: list[int],
    context_lengths: list[int],
    draft_widths: list[int],
    reps: int,
    warmup: int,
    seed: int,
    held_out_sizes: tuple[int, ...] = HELD_OUT_SIZES,
    held_out_contexts: tuple[int, ...] = HELD_OUT_CONTEXTS,
    fixed_tokens: int = 48,
    text_prompt: list[int] | None = None,
    meta: dict | None = None,
) -> LatencyCalibration:
    """Measure the latency model of docs/DESIGN.md §4 on this device (see the module docstring). One
    function on purpose (~80 lines): the three measurements share the filled cache and one random stream."""

    t_start = time.perf_counter()
    sizes, contexts, widths = sorted(set(tree_sizes)), sorted(set(context_lengths)), sorted(set(draft_widths))
    if not sizes or not contexts or not widths or reps < 1 or warmup < 0:
        raise ValueError("calibration needs tree sizes, context lengths, draft widths and reps >= 1")
    if sizes[0] < 1 or widths[0] < 1:
        raise ValueError("tree sizes and draft widths must be >= 1")
    held_sizes = [n for n in held_out_sizes if n not in sizes and n <= sizes[-1]]
    held_ctx = [L for L in held_out_contexts if L not in contexts]
    max_L = max(contexts + held_ctx)
    if max_L + sizes[-1] > target.cache.max_len:
        raise ValueError(f"context {max_L} + tree {sizes[-1]} exceeds the target cache of {target.cache.max_len} rows")
    rng = np.random.default_rng(seed)
    _fill_cache(target, max_L, seed)
    filled = target.cache.length

    # ---- t_verify table and held-out shapes, interleaved
    grid = [(n, L) for n in sizes for L in contexts]
    held = [(n, L) for n in held_sizes for L in held_ctx]
    samples, probes = _measure_grid(
        lambda n, L: _time_verify(target, n, L, rng), grid + held, reps=reps, warmup=warmup, rng=rng, burst=2,
        probe=lambda: _time_verify(target, 1, contexts[0], rng),
    )
    target.cache.length, target.cache.pending = filled, 0
    # every shape at the machine's mean state over the grid, and how it moves with the state: the state of
    # a timing is its probe (a one-row forward just before) over the probes' median
    ref = float(np.median([p for v in probes.values() for p in v]))
    state = {s: np.asarray(v) / ref for s, v in probes.items()}
    mean_state = float(np.mean(np.concatenate(list(state.values()))))
    fits = {s: state_fit(v, state[s], mean_state) for s, v in samples.items()}
    verify = {s: lv for s, (lv, _) in fits.items()}
    elasticity = (fit_elasticity(verify, {s: sl for s, (_, sl) in fits.items()}, sizes, contexts) if sizes[0] == 1
                  else [1.0] * len(sizes))
    table = np.array([[verify[(n, L)] for L in contexts] for n in sizes])  # [S, C]
    a, b, mode = fit_verify(sizes, contexts, table)
    a0, b0 = a[0], b[0]  # the grid's one-row line: what a probe is compared with during the requests below

    # ---- t_draft(w): frontier of w depth-1 nodes of a real drafting state
    prompt_len = min(contexts[0], 128)
    prompt = [int(t) for t in rng.integers(0, target.vocab_size, prompt_len)]
    pre = target.prefill(prompt)
    draft = {w: float(np.median(v)) for w, v in
             _measure_draft(target, drafter, prompt, pre, widths, reps=reps, warmup=warmup, rng=rng, dev=target.device)[0].items()}

    # ---- t_fixed per cycle kind from real requests
    text = list(text_prompt)[:prompt_len] if text_prompt else prompt
    fixed_samples, fixed_ar_samples, first_levels, forwards, draft_levels = measure_fixed(
        target, drafter, text, tokens=fixed_tokens, seed=seed,
        speed=lambda t: probe_seconds(t) / (a0 + b0 * t.cache.length))
    level = decode_loop_level(sizes, a, b, table, elasticity, forwards)
    # the draft table where decoding runs it: a level after a target pass, not right after `begin`
    draft_scale = decode_loop_draft_scale(widths, [draft[(w,)] for w in widths], draft_levels)
    draft = {k: v * draft_scale for k, v in draft.items()}
    level["draft_scale"] = draft_scale
    all_states = np.concatenate(list(state.values()))
    level["grid_states"] = {"mean": mean_state, "p10": float(np.percentile(all_states, 10)),
                            "p90": float(np.percentile(all_states, 90)), "probe_seconds": ref}
    fixed, fixed_slope = fit_fixed(fixed_samples)
    catchup = fit_catchup(first_levels)
    fixed_ar = float(np.median(fixed_ar_samples)) if fixed_ar_samples else 0.0

    info = {
        "device": _device_name(target.device),
        "torch": torch.__version__,
        "reps": reps,
        "warmup": warmup,
        "seed": seed,
        "decode_loop_level": level,
        **(meta or {}),
    }
    model = LatencyModel(
        sizes=sizes, contexts=contexts, verify_table=table.tolist(), verify_intercept=a, verify_slope=b,
        slope_mode=mode, draft_widths=widths, draft_table=[draft[(w,)] for w in widths], fixed=fixed, fixed_ar=fixed_ar,
        fixed_slope=fixed_slope, catchup=catchup, drift_elasticity=elasticity, probe_level=level["probe_level"], meta=info,
    )
    validation = []
    for n, L in held:  # the grid's held-out shapes, at the decode loop's level like the table (interpolation error)
        pred = float(model.t_verify(n, L))
        meas = verify[(n, L)] * level["scale"]
        validation.append({"n": n, "L": L, "measured": meas, "predicted": pred, "ape": abs(pred - meas) / meas})
    mdape = float(np.median([v["ape"] for v in validation])) if validation else float("nan")
    model.meta["validation_mdape"] = mdape
    target.cache.reset()
    return LatencyCalibration(
        model=model, validation=validation, mdape=mdape, fixed_samples=[[int(n), float(x)] for n, x in fixed_samples],
        fixed_ar_samples=fixed_ar_samples, catchup_samples=[[int(b), float(x)] for b, x in first_levels],
        seconds=time.perf_counter() - t_start,
    )


def kernel_cache_dir() -> Path:
    return K.native.cache_root() / "kernels"


def calibrate_device_kernels(
    hf_model, cfg: dict, *, device: str = "cpu", cache: Path | None = None, log=print
) -> tuple[K.KernelTable, bool]:
    """The kernel table for this model's weight classes and layer ops on this device (`engine.kernels`),
    and whether it came from the cache. cfg: the `kernels` config section. The cache key is the device
    key (CPU model, torch version, threads, dtype), the weight shapes, the settings, the selection rule and the native
    kernel's source, so any change times afresh. Only CPU kernels are timed: on CUDA the table holds
    the reference kernel (cuBLAS through F.linear) for every class. A model off the fast path
    (`fast_path_refusal`: Gemma, ...) runs through transformers' modules, which take no table: it
    gets an empty one that says why."""
    refusal = fast_path_refusal(hf_model.config)
    if refusal is not None:
        dtype = next(hf_model.parameters()).dtype
        return K.reference_table({}, device, dtype, f"the transformers backend runs this model ({refusal}): no kernels to choose"), False
    lm = LlamaTreeLM(hf_model, max_len=8)  # reference kernels only: just to collect the fused weights
    weights = {c: [w.w for w in lm.mm[c].weights] for c in K.CLASSES}
    shapes = {c: list(ws[0].shape) for c, ws in weights.items()}
    if device != "cpu":
        return K.reference_table(shapes, device, lm.dtype, f"only the reference kernel is used on {device}"), False
    threads = torch.get_num_threads()
    candidates = tuple(k for name in cfg["candidates"] for k in (K.native_kernels(threads) if name == "native" else (name,)))
    layer_ops = {"shape": lm.layer_ops_shape, "n_layers": len(lm.layers), "eps": lm.eps, "context": cfg["layer_ops_context"], "max_rows": 64}
    ident = {"key": K.device_key("cpu", lm.dtype), "shapes": shapes, "rows": cfg["rows"], "reps": cfg["reps"],
             "candidates": candidates, "layer_ops": layer_ops, "selection": K.SELECTION, "native": K.native.source_texts()}
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    cached = (cache or kernel_cache_dir()) / f"kernels-{digest}.json"
    if cfg["cache"] and cached.is_file():
        return K.read_kernel_table(cached), True
    table = K.calibrate_kernels(weights, rows=cfg["rows"], reps=cfg["reps"], candidates=candidates, layer_ops=layer_ops,
                                max_seconds=cfg["max_seconds"], log=log)
    table.meta["cache_key"] = digest
    if cfg["cache"]:
        K.write_kernel_table(table, cached)
    return table, False


def write_calibration(cal: LatencyCalibration, *, json_path: Path, png_path: Path | None = None) -> None:
    """latency.json (`artifacts.latency.write_latency`) and, optionally, the latency.png plot."""
    write_latency(cal, json_path)
    if png_path is not None:
        plot_calibration(cal, png_path=Path(png_path))


def plot_calibration(cal: LatencyCalibration, *, png_path: Path, dpi: int = 80) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = cal.model
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ns = np.arange(1, max(m.sizes) + 1)
    Ls = sorted(set(m.contexts) | {v["L"] for v in cal.validation})
    for i, L in enumerate(Ls):
        color = f"C{i}"
        ax1.plot(ns, 1e3 * m.t_verify(ns, L), "-", color=color, lw=1, label=f"model L={L}")
        if L in m.contexts:
            j = m.contexts.index(L)
            ax1.plot(m.sizes, 1e3 * np.asarray(m.verify_table)[:, j], "o", color=color, ms=3)
        pts = [v for v in cal.validation if v["L"] == L]
        if pts:
            ax1.plot([v["n"] for v in pts], [1e3 * v["measured"] for v in pts], "x", color=color, ms=6)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("tree tokens n (root included)")
    ax1.set_ylabel("t_verify (ms)")
    ax1.set_title(f"verify: table (o), held-out (x), MdAPE {100 * cal.mdape:.1f}%", fontsize=9)
    ax1.legend(fontsize=7)
    ws = np.arange(1, max(m.draft_widths) + 1)
    ax2.plot(m.draft_widths, 1e3 * np.asarray(m.draft_table), "o", ms=3, label="measured")
    ax2.plot(ws, 1e3 * m.t_draft(ws), "-", lw=1, label="model")
    ax2.set_xlabel("frontier width w")
    ax2.set_ylabel("t_draft (ms)")
    ax2.set_title(f"draft level ({m.meta.get('drafter', '?')}); t_fixed {1e3 * m.fixed:.1f} ms, + {1e6 * m.fixed_slope:.0f} us/node, AR {1e3 * m.fixed_ar:.2f} ms",
                  fontsize=9)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = png_path.with_name(f".{png_path.stem}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=dpi)
    plt.close(fig)
    os.replace(tmp, png_path)
