"""A chain with a confidence stop, chosen on posterior records for another program's measured costs.

llama.cpp's EAGLE-3 path (`--spec-type draft-eagle3`, common/speculative.cpp) drafts one chain per
cycle: the head's top-1 token, level after level, until the top-1 probability falls below
`--spec-draft-p-min P` or `--spec-draft-n-max N` tokens are drafted; the target verifies the chain
and what it committed in one forward of d + 1 rows. That is a structure (a chain of depth N) and a
stop policy (a threshold on the head's confidence) of the kind OGSPO optimises, so it is chosen the
same way: replayed on the records, priced with the program's own costs.

The records' template holds the chain: its rank-0 path (nodes "0", "0.0", ...), with the head's
log-probability `logq` of every node and each cycle's accepted template path. For cycle c, with q_ck
the head's probability of the depth-k chain node and k_c the number of leading chain nodes accepted:

    d_c = min(N, (first k with q_ck < P) - 1)        tokens drafted
    L_c = d_c if d_c = N else d_c + 1                 head passes while drafting (the level that fell
                                                      below P was computed: it is how P is seen)
    A_c = min(d_c, k_c) + 1                           tokens committed (T = 0)
    t_c = t_verify(d_c + 1) + (L_c + 1) t_level + t_other

(the extra head pass is the catch-up: the head reads the verified rows' features before drafting
again). J(N, P) = sum A_c / sum t_c against autoregressive decoding's 1 / t_ar; the choice is "off"
(plain decoding) when no (N, P) beats it.

Two approximations, both stated where the choice is reported: llama.cpp's P is the top-1 probability
renormalised over the head's top 10 tokens, q_ck is over the whole draft vocabulary (q_ck <= the
renormalised value, so the chosen P stops no earlier than replayed); and a head pass costs the same
whatever rows it reads (one row while drafting, d + 1 in the catch-up), which llama.cpp's timings
(`fit_chain_costs`) fold into t_level and t_other.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ogspo.artifacts.records import Records, template_index
from ogspo.engine.tree import Structure
from ogspo.offline.replay import prefix_lengths, replay_cycles, structure_mask, template_cum_logq

P_GRID = tuple(round(0.05 * i, 2) for i in range(20))  # 0.0 .. 0.95: p_min values tried


@dataclass(frozen=True)
class ChainCycles:
    """The records' chain, per cycle: head probabilities and how many leading nodes were accepted."""

    q: np.ndarray  # [C, K] float64 head probability of the depth-k chain node (k = 1..K)
    accepted: np.ndarray  # [C] int64 leading chain nodes on the accepted path (0..K)
    groups: np.ndarray  # [C] str, the workload of each cycle (request ids are "workload/prompt")

    @property
    def depth(self) -> int:
        return self.q.shape[1]


def chain_cycles(records: Records) -> ChainCycles:
    """The template's rank-0 chain out of `records` (T = 0 records: `accepted_tnodes` is then the
    greedy-matching path). ValueError when the template has no chain of depth >= 1."""
    index = template_index(records.template)
    chain, path = [], ()
    while (path := (*path, 0)) in index:
        chain.append(path)
    if not chain:
        raise ValueError("records template has no drafted node: no chain to replay")
    cum = template_cum_logq(records)[:, [0, *(index[p] for p in chain)]]  # [C, K + 1]
    if np.isnan(cum).any():
        raise ValueError("records lack a chain node's log-probability in some cycle (every cycle drafts the whole template)")
    mask = structure_mask(Structure(chain), records.template)
    accepted = prefix_lengths(mask[None], replay_cycles(records).paths)[0]  # [C] leading chain nodes accepted
    groups = np.array([r.split("/", 1)[0] for r in records.cycles["request_id"].to_list()])
    return ChainCycles(q=np.exp(np.diff(cum, axis=1)), accepted=accepted, groups=groups)


