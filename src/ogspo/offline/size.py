"""The size decision offline (docs/DESIGN.md §5 "Size decision"): replay, the extended oracle, fitting.

With the structure S fixed, a cycle that stopped drafting at depth d may verify any top-V prefix of
the confidence order of S_{<=d} (`engine.tree.confidence_order`: an ancestor- and left-closed
subset). With the same random numbers, the path accepted under such a subset is the longest prefix
of the cycle's accepted T-path inside it (docs/DESIGN.md §3), so the records answer every (d, V):

    A_c(d, V) = 1 + #{accepted-path nodes of S among the top V of S_{<=d}}
    t_c(d, V) = sum_{l<=d} t_draft(w_l(S)) + t_verify(V + 1, L_c) + t_fixed(V + 1)

`size_tables` builds both as [C, D, N + 1] arrays (V = 0 .. N = |S|; V > |S_{<=d}| is illegal and
masked). `extended_bound` is the oracle over the same action space (per-cycle best (d, V), exact
Dinkelbach), so it bounds every stop + size policy over S. `fit_size_rule` fits the decode-time rule
(`artifacts.size_rule.SizeRule`): a monotone calibration of cumulative drafter log-prob to
P(on the accepted path), and lambda by Dinkelbach over the records' cycles at the policy's stop depths.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ogspo.artifacts.latency import LatencyModel
from ogspo.artifacts.records import Records, path_str
from ogspo.artifacts.size_rule import SizeRule
from ogspo.engine.tree import Structure
from ogspo.offline.replay import level_profile, structure_mask


@dataclass
class SizeData:
    """Record cycles reduced to what the size decision needs, for one structure S."""

    structure: Structure
    cum: np.ndarray  # [C, N] cumulative drafter log-prob of S's nodes, in drafting (breadth-first) order
    depths: np.ndarray  # [N] depth of each node of S, same order
    on_path: np.ndarray  # [C, N] bool: the node is on the cycle's accepted T-path
    context_lengths: np.ndarray  # [C]
    requests: np.ndarray  # [C] request id per cycle
    order: np.ndarray  # [C, N] node columns in confidence order (most confident first)

    def subset(self, rows: np.ndarray) -> "SizeData":
        return SizeData(self.structure, self.cum[rows], self.depths, self.on_path[rows], self.context_lengths[rows],
                        self.requests[rows], self.order[rows])

    def level_sizes(self) -> np.ndarray:
        """|S_{<=d}| for d = 1 .. D. [D]"""
        return np.array([int((self.depths <= d).sum()) for d in range(1, int(self.depths.max()) + 1)])


def size_data(records: Records, structure: Structure) -> SizeData:
    """`SizeData` of every record cycle under S (a sub-structure of the records template)."""
    S, T = structure, records.template
    if len(S) == 0:
        raise ValueError("the size decision needs a structure with nodes")
    missing = [list(p) for p in S.paths if p not in T]
    if missing:
        raise ValueError(f"structure node {missing[0]} is not in the records template")
    keep = [path_str(p) for p in S.paths]
    nodes = records.nodes.filter(records.nodes["rank_path"].is_in(keep)).sort(["request_id", "cycle", "node"])
    cyc = records.cycles
    C, N = cyc.height, len(S)
    if nodes.height != C * N:
        raise ValueError(f"records hold {nodes.height} rows of the structure's nodes, expected {C} cycles x {N} "
                         "(every cycle drafts the whole template)")
    key = cyc.select("request_id", "cycle").with_row_index("row")
    nodes = nodes.join(key, on=["request_id", "cycle"], how="left").sort(["row", "node"])
    cum = nodes["cum_logq"].to_numpy().reshape(C, N)
    depths = nodes["depth"].to_numpy()[:N].astype(np.int64)
    tnodes = nodes["tnode"].to_numpy().reshape(C, N)
    accepted = cyc["accepted_tnodes"].to_list()
    on_path = np.zeros((C, N), dtype=bool)
    for c, path in enumerate(accepted):
        on_path[c] = np.isin(tnodes[c], np.asarray(path, dtype=np.int64))
    idx = np.broadcast_to(np.arange(N), (C, N))
    order = np.lexsort((idx, np.broadcast_to(depths, (C, N)), -cum), axis=1)  # [C, N] as confidence_order
    return SizeData(S, cum, depths, on_path, cyc["context_length"].to_numpy().astype(np.float64),
                    np.asarray(cyc["request_id"].to_list(), dtype=object), order)


def size_tables(data: SizeData, latency: LatencyModel) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A_c(d, V) and t_c(d, V) for d = 1..D (index d - 1) and V = 0..N, and the legality mask. Each [C, D, N + 1]."""
    C, N = data.cum.shape
    D = int(data.depths.max())
    on_ord = np.take_along_axis(data.on_path, data.order, axis=1)  # [C, N]
    dep_ord = data.depths[data.order]  # [C, N]
    A = np.ones((C, D, N + 1))
    legal = np.zeros((C, D, N + 1), dtype=bool)
    for d in range(1, D + 1):
        m = dep_ord <= d  # [C, N], n_d per row
        n_d = int(m[0].sum())
        filtered = on_ord[m].reshape(C, n_d)  # [C, n_d] on-path flags of S_{<=d} in confidence order
        A[:, d - 1, 1 : n_d + 1] += np.cumsum(filtered, axis=1)
        A[:, d - 1, n_d + 1 :] = np.nan
        legal[:, d - 1, : n_d + 1] = True
    widths, _ = level_profile(structure_mask(data.structure, data.structure)[None], data.structure)  # [1, D]
    draft_cum = np.cumsum(latency.t_draft(widths[0]))  # [D]
    verify = latency.t_verify(np.arange(1, N + 2)[None, :], data.context_lengths[:, None])  # [C, N + 1]
    fixed = latency.t_fixed(np.arange(1, N + 2), drafted=True)  # [N + 1] every option here drafted first
    t = draft_cum[None, :, None] + verify[:, None, :] + fixed[None, None, :]  # [C, D, N + 1]
    t = t + latency.t_catchup(np.where(legal, A, 1.0))  # the drafter re-encodes what the cycle commits
    return A, t, legal


