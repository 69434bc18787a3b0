"""State features of the OGSPO stop policy (docs/DESIGN.md §5): one pure function of the tree drafted
so far, used online (the engine's stop hook) and offline (training on records); see `learn.policy`
for the table of features."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ogspo.engine.policies import CycleContext
from ogspo.engine.tree import DraftTree

FEATURES_VERSION = 2


FEATURE_NAMES: tuple[str, ...] = (
    "level", "log_nodes", "log_width", "max_cum_prob", "mean_cum_prob", "sum_cum_prob", "top1_cum_logq",
    "mean_entropy", "max_prob", "log_context", "recent_accept",
    "top2_cum_prob", "top4_cum_prob", "next_gain", "last_accept",
)


N_FEATURES = len(FEATURE_NAMES)


LOGQ_FLOOR = -30.0


EMA_ALPHA = 0.3


@dataclass(frozen=True)
class History:
    """What the request's earlier cycles say, handed to `state_features`: the EMA of tokens committed per
    earlier cycle (`recent_accept`) and the previous cycle's committed tokens (`last_accept`); both 0 on a
    request's first cycle."""

    recent_accept: float = 0.0
    last_accept: float = 0.0


def state_features(tree: DraftTree, level: int, *, context_length: int, history: History) -> np.ndarray:
    """Features of the state after drafting `level` (order `FEATURE_NAMES`). [F] float32.

    Nodes deeper than `level` are ignored, so one tree per cycle serves every level offline."""
    depths, parents = tree.depths, tree.parents
    n = len(depths)
    cum = np.zeros(n)  # [n] cumulative drafter log-prob (root 0), summed level by level
    chain = np.zeros(n, dtype=bool)  # [n] on the rank-0 chain from the root
    chain[0] = True
    top1 = 0.0
    at = np.zeros(0, dtype=np.int64)
    for l in range(1, level + 1):
        at = np.nonzero(depths == l)[0]  # [w_l]
        if len(at) == 0:
            raise ValueError(f"state_features: the tree has no node at level {l} (asked for level {level})")
        par = parents[at]
        cum[at] = cum[par] + tree.logq[at]
        chain[at] = chain[par] & (tree.ranks[at] == 0)
        on = at[chain[at]]
        if len(on):
            top1 = float(cum[on[0]])
    lc = np.maximum(cum[at], LOGQ_FLOOR)  # [w]
    p = np.exp(lc)  # [w]
    top = np.sort(p)[::-1]  # [w] the level's cumulative scores, best first
    q = np.exp(np.maximum(tree.logq[at], LOGQ_FLOOR))  # [w] each node's own conditional prob
    return np.array(
        [
            level,
            math.log1p(int(((depths >= 1) & (depths <= level)).sum())),
            math.log1p(len(at)),
            p.max(),
            p.mean(),
            p.sum(),
            max(top1, LOGQ_FLOOR),
            float(np.mean(tree.entropy[at])),
            math.exp(max(float(tree.logq[at].max()), LOGQ_FLOOR)),
            math.log1p(context_length),
            history.recent_accept,
            top[:2].sum(),
            top[:4].sum(),
            float(p @ q),
            history.last_accept,
        ],
        dtype=np.float32,
    )


class RecentAccept:
    """Online `History`: the EMA (alpha `EMA_ALPHA`, start 0) of tokens committed per earlier cycle of the
    request and the last cycle's tokens, from the committed context length at each cycle's start.
    `update` once per cycle, in order; the request's first cycle (`CycleContext.first_cycle`) starts
    both again at 0."""

    def __init__(self, *, alpha: float = EMA_ALPHA):
        self.alpha = alpha
        self.value = History()
        self.last_length: int | None = None  # context length at the previous cycle of this request

    def reset(self) -> None:
        self.value, self.last_length = History(), None

    def update(self, ctx: CycleContext) -> History:
        if ctx.first_cycle or self.last_length is None:
            self.value = History()
        else:
            last = float(ctx.context_length - self.last_length)
            self.value = History((1 - self.alpha) * self.value.recent_accept + self.alpha * last, last)
        self.last_length = ctx.context_length
        return self.value
