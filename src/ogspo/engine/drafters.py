"""Drafters behind one small tree interface.

The engine never knows which drafter it has. A drafter
- `begin`s a request with the prompt (and the target's prefill output),
- `expand`s a frontier of tree nodes into ranked children with log-probs and an entropy,
- `observe`s each verified cycle: the per-node accept mask and the committed tokens,
- `fork`s: the same weights with a request state of its own (requests interleaved cycle by cycle).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from .target import ForwardOut, TreeLM
from .tree import DraftTree


@dataclass
class Expansion:
    tokens: np.ndarray  # [w, k] int64, -1 where a node has fewer than k candidates
    logq: np.ndarray  # [w, k] float64 drafter log-probs (-inf where tokens == -1)
    entropy: np.ndarray  # [w] drafter entropy at each frontier node


@dataclass
class Observation:
    """What the engine tells the drafter after verification."""

    tree: DraftTree  # the drafted tree (every drafted node, verified or not)
    accept_mask: np.ndarray  # [n] bool, True on the accepted root path (root included)
    committed: list[int]  # tokens committed this cycle: accepted drafted tokens, then the bonus token
    target: ForwardOut | None  # the verification forward; rows follow `verified`
    verified: np.ndarray  # [m] drafted-tree indices of the verified nodes, in verification row order


class TreeDrafter(ABC):
    name = "drafter"
    drafter_id: str | None = None  # which trained weights, for outputs (None: the drafter has none)
    feature_layers: tuple[int, ...] = ()  # target hidden layers the drafter reads from `ForwardOut.features`

    @abstractmethod
    def begin(self, prompt: list[int], target: ForwardOut | None) -> None: ...

    @abstractmethod
    def expand(self, tree: DraftTree, frontier: np.ndarray, k: int) -> Expansion: ...

    @abstractmethod
    def observe(self, obs: Observation) -> None: ...

    @abstractmethod
    def fork(self) -> TreeDrafter:
        """The same drafter (weights shared) with a request state of its own."""


def accepted_path(obs: Observation) -> np.ndarray:
    """Accepted node indices of the drafted tree, root first."""
    nodes = np.nonzero(obs.accept_mask)[0]
    return nodes[np.argsort(obs.tree.depths[nodes], kind="stable")]


def _topk_from_logits(logits: torch.Tensor, k: int) -> Expansion:
    logp = torch.log_softmax(logits.float(), dim=-1)  # [w, V]
    top = logp.topk(k, dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    return Expansion(
        tokens=top.indices.cpu().numpy().astype(np.int64),
        logq=top.values.double().cpu().numpy(),
        entropy=ent.double().cpu().numpy(),
    )


class LMDrafter(TreeDrafter):
    """A small causal LM sharing the target's tokenizer, drafting with tree attention over its own cache."""

    name = "lm"

    def __init__(self, lm: TreeLM):
        self.lm = lm
        self.backlog: list[int] = []  # committed tokens (before the root) not yet in the drafter's cache
        self.node_row = np.zeros(0, dtype=np.int64)  # pending cache row of each forwarded tree node, -1 if none

    def begin(self, prompt: list[int], target: ForwardOut | None) -> None:
        self.lm.cache.reset()
        self.backlog = list(prompt)
        self.node_row = np.zeros(0, dtype=np.int64)

    def fork(self) -> LMDrafter:
        return LMDrafter(self.lm.fork())

    def expand(self, tree: DraftTree, frontier: np.ndarray, k: int) -> Expansion:
        c, dev = self.lm.cache, self.lm.device
        if len(self.node_row) < len(tree):
            self.node_row = np.concatenate([self.node_row, np.full(len(tree) - len(self.node_row), -1)])
        if len(frontier) == 1 and frontier[0] == 0 and c.pending == 0:
            # first level: catch up on the backlog and forward the root in one pass
            toks = torch.tensor(self.backlog + [int(tree.tokens[0])], device=dev)
            b = len(self.backlog)
            pos = torch.arange(c.length, c.length + b + 1, device=dev)
            out = self.lm.forward(toks, pos, None, logits_rows=torch.tensor([b], device=dev))
            c.commit_prefix(b)
            self.backlog = []
            self.node_row[0] = c.length
            return _topk_from_logits(out.logits, k)
        w = len(frontier)
        pend = c.pending
        attend = np.zeros((w, pend + w), dtype=bool)  # built on the host, sent once
        for i, f in enumerate(frontier):
            a = tree.parents[f]
            while a >= 0:
                attend[i, self.node_row[a] - c.length] = True
                a = tree.parents[a]
            attend[i, pend + i] = True
        pos = torch.as_tensor(c.length + tree.depths[frontier], device=dev)  # [w]
        self.node_row[frontier] = c.end + np.arange(w)
        out = self.lm.forward(torch.as_tensor(tree.tokens[frontier], device=dev), pos, torch.as_tensor(attend, device=dev))
        return _topk_from_logits(out.logits, k)

    def observe(self, obs: Observation) -> None:
        path = accepted_path(obs)
        rows = self.node_row[path] if len(self.node_row) >= len(obs.tree) else np.full(len(path), -1)
        n_cached = int(np.argmax(rows < 0)) if (rows < 0).any() else len(path)
        self.lm.cache.commit(torch.as_tensor(rows[:n_cached], device=self.lm.device) if n_cached else None)
        self.backlog.extend(int(t) for t in obs.tree.tokens[path[n_cached:]])
        self.node_row = np.zeros(0, dtype=np.int64)