@dataclass(frozen=True)
class ChainCosts:
    """A program's seconds: a target forward of n rows (`verify[n - 1]`), a head pass, the rest of a
    speculative cycle, and one autoregressive token."""

    verify: np.ndarray  # [R] seconds of a target forward of 1..R rows at the typical context
    level: float
    other: float
    ar: float

    def cycle_seconds(self, drafted: np.ndarray, passes: np.ndarray) -> np.ndarray:
        if int(drafted.max(initial=0)) + 1 > len(self.verify):
            raise ValueError(f"verify costs cover {len(self.verify)} rows, a cycle needs {int(drafted.max()) + 1}")
        return self.verify[drafted] + (passes + 1) * self.level + self.other


def fit_chain_costs(verify: np.ndarray, runs: list[tuple[int, float]], ar: float) -> ChainCosts:
    """`level` and `other` from measured speculative runs without a stop (p_min 0): (N, seconds per
    cycle) pairs, each a cycle of t_verify(N + 1) + (N + 1) t_level + t_other. Least squares over at
    least two distinct N; both clipped at 0 (a negative one means the runs were too noisy to split)."""
    ns = sorted({n for n, _ in runs})
    if len(ns) < 2:
        raise ValueError(f"fit_chain_costs needs runs at two chain lengths at least, got {ns}")
    A = np.array([[n + 1.0, 1.0] for n, _ in runs])
    y = np.array([s - verify[n] for n, s in runs])
    (level, other), *_ = np.linalg.lstsq(A, y, rcond=None)
    return ChainCosts(verify=np.asarray(verify, dtype=np.float64), level=max(float(level), 0.0),
                      other=max(float(other), 0.0), ar=float(ar))


@dataclass(frozen=True)
class ChainChoice:
    n_max: int  # 0: off (plain decoding)
    p_min: float
    tokens_per_second: float  # replayed J of the choice (AR's when off)
    ar_tokens_per_second: float
    drafted_per_cycle: float  # replayed, under the choice
    acceptance: float  # replayed accepted / drafted under the choice

    @property
    def off(self) -> bool:
        return self.n_max == 0

    def to_dict(self) -> dict:
        return {**self.__dict__, "off": self.off}


def replay_chain(cycles: ChainCycles, costs: ChainCosts, n_max: int, p_min: float) -> tuple[float, float, float]:
    """(J tokens/s, drafted per cycle, accepted / drafted) of chain N = n_max with stop P = p_min."""
    if not 1 <= n_max <= cycles.depth:
        raise ValueError(f"n_max {n_max} outside the records' chain depth 1..{cycles.depth}")
    below = cycles.q[:, :n_max] < p_min  # [C, N]
    first_below = np.where(below.any(1), below.argmax(1), n_max)  # [C] drafted tokens d_c
    drafted = first_below.astype(np.int64)
    passes = np.where(drafted == n_max, drafted, drafted + 1)
    committed = np.minimum(drafted, cycles.accepted) + 1
    seconds = costs.cycle_seconds(drafted, passes)
    total = drafted.sum()
    return float(committed.sum() / seconds.sum()), float(drafted.mean()), float((committed - 1).sum() / max(total, 1))


def choose_chain(cycles: ChainCycles, costs: ChainCosts, *, max_n: int | None = None,
                 p_grid: tuple[float, ...] = P_GRID) -> ChainChoice:
    """The (N, P) of the highest replayed J, or off when none beats autoregressive decoding."""
    ar = 1.0 / costs.ar
    best = ChainChoice(n_max=0, p_min=0.0, tokens_per_second=ar, ar_tokens_per_second=ar, drafted_per_cycle=0.0,
                       acceptance=0.0)
    top = min(cycles.depth, max_n or cycles.depth, len(costs.verify) - 1)
    for n in range(1, top + 1):
        for p in p_grid:
            j, d, a = replay_chain(cycles, costs, n, p)
            if j > best.tokens_per_second:
                best = ChainChoice(n_max=n, p_min=float(p), tokens_per_second=j, ar_tokens_per_second=ar,
                                   drafted_per_cycle=d, acceptance=a)
    return best


def subset(cycles: ChainCycles, group: str) -> ChainCycles:
    keep = cycles.groups == group
    if not keep.any():
        raise ValueError(f"no records cycles of '{group}' (groups: {sorted(set(cycles.groups))})")
    return ChainCycles(q=cycles.q[keep], accepted=cycles.accepted[keep], groups=cycles.groups[keep])
