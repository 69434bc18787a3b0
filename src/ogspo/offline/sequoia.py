"""Sequoia-style static tree baseline (docs/DESIGN.md §7) from posterior verification records (stage: `stages.build_sequoia`).

**Positional acceptance.** Sequoia assumes that the probability that the accepted child of an accepted
node is its r-th ranked child depends only on r (optionally on the depth too). From records:

    p_r     = #(cycles whose accepted T-path takes rank r at some depth l)
              / #(cycles whose accepted T-path reaches depth l-1 at a node with more than r children in T)
    p_{l,r} = the same per depth l (`by_depth: true`)

Siblings are mutually exclusive on the accepted path, so for a structure S (ancestor- and left-closed)
the expected committed tokens are E[A(S)] = 1 + sum_{v in S} prod_{(l, r) on v's rank path} p_{l,r}
(exact under the assumption; `replay` gives the records' own figure when S lies inside T).

**Dynamic program** (Sequoia): F_l(n) = best value of a subtree of n nodes rooted at a node of depth l
(the root counts 1), G_l(m, r) = best split of m nodes over the children of ranks r, r+1, ...:

    F_l(1) = 1,  F_l(n) = 1 + G_l(n - 1, 0)            (F_D(n > 1) = -inf at the depth limit D)
    G_l(0, r) = 0,  G_l(m, r) = max_{1<=s<=m} p_{l+1,r} F_{l+1}(s) + G_l(m - s, r + 1)

Children are filled in rank order, so every tree the DP builds is left-closed. E[A] of the best tree of
n drafted nodes is F_0(n + 1).

**Size choice.** Modelled throughput of the best tree of each size n (n = 0 is autoregressive):
    J_n = F_0(n + 1) / (sum_l t_draft(w_l) + t_verify(n + 1, L) + t_fixed)
with w_l the tree's frontier widths and L the records' *mean* context length (t_verify is linear in L,
so the mean makes the denominator the exact expected cycle time). The chosen tree maximises J_n.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ogspo.artifacts.latency import LatencyModel
from ogspo.artifacts.settings import settings
from ogspo.engine.tree import Structure
from ogspo.offline.replay import ReplayCycles, replay

REPORT_FILE = "sequoia.json"


# ---------------------------------------------------------------- acceptance estimates


@dataclass
class PositionalAcceptance:
    """p[l-1, r]: P(the accepted child of an accepted depth-(l-1) node has rank r); NaN where never observed."""

    probs: np.ndarray  # [D, R] float64
    counts: np.ndarray  # [D, R] int64 numerators
    trials: np.ndarray  # [D, R] int64 denominators
    by_depth: bool

    @property
    def max_rank(self) -> int:
        """Ranks with an estimate at some depth (children per node the DP may use)."""
        seen = np.nonzero((self.trials > 0).any(axis=0))[0]
        return int(seen.max()) + 1 if len(seen) else 0


def estimate_acceptance(cycles: ReplayCycles, *, by_depth: bool = False) -> PositionalAcceptance:
    """Positional acceptance from the accepted T-paths of the records (pooled over depths unless `by_depth`)."""
    T = cycles.template
    tl = T.to_list()
    D = T.max_depth
    if D == 0:
        raise ValueError("the records template has no nodes")
    R = max(T.n_children.values())
    node_path = [()] + [tuple(p) for p in tl]  # template node id -> rank path
    counts = np.zeros((D, R), dtype=np.int64)
    trials = np.zeros((D, R), dtype=np.int64)
    pad = cycles.pad
    for row in cycles.paths:
        parent: tuple[int, ...] = ()
        for l in range(1, D + 1):
            width = T.n_children.get(parent, 0)
            if width == 0:
                break
            trials[l - 1, :width] += 1
            tid = int(row[l - 1])
            if tid == pad:
                break
            path = node_path[tid]
            counts[l - 1, path[-1]] += 1
            parent = path
    if not by_depth:
        counts = np.broadcast_to(counts.sum(0), (D, R)).copy()
        trials = np.broadcast_to(trials.sum(0), (D, R)).copy()
    with np.errstate(invalid="ignore", divide="ignore"):
        probs = np.where(trials > 0, counts / np.maximum(trials, 1), np.nan)
    return PositionalAcceptance(probs=probs, counts=counts, trials=trials, by_depth=by_depth)


# ---------------------------------------------------------------- dynamic program


@dataclass
class SequoiaTrees:
    """Best tree of every size n = 0..max_nodes (drafted nodes) and its expected committed tokens."""

    structures: list[Structure | None]  # None where no tree of that size fits the depth/width limits
    expected: np.ndarray  # [N+1] F_0(n + 1) (-inf where none fits)


def level_probs(acc: PositionalAcceptance, depth: int) -> np.ndarray:
    """p[l-1, r] for l = 1..depth; depths past the estimates reuse the pooled (or deepest) row; NaN -> 0. [depth, R]"""
    p = np.nan_to_num(acc.probs[:, : max(acc.max_rank, 1)], nan=0.0)
    rows = np.minimum(np.arange(depth), len(p) - 1)
    return p[rows]


def best_trees(probs: np.ndarray, max_nodes: int) -> SequoiaTrees:
    """Sequoia's DP over positional acceptance probs[l-1, r] (depth limit = len(probs)). Exact for every size."""
    D, R = probs.shape
    N = max_nodes + 1  # subtree sizes include their root
    NEG = -np.inf
    F = np.full((D + 1, N + 1), NEG)  # F[l, n]
    F[:, 1] = 1.0
    # G[l][r, m] and the chosen first-child size for reconstruction
    G = np.full((D, R + 1, N), NEG)
    choice = np.zeros((D, R + 1, N), dtype=np.int64)
    for l in range(D - 1, -1, -1):
        g = G[l]
        g[:, 0] = 0.0
        for r in range(R - 1, -1, -1):
            p = probs[l, r]
            for m in range(1, N):
                s = np.arange(1, m + 1)
                sub = F[l + 1, s]
                vals = np.where(sub > NEG, p * np.where(sub > NEG, sub, 0.0), NEG) + g[r + 1, m - s]  # [m]
                best = int(np.argmax(vals))
                if vals[best] > NEG:
                    g[r, m], choice[l, r, m] = vals[best], s[best]
        F[l, 2:] = 1.0 + g[0, 1:N]

    def build(l: int, n: int, prefix: tuple[int, ...], out: list[tuple[int, ...]]) -> None:
        m, r = n - 1, 0
        while m > 0:
            s = int(choice[l, r, m])
            child = prefix + (r,)
            out.append(child)
            build(l + 1, s, child, out)
            m, r = m - s, r + 1

    structures: list[Structure | None] = []
    for n in range(max_nodes + 1):
        if F[0, n + 1] == NEG:
            structures.append(None)
            continue
        paths: list[tuple[int, ...]] = []
        build(0, n + 1, (), paths)
        structures.append(Structure(paths))
    return SequoiaTrees(structures=structures, expected=F[0, 1:].copy())


