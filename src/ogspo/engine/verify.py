"""Verification of a draft tree against the target's next-token distributions.

Greedy (temperature 0): a node matches when its token is the target's argmax at its parent; the
accepted path is the deepest chain of matches from the root; the bonus token is the argmax at
the end of that path.

Stochastic (temperature > 0): recursive rejection sampling over ranked siblings. Draft children
are the drafter's deterministic top-ranked tokens, i.e. point-mass proposals, so sibling i is
accepted with probability p_res(x_i), where p_res is the target distribution with the rejected
siblings' tokens removed and renormalised; when every child is rejected the bonus token is drawn
from the final residual. This returns a token distributed exactly as the (warped) target
distribution whatever the drafter proposes. Using the drafter's q in the ratio would only be
lossless for children *sampled* from q, which top-k children are not.

Random numbers come from a per-cycle seed: U[depth, rank] decides sibling `rank` of the active
node at `depth`, B[depth] draws the bonus there. Only the active (accepted) node at each depth
consumes numbers, so the same seed replays the same path, and for any left- and ancestor-closed
sub-structure the accepted path is the longest prefix of the full tree's path inside it.

Both rules only ever read the target's row of a node on the accepted path (the root, then each
accepted node): that is what lets `verify_path` ask for the rows one at a time, forwarding each
node only once its parent accepted it (the engine's `verify="path"`), and reach the same verdict
as a forward over the whole tree. Where a tree forward costs many one-row steps (a CPU past its
roofline) and few nodes are accepted, that is the cheaper way to learn a large tree's outcome.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .tree import DraftTree, children_lists

MAX_DEPTH = 64  # rows of the per-cycle uniform table
MAX_RANK = 64  # columns of the per-cycle uniform table


@dataclass
class CycleRandom:
    """The random numbers of one cycle, fixed by its seed."""

    accept: np.ndarray  # [MAX_DEPTH + 1, MAX_RANK] uniforms deciding sibling acceptance
    bonus: np.ndarray  # [MAX_DEPTH + 1] uniforms drawing the bonus token

    @classmethod
    def from_seed(cls, seed: int) -> "CycleRandom":
        rng = np.random.Generator(np.random.Philox(int(seed) & (2**63 - 1)))
        return cls(accept=rng.random((MAX_DEPTH + 1, MAX_RANK)), bonus=rng.random(MAX_DEPTH + 1))


def cycle_seed(request_seed: int, cycle: int) -> int:
    """Seed of cycle `cycle` of a request: a fixed, collision-resistant mix of the two."""
    return int(np.random.SeedSequence([int(request_seed) & (2**32 - 1),
                                       int(cycle)]).generate_state(2, np.uint32).view(np.uint64)[0] >> 1)


@dataclass
class Verdict:
    path: list[int]  # accepted node indices, root first (root always accepted)
    bonus: int  # token sampled from the target at the end of the path
    matches: np.ndarray  # [n] bool: node accepted (T>0) / node matches the target argmax at its parent (T=0)
    rows: np.ndarray | None = None  # nodes whose target row was computed, in order (None: every node, a tree forward)


def target_probs(logits: torch.Tensor, *, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Target sampling distribution per row: softmax(logits / T), restricted to the top-p nucleus. float64."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        keep = (sorted_p.cumsum(-1) - sorted_p) < top_p  # keep tokens until the mass reaches top_p
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def verify_greedy(tree: DraftTree, logits: torch.Tensor) -> Verdict:
    """Greedy verification: logits [n, vocab], one row per tree node."""
    argmax = logits.argmax(dim=-1).cpu().numpy()  # [n] (the argmax runs where the logits are)
    parents = tree.parents
    matches = np.zeros(len(tree), dtype=bool)
    matches[1:] = tree.tokens[1:] == argmax[parents[1:]]
    ok = matches.copy()
    ok[0] = True
    for i in range(1, len(tree)):  # parents come first, so ok[parent] is final
        ok[i] &= ok[parents[i]]
    # at temperature 0 siblings carry distinct tokens: at most one accepted node per depth
    deepest = int(np.nonzero(ok)[0][-1])
    path = [deepest]
    while parents[path[-1]] >= 0:
        path.append(int(parents[path[-1]]))
    path.reverse()
    return Verdict(path=path, bonus=int(argmax[deepest]), matches=matches)


def sample_inverse_cdf(p: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from probability vector p with uniform u."""
    cdf = p.cumsum(0)
    idx = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype, device=cdf.device)).item())
    return min(idx, p.shape[0] - 1)


def verify_stochastic(
    tree: DraftTree, logits: torch.Tensor, rand: CycleRandom, *, temperature: float, top_p: float = 1.0
) -> Verdict:
    """Recursive rejection sampling over ranked siblings with point-mass proposals (lossless)."""
    verdict = _walk_stochastic(tree, lambda node: logits[node], rand, temperature=temperature, top_p=top_p)
    verdict.rows = None
    return verdict


def verify_path(tree: DraftTree, row: Callable[[int], torch.Tensor], rand: CycleRandom | None, *, temperature: float,
                top_p: float = 1.0) -> Verdict:
    """The verdict of `verify_greedy` (T=0) or `verify_stochastic` (T>0) from the target rows of the
    accepted path alone: `row(node)` [vocab] is called once per path node, root first, each after its
    parent accepted it (so it may run the forward then). `matches` is decided for the children of
    path nodes (T=0: False elsewhere, undecided); `rows` lists the nodes asked for."""
    if temperature > 0:
        if rand is None:
            raise ValueError("stochastic verification needs the cycle's random numbers")
        return _walk_stochastic(tree, row, rand, temperature=temperature, top_p=top_p)
    kids = children_lists(tree.parents, tree.ranks)
    matches = np.zeros(len(tree), dtype=bool)
    path, cur = [0], 0
    while True:
        best = int(row(cur).argmax())
        accepted = -1
        for child in kids[cur]:
            matches[child] = int(tree.tokens[child]) == best
            if matches[child] and accepted < 0:  # siblings carry distinct tokens at T=0; the first wins regardless
                accepted = child
        if accepted < 0:
            return Verdict(path=path, bonus=best, matches=matches, rows=np.asarray(path, dtype=np.int64))
        path.append(accepted)
        cur = accepted


def _walk_stochastic(tree: DraftTree, row: Callable[[int], torch.Tensor], rand: CycleRandom, *, temperature: float,
                     top_p: float) -> Verdict:
    kids = children_lists(tree.parents, tree.ranks)
    matches = np.zeros(len(tree), dtype=bool)
    path = [0]
    cur = 0
    while True:
        # [V] on the CPU: one copy, then scalar reads
        p = target_probs(row(cur)[None].cpu(), temperature=temperature, top_p=top_p)[0]
        depth = int(tree.depths[cur])
        accepted = -1
        for child in kids[cur]:
            x = int(tree.tokens[child])
            mass = float(p.sum())
            if rand.accept[depth, int(tree.ranks[child])] * mass < float(p[x]):
                accepted = child
                break
            p[x] = 0.0  # residual: drop the rejected token, renormalisation is implicit
        if accepted < 0:
            return Verdict(path=path, bonus=sample_inverse_cdf(p, rand.bonus[depth]), matches=matches,
                           rows=np.asarray(path, dtype=np.int64))
        matches[accepted] = True
        path.append(accepted)
        cur = accepted
