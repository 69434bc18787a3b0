"""Stage `calibrate_latency`: the per-device latency model of docs/DESIGN.md §4, measured on real shapes.

The fits from the timings are `ogspo.offline.latency_fit`'s.

- t_verify(n, L): one target tree forward of n tree tokens (root included, ancestor mask of a bushy
  tree) over a KV cache holding L committed tokens, through the engine's own code path
  (`target.forward`, then `target.cache.commit(None)` to drop the pending rows). Stored as a table
  over n x L; the model is piecewise linear in n (between table sizes) and linear in L (per-size or
  global slope, whichever predicts the table better by leave-one-L-out). A shared CPU changes state
  for tens of seconds, and not uniformly: on the 2-core AMD EPYC a one-row forward flips between ~7.5
  and ~11 ms while an 8-row forward stays near 12 ms. So each timing is preceded by a probe (a one-row
  forward) that gives its state, and each shape is fitted against its timings' states (`state_fit`):
  its time at the mean state over the whole grid goes into the table, and how it moves with the
  one-row forward is the size's `drift_elasticity` (`fit_elasticity`). The table's level is then set
  where decoding runs it (`decode_loop_level`): one scale from the target forwards of real requests
  (autoregressive and static trees), each request compared in its state (the probes around it,
  `probe_seconds`).
- t_draft(w): one drafter level (`drafter.expand`) over a frontier of w nodes at depth 1 of a real
  drafting state (request begun, root expanded); the drafter state is discarded between
  repetitions by beginning the request again. Piecewise linear in w, t_draft(0) = 0. Then scaled to
  the levels past the first of the static-tree requests below (`decode_loop_draft_scale`): in
  decoding a level follows a target pass. Its shapes are timed in the verify grid, shuffled among
  the verify shapes, so how a level moves with the state is fitted the same way, over the same states
  (`draft_elasticity`, relative to the one-row forward; the model applies it to the per-cycle
  overheads too).
- t_catchup: a drafted cycle that commits A tokens leaves A - 1 of them for the EAGLE head to re-encode
  at the next cycle's first level. From the same static-tree requests as t_fixed: the first level's
  time of each cycle against the tokens the previous cycle committed b: the increments of its median
  over b = 2, 3, ... are `catchup` (`fit_catchup`; measured: 5 ms at b = 1, 9 ms at b = 2..4, AMD EPYC).
- t_fixed: per-cycle overhead from real `SpeculativeEngine` requests, everything of a request that is
  neither prefill, drafting nor the target's forward (sampling, cache compaction, drafter bookkeeping,
  the decode loop between cycles), per cycle. One value per cycle kind, because they differ by an order
  of magnitude: `fixed_ar` from autoregressive requests (no drafter, median over steps), and for tree
  cycles a line in the verified nodes n, `fixed + fixed_slope * (n - 1)`, through the median overhead of
  static trees of three sizes (the 2-token chain, 10 and 28 nodes: `fit_fixed`). Autoregressive requests
  at T = 1 give what sampling adds per cycle (`fixed_sampled`, the model's `at_temperature`). The
  autoregressive and tree requests run in shuffled rounds, so all kinds see the same mix of machine states.

    t_cycle(level_widths, n, L, A) = sum_l t_draft(w_l) + t_verify(n, L) + t_fixed(n) + t_catchup(A)

Shapes are timed in a shuffled, interleaved order after a warm-up, each `reps` times; each timing is
the second call of a burst of two of the same shape, because decoding runs a shape after similar
shapes (an autoregressive step after a step), never cold after a 128-token forward.
Held-out shapes (n and L outside the table) give the validation error (MdAPE).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ogspo.analysis.plots import plot_calibration
from ogspo.artifacts.latency import LatencyCalibration, LatencyModel, fit_verify, write_latency
from ogspo.engine.decode import SpeculativeEngine
from ogspo.engine.drafters import TreeDrafter
from ogspo.engine.policies import Autoregressive, StaticTree
from ogspo.engine.target import TreeLM, synchronize
from ogspo.engine.tree import DraftTree, Structure, ancestor_matrix
from ogspo.methods.harness import probe_seconds
from ogspo.offline.latency_fit import (
    decode_loop_draft_scale,
    decode_loop_level,
    fit_catchup,
    fit_draft_elasticity,
    fit_elasticity,
    fit_fixed,
    state_fit,
)

# Rank-path order of the bushy trees timed for t_verify: the first n-1 nodes of this template in
# (depth, rank path) order are ancestor-closed, so any n up to its size is a realistic tree.
BUSHY_TEMPLATE = Structure.full([8, 4, 3, 2, 2, 2, 1, 1])
HELD_OUT_SIZES = (5, 11, 20, 40, 80)
HELD_OUT_CONTEXTS = (256, 600)


def bushy_tree(n: int, context_length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(positions [n], attend [n, n] ancestor mask or None, depths) of a bushy tree of n nodes."""
    if n < 1 or n - 1 > len(BUSHY_TEMPLATE):
        raise ValueError(f"tree size {n} outside 1..{len(BUSHY_TEMPLATE) + 1}")
    paths = [()] + BUSHY_TEMPLATE.to_list()[: n - 1]
    index = {tuple(p): i for i, p in enumerate(paths)}
    parents = np.array([-1] + [index[tuple(p[:-1])] for p in paths[1:]], dtype=np.int64)
    depths = np.array([len(p) for p in paths], dtype=np.int64)
    attend = None if n == 1 else torch.as_tensor(ancestor_matrix(parents, depths), device=device)  # [n, n]
    return torch.as_tensor(context_length + depths, device=device), attend, depths


