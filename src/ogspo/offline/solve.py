"""The OGSPO mixed-integer fractional programs (docs/DESIGN.md §5), solved with SCIP (`offline.milp`).

**Oracle (step 0).** Choose a structure S ⊆ T and one stop depth per cycle to maximise
sum_c A_c(S, d_c) / sum_c t_c(S, d_c). **Structure update.** With per-cycle stop probabilities
P_c(d) of a fixed policy, choose S to maximise sum_c sum_d P_c(d) A_c(S,d) / sum_c sum_d P_c(d) t_c(S,d).

Both are written as one *linear fractional MILP* (`FractionalMILP`: variables, linear constraints,
a linear numerator and a linear denominator, plain data) and solved by Dinkelbach iterations
(maximise num - lambda den with SCIP, lambda <- num/den of the solution, until lambda stops rising).
`charnes_cooper` solves the same program as one MILP (scaled variables, big-M products with the
scale) and `brute_force_*` enumerates tiny templates: both are cross-checks for tests.

Formulation (template nodes v = 1..N in `template_index` order, levels l = 1..D):
- x_v binary (v in S); x_v <= x_parent(v) (ancestor-closed), x_v <= x_elder_sibling(v) (left-closed).
- Sizes: per depth d, one-hot u_{d,n} (n = 0..|T_{<=d}|) with sum_n n u_{d,n} = |S_{<=d}|; the verify
  term of a cycle stopping at d is sum_n u_{d,n} t_verify(n + 1, L) (t_verify is a table, not linear).
- Frontier widths: node p has a child in S iff its rank-0 child is in S (left closure), so
  w_l = sum_{p at depth l-1} x_{rank-0 child of p}; one-hot q_{l,w} with sum_w w q_{l,w} = w_l and the
  level's draft time D_l = sum_w t_draft(w) q_{l,w} (t_draft is a table too).
- Oracle only: cycles with the same accepted path in T and the same context-length bucket form a
  *group* g (weight W_g = cycle count) sharing one stop depth: one-hot y_{g,d}, Y_{g,j} = sum_{d>=j} y_{g,d}.
  A: z_{g,j} <= x_{v_j}, z_{g,j} <= Y_{g,j} (z continuous; maximised, so z = min(x, Y) at the optimum;
  S ancestor-closed makes sum_j z_{g,j} the prefix-in-S count). t: P_{g,l} >= D_l - M (1 - Y_{g,l}) pays
  level l's draft time when the group drafts it, V_{g,d} >= sum_n tv_g(n) u_{d,n} - M (1 - y_{g,d}) pays
  the verify time at the chosen depth, where tv_g(n) = sum over the group's cycles of t_verify(n + 1, L_c)
  is exact per cycle (so bucketing L only ties the stop depths of a bucket's cycles together, it does
  not approximate any time; `context_buckets: 0` groups by exact L).
- Structure update: no y. A and t are linear in x, q and u with coefficients aggregated over cycles:
  sum_c P_c(d >= j) for the path nodes, t_draft(w) sum_c P_c(d >= l) for q_{l,w},
  sum_c P_c(d) t_verify(n + 1, L_c) for u_{d,n}. Exact, no grouping needed.

Every solution is re-evaluated with `ogspo.offline.replay` (the vectorised record replay); the MILP's own
num/den must agree (a mismatch is a formulation bug and raises).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ogspo.artifacts.latency import LatencyModel
from ogspo.artifacts.oracle import OracleResult, StructureResult
from ogspo.artifacts.records import template_index
from ogspo.artifacts.settings import settings
from ogspo.engine.tree import Structure
from ogspo.offline.milp import FractionalMILP, add_coef, dinkelbach
from ogspo.offline.replay import ReplayCycles, accepted_lengths, cycle_times, structure_mask

CONSISTENCY_RTOL = 1e-6


# ---------------------------------------------------------------- plain data


@dataclass
class TemplateInfo:
    """T's node ids (root 0, then `Structure.to_list()` order) and their relations."""

    template: Structure
    paths: list[tuple[int, ...]]  # [N + 1], paths[0] = ()
    depth: np.ndarray  # [N + 1]
    parent: np.ndarray  # [N + 1] (-1 for the root)
    elder: np.ndarray  # [N + 1] elder sibling id, -1 for rank 0
    first_child: np.ndarray  # [N + 1] rank-0 child id, -1 for leaves of T

    @property
    def n(self) -> int:
        return len(self.paths) - 1

    @property
    def max_depth(self) -> int:
        return self.template.max_depth

    def cum_sizes(self) -> np.ndarray:
        """|T_{<=d}| for d = 0..D."""
        return np.array([int((self.depth[1:] <= d).sum()) for d in range(self.max_depth + 1)])

    def frontier(self, level: int) -> np.ndarray:
        """Ids of T's nodes at depth level-1 that have children in T."""
        return np.nonzero((self.depth == level - 1) & (self.first_child >= 0))[0]