class PromptLookupDrafter(TreeDrafter):
    """Model-free n-gram drafter: continue the longest suffix n-gram that already occurred in the context."""

    name = "lookup"

    def __init__(self, *, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.context = np.zeros(0, dtype=np.int64)  # committed tokens before the root

    def begin(self, prompt: list[int], target: ForwardOut | None) -> None:
        self.context = np.asarray(prompt, dtype=np.int64)

    def fork(self) -> PromptLookupDrafter:
        return PromptLookupDrafter(max_ngram=self.max_ngram, min_ngram=self.min_ngram)

    def _candidates(self, seq: np.ndarray, k: int) -> tuple[list[int], list[float]]:
        n_seq = len(seq)
        for n in range(min(self.max_ngram, n_seq - 1), self.min_ngram - 1, -1):
            suffix = seq[n_seq - n :]
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # [n_seq - n, n]
            hits = np.nonzero((windows == suffix).all(axis=1))[0]
            if len(hits) == 0:
                continue
            nxt = seq[hits + n]
            counts: dict[int, list] = {}
            for pos, t in zip(hits, nxt):  # later occurrences win ties
                e = counts.setdefault(int(t), [0, 0])
                e[0] += 1
                e[1] = int(pos)
            ranked = sorted(counts.items(), key=lambda kv: (-kv[1][0], -kv[1][1]))[:k]
            total = float(len(hits))
            return [t for t, _ in ranked], [float(np.log(c[0] / total)) for _, c in ranked]
        return [], []

    def expand(self, tree: DraftTree, frontier: np.ndarray, k: int) -> Expansion:
        w = len(frontier)
        tokens = np.full((w, k), -1, dtype=np.int64)
        logq = np.full((w, k), -np.inf)
        for i, f in enumerate(frontier):
            path = []
            a = int(f)
            while a >= 0:
                path.append(int(tree.tokens[a]))
                a = int(tree.parents[a])
            seq = np.concatenate([self.context, np.asarray(path[::-1], dtype=np.int64)])
            toks, lq = self._candidates(seq, k)
            tokens[i, : len(toks)] = toks
            logq[i, : len(lq)] = lq
        return Expansion(tokens=tokens, logq=logq, entropy=np.zeros(w))

    def observe(self, obs: Observation) -> None:
        path = accepted_path(obs)
        self.context = np.concatenate([self.context, obs.tree.tokens[path]])
