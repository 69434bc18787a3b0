"""The decoding cycle (docs/DESIGN.md §1): draft level by level, verify the tree in one target pass,
commit the accepted path plus a bonus token, and compact the KV cache to the accepted rows.

`verify="path"` reaches the same verdict by forwarding the accepted path one node at a time (the
root, then each node its parent accepted; `verify.verify_path`): one one-row forward per committed
token instead of one forward over the tree. Records use it where a forward of the whole template
costs more than the path's steps (`stages/collect_records.py`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from .drafters import Observation, TreeDrafter
from .policies import CycleContext, StopHook, TreePolicy
from .target import ForwardOut, TreeLM, synchronize
from .tree import DraftTree, ancestor_matrix
from .verify import (
    CycleRandom,
    Verdict,
    cycle_seed,
    sample_inverse_cdf,
    target_probs,
    verify_greedy,
    verify_path,
    verify_stochastic,
)

VERIFY_MODES = ("tree", "path")


@dataclass
class CycleStats:
    draft_seconds: list[float]  # per drafted level
    verify_seconds: float  # the target's tree forward
    cycle_seconds: float  # the whole cycle
    tree_size: int  # verified drafted nodes (root excluded)
    depth: int  # depth of the verified tree
    accepted: int  # tokens committed (bonus included)
    seed: int

    @property
    def other_seconds(self) -> float:
        return self.cycle_seconds - sum(self.draft_seconds) - self.verify_seconds


@dataclass
class CycleTrace:
    """Everything one cycle saw, handed to an engine's optional `cycle_observer` (records, same-trace runs)."""

    request_seed: int
    index: int  # cycle index within the request (1-based, as in cycle_seed)
    root: int  # root token (the last committed token)
    context_length: int  # committed KV rows before the cycle (the root is not among them)
    drafted: DraftTree  # every drafted node
    verified: np.ndarray  # [m] drafted-tree indices sent to verification, root first
    tree: DraftTree  # the verified tree (`verified` of `drafted`)
    logits: torch.Tensor  # [r, vocab] target logits of the nodes of `tree` that were forwarded (`rows`)
    rows: np.ndarray  # [r] `tree` indices of the logits' rows (tree verification: all, in order; path: the accepted path)
    verdict: Verdict  # path/matches index `tree`
    committed: list[int]  # accepted drafted tokens then the bonus token
    stats: CycleStats


