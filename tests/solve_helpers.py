"""Synthetic replay inputs for solver tests and benchmarks: cycles whose acceptance decays with
depth and rank, and a CPU-like latency model (t_verify flat-ish then rising, t_draft per width)."""

from __future__ import annotations

import numpy as np

from ogspo.artifacts.latency import LatencyModel
from ogspo.artifacts.records import template_index
from ogspo.engine.tree import Structure
from ogspo.offline.replay import ReplayCycles, _node_depths


def synthetic_cycles(template: Structure, n_cycles: int, *, seed: int = 0, p0: float = 0.75, decay: float = 0.93,
                     rank_decay: float = 0.45, context=(64, 900)) -> ReplayCycles:
    """Each cycle walks down T: at depth l, rank r is the accepted child with probability
    p0 * decay**(l-1) * rank_decay**r (ranks tried in order, as rejection sampling does); stop on none."""
    rng = np.random.default_rng(seed)
    idx = template_index(template)
    D = template.max_depth
    pad = len(template) + 1
    paths = np.full((n_cycles, D), pad, dtype=np.int64)
    for c in range(n_cycles):
        node: tuple[int, ...] = ()
        for l in range(1, D + 1):
            k = template.n_children.get(node, 0)
            nxt = None
            for r in range(k):
                if rng.random() < p0 * decay ** (l - 1) * rank_decay**r:
                    nxt = node + (r,)
                    break
            if nxt is None:
                break
            paths[c, l - 1] = idx[nxt]
            node = nxt
    return ReplayCycles(
        template=template,
        paths=paths,
        context_lengths=rng.integers(context[0], context[1], n_cycles).astype(np.float64),
        node_depth=_node_depths(template),
    )


def synthetic_latency(*, verify_base: float = 0.11, knee: int = 4, draft: float = 0.012, fixed: float = 0.004,
                      fixed_ar: float | None = None, fixed_slope: float = 0.0, catchup: tuple = ()) -> LatencyModel:
    """Roughly the 2-core CPU shape of docs/DESIGN.md §4: 1 token ~110 ms, 4-16 tokens ~180 ms, then rising."""
    sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    a = [verify_base, verify_base + 0.04, verify_base + 0.07, verify_base + 0.075, verify_base + 0.08,
         verify_base + 0.14, verify_base + 0.27, verify_base + 0.55]
    b = [2e-5 + 1e-6 * n for n in sizes]
    contexts = [128, 384, 768]
    widths = [1, 2, 4, 8, 16]
    return LatencyModel(
        sizes=sizes, contexts=contexts, verify_table=[[ai + bi * L for L in contexts] for ai, bi in zip(a, b)],
        verify_intercept=a, verify_slope=b, slope_mode="per-size", draft_widths=widths,
        draft_table=[draft * (1 + 0.15 * (w - 1)) for w in widths], fixed=fixed, fixed_ar=fixed if fixed_ar is None else fixed_ar,
        fixed_slope=fixed_slope, catchup=list(catchup), meta={"synthetic": True},
    )
