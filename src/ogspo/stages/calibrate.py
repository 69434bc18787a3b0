"""Stages `calibrate_kernels` and `calibrate_latency`: what this device is fast at, measured.

`calibrate_device_kernels`: the kernel table of `engine.kernels` for the target's weight shapes
(cached per machine, so a rerun of the workflow does not time it again).

`calibrate_latency`: the per-device latency model of docs/DESIGN.md §4, measured on real shapes.

- t_verify(n, L): one target tree forward of n tree tokens (root included, ancestor mask of a bushy
  tree) over a KV cache holding L committed tokens, through the engine's own code path
  (`target.forward`, then `target.cache.commit(None)` to drop the pending rows). Stored as a table
  of medians over n x L; the model is piecewise linear in n (between table sizes) and linear in L
  (per-size or global slope, whichever predicts the table better by leave-one-L-out).
- t_draft(w): one drafter level (`drafter.expand`) over a frontier of w nodes at depth 1 of a real
  drafting state (request begun, root expanded); the drafter state is discarded between
  repetitions by beginning the request again. Piecewise linear in w, t_draft(0) = 0.
- t_fixed: per-cycle overhead from real `SpeculativeEngine` cycles (cycle - draft - verify, median).

    t_cycle(level_widths, n, L) = sum_l t_draft(w_l) + t_verify(n, L) + t_fixed

Shapes are timed in a shuffled, interleaved order after a warm-up, each `reps` times; medians are
kept. Held-out shapes (n and L outside the table) give the validation error (MdAPE).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import hashlib

import numpy as np
import torch

from ogspo.artifacts.latency import LatencyCalibration, LatencyModel, fit_verify, write_latency
from ogspo.engine import kernels as K
from ogspo.engine.decode import SpeculativeEngine
from ogspo.engine.drafters import TreeDrafter
from ogspo.engine.policies import StaticTree
from ogspo.engine.target import LlamaTreeLM, TreeLM, fast_path_refusal, synchronize
from ogspo.engine.tree import DraftTree, Structure, ancestor_matrix

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


def _measure_grid(fn, shapes: list[tuple], *, reps: int, warmup: int, rng: np.random.Generator) -> dict[tuple, float]:
    """Median over `reps` of fn(*shape), shapes interleaved in a shuffled order each round."""
    for _ in range(warmup):
        for s in shapes:
            fn(*s)
    samples: dict[tuple, list[float]] = {s: [] for s in shapes}
    for _ in range(reps):
        order = rng.permutation(len(shapes))
        for i in order:
            samples[shapes[i]].append(fn(*shapes[i]))
    return {s: float(np.median(v)) for s, v in samples.items()}


def _measure_draft(target: TreeLM, drafter: TreeDrafter, prompt: list[int], pre, widths: list[int], *, reps: int, warmup: int,
                   rng: np.random.Generator, dev) -> dict[tuple, float]:
    """t_draft(w): one drafter level over a frontier of w depth-1 nodes of a real drafting state."""
    kmax = max(widths)

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

    return _measure_grid(time_draft, [(w,) for w in widths], reps=reps, warmup=warmup, rng=rng)


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
    fixed_cycles: int = 12,
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
    _fill_cache(target, max_L, seed)
    filled = target.cache.length

    # ---- t_verify table and held-out shapes, interleaved
    grid = [(n, L) for n in sizes for L in contexts]
    held = [(n, L) for n in held_sizes for L in held_ctx]
    verify = _measure_grid(
        lambda n, L: _time_verify(target, n, L, rng), grid + held, reps=reps, warmup=warmup, rng=rng
    )
    target.cache.length, target.cache.pending = filled, 0
    table = np.array([[verify[(n, L)] for L in contexts] for n in sizes])  # [S, C]
    a, b, mode = fit_verify(sizes, contexts, table)

    # ---- t_draft(w): frontier of w depth-1 nodes of a real drafting state
    prompt_len = min(contexts[0], 128)
    prompt = [int(t) for t in rng.integers(0, target.vocab_size, prompt_len)]
    pre = target.prefill(prompt)
    draft = _measure_draft(target, drafter, prompt, pre, widths, reps=reps, warmup=warmup, rng=rng, dev=target.device)

    # ---- t_fixed from real engine cycles
    struct = Structure.full([2, 2, 1])
    engine = SpeculativeEngine(target=target, policy=StaticTree(struct), drafter=drafter)
    res = engine.generate(prompt, max_new_tokens=fixed_cycles * 2 + 1, seed=seed)
    fixed_samples = [c.other_seconds for c in res.cycles]
    fixed = float(np.median(fixed_samples)) if fixed_samples else 0.0

    info = {
        "device": _device_name(target.device),
        "torch": torch.__version__,
        "reps": reps,
        "warmup": warmup,
        "seed": seed,
        **(meta or {}),
    }
    model = LatencyModel(
        sizes=sizes, contexts=contexts, verify_table=table.tolist(), verify_intercept=a, verify_slope=b,
        slope_mode=mode, draft_widths=widths, draft_table=[draft[(w,)] for w in widths], fixed=fixed, meta=info,
    )
    validation = []
    for n, L in held:
        pred = float(model.t_verify(n, L))
        validation.append({"n": n, "L": L, "measured": verify[(n, L)], "predicted": pred, "ape": abs(pred - verify[(n, L)]) / verify[(n, L)]})
    mdape = float(np.median([v["ape"] for v in validation])) if validation else float("nan")
    model.meta["validation_mdape"] = mdape
    target.cache.reset()
    return LatencyCalibration(
        model=model, validation=validation, mdape=mdape, fixed_samples=fixed_samples, seconds=time.perf_counter() - t_start
    )


def kernel_cache_dir() -> Path:
    return K.native.cache_root() / "kernels"


def calibrate_device_kernels(
    hf_model, cfg: dict, *, device: str = "cpu", cache: Path | None = None, log=print
) -> tuple[K.KernelTable, bool]:
    """The kernel table for this model's weight classes and layer ops on this device (`engine.kernels`),
    and whether it came from the cache. cfg: the `kernels` config section. The cache key is the device
    key (CPU model, torch version, threads, dtype), the weight shapes, the settings, the selection rule and the native
    kernel's source, so any change times afresh. Only CPU kernels are timed: on CUDA the table holds
    the reference kernel (cuBLAS through F.linear) for every class. A model off the fast path
    (`fast_path_refusal`: Gemma, ...) runs through transformers' modules, which take no table: it
    gets an empty one that says why."""
    refusal = fast_path_refusal(hf_model.config)
    if refusal is not None:
        dtype = next(hf_model.parameters()).dtype
        return K.reference_table({}, device, dtype, f"the transformers backend runs this model ({refusal}): no kernels to choose"), False
    lm = LlamaTreeLM(hf_model, max_len=8)  # reference kernels only: just to collect the fused weights
    weights = {c: [w.w for w in lm.mm[c].weights] for c in K.CLASSES}
    shapes = {c: list(ws[0].shape) for c, ws in weights.items()}
    if device != "cpu":
        return K.reference_table(shapes, device, lm.dtype, f"only the reference kernel is used on {device}"), False
    threads = torch.get_num_threads()
    candidates = tuple(k for name in cfg["candidates"] for k in (K.native_kernels(threads) if name == "native" else (name,)))
    layer_ops = {"shape": lm.layer_ops_shape, "n_layers": len(lm.layers), "eps": lm.eps, "context": cfg["layer_ops_context"], "max_rows": 64}
    ident = {"key": K.device_key("cpu", lm.dtype), "shapes": shapes, "rows": cfg["rows"], "reps": cfg["reps"],
             "candidates": candidates, "layer_ops": layer_ops, "selection": K.SELECTION, "native": K.native.source_texts()}
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    cached = (cache or kernel_cache_dir()) / f"kernels-{digest}.json"
    if cfg["cache"] and cached.is_file():
        return K.read_kernel_table(cached), True
    table = K.calibrate_kernels(weights, rows=cfg["rows"], reps=cfg["reps"], candidates=candidates, layer_ops=layer_ops,
                                max_seconds=cfg["max_seconds"], log=log)
    table.meta["cache_key"] = digest
    if cfg["cache"]:
        K.write_kernel_table(table, cached)
    return table, False


def write_calibration(cal: LatencyCalibration, *, json_path: Path, png_path: Path | None = None) -> None:
    """latency.json (`artifacts.latency.write_latency`) and, optionally, the latency.png plot."""
    write_latency(cal, json_path)
    if png_path is not None:
        plot_calibration(cal, png_path=Path(png_path))


def plot_calibration(cal: LatencyCalibration, *, png_path: Path, dpi: int = 80) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = cal.model
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ns = np.arange(1, max(m.sizes) + 1)
    Ls = sorted(set(m.contexts) | {v["L"] for v in cal.validation})
    for i, L in enumerate(Ls):
        color = f"C{i}"
        ax1.plot(ns, 1e3 * m.t_verify(ns, L), "-", color=color, lw=1, label=f"model L={L}")
        if L in m.contexts:
            j = m.contexts.index(L)
            ax1.plot(m.sizes, 1e3 * np.asarray(m.verify_table)[:, j], "o", color=color, ms=3)
        pts = [v for v in cal.validation if v["L"] == L]
        if pts:
            ax1.plot([v["n"] for v in pts], [1e3 * v["measured"] for v in pts], "x", color=color, ms=6)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("tree tokens n (root included)")
    ax1.set_ylabel("t_verify (ms)")
    ax1.set_title(f"verify: table (o), held-out (x), MdAPE {100 * cal.mdape:.1f}%", fontsize=9)
    ax1.legend(fontsize=7)
    ws = np.arange(1, max(m.draft_widths) + 1)
    ax2.plot(m.draft_widths, 1e3 * np.asarray(m.draft_table), "o", ms=3, label="measured")
    ax2.plot(ws, 1e3 * m.t_draft(ws), "-", lw=1, label="model")
    ax2.set_xlabel("frontier width w")
    ax2.set_ylabel("t_draft (ms)")
    ax2.set_title(f"draft level ({m.meta.get('drafter', '?')}); t_fixed {1e3 * m.fixed:.1f} ms", fontsize=9)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = png_path.with_name(f".{png_path.stem}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=dpi)
    plt.close(fig)
    os.replace(tmp, png_path)
