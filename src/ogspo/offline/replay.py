"""Replay of posterior verification records under any sub-structure (docs/DESIGN.md §3, §4).

For a left- and ancestor-closed S ⊆ T and a stop depth d, with the same random numbers, the path
accepted under S_{<=d} is the longest prefix of the T-path that lies in S_{<=d}, so

    A_c(S, d) = 1 + min(k_c(S), d),   k_c(S) = length of the longest prefix of cycle c's accepted
                                      T-path whose nodes are all in S (once one is outside, stop)
    t_c(S, d) = sum_{l<=d} t_draft(w_l(S)) + t_verify(|S_{<=d}| + 1, L_c) + t_fixed(|S_{<=d}| + 1) + t_catchup(A_c)

(t_fixed of an autoregressive step, and no catch-up, when S_{<=d} is empty: nothing was drafted.)

with w_l(S) the frontier width of level l (nodes of S at depth l-1 that have children in S).

Everything is vectorised: a cycle's accepted path is a row of template node ids (padded with an
id that is never in S), a structure is a boolean mask over T's node ids (root = 0), and the
prefix-in-S length of K structures x C cycles is one gather + cumprod.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ogspo.artifacts.latency import LatencyModel
from ogspo.artifacts.records import Records, template_index
from ogspo.engine.tree import (
    Structure,
    select_top_nodes,  # the engine's own rerank: replay and decoding agree
)


@dataclass
class ReplayCycles:
    """Records reduced to what replay needs."""

    template: Structure
    paths: np.ndarray  # [C, D] int64 accepted template node ids by depth, padded with `pad` (= |T| + 1)
    context_lengths: np.ndarray  # [C] float64
    node_depth: np.ndarray  # [|T| + 2] int64 depth of each template node id (root 0, pad = D + 1)

    @property
    def pad(self) -> int:
        return len(self.template) + 1


def replay_cycles(records: Records) -> ReplayCycles:
    T = records.template
    D = T.max_depth
    acc = records.cycles["accepted_tnodes"].to_list()
    C = len(acc)
    pad = len(T) + 1
    paths = np.full((C, D), pad, dtype=np.int64)  # [C, D]
    for c, p in enumerate(acc):
        paths[c, : len(p)] = p
    return ReplayCycles(
        template=T,
        paths=paths,
        context_lengths=records.cycles["context_length"].to_numpy().astype(np.float64),
        node_depth=_node_depths(T),
    )


def _node_depths(T: Structure) -> np.ndarray:
    return np.array([0] + [len(p) for p in T.to_list()] + [T.max_depth + 1], dtype=np.int64)


def structure_mask(S: Structure, T: Structure) -> np.ndarray:
    """Boolean mask over T's node ids (root 0 True, pad False). [|T| + 2]"""
    idx = template_index(T)
    mask = np.zeros(len(T) + 2, dtype=bool)
    mask[0] = True
    for p in S.paths:
        if p not in idx:
            raise ValueError(f"structure node {list(p)} is not in the template")
        mask[idx[p]] = True
    return mask


def prefix_lengths(masks: np.ndarray, paths: np.ndarray) -> np.ndarray:
    """k_c(S): longest prefix of each accepted path inside each structure. masks [K, N] bool, paths [C, D] -> [K, C]."""
    inside = masks[:, paths]  # [K, C, D]
    return np.cumprod(inside, axis=2, dtype=np.int8).sum(axis=2, dtype=np.int64)  # [K, C]


def accepted_lengths(masks: np.ndarray, paths: np.ndarray, depths: np.ndarray) -> np.ndarray:
    """A_c(S, d) = 1 + min(k_c(S), d). masks [K, N], paths [C, D], depths [K] or [K, C] -> [K, C]."""
    k = prefix_lengths(masks, paths)  # [K, C]
    d = np.asarray(depths)
    if d.ndim == 1:
        d = d[:, None]
    return 1 + np.minimum(k, d)


def level_profile(masks: np.ndarray, T: Structure) -> tuple[np.ndarray, np.ndarray]:
    """Per structure and level l = 1..D: frontier width w_l(S) and cumulative size |S_{<=l}|. Each [K, D]."""
    tl = T.to_list()
    D = T.max_depth
    idx = template_index(T)
    parent = np.array([0] + [idx[tuple(p[:-1])] for p in tl], dtype=np.int64)  # [|T|+1]
    depth = np.array([0] + [len(p) for p in tl], dtype=np.int64)
    m = masks[:, : len(tl) + 1]  # [K, |T|+1]
    K = m.shape[0]
    sizes = np.zeros((K, D), dtype=np.int64)
    widths = np.zeros((K, D), dtype=np.int64)
    for l in range(1, D + 1):
        at = depth == l
        sizes[:, l - 1] = m[:, at].sum(1)
        # frontier of level l: distinct parents (depth l-1) of S's nodes at depth l
        has_child = np.zeros((K, len(tl) + 1), dtype=bool)
        cols = np.nonzero(at)[0]
        np.logical_or.at(has_child.T, parent[cols], m[:, cols].T)
        widths[:, l - 1] = (has_child & (depth == l - 1)[None]).sum(1)
    return widths, np.cumsum(sizes, axis=1)