def template_info(template: Structure) -> TemplateInfo:
    idx = template_index(template)
    paths = [()] + [tuple(p) for p in template.to_list()]
    depth = np.array([len(p) for p in paths], dtype=np.int64)
    parent = np.array([-1] + [idx[p[:-1]] for p in paths[1:]], dtype=np.int64)
    elder = np.array([-1] + [idx[p[:-1] + (p[-1] - 1,)] if p[-1] > 0 else -1 for p in paths[1:]], dtype=np.int64)
    first_child = np.array([idx.get(p + (0,), -1) for p in paths], dtype=np.int64)
    return TemplateInfo(template=template, paths=paths, depth=depth, parent=parent, elder=elder, first_child=first_child)


@dataclass
class CycleGroups:
    """Interchangeable cycles: same accepted T-path and same context-length bucket."""

    paths: list[tuple[int, ...]]  # [G] accepted template node ids (root excluded)
    weights: np.ndarray  # [G] cycle counts
    verify: np.ndarray  # [G, N + 1] sum over the group's cycles of t_verify(n + 1, L_c), n = 0..N
    mean_context: np.ndarray  # [G]
    cycle_group: np.ndarray  # [C] group of every cycle

    @property
    def n_cycles(self) -> int:
        return int(self.weights.sum())


def verify_table(cycles: ReplayCycles, latency: LatencyModel) -> np.ndarray:
    """t_verify(n + 1, L_c) for every cycle and n = 0..N, plus `fixed_offset`: n = 0 (nothing drafted
    at depth 0 or an empty S) is an autoregressive step, whose overhead is `fixed_ar`, not the
    `fixed` the programs book per cycle. [C, N + 1]"""
    n = np.arange(len(cycles.template) + 1)
    return latency.t_verify(n[None, :] + 1, cycles.context_lengths[:, None]) + latency.fixed_offset(n + 1)[None, :]


def group_cycles(*, cycles: ReplayCycles, latency: LatencyModel, context_buckets: int = 4) -> CycleGroups:
    """Group cycles by accepted path and context bucket (quantile buckets; 0 = exact context length)."""
    C = len(cycles.context_lengths)
    if C == 0:
        raise ValueError("no cycles to solve over (empty records)")
    if context_buckets < 0:
        raise ValueError(f"context_buckets must be >= 0, got {context_buckets}")
    L = cycles.context_lengths
    if context_buckets == 0:
        bucket = np.unique(L, return_inverse=True)[1]
    else:
        edges = np.quantile(L, np.linspace(0, 1, context_buckets + 1)[1:-1])
        bucket = np.searchsorted(edges, L, side="right")
    keys: dict[tuple, int] = {}
    cycle_group = np.empty(C, dtype=np.int64)
    pad = cycles.pad
    for c in range(C):
        path = tuple(int(v) for v in cycles.paths[c] if v != pad)
        cycle_group[c] = keys.setdefault((path, int(bucket[c])), len(keys))
    G = len(keys)
    tv = verify_table(cycles, latency)  # [C, N + 1]
    verify = np.zeros((G, tv.shape[1]))
    np.add.at(verify, cycle_group, tv)
    weights = np.bincount(cycle_group, minlength=G)
    mean_context = np.bincount(cycle_group, weights=L, minlength=G) / weights
    return CycleGroups(
        paths=[k[0] for k in keys], weights=weights, verify=verify, mean_context=mean_context, cycle_group=cycle_group
    )


# ---------------------------------------------------------------- a linear fractional MILP as data


