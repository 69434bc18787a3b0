"""Pre-drafting routing at decode time (docs/DESIGN.md §7): a router picks a template per cycle before
drafting; see `learn.routing` for the features and the training."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ogspo.artifacts.router import Router, load_router, template_name
from ogspo.engine.policies import CycleContext, Draft, StaticTree, TreePolicy
from ogspo.engine.tree import DraftTree
from ogspo.methods.features import EMA_ALPHA, RecentAccept


def router_features(*, context_length: float, recent_accept: float, last_commit: int, last_depth: int | None) -> np.ndarray:
    """Features before drafting a cycle (order `ROUTER_FEATURES`); `last_depth` None = the request's first cycle. [F]"""
    first = last_depth is None
    drafted = not first and last_depth > 0
    return np.array(
        [math.log1p(context_length), recent_accept, 0 if first else last_commit, float(drafted),
         float(drafted and last_commit == last_depth + 1), float(first)],
        dtype=np.float64,
    )


class RouterState:
    """Online feature state of one request: the committed context length at each cycle's start gives the
    previous cycle's commit (`RecentAccept`); `drafted(depth)` tells it the depth just drafted."""

    def __init__(self, *, alpha: float = EMA_ALPHA):
        self.recent = RecentAccept(alpha=alpha)
        self.last_depth: int | None = None

    def reset(self) -> None:
        self.recent.reset()
        self.last_depth = None

    def features(self, ctx: CycleContext) -> np.ndarray:
        """Router features of the cycle about to be drafted (call once per cycle, in order). [F]"""
        if ctx.first_cycle or self.recent.last_length is None:
            self.last_depth = None
        history = self.recent.update(ctx)
        return router_features(context_length=ctx.context_length, recent_accept=history.recent_accept,
                               last_commit=int(history.last_accept), last_depth=self.last_depth)

    def drafted(self, depth: int) -> None:
        self.last_depth = int(depth)


class RoutedTree(TreePolicy):
    """Per cycle: features before drafting (from the engine's `CycleContext`) -> router -> draft that
    template fully (nothing for `[]`)."""

    def __init__(self, router: Router, name: str = "routing"):
        self.name = name
        self.router = router
        self.trees = [StaticTree(S, name=template_name(S)) if len(S) else None for S in router.templates]
        self.max_depth = max(S.max_depth for S in router.templates)
        self.max_nodes = max(len(S) for S in router.templates) + 1
        self.state = RouterState()
        self.counts = np.zeros(len(router.templates), dtype=np.int64)  # cycles routed to each template

    def begin(self, prompt: list[int]) -> None:
        self.state.reset()

    def draft(self, drafter, root, ctx, *, stop_hook=None) -> Draft:
        k = int(self.router.choose(self.state.features(ctx))[0])
        self.counts[k] += 1
        tree = self.trees[k]
        if tree is None:
            draft = Draft(drafted=DraftTree.from_root(root), verified=np.zeros(1, dtype=np.int64))
        else:
            draft = tree.draft(drafter, root, ctx, stop_hook=stop_hook)
        self.state.drafted(int(draft.drafted.depths.max()))
        return draft


def make_routing(router_path: str | Path | None, name: str = "routing") -> RoutedTree:
    if router_path is None:
        raise ValueError("method 'routing' needs a router (--router PATH: router.json or its folder)")
    return RoutedTree(load_router(router_path), name=name)