def cycle_times(masks: np.ndarray, T: Structure, depths: np.ndarray, context_lengths: np.ndarray,
                model: LatencyModel) -> np.ndarray:
    """t_c(S, d) from the latency model. masks [K, N], depths [K] or [K, C], context_lengths [C] -> [K, C]."""
    widths, cum = level_profile(masks, T)  # [K, D]
    K, D = widths.shape
    draft_cum = np.concatenate([np.zeros((K, 1)), np.cumsum(model.t_draft(widths), axis=1)], axis=1)  # [K, D+1]
    size_cum = np.concatenate([np.zeros((K, 1), dtype=np.int64), cum], axis=1)  # [K, D+1]
    d = np.asarray(depths)
    C = len(context_lengths)
    d = np.broadcast_to(d[:, None] if d.ndim == 1 else d, (K, C)).clip(0, D)  # [K, C]
    rows = np.arange(K)[:, None]
    n = size_cum[rows, d] + 1  # [K, C]
    return draft_cum[rows, d] + model.t_verify(n, np.asarray(context_lengths)[None, :]) + model.t_fixed(n)


@dataclass
class ReplayResult:
    accepted: np.ndarray  # [K, C] A_c(S, d)
    seconds: np.ndarray  # [K, C] t_c(S, d) (empty when no latency model was given)

    @property
    def throughput(self) -> np.ndarray:
        """J = sum_c A / sum_c t per structure. [K]"""
        return self.accepted.sum(1) / self.seconds.sum(1)


def replay(
    *, cycles: ReplayCycles, structures: list[Structure], depths, model: LatencyModel | None = None
) -> ReplayResult:
    """A_c and t_c of every (structure, stop depth) over every recorded cycle."""
    masks = np.stack([structure_mask(S, cycles.template) for S in structures])  # [K, N]
    acc = accepted_lengths(masks, cycles.paths, depths)
    secs = np.zeros((0, 0)) if model is None else (
        cycle_times(masks, cycles.template, depths, cycles.context_lengths, model) + model.t_catchup(acc))  # [K, C]
    return ReplayResult(accepted=acc, seconds=secs)


def template_cum_logq(records: Records) -> np.ndarray:
    """Every cycle's cumulative head log-probability of every template node (root 0 = 0). [C, |T| + 1];
    rows follow `records.cycles` (what `replay_cycles` reads)."""
    cyc = records.cycles
    row = {(r, c): i for i, (r, c) in enumerate(zip(cyc["request_id"].to_list(), cyc["cycle"].to_list()))}
    out = np.full((cyc.height, len(records.template) + 1), np.nan)
    out[:, 0] = 0.0
    n = records.nodes
    for r, c, t, v in zip(n["request_id"].to_list(), n["cycle"].to_list(), n["tnode"].to_list(), n["cum_logq"].to_list()):
        out[row[(r, c)], t] = v
    return out


def replay_dynamic(*, cycles: ReplayCycles, cum_logq: np.ndarray, total_tokens: int, depth: int, top_k: int,
                   model: LatencyModel) -> ReplayResult:
    """A_c and t_c of EAGLE-3's dynamic tree [total_tokens, depth, top_k] (`engine.policies.DynamicTree`,
    SGLang's three settings) on every recorded cycle: per cycle, the template nodes it would draft
    (the top_k children of each of the top_k frontier nodes, level by level) and verify (the best
    `total_tokens` of them by cumulative log-prob). ValueError when the template lacks a child the
    tree would draft (a level narrower than top_k). Returns [1, C] arrays."""
    T = cycles.template
    idx = template_index(T)
    paths = [()] + [tuple(p) for p in T.to_list()]
    C = cum_logq.shape[0]
    masks = np.zeros((C, len(T) + 2), dtype=bool)
    widths = np.zeros(depth, dtype=np.int64)
    sizes = np.zeros(C, dtype=np.int64)
    for c in range(C):
        drafted, frontier = [0], [0]
        for level in range(depth):
            new = []
            for f in frontier:
                for r in range(top_k):
                    child = idx.get((*paths[f], r))
                    if child is None:
                        raise ValueError(f"the records template has no node {list((*paths[f], r))}: it cannot replay a dynamic "
                                         f"tree of top_k {top_k} to depth {depth} (template level sizes {T.level_sizes()})")
                    new.append(child)
            widths[level] = len(frontier)
            drafted += new
            frontier = sorted(sorted(new, key=lambda v: -cum_logq[c, v])[:top_k])
        sub = np.array(drafted)
        if np.isnan(cum_logq[c, sub]).any():
            raise ValueError(f"records cycle {c} lacks the log-probability of a template node (every cycle drafts the template)")
        parents = np.array([0] + [drafted.index(idx[paths[v][:-1]]) for v in drafted[1:]])
        depths = np.array([len(paths[v]) for v in drafted])
        keep = sub[select_top_nodes(parents, depths, cum_logq[c, sub], total_tokens)]
        masks[c, keep] = True
        sizes[c] = len(keep)
    k = np.cumprod(masks[np.arange(C)[:, None], cycles.paths], axis=1, dtype=np.int8).sum(axis=1, dtype=np.int64)  # [C]
    acc = 1 + k
    secs = model.t_draft(widths).sum() + model.t_verify(sizes, cycles.context_lengths) + model.t_fixed(sizes) + \
        model.t_catchup(acc)  # [C]; sizes: verified nodes, root included
    return ReplayResult(accepted=acc[None], seconds=np.asarray(secs, dtype=np.float64)[None])