@dataclass
class _Encoding:
    """Variable ids of a structure program (x, size and width indicators) plus group depth choices."""

    milp: FractionalMILP
    x: np.ndarray  # [N + 1] var id of x_v (x[0] = -1: the root is always in S)
    size_expr: dict[int, dict[int, int]]  # d -> {n: u_{d,n} var id}
    draft_expr: dict[int, dict[int, float]]  # l -> {q var id: t_draft(w)}
    y: list[dict[int, int]] = field(default_factory=list)  # per group: d -> y var id


def _structure_vars(info: TemplateInfo, latency: LatencyModel, max_depth: int) -> _Encoding:
    m = FractionalMILP()
    x = np.full(info.n + 1, -1, dtype=np.int64)
    for v in range(1, info.n + 1):
        x[v] = m.var(f"x[{'.'.join(map(str, info.paths[v]))}]", binary=True)
    for v in range(1, info.n + 1):
        if info.parent[v] > 0:
            m.row({int(x[v]): 1.0, int(x[info.parent[v]]): -1.0}, "<=", 0.0)
        if info.elder[v] > 0:
            m.row({int(x[v]): 1.0, int(x[info.elder[v]]): -1.0}, "<=", 0.0)
    cum = info.cum_sizes()
    size_expr: dict[int, dict[int, int]] = {}
    for d in range(1, max_depth + 1):
        u = {n: m.var(f"u[{d},{n}]", binary=True) for n in range(cum[d] + 1)}
        m.row({i: 1.0 for i in u.values()}, "==", 1.0)
        row = {i: float(n) for n, i in u.items() if n}
        for v in np.nonzero((info.depth >= 1) & (info.depth <= d))[0]:
            add_coef(row, int(x[v]), -1.0)
        m.row(row, "==", 0.0)
        size_expr[d] = u
    draft_expr: dict[int, dict[int, float]] = {}
    for l in range(1, max_depth + 1):
        front = info.frontier(l)
        q = {w: m.var(f"q[{l},{w}]", binary=True) for w in range(len(front) + 1)}
        m.row({i: 1.0 for i in q.values()}, "==", 1.0)
        row = {i: float(w) for w, i in q.items() if w}
        for p in front:
            add_coef(row, int(x[info.first_child[p]]), -1.0)
        m.row(row, "==", 0.0)
        tw = latency.t_draft(np.arange(len(front) + 1, dtype=np.float64))
        draft_expr[l] = {i: float(tw[w]) for w, i in q.items()}
    return _Encoding(milp=m, x=x, size_expr=size_expr, draft_expr=draft_expr)


def _depth_range(info: TemplateInfo, min_depth: int, max_depth: int | None) -> tuple[int, int]:
    D = info.max_depth if max_depth is None else min(int(max_depth), info.max_depth)
    if min_depth not in (0, 1):
        raise ValueError(f"min_depth must be 0 (allow verifying the root alone) or 1, got {min_depth}")
    if D < max(min_depth, 1):
        raise ValueError(f"max_depth {max_depth} leaves no stop depth (template depth {info.max_depth})")
    return min_depth, D