def expected_accepted(S: Structure, probs: np.ndarray) -> float:
    """1 + sum over nodes of the product of positional probabilities along the rank path."""
    total = 1.0
    for p in S.paths:
        if len(p) > probs.shape[0] or max(p) >= probs.shape[1]:
            raise ValueError(f"node {list(p)} lies outside the acceptance table ({probs.shape[0]} depths x {probs.shape[1]} "
                             "ranks)")
        total += float(np.prod([probs[l, r] for l, r in enumerate(p)]))
    return total


def frontier_widths(S: Structure) -> list[int]:
    """w_l: nodes of depth l-1 with children in S, per level l = 1..depth."""
    widths = [0] * S.max_depth
    for parent in S.n_children:
        widths[len(parent)] += 1
    return widths


def modelled_seconds(S: Structure, latency: LatencyModel, context_length: float, expected: float = 1.0) -> float:
    """t_cycle of the static tree S at context L, committing `expected` tokens on average (its catch-up)."""
    return float(latency.t_cycle(frontier_widths(S), len(S) + 1, context_length, accepted=expected))


# ---------------------------------------------------------------- stage


def sequoia_settings(config: dict | None) -> dict:
    cfg = settings("baselines.sequoia", config)
    if not isinstance(cfg["max_nodes"], int) or cfg["max_nodes"] < 0:
        raise ValueError(f"baselines.sequoia.max_nodes must be an integer >= 0, got {cfg['max_nodes']!r}")
    if cfg["max_depth"] is not None and (not isinstance(cfg["max_depth"], int) or cfg["max_depth"] < 1):
        raise ValueError("baselines.sequoia.max_depth must be an integer >= 1 or null (template depth), "
                         f"got {cfg['max_depth']!r}")
    return cfg


