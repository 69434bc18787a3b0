"""Tree policies: how a cycle's draft tree is grown, level by level, over any drafter.

Every policy drafts level by level and calls an optional *stop hook* after each drafted level;
returning True stops drafting there (the OGSPO policy head plugs in here). The verified tree is
then the drafted tree (static structures, chains) or its best sub-tree (EAGLE-3 dynamic tree).

The contract is explicit both ways: the engine calls `policy.begin(prompt)` when a request starts
and hands every `draft` a `CycleContext` (committed length, request seed, cycle index, the
request's start), which the policy passes on to the stop hook. Nothing reads the target's cache.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .drafters import TreeDrafter
from .tree import DraftTree, Structure, select_top_nodes


@dataclass(frozen=True)
class CycleContext:
    """What the engine tells a policy and its stop hook about the cycle being drafted."""

    context_length: int  # committed KV rows before the cycle (the root token is not among them)
    request_seed: int
    index: int  # cycle index within the request, 1-based (as in verify.cycle_seed)
    prompt_length: int  # committed rows when the request's first cycle began (where the request starts)

    @property
    def first_cycle(self) -> bool:
        return self.index == 1


StopHook = Callable[[DraftTree, int, CycleContext], bool]  # (tree so far, level just drafted, cycle) -> stop now?


@dataclass
class Draft:
    drafted: DraftTree  # everything the drafter produced this cycle
    verified: np.ndarray  # indices into `drafted` of the nodes sent to verification (root first)
    level_seconds: list[float] = field(default_factory=list)
    stopped_early: bool = False


class TreePolicy(ABC):
    name = "policy"  # set by each policy's constructor (a method label in outputs)
    max_depth = 0
    max_nodes = 1  # most nodes (root included) one verification can hold
    hook: StopHook | None = None  # the policy's own stop hook (OGSPO's head); the engine's `stop_hook` overrides it

    def begin(self, prompt: list[int]) -> None:
        """A request starts after `prompt`: per-request state resets here (most policies have none)."""

    @abstractmethod
    def draft(self, drafter: TreeDrafter | None, root: int, ctx: CycleContext, *,
              stop_hook: StopHook | None = None) -> Draft:
        """The cycle's draft from `root`; `stop_hook` (else `self.hook`) is asked after each level."""


class Autoregressive(TreePolicy):
    def __init__(self, name: str = "ar"):
        self.name = name

    def draft(self, drafter, root, ctx, *, stop_hook=None) -> Draft:
        return Draft(drafted=DraftTree.from_root(root), verified=np.zeros(1, dtype=np.int64))


class StaticTree(TreePolicy):
    """Draft exactly the rank paths of a structure (nested by depth), stopping early if the hook says so."""

    def __init__(self, structure: Structure, name: str = "static"):
        if len(structure) == 0:
            raise ValueError("a static tree needs at least one node; use the autoregressive method instead")
        self.structure = structure
        self.name = name
        self.max_depth = structure.max_depth
        self.max_nodes = len(structure) + 1

    def draft(self, drafter, root, ctx, *, stop_hook=None) -> Draft:
        stop_hook = stop_hook if stop_hook is not None else self.hook
        tree = DraftTree.from_root(root)
        paths: list[tuple[int, ...]] = [()]
        frontier = np.zeros(1, dtype=np.int64)
        times: list[float] = []
        stopped = False
        for level in range(1, self.max_depth + 1):
            widths = [self.structure.n_children.get(paths[f], 0) for f in frontier]
            keep = [i for i, w in enumerate(widths) if w > 0]
            if not keep:
                break
            frontier = frontier[keep]
            widths = [widths[i] for i in keep]
            t0 = time.perf_counter()
            exp = drafter.expand(tree, frontier, max(widths))
            par, tok, rk, lq, ent = [], [], [], [], []
            for i, f in enumerate(frontier):
                for r in range(widths[i]):
                    if exp.tokens[i, r] < 0:
                        break
                    par.append(f), tok.append(exp.tokens[i, r]), rk.append(r), lq.append(exp.logq[i, r])
                    ent.append(exp.entropy[i])
            new = tree.add_children(parents=np.array(par, dtype=np.int64), tokens=np.array(tok), ranks=np.array(rk),
                                    logq=np.array(lq), entropy=np.array(ent))
            paths.extend(paths[p] + (r,) for p, r in zip(par, rk))
            times.append(time.perf_counter() - t0)
            frontier = new
            if len(new) == 0:
                break
            if stop_hook is not None and level < self.max_depth and stop_hook(tree, level, ctx):
                stopped = True
                break
        return Draft(drafted=tree, verified=np.arange(len(tree)), level_seconds=times, stopped_early=stopped)


def chain(k: int) -> StaticTree:
    return StaticTree(Structure.chain(k), name=f"chain{k}")


class DynamicTree(TreePolicy):
    """EAGLE-3's dynamic tree: expand the top_k frontier nodes by top_k children each, keep the top_k
    new nodes by cumulative log-prob as the next frontier, then rerank every drafted node by
    cumulative log-prob and verify the best `total_tokens` (depth = number of drafted levels)."""

    def __init__(self, *, total_tokens: int = 60, depth: int = 5, top_k: int = 10, name: str | None = None):
        if total_tokens < 1 or depth < 1 or top_k < 1:
            raise ValueError(f"dynamic tree needs positive total_tokens/depth/top_k, got {total_tokens}/{depth}/{top_k}")
        self.total_tokens, self.max_depth, self.top_k = total_tokens, depth, top_k
        self.max_nodes = total_tokens + 1
        self.name = name or f"eagle{total_tokens}-{depth}-{top_k}"

    def draft(self, drafter, root, ctx, *, stop_hook=None) -> Draft:
        stop_hook = stop_hook if stop_hook is not None else self.hook
        tree = DraftTree.from_root(root)
        cum = np.zeros(1)
        frontier = np.zeros(1, dtype=np.int64)
        times: list[float] = []
        stopped = False
        k = self.top_k
        for level in range(1, self.max_depth + 1):
            t0 = time.perf_counter()
            exp = drafter.expand(tree, frontier, k)
            valid = exp.tokens >= 0  # [w, k]
            par = np.repeat(frontier, k)[valid.ravel()]
            new = tree.add_children(
                parents=par,
                tokens=exp.tokens[valid],
                ranks=np.tile(np.arange(k), len(frontier))[valid.ravel()],
                logq=exp.logq[valid],
                entropy=np.repeat(exp.entropy, k)[valid.ravel()],
            )
            cum = np.concatenate([cum, cum[par] + exp.logq[valid]])
            times.append(time.perf_counter() - t0)
            if len(new) == 0:
                break
            order = np.argsort(-cum[new], kind="stable")[:k]
            frontier = new[np.sort(order)]
            if stop_hook is not None and level < self.max_depth and stop_hook(tree, level, ctx):
                stopped = True
                break
        keep = select_top_nodes(tree.parents, tree.depths, cum, self.total_tokens)
        return Draft(drafted=tree, verified=keep, level_seconds=times, stopped_early=stopped)
