"""GTO's objective (Group Tree Optimization, arXiv 2509.22134), in the terms of a draft tree.

A draft tree is the flat arrays the engine uses (`parents`, root 0, parents before children). For
each drafted node v, `p[v]` is the target's probability of v's token after v's root path (one
target forward over the tree with tree attention gives all of them).

- **Draft Tree Reward.** A root-to-leaf branch i with nodes v_1..v_n (depth order) is worth
  L_i = sum_j prod_{k<=j} p[v_k]: the expected number of its tokens the target accepts when it
  samples token by token (greedy acceptance has the same form with 0/1 probabilities). The tree's
  reward is the soft maximum over branches, r = (1/eta) log sum_i exp(eta L_i); sampling-free, and
  independent of sibling order.
- **Group advantages.** Positions are taken in groups of m adjacent ones; at each position one
  tree is drafted by the current head and one by the frozen reference head; R = r(T) - r(T_ref)
  and A = (R - mean(R)) / (std(R) + delta) within the group.
- **Clipped surrogate.** Along S_i, the longest root path of T_i the target accepts (l_i nodes),
  the length-normalised ratio s_i = exp((log M(S_i) - log M_ref(S_i)) / max(l_i, 1)); the loss is
  -(1/m) sum_i min(s_i A_i, clip(s_i, 1 - eps, 1 + eps) A_i), added to the token loss with weight
  omega.
"""

from __future__ import annotations

import numpy as np
import torch


def branch_values(parents: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(leaves, L): every leaf of the tree and the value L of its root-to-leaf branch.

    parents [n] (root 0 has -1, parents before children); p [n] target probability of each node's
    token after its root path (p[0], the root, is unused)."""
    n = len(parents)
    prefix = np.ones(n)  # [n] prod of p along the root path, root excluded (root: 1)
    value = np.zeros(n)  # [n] sum over the path's nodes of their prefix products
    for v in range(1, n):
        a = parents[v]
        prefix[v] = prefix[a] * p[v]
        value[v] = value[a] + prefix[v]
    has_child = np.zeros(n, dtype=bool)
    has_child[parents[1:]] = True
    leaves = np.nonzero(~has_child)[0]
    leaves = leaves[leaves > 0] if n > 1 else leaves
    return leaves, value[leaves]


def tree_reward(parents: np.ndarray, p: np.ndarray, *, eta: float = 1.0) -> float:
    """The Draft Tree Reward r = (1/eta) log sum_i exp(eta L_i) over root-to-leaf branches i; a tree
    of the root alone is worth 0 (nothing drafted: the cycle still commits its bonus token)."""
    if len(parents) <= 1:
        return 0.0
    _, L = branch_values(parents, p)
    z = eta * L
    top = z.max()
    return float((top + np.log(np.exp(z - top).sum())) / eta)


def group_advantages(rewards: torch.Tensor, reference: torch.Tensor, *, delta: float) -> torch.Tensor:
    """A = (R - mean R) / (std R + delta) with R = reward - reference reward, within each group.
    rewards, reference [G, m] -> [G, m]."""
    R = rewards - reference  # [G, m]
    return (R - R.mean(-1, keepdim=True)) / (R.std(-1, unbiased=False, keepdim=True) + delta)


def clipped_surrogate(logp: torch.Tensor, logp_ref: torch.Tensor, lengths: torch.Tensor, advantages: torch.Tensor,
                      *, eps: float) -> torch.Tensor:
    """GTO's loss -(1/m) sum_i min(s_i A_i, clip(s_i, 1-eps, 1+eps) A_i), averaged over groups.

    logp, logp_ref [G, m]: log-probability of the accepted path S_i under the current and the
    reference head (sum over its nodes); lengths [G, m] nodes on S_i; advantages [G, m] (no
    gradient flows into them)."""
    s = torch.exp((logp - logp_ref) / lengths.clamp(min=1))  # [G, m]
    a = advantages.detach()
    return -torch.minimum(s * a, s.clamp(1 - eps, 1 + eps) * a).mean()