def _device_name(device) -> str:
    if str(device).startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


def _time_verify(target: TreeLM, n: int, L: int, rng: np.random.Generator) -> float:
    dev = target.device
    positions, attend, _ = bushy_tree(n, L, dev)
    tokens = torch.as_tensor(rng.integers(0, target.vocab_size, n), device=dev)  # [n]
    cache = target.cache
    cache.length, cache.pending = L, 0  # the committed rows hold a real prefix (see _fill_cache)
    synchronize(dev)
    t0 = time.perf_counter()
    target.forward(tokens, positions, attend)
    synchronize(dev)
    dt = time.perf_counter() - t0
    cache.commit(None)
    return dt


def _fill_cache(target: TreeLM, L: int, seed: int) -> None:
    """Write L real committed rows (a random-token prefill) so timings read real cache contents."""
    rng = np.random.default_rng(seed)
    cache = target.cache
    cache.reset()
    dev = target.device
    toks = torch.as_tensor(rng.integers(0, target.vocab_size, L), device=dev)  # [L]
    for s in range(0, L, 256):  # chunked prefill keeps the mask small
        e = min(L, s + 256)
        target.forward(toks[s:e], torch.arange(s, e, device=dev), None, logits_rows=torch.tensor([e - s - 1], device=dev))
        cache.commit_prefix(e - s)


def _measure_grid(fn, shapes: list[tuple], *, reps: int, warmup: int, rng: np.random.Generator, burst: int = 1,
                  probe=None) -> tuple[dict[tuple, list[float]], dict[tuple, list[float]]]:
    """(samples, probes): `reps` timings of fn(*shape) per shape, shapes interleaved in a shuffled order
    each pass; with `burst` > 1 each shape runs `burst` times in a row and only the last call is kept
    (the state a shape meets in decoding: after itself or a similar one, not after any shape of the
    grid). With `probe` (a timed call), each burst is preceded by one, and probes[s][r] is the probe
    time of samples[s][r]: the machine's state tens of milliseconds before it (empty lists without)."""
    for _ in range(warmup):
        for s in shapes:
            fn(*s)
    samples: dict[tuple, list[float]] = {s: [] for s in shapes}
    probes: dict[tuple, list[float]] = {s: [] for s in shapes}
    for _ in range(reps):
        order = rng.permutation(len(shapes))
        for i in order:
            if probe is not None:
                probes[shapes[i]].append(probe())
            for _ in range(burst - 1):
                fn(*shapes[i])
            samples[shapes[i]].append(fn(*shapes[i]))
    return samples, probes


