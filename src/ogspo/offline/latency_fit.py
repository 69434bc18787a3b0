"""The latency model's fits from its timings (docs/DESIGN.md §4): numpy only, so they are tested on
made-up timings. The timings themselves are taken by stage `calibrate_latency`.

- `state_fit`, `fit_elasticity`, `fit_draft_elasticity`: one shape's time at the grid's mean machine
  state and how it moves with the state (a shared CPU changes speed for tens of seconds).
- `decode_loop_level`, `decode_loop_draft_scale`: the tables' level set where decoding runs them.
- `fit_fixed`, `fit_catchup`: the per-cycle overhead and the EAGLE head's catch-up.
"""

from __future__ import annotations

import numpy as np


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


def relative_slopes(levels: dict[tuple, float], slopes: dict[tuple, float], contexts: list[int]) -> dict[tuple, float]:
    """Per shape (n, L), its relative change per relative change of the one-row forward at the same L:
    (slope / level) / (slope(1, L) / level(1, L)); empty when the one-row forwards did not move."""
    one = {L: slopes[(1, L)] / levels[(1, L)] for L in contexts if (1, L) in levels and slopes[(1, L)] > 0}
    return {s: (slopes[s] / levels[s]) / one[s[1]] for s in levels if s[1] in one}


def fit_elasticity(levels: dict[tuple, float], slopes: dict[tuple, float], sizes: list[int], contexts: list[int]) -> list[float]:
    """Per table size, how t_verify(n, L) moves with t_verify(1, L): one curve n ** -c through the
    relative slopes of every shape (each clipped to [0, 1.5], least absolute deviations over c in [0, 4],
    so a preempted shape moves it little), so 1 at
    n = 1, non-increasing (a forward over more rows is less bound by the memory bandwidth a neighbour
    takes) and as steady as the grid is large: one slope per shape from ten timings scatters by +-0.3,
    and a per-size value made non-increasing followed its first low one. All 1 when the one-row forwards
    did not move."""
    rel = relative_slopes(levels, slopes, contexts)
    pts = [(n, min(max(v, 0.0), 1.5)) for (n, _), v in rel.items() if n > 1]
    if not pts or sizes[0] != 1:
        return [1.0] * len(sizes)
    n, v = np.array(pts, dtype=np.float64).T
    cs = np.linspace(0.0, 4.0, 401)
    c = float(cs[np.argmin([np.sum(np.abs(v - n ** -c)) for c in cs])])
    return [float(k ** -c) for k in sizes]


def fit_draft_elasticity(levels: dict[int, float], slopes: dict[int, float], one_row: float) -> float:
    """How a draft level moves with the machine state, relative to a one-row forward (`one_row`: the
    median over L of its slope / level): the median over frontier widths of (slope / level) / one_row,
    within [0, 1]; 0 when the one-row forwards did not move."""
    if not one_row > 0 or not levels:
        return 0.0
    return float(np.clip(np.median([(slopes[w] / levels[w]) / one_row for w in levels]), 0.0, 1.0))


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
    level = np.interp(n, xs, np.asarray(a)) + np.interp(n, xs, np.asarray(b)) * L
    grid = level * (1.0 + np.interp(n, xs, np.asarray(elasticity)) * (f - 1.0))
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