def extended_bound(A: np.ndarray, t: np.ndarray, legal: np.ndarray, tol: float = 1e-12) -> tuple[np.ndarray, float]:
    """Per-cycle posterior-optimal (d, V) over the legal options, exact Dinkelbach: max sum A / sum t.
    A, t, legal [C, D, V] -> (choice [C, 2] as (d, V) with d 1-based, J)."""
    C, D, W = A.shape
    a = np.where(legal, A, 0.0).reshape(C, D * W)
    s = np.where(legal, t, np.inf).reshape(C, D * W)
    rows = np.arange(C)
    pick = np.argmin(s, axis=1)  # start: the cheapest legal option
    lam = a[rows, pick].sum() / s[rows, pick].sum()
    while True:
        pick = np.argmax(np.where(np.isfinite(s), a - lam * s, -np.inf), axis=1)
        new = a[rows, pick].sum() / s[rows, pick].sum()
        if new <= lam * (1 + tol):
            break
        lam = new
    d, v = np.divmod(pick, W)
    return np.stack([d + 1, v], axis=1), float(max(new, lam))


# ---------------------------------------------------------------- the decode-time rule


def isotonic(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Pool-adjacent-violators: the non-decreasing fit of y with weights w. [k] -> [k]"""
    vals, wts, counts = [], [], []
    for yi, wi in zip(y.astype(np.float64), w.astype(np.float64)):
        vals.append(yi), wts.append(wi), counts.append(1)
        while len(vals) > 1 and vals[-2] > vals[-1]:
            wsum = wts[-2] + wts[-1]
            v = (vals[-2] * wts[-2] + vals[-1] * wts[-1]) / wsum
            c = counts[-2] + counts[-1]
            del vals[-1], wts[-1], counts[-1]
            vals[-1], wts[-1], counts[-1] = v, wsum, c
    return np.repeat(vals, counts)


def fit_calibration(cum: np.ndarray, on_path: np.ndarray, *, bins: int = 16) -> tuple[list[float], list[float]]:
    """Monotone P(on the accepted path | cumulative log-prob): quantile bins, then isotonic regression."""
    x = np.asarray(cum, dtype=np.float64).ravel()
    y = np.asarray(on_path, dtype=np.float64).ravel()
    edges = np.unique(np.quantile(x, np.linspace(0, 1, bins + 1)[1:-1]))
    b = np.searchsorted(edges, x, side="right")
    count = np.bincount(b, minlength=len(edges) + 1).astype(np.float64)
    hits = np.bincount(b, weights=y, minlength=len(edges) + 1)
    mean = np.where(count > 0, hits / np.maximum(count, 1), 0.0)
    probs = isotonic(mean, np.maximum(count, 1e-9))
    return [float(e) for e in edges], [float(p) for p in probs]


def rule_sizes(rule: SizeRule, data: SizeData, depths: np.ndarray) -> np.ndarray:
    """V the rule chooses in each cycle after stopping at `depths` (1-based), as it does at decode time. [C]"""
    C = len(depths)
    out = np.zeros(C, dtype=np.int64)
    dep_ord = data.depths[data.order]  # [C, N]
    cum_ord = np.take_along_axis(data.cum, data.order, axis=1)  # [C, N]
    for c in range(C):
        cums = cum_ord[c][dep_ord[c] <= depths[c]]
        out[c] = rule.choose(cums, data.context_lengths[c])
    return out


def throughput_at(A: np.ndarray, t: np.ndarray, depths: np.ndarray, sizes: np.ndarray) -> float:
    rows = np.arange(len(depths))
    return float(A[rows, depths - 1, sizes].sum() / t[rows, depths - 1, sizes].sum())


def full_sizes(data: SizeData, depths: np.ndarray) -> np.ndarray:
    """V = |S_{<=d}| (verify everything drafted) for each cycle's stop depth. [C]"""
    return data.level_sizes()[depths - 1]


def fit_size_rule(*, data: SizeData, depths: np.ndarray, latency: LatencyModel, lam: float, bins: int = 16,
                  rounds: int = 10, meta: dict | None = None) -> SizeRule:
    """The size rule on these cycles at the policy's stop depths: calibration of the drafter's cumulative
    log-prob, verify costs from the latency model, lambda by Dinkelbach from `lam`."""
    edges, probs = fit_calibration(data.cum, data.on_path, bins=bins)
    N = data.cum.shape[1]
    n = np.arange(1, N + 2)
    a = latency.t_verify(n, 0.0) + latency.fixed_offset(n, drafted=True)  # the per-node overhead is a verify cost too
    b = latency.t_verify(n, 1.0) - latency.t_verify(n, 0.0)
    A, t, _ = size_tables(data, latency)
    rule = SizeRule(lam=float(lam), edges=edges, probs=probs, verify_intercept=[float(x) for x in a],
                    verify_slope=[float(x) for x in b], meta=dict(meta or {}))
    # Dinkelbach on lambda; the rule maximises calibrated (not posterior) gains, so J need not rise: keep the best
    best_J, best_lam = -np.inf, rule.lam
    for _ in range(rounds):
        J = throughput_at(A, t, depths, rule_sizes(rule, data, depths))
        if J > best_J:
            best_J, best_lam = J, rule.lam
        if abs(J - rule.lam) <= 1e-9 * rule.lam:
            break
        rule.lam = J
    rule.lam = best_lam
    return rule