def build_oracle_milp(
    *, groups: CycleGroups, info: TemplateInfo, latency: LatencyModel, min_depth: int = 1, max_depth: int | None = None
) -> _Encoding:
    dmin, D = _depth_range(info, min_depth, max_depth)
    enc = _structure_vars(info, latency, D)
    m = enc.milp
    inc = np.concatenate([[0.0], np.diff(latency.catchup_cum(D))])  # [D + 1] catch-up of the j-th accepted token
    W = groups.weights.astype(np.float64)
    m.num_const = float(W.sum())
    m.den_const = float(W.sum() * latency.fixed)
    # levels every cycle drafts (l <= dmin): aggregated, no per-group payment
    for l in range(1, dmin + 1):
        for i, c in enc.draft_expr[l].items():
            add_coef(m.den, i, W.sum() * c)
    draft_max = {l: max(enc.draft_expr[l].values()) for l in enc.draft_expr}
    # Dominance: when t_verify is non-decreasing in n, stopping deeper than the group's accepted prefix
    # in S adds time and no tokens, so WLOG d_g <= max(dmin, k_g(S)): depths beyond the group's path
    # are dropped and y_{g,d} <= x_{v_d}. (Exact; checked per group, else every depth stays allowed.)
    monotone = bool((np.diff(groups.verify, axis=1) >= -1e-15).all())
    for g, path in enumerate(groups.paths):
        top = max(dmin, min(len(path), D)) if monotone else D
        y = {d: m.var(f"y[{g},{d}]", binary=True) for d in range(dmin, top + 1)}
        m.row({i: 1.0 for i in y.values()}, "==", 1.0)
        if monotone:
            for d in range(max(dmin, 1) + 1, top + 1):
                m.row({y[d]: 1.0, int(enc.x[path[d - 1]]): -1.0}, "<=", 0.0)
        enc.y.append(y)
        Y = {j: {y[d]: 1.0 for d in y if d >= j} for j in range(1, top + 1)}  # "stops at depth >= j"
        for j, v in enumerate(path[:D], start=1):
            z = m.var(f"z[{g},{j}]", binary=False)
            m.row({z: 1.0, int(enc.x[v]): -1.0}, "<=", 0.0)
            if j > dmin:
                m.row({z: 1.0, **{i: -c for i, c in Y.get(j, {}).items()}}, "<=", 0.0)
            add_coef(m.num, z, W[g])
            add_coef(m.den, z, W[g] * float(inc[j]))  # the drafter re-encodes the j-th accepted token
        # Draft time, disaggregated by width: r_{g,l,w} <= q_{l,w}, sum_w r_{g,l,w} = Y_{g,l}; pays
        # sum_w t_draft(w) r_{g,l,w} (at integer q, r sits on the one width q selects).
        for l in range(dmin + 1, top + 1):
            row = {i: -c for i, c in Y[l].items()}
            for qid, c in enc.draft_expr[l].items():
                r = m.var(f"r[{g},{l},{qid}]", binary=False)
                m.row({r: 1.0, qid: -1.0}, "<=", 0.0)
                row[r] = 1.0
                add_coef(m.den, r, W[g] * c)
            m.row(row, "==", 0.0)
        # Verify time, disaggregated by size: s_{g,d,n} <= u_{d,n}, sum_n s_{g,d,n} = y_{g,d}; pays
        # sum_n tv_g(n) s_{g,d,n}. Much tighter than big-M (whose LP relaxation pays almost nothing).
        tv = groups.verify[g]
        if dmin == 0:
            add_coef(m.den, y[0], float(tv[0]))
        for d in range(max(dmin, 1), top + 1):
            row = {y[d]: -1.0}
            for n, uid in enc.size_expr[d].items():
                sv = m.var(f"s[{g},{d},{n}]", binary=False)
                m.row({sv: 1.0, uid: -1.0}, "<=", 0.0)
                row[sv] = 1.0
                add_coef(m.den, sv, float(tv[n]))
            m.row(row, "==", 0.0)
    m.den_lower = m.den_const + float(groups.verify.min(axis=1).sum())
    m.den_upper = (m.den_const + float(groups.verify.max(axis=1).sum()) + W.sum() * sum(draft_max.values())
                   + W.sum() * float(inc.sum()))
    m.den_upper = max(m.den_upper, m.den_lower * (1 + 1e-9))
    return enc


def build_structure_milp(
    *, cycles: ReplayCycles, info: TemplateInfo, latency: LatencyModel, stop_probs: np.ndarray
) -> _Encoding:
    P = np.asarray(stop_probs, dtype=np.float64)
    C, D = len(cycles.context_lengths), info.max_depth
    if P.shape != (C, D + 1):
        raise ValueError(f"stop_probs must be [cycles, depth + 1] = [{C}, {D + 1}], got {list(P.shape)}")
    if (P < -1e-12).any() or not np.allclose(P.sum(1), 1.0, atol=1e-9):
        raise ValueError("stop_probs rows must be probability distributions over stop depths 0..D")
    enc = _structure_vars(info, latency, D)
    m = enc.milp
    inc = np.concatenate([[0.0], np.diff(latency.catchup_cum(D))])  # [D + 1] catch-up of the j-th accepted token
    reach = np.cumsum(P[:, ::-1], axis=1)[:, ::-1]  # [C, D+1] P(d >= j)
    m.num_const = float(C)
    m.den_const = float(C * latency.fixed)
    pad = cycles.pad
    for c in range(C):
        for j, v in enumerate(cycles.paths[c], start=1):
            if v == pad:
                break
            add_coef(m.num, int(enc.x[v]), reach[c, j])
            add_coef(m.den, int(enc.x[v]), reach[c, j] * float(inc[j]))
    reach_tot = reach.sum(0)
    for l in range(1, D + 1):
        for i, t in enc.draft_expr[l].items():
            add_coef(m.den, i, t * reach_tot[l])
    tv = verify_table(cycles, latency)  # [C, N+1]
    m.den_const += float(P[:, 0] @ tv[:, 0])
    cum = info.cum_sizes()
    for d in range(1, D + 1):
        coef = P[:, d] @ tv[:, : cum[d] + 1]
        for n, i in enc.size_expr[d].items():
            add_coef(m.den, i, float(coef[n]))
    m.den_lower = m.den_const + float(sum(min(0.0, c) for c in m.den.values()))
    m.den_lower = max(m.den_lower, C * latency.fixed + float(tv.min(1).sum()))
    return enc


