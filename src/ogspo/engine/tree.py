"""Draft trees as flat arrays, and the pure functions built on them.

A tree holds node 0, the *root* (the last committed token, whose children are the first drafted
level), followed by drafted nodes in breadth-first order: a node's parent always comes before it.
Every node has a token, a parent (-1 for the root), a depth (root 0), a rank among its siblings
(0 = the drafter's best) and the drafter's log-probability of its token.

Nodes are named by *rank paths* (docs/DESIGN.md §2): the ranks from depth 1 down to the node.
A *structure* is a set of rank paths that is ancestor-closed and left-closed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

RankPath = tuple[int, ...]


@dataclass
class DraftTree:
    """A draft tree under construction or ready for verification (flat, breadth-first arrays)."""

    tokens: np.ndarray  # [n] int64; tokens[0] is the root token
    parents: np.ndarray  # [n] int64; parents[0] == -1
    depths: np.ndarray  # [n] int64
    ranks: np.ndarray  # [n] int64, rank among siblings
    logq: np.ndarray  # [n] float64, drafter log-prob of the token given its parent (0 at root)
    entropy: np.ndarray = field(default_factory=lambda: np.zeros(1))  # [n] drafter entropy at node's parent

    @classmethod
    def from_root(cls, token: int) -> "DraftTree":
        z = np.zeros(1, dtype=np.int64)
        return cls(
            tokens=np.array([token], dtype=np.int64),
            parents=np.array([-1], dtype=np.int64),
            depths=z.copy(),
            ranks=z.copy(),
            logq=np.zeros(1),
            entropy=np.zeros(1),
        )

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        return int(self.depths[-1])

    @property
    def cum_logq(self) -> np.ndarray:
        return cumulative_logq(self.parents, self.logq)

    def add_children(
        self,
        *,
        parents: np.ndarray,
        tokens: np.ndarray,
        ranks: np.ndarray,
        logq: np.ndarray,
        entropy: np.ndarray,
    ) -> np.ndarray:
        """Append one level of children; returns their node indices."""
        start = len(self.tokens)
        parents = np.asarray(parents, dtype=np.int64)
        self.tokens = np.concatenate([self.tokens, np.asarray(tokens, dtype=np.int64)])
        self.parents = np.concatenate([self.parents, parents])
        self.depths = np.concatenate([self.depths, self.depths[parents] + 1])
        self.ranks = np.concatenate([self.ranks, np.asarray(ranks, dtype=np.int64)])
        self.logq = np.concatenate([self.logq, np.asarray(logq, dtype=np.float64)])
        self.entropy = np.concatenate([self.entropy, np.asarray(entropy, dtype=np.float64)])
        return np.arange(start, len(self.tokens))

    def subset(self, keep: np.ndarray) -> tuple["DraftTree", np.ndarray]:
        """The sub-tree on the (ancestor-closed) node set `keep`; also returns the kept source indices."""
        keep = np.unique(np.asarray(keep, dtype=np.int64))  # sorted: parents stay before children
        if keep[0] != 0:
            raise ValueError("a sub-tree must keep the root")
        remap = np.full(len(self.tokens), -1, dtype=np.int64)
        remap[keep] = np.arange(len(keep))
        new_parents = np.where(self.parents[keep] >= 0, remap[np.maximum(self.parents[keep], 0)], -1)
        if (new_parents[1:] < 0).any():
            raise ValueError("a sub-tree must be ancestor-closed")
        # breadth-first order: sort kept nodes by depth (stable keeps parent-before-child)
        order = np.argsort(self.depths[keep], kind="stable")
        keep = keep[order]
        remap[keep] = np.arange(len(keep))
        new_parents = np.where(self.parents[keep] >= 0, remap[np.maximum(self.parents[keep], 0)], -1)
        sub = DraftTree(
            tokens=self.tokens[keep],
            parents=new_parents,
            depths=self.depths[keep],
            ranks=self.ranks[keep],
            logq=self.logq[keep],
            entropy=self.entropy[keep],
        )
        return sub, keep


def cumulative_logq(parents: np.ndarray, logq: np.ndarray) -> np.ndarray:
    """Sum of drafter log-probs from the root down to each node (parents come first)."""
    cum = np.array(logq, dtype=np.float64)
    for i in range(1, len(cum)):
        cum[i] += cum[parents[i]]
    return cum


def confidence_order(cum: np.ndarray, depths: np.ndarray) -> np.ndarray:
    """Drafted nodes (root excluded, as indices >= 1) from most to least confident: by cumulative
    log-prob, ties toward shallower nodes, then toward the earlier node (parents and lower ranks come
    first in drafting order). Log-probs are <= 0 and siblings are drafted best first, so every prefix
    of this order is ancestor- and left-closed: the top-V nodes are a tree one can verify."""
    idx = np.arange(1, len(cum))
    return np.lexsort((idx, depths[1:], -np.asarray(cum)[1:])) + 1  # [n - 1]


def ancestor_matrix(parents: np.ndarray, depths: np.ndarray) -> np.ndarray:
    """anc[i, j] is True when node j is node i or one of its ancestors. [n, n] bool.

    Vectorised by level: a node's row is its parent's row plus itself.
    """
    n = len(parents)
    anc = np.eye(n, dtype=bool)
    for d in range(1, int(depths.max(initial=0)) + 1):
        level = np.nonzero(depths == d)[0]
        anc[level] |= anc[parents[level]]
    return anc


def tree_positions(depths: np.ndarray, context_length: int) -> np.ndarray:
    """Position ids of tree nodes: the root sits at `context_length`, a node at root + depth."""
    return context_length + np.asarray(depths, dtype=np.int64)


def node_rank_paths(parents: np.ndarray, ranks: np.ndarray) -> list[RankPath]:
    """Rank path of every node (the root's is the empty tuple)."""
    paths: list[RankPath] = [()]
    for i in range(1, len(parents)):
        paths.append(paths[parents[i]] + (int(ranks[i]),))
    return paths


def leaf_paths(parents: np.ndarray) -> list[list[int]]:
    """Node indices from the root to each leaf, leaves in index order."""
    n = len(parents)
    has_child = np.zeros(n, dtype=bool)
    has_child[parents[1:]] = True
    out = []
    for leaf in np.nonzero(~has_child)[0]:
        path = [int(leaf)]
        while parents[path[-1]] >= 0:
            path.append(int(parents[path[-1]]))
        out.append(path[::-1])
    return out


def children_lists(parents: np.ndarray, ranks: np.ndarray) -> list[list[int]]:
    """Children of every node, ordered by rank."""
    kids: list[list[int]] = [[] for _ in range(len(parents))]
    for i in range(1, len(parents)):
        kids[parents[i]].append(i)
    for k in kids:
        k.sort(key=lambda c: ranks[c])
    return kids


class Structure:
    """A shared nested draft structure: an ancestor- and left-closed set of rank paths."""

    def __init__(self, paths):
        self.paths: frozenset[RankPath] = frozenset(tuple(int(r) for r in p) for p in paths)
        validate_structure(self.paths)
        self.max_depth = max((len(p) for p in self.paths), default=0)
        # number of children per parent path: the widest rank + 1 (left-closed)
        self.n_children: dict[RankPath, int] = {}
        for p in self.paths:
            self.n_children[p[:-1]] = max(self.n_children.get(p[:-1], 0), p[-1] + 1)

    def __len__(self) -> int:
        return len(self.paths)

    def __contains__(self, path) -> bool:
        return tuple(path) in self.paths

    def __repr__(self) -> str:
        return f"Structure({len(self.paths)} nodes, depth {self.max_depth})"

    def up_to(self, depth: int) -> "Structure":
        """S_{<=d}: the nodes of depth at most `depth`."""
        return Structure(p for p in self.paths if len(p) <= depth)

    def level_sizes(self) -> list[int]:
        sizes = [0] * self.max_depth
        for p in self.paths:
            sizes[len(p) - 1] += 1
        return sizes

    def to_list(self) -> list[list[int]]:
        return [list(p) for p in sorted(self.paths, key=lambda p: (len(p), p))]

    @classmethod
    def chain(cls, k: int) -> "Structure":
        return cls([(0,) * d for d in range(1, k + 1)])

    @classmethod
    def full(cls, widths: list[int]) -> "Structure":
        """Every rank path whose rank at depth l is below widths[l-1] (a complete template)."""
        paths: list[RankPath] = [()]
        out: list[RankPath] = []
        for w in widths:
            paths = [p + (r,) for p in paths for r in range(w)]
            out.extend(paths)
        return cls(out)


def validate_structure(paths: frozenset[RankPath]) -> None:
    """Raise ValueError (one line) unless `paths` is ancestor-closed and left-closed."""
    for p in paths:
        if len(p) == 0:
            raise ValueError("structure error: the empty rank path (the root) is implicit; do not list it")
        if any(r < 0 for r in p):
            raise ValueError(f"structure error: rank path {list(p)} has a negative rank")
        if len(p) > 1 and p[:-1] not in paths:
            raise ValueError(
                f"structure error: {list(p)} is listed but its parent {list(p[:-1])} is not (must be ancestor-closed)"
            )
        if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in paths:
            raise ValueError(
                f"structure error: {list(p)} is listed but its elder sibling {list(p[:-1] + (p[-1] - 1,))} "
                "is not (must be left-closed)"
            )


def select_top_nodes(parents: np.ndarray, depths: np.ndarray, cum: np.ndarray, total: int) -> np.ndarray:
    """Root plus the `total` drafted nodes with the highest cumulative log-prob, ancestor-closed.

    Log-probs are <= 0, so a parent never scores below its child; ties break toward shallower nodes.
    """
    order = np.lexsort((depths[1:], -cum[1:])) + 1  # by score desc, then depth asc
    chosen = np.zeros(len(parents), dtype=bool)
    chosen[0] = True
    count = 0
    for v in order:
        if count >= total:
            break
        if chosen[v]:
            continue
        chain_ = []
        a = v
        while not chosen[a]:
            chain_.append(a)
            a = parents[a]
        if count + len(chain_) > total:
            continue
        chosen[chain_] = True
        count += len(chain_)
    return np.nonzero(chosen)[0]