# English prose for the requests that measure t_fixed and the catch-up: after random tokens the drafter
# accepts nothing, and the catch-up of accepted tokens would never be seen
CALIBRATION_TEXT = (
    "Speculative decoding makes a large language model generate text faster without changing what it "
    "writes. A small drafter proposes a few tokens ahead, arranged as a tree of alternatives, and the large "
    "model checks the whole tree in one forward pass. Every proposed token that the large model would have "
    "chosen itself is kept, and the first one it disagrees with is replaced by its own choice. The speed-up "
    "depends on how often the drafter guesses right, on how much more a pass over many tokens costs than a "
    "pass over one, and on the time spent between passes."
)


# static trees whose real cycles give t_fixed of a speculative cycle: a 2-token chain, a small and a bushy tree
FIXED_TREES = (Structure.chain(2), Structure.full([2, 2, 1]), Structure.full([4, 2, 2]))


def _overhead_per_cycle(res) -> list[tuple[int, float]]:
    """Per cycle of a request: (verified nodes, the cycle's time outside drafting and the target forward
    plus an equal share of the decode loop's time between cycles, wall - prefill - cycles)."""
    if not res.cycles:
        return []
    loop = (res.wall_seconds - res.prefill_seconds - sum(c.cycle_seconds for c in res.cycles)) / len(res.cycles)
    return [(c.tree_size + 1, c.other_seconds + loop) for c in res.cycles]


def level_widths(structure: Structure) -> list[int]:
    """Frontier width of each drafting level of a static tree: level l expands the nodes of depth l - 1
    that have children in it."""
    paths = structure.to_list()
    return [len({tuple(p[:-1]) for p in paths if len(p) == lvl}) for lvl in range(1, structure.max_depth + 1)]


def _deeper_levels(res, widths: list[int]) -> list[tuple[int, float]]:
    """(frontier width, seconds) of every drafting level past the first of a static tree's request (the
    first level re-encodes the accepted tokens: the catch-up's measurement)."""
    return [(widths[i], sec) for c in res.cycles for i, sec in enumerate(c.draft_seconds) if 0 < i < len(widths)]


def _first_levels(res) -> list[tuple[int, float]]:
    """(tokens the previous cycle committed, seconds of this cycle's first draft level), from the 2nd cycle on."""
    return [(prev.accepted, c.draft_seconds[0]) for prev, c in zip(res.cycles, res.cycles[1:]) if c.draft_seconds]


@dataclass
class DecodeLoopTimings:
    """What `measure_fixed` read off real requests, in seconds."""

    tree_overheads: list[tuple[int, float]] = field(default_factory=list)  # (verified nodes, overhead) of drafted cycles
    ar_overheads: list[float] = field(default_factory=list)  # overhead of greedy autoregressive steps
    sampled_overheads: list[float] = field(default_factory=list)  # overhead of autoregressive steps at T = 1
    first_levels: list[tuple[int, float]] = field(default_factory=list)  # (previous cycle's committed tokens, first level)
    forwards: list[tuple[int, int, int, float, float]] = field(default_factory=list)  # (request, n, L, state, forward)
    levels: list[tuple[int, int, float]] = field(default_factory=list)  # (request, frontier width, level) past the first

    @property
    def fixed_sampled(self) -> float:
        """What sampling adds to an autoregressive step's overhead (median at T = 1 less median at T = 0,
        >= 0): the rows' softmax and draws, the same per cycle for drafted cycles (0.4-0.6 ms for 1-4 rows
        on the AMD EPYC Zen 3)."""
        if not self.sampled_overheads or not self.ar_overheads:
            return 0.0
        return max(float(np.median(self.sampled_overheads) - np.median(self.ar_overheads)), 0.0)