# ---------------------------------------------------------------- SCIP backends


# ---------------------------------------------------------------- decoding and checking solutions


def _structure_of(enc: _Encoding, info: TemplateInfo, vals: np.ndarray) -> Structure:
    return Structure(info.paths[v] for v in range(1, info.n + 1) if vals[enc.x[v]] > 0.5)


def _depths_of(enc: _Encoding, vals: np.ndarray) -> np.ndarray:
    return np.array([max(y, key=lambda d: vals[y[d]]) for y in enc.y], dtype=np.int64)


def _start_values(enc: _Encoding, info: TemplateInfo, S: Structure, depths: np.ndarray | None,
                  groups: CycleGroups | None) -> np.ndarray:
    """A feasible point of the encoding (tight continuous values) for structure S and group depths."""
    m = enc.milp
    vals = np.zeros(len(m.names))
    mask = np.zeros(info.n + 1, dtype=bool)
    mask[0] = True
    idx = {p: i for i, p in enumerate(info.paths)}
    for p in S.paths:
        mask[idx[p]] = True
    vals[enc.x[1:]] = mask[1:]
    for d, u in enc.size_expr.items():
        vals[u[int(mask[(info.depth >= 1) & (info.depth <= d)].sum())]] = 1.0
    qsel = {}
    for l, expr in enc.draft_expr.items():
        w = int(mask[info.first_child[info.frontier(l)]].sum())
        qsel[l] = sorted(expr)[w]  # q vars were created in width order
        vals[qsel[l]] = 1.0
    if groups is not None:
        pos = {n: i for i, n in enumerate(m.names)}
        for g, y in enumerate(enc.y):
            d = int(depths[g])
            vals[y[d]] = 1.0
            for j, v in enumerate(groups.paths[g], start=1):
                if f"z[{g},{j}]" in pos:
                    vals[pos[f"z[{g},{j}]"]] = float(mask[v] and d >= j)
            for l, qid in qsel.items():
                if f"r[{g},{l},{qid}]" in pos and d >= l:
                    vals[pos[f"r[{g},{l},{qid}]"]] = 1.0
            if d >= 1:
                n = int(mask[(info.depth >= 1) & (info.depth <= d)].sum())
                vals[pos[f"s[{g},{d},{n}]"]] = 1.0
    return vals


def replay_totals(
    *, cycles: ReplayCycles, structure: Structure, cycle_depths: np.ndarray, latency: LatencyModel
) -> tuple[float, float]:
    """sum_c A_c(S, d_c) and sum_c t_c(S, d_c) by `ogspo.offline.replay` (the reference evaluator)."""
    mask = structure_mask(structure, cycles.template)[None]
    d = np.asarray(cycle_depths)[None]
    acc = accepted_lengths(mask, cycles.paths, d)
    secs = cycle_times(mask, cycles.template, d, cycles.context_lengths, latency) + latency.t_catchup(acc)
    return float(acc.sum()), float(secs.sum())


def replay_expected_totals(
    *, cycles: ReplayCycles, structure: Structure, stop_probs: np.ndarray, latency: LatencyModel
) -> tuple[float, float]:
    """sum_c sum_d P_c(d) A_c(S, d) and the same for t, by `ogspo.offline.replay`."""
    D = cycles.template.max_depth
    mask = structure_mask(structure, cycles.template)[None]
    A = T = 0.0
    P = np.asarray(stop_probs, dtype=np.float64)
    for d in range(D + 1):
        dd = np.full((1, len(cycles.context_lengths)), d)
        acc = accepted_lengths(mask, cycles.paths, dd)[0]
        A += float(P[:, d] @ acc)
        T += float(P[:,
                     d] @ (cycle_times(mask, cycles.template, dd, cycles.context_lengths, latency)[0] + latency.t_catchup(acc)))
    return A, T