@dataclass
class GenerationResult:
    prompt_tokens: int
    tokens: list[int]
    prefill_seconds: float
    wall_seconds: float  # the request's own time, prefill included (`Generation.seconds`)
    cycles: list[CycleStats] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Mean tokens committed per cycle, bonus included."""
        return float(np.mean([c.accepted for c in self.cycles])) if self.cycles else 0.0

    @property
    def throughput(self) -> float:
        """Complete-request throughput: generated tokens / wall time (prefill included)."""
        return len(self.tokens) / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def time_split(self) -> dict[str, float]:
        draft = sum(sum(c.draft_seconds) for c in self.cycles)
        verify = sum(c.verify_seconds for c in self.cycles)
        other = sum(c.other_seconds for c in self.cycles)
        return {"prefill": self.prefill_seconds, "draft": draft, "verify": verify, "other": other}


@dataclass
class Generation:
    """A request in progress (`SpeculativeEngine.start` / `step`): what it generated so far and the
    seconds spent on it (its prefill and cycles; time between its steps is not its own)."""

    prompt_length: int
    seed: int
    max_new_tokens: int
    tokens: list[int]
    prefill_seconds: float
    seconds: float
    cycles: list[CycleStats] = field(default_factory=list)
    done: bool = False

    def result(self) -> GenerationResult:
        return GenerationResult(prompt_tokens=self.prompt_length, tokens=list(self.tokens),
                                prefill_seconds=self.prefill_seconds, wall_seconds=self.seconds, cycles=list(self.cycles))


class SpeculativeEngine:
    """Lossless tree speculative decoding over a `TreeLM` target, any drafter and any tree policy."""

    def __init__(
        self,
        *,
        target: TreeLM,
        policy: TreePolicy,
        drafter: TreeDrafter | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        eos_token_id: int | None = None,
        stop_hook: StopHook | None = None,
        cycle_observer: Callable[[CycleTrace], None] | None = None,
        verify: str = "tree",
    ):
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if policy.max_nodes > 1 and drafter is None:
            raise ValueError(f"method '{policy.name}' drafts a tree and needs a drafter")
        self.target, self.policy, self.drafter = target, policy, drafter
        self.temperature, self.top_p = temperature, top_p
        self.eos_token_id = eos_token_id
        self.stop_hook = stop_hook
        self.cycle_observer = cycle_observer  # called after every cycle (outside its timing)
        self.verify = verify  # "tree": one forward over the tree; "path": the accepted path one row at a time

    def _check_prompt(self, prompt: list[int], max_new_tokens: int) -> None:
        if len(prompt) == 0:
            raise ValueError("empty prompt: give at least one token")
        limit = getattr(self.target.config, "max_position_embeddings", None) or self.target.cache.max_len
        need = len(prompt) + max_new_tokens + self.policy.max_nodes
        if len(prompt) >= limit:
            raise ValueError(f"prompt of {len(prompt)} tokens exceeds the model's context of {limit} tokens")
        if need > min(limit, self.target.cache.max_len):
            raise ValueError(
                f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) + tree ({self.policy.max_nodes}) "
                f"= {need} tokens exceeds the limit of {min(limit, self.target.cache.max_len)}"
            )

    def _first_token(self, logits: torch.Tensor, seed: int) -> int:
        if self.temperature == 0:
            return int(logits.argmax())
        p = target_probs(logits[None].cpu(), temperature=self.temperature, top_p=self.top_p)[0]  # [V]
        return sample_inverse_cdf(p, CycleRandom.from_seed(cycle_seed(seed, 0)).bonus[0])

    def start(self, prompt: list[int], *, max_new_tokens: int, seed: int = 0) -> Generation:
        """Begin a request: prefill the target and the drafter, sample the first token. `step` then
        runs its cycles; requests of engines on separate caches (`TreeLM.fork`) may be stepped in turn."""
        self._check_prompt(prompt, max_new_tokens)
        t0 = time.perf_counter()
        pre = self._prefill(prompt)
        first = self._first_token(pre.logits[0], seed)
        seconds = time.perf_counter() - t0
        gen = Generation(prompt_length=len(prompt), seed=seed, max_new_tokens=max_new_tokens, tokens=[first],
                         prefill_seconds=seconds, seconds=seconds)
        gen.done = max_new_tokens <= 1 or first == self.eos_token_id
        return gen

    def step(self, gen: Generation) -> list[int]:
        """One cycle of request `gen` (which this engine started, its cache untouched since its last
        step); returns the tokens it added (cut at EOS and at max_new_tokens)."""
        if gen.done:
            raise ValueError("the request is done: start another")
        t0 = time.perf_counter()
        ctx = CycleContext(context_length=self.target.cache.length, request_seed=gen.seed, index=len(gen.cycles) + 1,
                           prompt_length=gen.prompt_length)
        stats, committed = self._cycle(gen.tokens[-1], ctx)
        gen.cycles.append(stats)
        if self.eos_token_id is not None and self.eos_token_id in committed:
            committed = committed[: committed.index(self.eos_token_id) + 1]
        committed = committed[: gen.max_new_tokens - len(gen.tokens)]
        gen.tokens.extend(committed)
        gen.done = len(gen.tokens) >= gen.max_new_tokens or gen.tokens[-1] == self.eos_token_id
        gen.seconds += time.perf_counter() - t0
        return committed

    def generate(
        self,
        prompt: list[int],
        *,
        max_new_tokens: int,
        seed: int = 0,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> GenerationResult:
        """Generate up to `max_new_tokens` tokens after `prompt` (stops after EOS): `start`, then `step`
        until done. Its seconds are the request's own (prefill and cycles), not the callback's."""
        gen = self.start(prompt, max_new_tokens=max_new_tokens, seed=seed)
        if on_tokens:
            on_tokens(gen.tokens[:])
        while not gen.done:
            new = self.step(gen)
            if on_tokens:
                on_tokens(new)
        return gen.result()

    def _cycle(self, root: int, ctx: CycleContext) -> tuple[CycleStats, list[int]]:
        t0 = time.perf_counter()
        cache, dev = self.target.cache, self.target.device
        draft = self.policy.draft(self.drafter, root, ctx, stop_hook=self.stop_hook)
        tree = draft.drafted
        if len(draft.verified) < len(tree):
            tree, _ = tree.subset(draft.verified)
        n = len(tree)
        L = cache.length
        seed = cycle_seed(ctx.request_seed, ctx.index)
        synchronize(dev)
        t1 = time.perf_counter()
        if self.verify == "path":
            fwd, verdict = self._verify_path(tree, seed)  # commits the path as it goes
            rows = verdict.rows
            synchronize(dev)
            t2 = time.perf_counter()
        else:
            positions = torch.as_tensor(L + tree.depths, device=dev)  # [n]
            attend = None if n == 1 else torch.as_tensor(ancestor_matrix(tree.parents, tree.depths), device=dev)  # [n, n]
            fwd = self.target.forward(torch.as_tensor(tree.tokens, device=dev), positions, attend)
            synchronize(dev)
            t2 = time.perf_counter()
            if self.temperature == 0:
                verdict = verify_greedy(tree, fwd.logits)
            else:
                verdict = verify_stochastic(
                    tree, fwd.logits, CycleRandom.from_seed(seed), temperature=self.temperature, top_p=self.top_p
                )
            cache.commit(torch.as_tensor(L + np.asarray(verdict.path, dtype=np.int64), device=dev))
            rows = np.arange(n)
        path = np.asarray(verdict.path, dtype=np.int64)
        committed = [int(t) for t in tree.tokens[path[1:]]] + [verdict.bonus]
        if self.drafter is not None:
            mask = np.zeros(len(draft.drafted), dtype=bool)
            mask[draft.verified[path]] = True
            self.drafter.observe(
                Observation(
                    tree=draft.drafted, accept_mask=mask, committed=committed, target=fwd, verified=draft.verified[rows]
                )
            )
        synchronize(dev)
        t3 = time.perf_counter()
        stats = CycleStats(
            draft_seconds=draft.level_seconds,
            verify_seconds=t2 - t1,
            cycle_seconds=t3 - t0,
            tree_size=n - 1,
            depth=int(tree.depths.max()),
            accepted=len(committed),
            seed=seed,
        )
        if self.cycle_observer is not None:
            self.cycle_observer(
                CycleTrace(
                    request_seed=ctx.request_seed, index=ctx.index, root=root, context_length=L, drafted=draft.drafted,
                    verified=draft.verified, tree=tree, logits=fwd.logits, rows=rows, verdict=verdict,
                    committed=committed, stats=stats,
                )
            )
        return stats, committed

    def _verify_path(self, tree: DraftTree, seed: int) -> tuple[ForwardOut, Verdict]:
        """Verify `tree` by forwarding its accepted path one node at a time, each row committed as it
        is computed (every forwarded node is on the path). Returns the rows' outputs [r] and the verdict."""
        cache, dev = self.target.cache, self.target.device
        outs: list[ForwardOut] = []

        def row(node: int) -> torch.Tensor:  # [vocab]
            L = cache.length
            out = self.target.forward(torch.as_tensor(tree.tokens[node : node + 1], device=dev),
                                      torch.tensor([L], device=dev), None)  # position L = the committed rows so far
            cache.commit_prefix(1)
            outs.append(out)
            return out.logits[0]

        rand = CycleRandom.from_seed(seed) if self.temperature > 0 else None
        verdict = verify_path(tree, row, rand, temperature=self.temperature, top_p=self.top_p)
        features = None if outs[0].features is None else torch.cat([o.features for o in outs])  # [r, F]
        return ForwardOut(logits=torch.cat([o.logits for o in outs]), features=features), verdict  # logits [r, V]

    def cycle_from(self, context: list[int], root: int, *, request_seed: int, index: int,
                   prompt_length: int | None = None) -> tuple[CycleStats, list[int]]:
        """Run one cycle after committed `context` with root token `root`, using the random numbers of
        cycle `index` of request `request_seed`: a same-trace execution of that recorded cycle.
        `prompt_length` is where the request started (default: unknown, the whole context)."""
        self._check_prompt(list(context) + [root], 1)
        self._prefill(list(context))
        ctx = CycleContext(context_length=len(context), request_seed=request_seed, index=index,
                           prompt_length=len(context) if prompt_length is None else prompt_length)
        return self._cycle(int(root), ctx)

    def _prefill(self, prompt: list[int]) -> ForwardOut:
        """Fill the target cache with the prompt and begin the drafter; returns the target's output
        (logits of the last position, features of every position)."""
        pre = self.target.prefill(prompt)
        self.policy.begin(list(prompt))
        if self.drafter is not None:
            self.drafter.begin(list(prompt), pre)
        return pre