def measure_fixed(target: TreeLM, drafter: TreeDrafter, prompt: list[int], *, tokens: int, seed: int,
                  speed: Callable[[TreeLM], float], rounds: int = 4) -> DecodeLoopTimings:
    """Timings of real requests of `tokens` new tokens: `rounds` rounds of greedy and sampled (T = 1)
    autoregressive decoding without a drafter and each of `FIXED_TREES`, in a shuffled order per round; a
    request's state is the mean of the probes before and after it (`speed(target)`), so the kinds are
    compared in the states they met."""
    rng = np.random.default_rng(seed)
    ars = [SpeculativeEngine(target=target, policy=Autoregressive()),
           SpeculativeEngine(target=target, policy=Autoregressive(), temperature=1.0)]
    trees = [SpeculativeEngine(target=target, policy=StaticTree(S), drafter=drafter) for S in FIXED_TREES]
    out = DecodeLoopTimings()
    ars[0].generate(prompt, max_new_tokens=4, seed=seed)  # warm-up of the one-row shapes
    ars[1].generate(prompt, max_new_tokens=4, seed=seed)
    own = ars[0].generate(prompt, max_new_tokens=tokens, seed=seed)
    # the trees continue the target's own text, where the drafter guesses as it does on real text (given a
    # text prompt, `CALIBRATION_TEXT`): cycles commit 1..4 tokens, so the catch-up is seen at several sizes
    text = list(prompt) + own.tokens
    for eng in trees:
        eng.generate(text, max_new_tokens=4, seed=seed)
    before = speed(target)
    order = [int(j) for _ in range(rounds) for j in rng.permutation(len(trees) + len(ars))]
    for request, j in enumerate(order):
        if j < len(ars):
            res = ars[j].generate(prompt, max_new_tokens=tokens, seed=seed)
            (out.ar_overheads if j == 0 else out.sampled_overheads).extend(s for _, s in _overhead_per_cycle(res))
        else:
            tree = FIXED_TREES[j - len(ars)]
            res = trees[j - len(ars)].generate(text, max_new_tokens=tokens, seed=seed)
            out.tree_overheads += _overhead_per_cycle(res)
            out.first_levels += _first_levels(res)
            out.levels += [(request, w, sec) for w, sec in _deeper_levels(res, level_widths(tree))]
        after = speed(target)
        f = 0.5 * (before + after)
        L = len(prompt) if j < len(ars) else len(text)
        for c in res.cycles:  # (request, verified nodes, committed context, state, forward seconds) in the decode loop
            out.forwards.append((request, c.tree_size + 1, L, f, c.verify_seconds))
            L += c.accepted
        before = after
    return out


def _draft_timer(target: TreeLM, drafter: TreeDrafter, prompt: list[int], pre, kmax: int, *, rng: np.random.Generator,
                 dev) -> Callable[[int], float]:
    """t_draft(w): seconds of one drafter level over a frontier of w depth-1 nodes of a real drafting
    state (the request begun on `prompt`, whose target prefill is `pre`; the target's cache is not read)."""

    def time_draft(w: int) -> float:
        drafter.begin(list(prompt), pre)  # discards any pending drafter state of the previous rep
        tree = DraftTree.from_root(int(prompt[-1]))
        exp = drafter.expand(tree, np.zeros(1, dtype=np.int64), kmax)
        toks = exp.tokens[0]
        toks = np.where(toks < 0, rng.integers(0, target.vocab_size, kmax), toks)  # model-free drafters may run short
        kids = tree.add_children(
            parents=np.zeros(kmax, dtype=np.int64), tokens=toks, ranks=np.arange(kmax),
            logq=np.zeros(kmax), entropy=np.zeros(kmax),
        )
        synchronize(dev)
        t0 = time.perf_counter()
        drafter.expand(tree, kids[:w], kmax)
        synchronize(dev)
        return time.perf_counter() - t0

    return time_draft