def _check_consistency(what: str, milp: FractionalMILP, vals: np.ndarray, ref_num: float, ref_den: float) -> tuple[float, float]:
    """The MILP's num/den at the solution must equal the replayed ones. Continuous linearisation variables
    can only be slack in the conservative direction (num lower, den higher) at a non-optimal incumbent;
    any other disagreement is a formulation bug."""
    num = milp.value(milp.num, milp.num_const, vals)
    den = milp.value(milp.den, milp.den_const, vals)
    tol_n, tol_d = CONSISTENCY_RTOL * max(1.0, abs(ref_num)), CONSISTENCY_RTOL * max(1.0, abs(ref_den))
    if num > ref_num + tol_n or den < ref_den - tol_d:
        raise ValueError(
            f"{what}: MILP objective disagrees with record replay (num {num:.9g} vs {ref_num:.9g}, "
            f"den {den:.9g} vs {ref_den:.9g}): formulation bug"
        )
    return num, den


# ---------------------------------------------------------------- Dinkelbach


# ---------------------------------------------------------------- public API


def solve_settings(config: dict | None) -> dict:
    """The `solve` section (or a config holding it) over the defaults (`artifacts.settings`)."""
    return settings("solve", config)


def _group_tables(groups: CycleGroups, info: TemplateInfo, latency: LatencyModel, D: int):
    """A_g(S, d) and t_g(S, d) for a mask, all groups and depths 0..D (numpy; for starts and brute force)."""

    def tables(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        mask = mask[: info.n + 1]  # drop the pad id of `structure_mask`
        W = groups.weights.astype(np.float64)
        G = len(groups.paths)
        A = np.empty((G, D + 1))
        for g, path in enumerate(groups.paths):
            k = 0
            for v in path:
                if not mask[v]:
                    break
                k += 1
            A[g] = W[g] * (1 + np.minimum(k, np.arange(D + 1)))
        widths = np.array([mask[info.first_child[info.frontier(l)]].sum() for l in range(1, D + 1)])
        draft = np.concatenate([[0.0], np.cumsum(latency.t_draft(widths.astype(np.float64)))])  # [D+1]
        sizes = np.array([mask[(info.depth >= 1) & (info.depth <= d)].sum() for d in range(D + 1)])
        T = (W[:, None] * (draft[None, :] + latency.fixed) + groups.verify[:, sizes]
             + W[:, None] * latency.t_catchup(A / W[:, None]))
        return A, T

    return tables


def _best_depths(A: np.ndarray, T: np.ndarray, dmin: int, tol: float = 1e-12) -> tuple[np.ndarray, float]:
    """Exact max over per-group depths of sum A / sum T (Dinkelbach on a finite separable problem)."""
    A, T = A[:, dmin:], T[:, dmin:]
    d = np.zeros(A.shape[0], dtype=np.int64)
    rows = np.arange(A.shape[0])
    lam = A[rows, d].sum() / T[rows, d].sum()
    while True:
        d = np.argmax(A - lam * T, axis=1)
        new = A[rows, d].sum() / T[rows, d].sum()
        if new <= lam * (1 + tol):
            return d + dmin, max(new, lam)
        lam = new


def _dinkelbach_with(cfg: dict, enc, start, evaluate):
    """Dinkelbach iterations on an encoded MIFP with the solver settings of the config."""
    return dinkelbach(
        enc.milp, start=start, evaluate=evaluate, time_limit=float(cfg["time_limit"]), mip_gap=float(cfg["mip_gap"]),
        tol=float(cfg["dinkelbach_tol"]), max_iterations=int(cfg["max_iterations"]),
    )


def _checked_template_info(cycles: ReplayCycles, template: Structure | None):
    """The records' template info, after checking it is the template the caller expects."""
    if template is not None and template.paths != cycles.template.paths:
        raise ValueError(f"records template ({len(cycles.template)} nodes) differs from the given template ({len(template)} "
                         "nodes)")
    return template_info(cycles.template)


def solve_oracle(
    *,
    cycles: ReplayCycles,
    latency: LatencyModel,
    template: Structure | None = None,
    config: dict | None = None,
) -> OracleResult:
    """Posterior-optimal structure and per-group stop depths (docs/DESIGN.md §5 step 0) by Dinkelbach + SCIP."""
    cfg = solve_settings(config)
    info = _checked_template_info(cycles, template)
    groups = group_cycles(cycles=cycles, latency=latency, context_buckets=int(cfg["context_buckets"]))
    dmin, D = _depth_range(info, int(cfg["min_depth"]), cfg["max_depth"])
    enc = build_oracle_milp(groups=groups, info=info, latency=latency, min_depth=dmin, max_depth=D)
    tables = _group_tables(groups, info, latency, D)

    # lambda_0: the best of T and the chain, then a greedy local search (add / drop one node)
    start_name, start_S, start_d, start_ratio = "", None, None, -1.0
    for name, S in (("template", cycles.template), ("chain", Structure.chain(min(D, _chain_len(info))))):
        S = S.up_to(D)
        A, T = tables(structure_mask(S, cycles.template))
        d, r = _best_depths(A, T, dmin)
        if r > start_ratio:
            start_name, start_S, start_d, start_ratio = name, S, d, r
    start_S, start_d, ls_ratio = _local_search(start_S, cycles.template.up_to(D), tables, dmin, start_ratio)
    if ls_ratio > start_ratio:
        start_name, start_ratio = f"{start_name} + local search", ls_ratio

    def evaluate(vals: np.ndarray) -> tuple[float, float]:
        S = _structure_of(enc, info, vals)
        depths = _depths_of(enc, vals)
        num, den = replay_totals(cycles=cycles, structure=S, cycle_depths=depths[groups.cycle_group], latency=latency)
        _check_consistency("oracle", enc.milp, vals, num, den)
        return num, den

    start = _start_values(enc, info, start_S, start_d, groups)
    t0 = time.perf_counter()
    vals, lam, trace = _dinkelbach_with(cfg, enc, start, evaluate)
    seconds = time.perf_counter() - t0
    S = _structure_of(enc, info, vals)
    depths = _depths_of(enc, vals)
    num, den = replay_totals(cycles=cycles, structure=S, cycle_depths=depths[groups.cycle_group], latency=latency)
    W = groups.weights
    return OracleResult(
        structure=S.to_list(),
        group_depths=depths.tolist(),
        group_paths=[list(p) for p in groups.paths],
        group_weights=W.tolist(),
        throughput=num / den,
        accepted=num,
        seconds_total=den,
        mean_accepted=num / groups.n_cycles,
        mean_depth=float((depths * W).sum() / W.sum()),
        lambdas=trace.lambdas,
        iterations=len(trace.gaps),
        gaps=trace.gaps,
        statuses=trace.statuses,
        solve_seconds=seconds,
        ratio_upper_bound=max(trace.ratio_upper_bound, num / den),
        n_groups=len(groups.paths),
        n_cycles=groups.n_cycles,
        start=f"{start_name} (ratio {start_ratio:.6g})",
        settings=cfg,
    )


def _local_search(S: Structure, T: Structure, tables, dmin: int, ratio: float, max_steps: int = 200):
    """Best-improvement moves: add a node whose parent and elder sibling are in S, or drop a node of S
    with no children and no younger sibling in S. Returns (S, depths, ratio)."""
    A, Tt = tables(structure_mask(S, T))
    depths, ratio = _best_depths(A, Tt, dmin)
    for _ in range(max_steps):
        best = (ratio * (1 + 1e-12), None, None)
        cands = [S.paths | {p} for p in T.paths - S.paths
                 if (len(p) == 1 or p[:-1] in S.paths) and (p[-1] == 0 or p[:-1] + (p[-1] - 1,) in S.paths)]
        cands += [S.paths - {p} for p in S.paths
                  if S.n_children.get(p, 0) == 0 and p[:-1] + (p[-1] + 1,) not in S.paths]
        for paths in cands:
            cand = Structure(paths)
            A, Tt = tables(structure_mask(cand, T))
            d, r = _best_depths(A, Tt, dmin)
            if r > best[0]:
                best = (r, cand, d)
        if best[1] is None:
            break
        ratio, S, depths = best
    return S, depths, ratio


def _chain_len(info: TemplateInfo) -> int:
    d = 0
    while (0,) * (d + 1) in info.template:
        d += 1
    return d


def solve_structure(
    *,
    cycles: ReplayCycles,
    latency: LatencyModel,
    stop_probs: np.ndarray,
    template: Structure | None = None,
    config: dict | None = None,
) -> StructureResult:
    """Structure update (docs/DESIGN.md §5): S maximising the stop-probability-weighted ratio, policy fixed."""
    cfg = solve_settings(config)
    info = _checked_template_info(cycles, template)
    enc = build_structure_milp(cycles=cycles, info=info, latency=latency, stop_probs=stop_probs)

    def evaluate(vals: np.ndarray) -> tuple[float, float]:
        S = _structure_of(enc, info, vals)
        num, den = replay_expected_totals(cycles=cycles, structure=S, stop_probs=stop_probs, latency=latency)
        _check_consistency("structure update", enc.milp, vals, num, den)
        return num, den

    best_S, best_r = None, -1.0
    for S in (cycles.template, Structure.chain(_chain_len(info))):
        a, t = replay_expected_totals(cycles=cycles, structure=S, stop_probs=stop_probs, latency=latency)
        if a / t > best_r:
            best_S, best_r = S, a / t
    start = _start_values(enc, info, best_S, None, None)
    t0 = time.perf_counter()
    vals, lam, trace = _dinkelbach_with(cfg, enc, start, evaluate)
    seconds = time.perf_counter() - t0
    S = _structure_of(enc, info, vals)
    num, den = replay_expected_totals(cycles=cycles, structure=S, stop_probs=stop_probs, latency=latency)
    return StructureResult(
        structure=S.to_list(), throughput=num / den, accepted=num, seconds_total=den, lambdas=trace.lambdas,
        iterations=len(trace.gaps), gaps=trace.gaps, statuses=trace.statuses, solve_seconds=seconds,
        ratio_upper_bound=max(trace.ratio_upper_bound, num / den), n_cycles=len(cycles.context_lengths),
    )


# ---------------------------------------------------------------- brute force (tiny templates, tests)


def closed_structures(template: Structure, max_count: int = 100_000) -> list[Structure]:
    """Every ancestor- and left-closed S ⊆ T (the empty one included)."""
    out: list[frozenset] = []

    def expand(chosen: frozenset, frontier: list[tuple[int, ...]]) -> None:
        if len(out) > max_count:
            raise ValueError(f"template has more than {max_count} sub-structures: too large to enumerate")
        if not frontier:
            out.append(chosen)
            return
        p, rest = frontier[0], frontier[1:]
        k = template.n_children.get(p, 0)
        for c in range(k + 1):  # p keeps its first c children
            kids = [p + (r,) for r in range(c)]
            expand(chosen | frozenset(kids), rest + kids)

    expand(frozenset(), [()])
    return [Structure(s) for s in out]


def brute_force_oracle(
    *, groups: CycleGroups, template: Structure, latency: LatencyModel, min_depth: int = 1, max_depth: int | None = None
) -> tuple[float, Structure, np.ndarray]:
    info = template_info(template)
    dmin, D = _depth_range(info, min_depth, max_depth)
    tables = _group_tables(groups, info, latency, D)
    best = (-1.0, None, None)
    for S in closed_structures(template):
        A, T = tables(structure_mask(S, template))
        d, r = _best_depths(A, T, dmin)
        if r > best[0]:
            best = (r, S, d)
    return best


def brute_force_structure(
    *, cycles: ReplayCycles, latency: LatencyModel, stop_probs: np.ndarray
) -> tuple[float, Structure]:
    best = (-1.0, None)
    for S in closed_structures(cycles.template):
        a, t = replay_expected_totals(cycles=cycles, structure=S, stop_probs=stop_probs, latency=latency)
        if a / t > best[0]:
            best = (a / t, S)
    return best


# ---------------------------------------------------------------- records -> cycles, output


def combine_cycles(parts: list[ReplayCycles]) -> ReplayCycles:
    """Cycles of several records folders (same template) as one set."""
    if not parts:
        raise ValueError("no records given")
    T = parts[0].template
    for p in parts[1:]:
        if p.template.paths != T.paths:
            raise ValueError("records folders were collected with different templates")
    return ReplayCycles(
        template=T,
        paths=np.concatenate([p.paths for p in parts]),
        context_lengths=np.concatenate([p.context_lengths for p in parts]),
        node_depth=parts[0].node_depth,
    )