@dataclass
class SequoiaResult:
    out_dir: Path | None
    structure: Structure  # the chosen tree (empty = autoregressive)
    size: int
    context_length: float  # L used by the latency model (mean over record cycles)
    acceptance: PositionalAcceptance
    expected: list[float]  # E[A] per size n = 0..max_nodes (model)
    seconds: list[float]  # modelled t per size
    throughputs: list[float]  # modelled J per size (0 where no tree fits)
    replayed: list[float | None]  # J on the records per size, None where the tree leaves the template
    inside_template: bool  # the chosen tree lies in T (replayed[size] is its record figure)
    replayed_autoregressive: float
    n_cycles: int
    settings: dict
    build_seconds: float

    @property
    def throughput(self) -> float:
        return self.throughputs[self.size]

    def to_json(self) -> dict:
        return {
            "structure": self.structure.to_list(), "size": self.size, "depth": self.structure.max_depth,
            "autoregressive": self.size == 0, "modelled_throughput": self.throughput,
            "modelled_expected_accepted": self.expected[self.size],
            "replayed_throughput": self.replayed[self.size], "inside_template": self.inside_template,
            "replayed_autoregressive": self.replayed_autoregressive, "context_length": self.context_length,
            "acceptance": {"probs": np.where(np.isnan(self.acceptance.probs), None, self.acceptance.probs).tolist(),
                           "counts": self.acceptance.counts.tolist(), "trials": self.acceptance.trials.tolist(),
                           "by_depth": self.acceptance.by_depth},
            "per_size": {"expected_accepted": self.expected, "seconds": self.seconds,
                         "modelled_throughput": self.throughputs, "replayed_throughput": self.replayed},
            "n_cycles": self.n_cycles, "settings": self.settings, "build_seconds": self.build_seconds,
        }


def sequoia_tree(*, cycles: ReplayCycles, latency: LatencyModel, config: dict | None = None) -> SequoiaResult:
    """Acceptance estimates, DP trees of every size, modelled size choice, and record replay figures."""
    cfg = sequoia_settings(config)
    t0 = time.perf_counter()
    T = cycles.template
    acc = estimate_acceptance(cycles, by_depth=bool(cfg["by_depth"]))
    depth = cfg["max_depth"] or T.max_depth
    if acc.by_depth and depth > T.max_depth:
        raise ValueError(f"baselines.sequoia.max_depth {depth} exceeds the records template depth {T.max_depth} "
                         "(by_depth needs an estimate per depth; use by_depth: false to go deeper)")
    probs = level_probs(acc, depth)  # [depth, R]
    trees = best_trees(probs, int(cfg["max_nodes"]))
    L = float(np.mean(cycles.context_lengths)) if len(cycles.context_lengths) else 0.0
    expected, seconds, J = [], [], []
    for n, S in enumerate(trees.structures):
        if S is None:
            expected.append(0.0), seconds.append(0.0), J.append(0.0)
            continue
        e = float(trees.expected[n])
        s = modelled_seconds(S, latency, L, expected=e)
        expected.append(e), seconds.append(s), J.append(e / s)
    size = int(np.argmax(J))
    chosen = trees.structures[size]
    inside = [S is not None and all(p in T for p in S.paths) for S in trees.structures]
    replayed: list[float | None] = [None] * len(trees.structures)
    idx = [n for n, ok in enumerate(inside) if ok]
    if idx and len(cycles.paths):
        res = replay(cycles=cycles, structures=[trees.structures[n] for n in idx],
                     depths=np.array([max(trees.structures[n].max_depth, 0) for n in idx]), model=latency)
        for n, j in zip(idx, res.throughput):
            replayed[n] = float(j)
    return SequoiaResult(
        out_dir=None, structure=chosen, size=size, context_length=L, acceptance=acc, expected=expected,
        seconds=seconds, throughputs=J, replayed=replayed, inside_template=inside[size],
        replayed_autoregressive=replayed[0] if replayed[0] is not None else float("nan"), n_cycles=len(cycles.paths),
        settings=cfg, build_seconds=time.perf_counter() - t0,
    )