def calibrate_latency(
    *,
    target: TreeLM,
    drafter: TreeDrafter,
    tree_sizes: list[int],
    context_lengths: list[int],
    draft_widths: list[int],
    reps: int,
    warmup: int,
    seed: int,
    held_out_sizes: tuple[int, ...] = HELD_OUT_SIZES,
    held_out_contexts: tuple[int, ...] = HELD_OUT_CONTEXTS,
    fixed_tokens: int = 48,
    text_prompt: list[int] | None = None,
    meta: dict | None = None,
) -> LatencyCalibration:
    """Measure the latency model of docs/DESIGN.md §4 on this device (see the module docstring). One
    function on purpose (~80 lines): the three measurements share the filled cache and one random stream."""

    t_start = time.perf_counter()
    sizes, contexts, widths = sorted(set(tree_sizes)), sorted(set(context_lengths)), sorted(set(draft_widths))
    if not sizes or not contexts or not widths or reps < 1 or warmup < 0:
        raise ValueError("calibration needs tree sizes, context lengths, draft widths and reps >= 1")
    if sizes[0] < 1 or widths[0] < 1:
        raise ValueError("tree sizes and draft widths must be >= 1")
    held_sizes = [n for n in held_out_sizes if n not in sizes and n <= sizes[-1]]
    held_ctx = [L for L in held_out_contexts if L not in contexts]
    max_L = max(contexts + held_ctx)
    if max_L + sizes[-1] > target.cache.max_len:
        raise ValueError(f"context {max_L} + tree {sizes[-1]} exceeds the target cache of {target.cache.max_len} rows")
    rng = np.random.default_rng(seed)
    prompt_len = min(contexts[0], 128)
    prompt = [int(t) for t in rng.integers(0, target.vocab_size, prompt_len)]
    pre = target.prefill(prompt)  # the drafting state of t_draft; its cache is then filled for t_verify
    time_draft = _draft_timer(target, drafter, prompt, pre, max(widths), rng=rng, dev=target.device)
    _fill_cache(target, max_L, seed)
    filled = target.cache.length

    # ---- t_verify table, held-out shapes and t_draft(w) in one shuffled grid, so that every shape meets
    # the same machine states (a draft grid of its own lasted ~15 s and read its elasticity 0.4 in one
    # calibration and 1.0 in the next)
    grid = [(n, L) for n in sizes for L in contexts]
    held = [(n, L) for n in held_sizes for L in held_ctx]
    levels = [("draft", w) for w in widths]
    samples, probes = _measure_grid(
        lambda a, b: time_draft(b) if a == "draft" else _time_verify(target, a, b, rng), grid + held + levels,
        reps=reps, warmup=warmup, rng=rng, burst=2, probe=lambda: _time_verify(target, 1, contexts[0], rng),
    )
    target.cache.length, target.cache.pending = filled, 0
    # every shape at the machine's mean state over the grid, and how it moves with the state: the state of
    # a timing is its probe (a one-row forward just before) over the probes' median
    ref = float(np.median([p for v in probes.values() for p in v]))
    state = {s: np.asarray(v) / ref for s, v in probes.items()}
    mean_state = float(np.mean(np.concatenate(list(state.values()))))
    fits = {s: state_fit(v, state[s], mean_state) for s, v in samples.items()}
    draft_fits = {s[1]: fits.pop(s) for s in levels}
    verify = {s: lv for s, (lv, _) in fits.items()}
    elasticity = (fit_elasticity(verify, {s: sl for s, (_, sl) in fits.items()}, sizes, contexts) if sizes[0] == 1
                  else [1.0] * len(sizes))
    table = np.array([[verify[(n, L)] for L in contexts] for n in sizes])  # [S, C]
    a, b, mode = fit_verify(sizes, contexts, table)
    a0, b0 = a[0], b[0]  # the grid's one-row line: what a probe is compared with during the requests below

    # ---- t_draft(w) and how it follows the state
    draft = {w: float(np.median(samples[("draft", w)])) for w in widths}
    one_row_slope = float(np.median([fits[(1, L)][1] / verify[(1, L)] for L in contexts])) if sizes[0] == 1 else 0.0
    draft_elasticity = fit_draft_elasticity({w: lv for w, (lv, _) in draft_fits.items()},
                                            {w: sl for w, (_, sl) in draft_fits.items()}, one_row_slope)

    # ---- t_fixed per cycle kind from real requests
    text = list(text_prompt)[:prompt_len] if text_prompt else prompt
    loop = measure_fixed(target, drafter, text, tokens=fixed_tokens, seed=seed,
                         speed=lambda t: probe_seconds(t) / (a0 + b0 * t.cache.length))
    fixed_samples, fixed_ar_samples, first_levels = loop.tree_overheads, loop.ar_overheads, loop.first_levels
    level = decode_loop_level(sizes, a, b, table, elasticity, loop.forwards)
    # the draft table where decoding runs it: a level after a target pass, not right after `begin`
    draft_scale = decode_loop_draft_scale(widths, [draft[w] for w in widths], loop.levels)
    draft = {k: v * draft_scale for k, v in draft.items()}
    level["draft_scale"] = draft_scale
    all_states = np.concatenate(list(state.values()))
    level["grid_states"] = {"mean": mean_state, "p10": float(np.percentile(all_states, 10)),
                            "p90": float(np.percentile(all_states, 90)), "probe_seconds": ref}
    fixed, fixed_slope = fit_fixed(fixed_samples)
    catchup = fit_catchup(first_levels)
    fixed_ar = float(np.median(fixed_ar_samples)) if fixed_ar_samples else 0.0

    info = {
        "device": _device_name(target.device),
        "torch": torch.__version__,
        "reps": reps,
        "warmup": warmup,
        "seed": seed,
        "decode_loop_level": level,
        **(meta or {}),
    }
    model = LatencyModel(
        sizes=sizes, contexts=contexts, verify_table=table.tolist(), verify_intercept=a, verify_slope=b,
        slope_mode=mode, draft_widths=widths, draft_table=[draft[w] for w in widths], fixed=fixed, fixed_ar=fixed_ar,
        fixed_slope=fixed_slope, catchup=catchup, drift_elasticity=elasticity, probe_level=level["probe_level"],
        draft_elasticity=draft_elasticity, fixed_sampled=loop.fixed_sampled, meta=info,
    )
    validation = []
    for n, L in held:  # the grid's held-out shapes, at the decode loop's level like the table (interpolation error)
        pred = float(model.t_verify(n, L))
        meas = verify[(n, L)] * level["scale"]
        validation.append({"n": n, "L": L, "measured": meas, "predicted": pred, "ape": abs(pred - meas) / meas})
    mdape = float(np.median([v["ape"] for v in validation])) if validation else float("nan")
    model.meta["validation_mdape"] = mdape
    target.cache.reset()
    return LatencyCalibration(
        model=model, validation=validation, mdape=mdape, fixed_samples=[[int(n), float(x)] for n, x in fixed_samples],
        fixed_ar_samples=fixed_ar_samples, catchup_samples=[[int(b), float(x)] for b, x in first_levels],
        seconds=time.perf_counter() - t_start,
    )


def write_calibration(cal: LatencyCalibration, *, json_path: Path, png_path: Path | None = None) -> None:
    """latency.json (`artifacts.latency.write_latency`) and, optionally, the latency.png plot."""
    write_latency(cal, json_path)
    if png_path is not None:
        plot_calibration(cal, png_path=Path(png_path))


