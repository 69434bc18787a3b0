"""Matmul kernels of the target's forward, chosen per device by measurement (`calibrate_kernels`).

A tree forward multiplies m rows (m = tree size, 1..64; the prompt length at prefill) by every
weight matrix of the target. Which implementation is fastest depends on the CPU (AVX-512/AMX or
AVX2, MKL's small-m paths), the thread count and m itself, so nothing here is chosen by a constant:
a `KernelTable` maps (matmul class, row count) to the fastest measured candidate and to the row
count to pad to when a larger one was measured cheaper. Without a table every matmul is torch's
own `F.linear` (the reference kernel).

Classes: `qkv` (fused Q/K/V), `o`, `gate_up` (fused), `down`, `lm_head`. Candidates:

- `linear`:   `F.linear(x, W)` over W [out, in] (the weight shared with the transformers model)
- `matmul_t`: `x @ Wt` over a transposed copy Wt [in, out]
- `wx_t`:     `(W @ x.T).T` over W (the product computed transposed: another BLAS path)
- `mkldnn`:   oneDNN linear over a weight reordered for it (torch.ops.mkldnn)
- `numpy`:    numpy's BLAS (OpenBLAS in numpy wheels) on zero-copy views of x and Wt
- `native1`, `native2`, ...: the engine's own GEMM (`ogspo.engine.native`) on 1, 2, ... threads

Numerics: every candidate computes the same product in fp32 with its own summation order, so two
candidates differ in the last bits. `native*` gives a row the same bits whatever the row count
(batch-invariant); the others may not. The engine stays lossless either way (the verifier's
result only depends on the logits it is given; a greedy flip against the 1-row step can happen
only on a near-tie, which `engine.lossless.compare_greedy` tells apart from a bug).

A bf16 weight (a bf16 target) takes fp32 rows and gives fp32 rows: the rows are rounded to bf16 and
the sums run in fp32 (`native*`: AVX512-BF16, fp32 output; torch's candidates: oneDNN's bf16
product, its output rounded to bf16 and widened back). For bf16 the calibration admits only kernels
that give every row the native kernel's bits at every row count (`batch_invariant`): bf16 rounding
makes near-ties common, so a row's logits must not depend on the tree size or the kernel picked.

The table has one more entry, `layer_ops`: which implementation of a layer's non-matmul work
(`engine.layer_ops`: `torch`, or the native ops on 1, 2, ... threads) runs a single-sequence
forward of m rows, timed the same way over all layers' caches at a typical context.

Only the weight layouts a table uses are built (a model run without a table keeps none).
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from . import native
from .layer_ops import TORCH, Step, make_layer_ops

SCHEMA_VERSION = 2
CLASSES = ("qkv", "o", "gate_up", "down", "lm_head")  # matmul classes
BASE_KERNELS = ("linear", "matmul_t", "wx_t", "mkldnn", "numpy")
REFERENCE = "linear"
LAYER_OPS = "layer_ops"  # the table entry for the non-matmul work of a layer
# how calibrate_kernels picks from its timings (part of the kernel cache key): pad only to a row count
# measured 3% cheaper; keep a native kernel within 3% of the fastest
SELECTION = {"pad_margin": 0.03, "invariant_margin": 0.03}


def native_kernels(threads: int) -> tuple[str, ...]:
    """Names of the native candidates for a torch thread count: native1 .. native{threads}."""
    return tuple(f"native{t}" for t in range(1, max(1, threads) + 1))


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_key(device: str = "cpu", dtype: torch.dtype = torch.float32) -> dict:
    """What a kernel table is valid for: the CPU (or GPU) model, torch version, thread count and dtype."""
    name = cpu_model() if device == "cpu" else torch.cuda.get_device_name(torch.device(device))
    return {"device": device, "model": name, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "dtype": str(dtype).removeprefix("torch.")}


# ------------------------------------------------------------------------------------ weights


class Weight:
    """One weight matrix W [out, in] in the layouts its class's kernels need."""

    def __init__(self, w: torch.Tensor, kernels: set[str]):
        w = w.detach()
        if w.dtype != torch.float32 and "numpy" in kernels:
            raise ValueError(f"kernel 'numpy' multiplies fp32 weights only, not {w.dtype}")
        self.w = w  # [out, in], shared with the transformers module
        self.out_features, self.in_features = w.shape
        self.w_t = w.t().contiguous() if kernels & {"matmul_t", "numpy"} else None  # [in, out]
        self.w_np = self.w_t.numpy() if "numpy" in kernels else None
        self.w_mkldnn = torch.ops.mkldnn._reorder_linear_weight(w) if "mkldnn" in kernels else None
        self.packed = native.PackedWeight(w) if any(k.startswith("native") for k in kernels) else None

    def apply(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] with the named kernel (a bf16 weight: x and the result fp32)."""
        if self.w.dtype != x.dtype and not kernel.startswith("native"):
            return self.apply(kernel, x.to(self.w.dtype)).to(x.dtype)  # torch's bf16 product, widened back
        if kernel == "linear":
            return F.linear(x, self.w)
        if kernel == "matmul_t":
            return x @ self.w_t
        if kernel == "wx_t":
            x2 = x.reshape(-1, self.in_features)
            return (self.w @ x2.T).T.reshape(*x.shape[:-1], self.out_features)
        if kernel == "mkldnn":
            return torch.ops.mkldnn._linear_pointwise(x, self.w_mkldnn, None, "none", [], "")
        if kernel == "numpy":
            x2 = x.reshape(-1, self.in_features)
            if not x2.is_contiguous():
                x2 = x2.contiguous()
            return torch.as_tensor(x2.numpy() @ self.w_np, device="cpu").view(*x.shape[:-1], self.out_features)
        if kernel.startswith("native"):
            return self.packed.matmul(x, int(kernel[len("native") :]))
        raise ValueError(f"unknown kernel '{kernel}'")


# ------------------------------------------------------------------------------------ table


@dataclass
class KernelTable:
    """Per class: the kernel and the padded row count for every timed row count (ascending)."""

    key: dict  # device_key() of the machine it was measured on
    shapes: dict[str, list[int]]  # class -> [out, in]
    rows: list[int]  # timed row counts, ascending
    choice: dict[str, list[str]]  # class -> kernel per entry of `rows`
    pad_to: dict[str, list[int]]  # class -> row count to run instead (>= rows[i])
    timings_us: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # class -> kernel -> median us per row count
    meta: dict = field(default_factory=dict)

    def kernels(self, cls: str) -> set[str]:
        return set(self.choice[cls])

    def lookup(self, cls: str, m: int) -> tuple[str, int]:
        """(kernel, rows to pad to) for a matmul of m rows: the entry of the smallest timed row
        count >= m, or the largest one (without padding) past the table."""
        i = int(np.searchsorted(self.rows, m))
        if i >= len(self.rows):
            return self.choice[cls][-1], m
        if self.rows[i] == m:
            return self.choice[cls][i], self.pad_to[cls][i]
        pad = self.pad_to[cls][i]
        return self.choice[cls][i], pad if pad != self.rows[i] else m

    def layer_ops(self, m: int) -> str:
        """The layer-ops implementation for a single-sequence forward of m rows ("torch" where the
        table has no `layer_ops` entry)."""
        return self.lookup(LAYER_OPS, m)[0] if LAYER_OPS in self.choice else TORCH

    def cheapest_rows(self, at_least: int = 1) -> int:
        """The timed row count (>= `at_least`) whose forward costs least per row: the chosen kernels'
        times summed over the matmul classes, divided by the rows (a teacher-forced pass over text
        runs at this width). `at_least` itself where the table timed no such row count."""
        best, best_cost = at_least, float("inf")
        for i, m in enumerate(self.rows):
            if m < at_least:
                continue
            try:
                t = sum(self.timings_us[c][self.choice[c][i]][i] for c in CLASSES)
            except (KeyError, IndexError):  # a class not timed at this row count (the LM head's largest)
                continue
            if t / m < best_cost:
                best, best_cost = m, t / m
        return best

    def check_shapes(self, shapes: dict[str, list[int]]) -> None:
        for cls in (*CLASSES, *([LAYER_OPS] if LAYER_OPS in self.choice else [])):
            if cls in shapes and list(self.shapes.get(cls, [])) != list(shapes[cls]):
                what = ("layer ops of [heads, kv heads, head dim, dim, intermediate]" if cls == LAYER_OPS
                        else f"{cls} weights of shape")
                raise ValueError(
                    f"kernel table was measured for {what} {self.shapes.get(cls)}, this model has "
                    f"{list(shapes[cls])}: run `ogspo calibrate-kernels` for this model"
                )

    def to_json(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION, "key": self.key, "shapes": self.shapes, "rows": self.rows,
            "choice": self.choice, "pad_to": self.pad_to, "timings_us": self.timings_us, "meta": self.meta,
        }

    @classmethod
    def from_json(cls, doc: dict) -> "KernelTable":
        if doc.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"kernel table schema {doc.get('schema_version')!r}; this ogspo reads {SCHEMA_VERSION}")
        t = cls(key=doc["key"], shapes=doc["shapes"], rows=[int(r) for r in doc["rows"]], choice=doc["choice"],
                pad_to={k: [int(x) for x in v] for k, v in doc["pad_to"].items()}, timings_us=doc.get("timings_us", {}),
                meta=doc.get("meta", {}))
        for c, ks in t.choice.items():
            if c not in (*CLASSES, LAYER_OPS) or len(ks) != len(t.rows) or len(t.pad_to.get(c, [])) != len(t.rows):
                raise ValueError(f"kernel table: class '{c}' must be one of {', '.join(CLASSES)}, {LAYER_OPS} with one entry per "
                                 "row count")
            allowed = (TORCH,) if c == LAYER_OPS else BASE_KERNELS
            bad = set(ks) - set(allowed) - set(native_kernels(64))
            if bad:
                raise ValueError(f"kernel table: unknown kernel(s) {sorted(bad)} for '{c}'; allowed: {', '.join(allowed)}, "
                                 "native<threads>")
        return t


def reference_table(shapes: dict[str, list[int]], device: str, dtype: torch.dtype, why: str) -> KernelTable:
    """A table that runs every class with the reference kernel (nothing timed), e.g. on CUDA."""
    choice = {c: [TORCH if c == LAYER_OPS else REFERENCE] for c in shapes}
    return KernelTable(key=device_key(device, dtype), shapes=shapes, rows=[1], choice=choice,
                       pad_to={c: [1] for c in shapes}, meta={"seconds": 0, "not_timed": why})


def describe(table: KernelTable) -> str:
    """One line per class: row ranges and their kernel (-> padded row count)."""
    lines = []
    for c in [c for c in (*CLASSES, LAYER_OPS) if c in table.choice]:
        runs, prev = [], None
        for r, k, p in zip(table.rows, table.choice[c], table.pad_to[c]):
            label = k if p == r else f"{k}->{p}"
            if prev is not None and prev[2] == label:
                prev[1] = r
            else:
                prev = [r, r, label]
                runs.append(prev)
        lines.append(f"{c} {table.shapes[c]}: " + ", ".join(f"{a}-{b}: {lab}" if a != b else f"{a}: {lab}" for a, b, lab in runs))
    return "\n".join(lines)


def read_kernel_table(path: str | Path) -> KernelTable:
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"kernel table {path} does not exist (rule calibrate_kernels writes it)") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"kernel table {path} is not JSON: {err}") from None
    return KernelTable.from_json(doc)


def write_kernel_table(table: KernelTable, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(table.to_json(), indent=1) + "\n")
    os.replace(tmp, path)


def check_usable(table: KernelTable, device: str, dtype: torch.dtype) -> None:
    """Refuse a table measured for another device kind or dtype, or naming a native kernel not built here."""
    if table.key.get("device", "cpu").split(":")[0] != device.split(":")[0]:
        raise ValueError(f"kernel table was measured on '{table.key.get('device')}', the target runs on '{device}'")
    want = str(dtype).removeprefix("torch.")
    if table.key.get("dtype") != want:
        raise ValueError(f"kernel table was measured for {table.key.get('dtype')} weights, the target is {want}")
    if any(k.startswith("native") for ks in table.choice.values() for k in ks) and native.load() is None:
        raise RuntimeError(f"kernel table uses the native kernel, which cannot be built here: {native.unavailable_reason()}")


# ------------------------------------------------------------------------------------ dispatch


class Matmul:
    """The matmul of one class over its layers' weights, dispatched by row count through a table."""

    def __init__(self, cls: str, weights: list[torch.Tensor], table: KernelTable | None):
        self.cls = cls
        if table is not None and cls not in table.choice:  # a table with nothing timed for this class (one made for
            table = None  # a transformers-backend target holds no class): the reference kernel
        used = table.kernels(cls) if table is not None else {REFERENCE}
        self.weights = [Weight(w, used) for w in weights]
        self.table = table
        self._plan: dict[int, tuple[str, int]] = {}

    def plan(self, m: int) -> tuple[str, int]:
        p = self._plan.get(m)
        if p is None:
            p = (REFERENCE, m) if self.table is None else self.table.lookup(self.cls, m)
            self._plan[m] = p
        return p

    def native_threads(self, m: int) -> int | None:
        """The native kernel's thread count when the table runs m rows of this class on it, else None."""
        kernel, _ = self.plan(m)
        return int(kernel[len("native") :]) if kernel.startswith("native") else None

    def __call__(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] for the weight of `layer`; padded to a cheaper row count when
        the table says so (extra zero rows, dropped from the result)."""
        rows = x.numel() // x.shape[-1]
        kernel, pad = self.plan(rows) if x.device.type == "cpu" else (REFERENCE, rows)
        w = self.weights[layer]
        if pad == rows:
            return w.apply(kernel, x)
        x2 = torch.zeros(pad, x.shape[-1], dtype=x.dtype, device=x.device)  # [pad, in]
        x2[:rows] = x.reshape(rows, -1)
        return w.apply(kernel, x2)[:rows].view(*x.shape[:-1], w.out_features)


# ------------------------------------------------------------------------------------ calibration


def _pick(kernels: list[str], t: dict[str, float], margin: float) -> str:
    """The fastest kernel, or the fastest native (batch-invariant) one if it is within `margin`."""
    fastest = min(kernels, key=t.get)
    invariant = [k for k in kernels if k.startswith("native")]
    if invariant:
        k = min(invariant, key=t.get)
        if t[k] <= (1 + margin) * t[fastest]:
            return k
    return fastest


def layer_ops_shape(*, n_heads: int, kv_heads: int, head_dim: int, dim: int, inter: int) -> list[int]:
    """The `shapes` entry of `layer_ops`: the sizes its timings depend on (per layer; an early-exit
    drafter with fewer of the target's layers shares the entry)."""
    return [n_heads, kv_heads, head_dim, dim, inter]


def _layer_ops_runner(name: str, shape: list[int], n_layers: int, eps: float, context: int, rows: list[int], g: torch.Generator):
    """A function of m that runs the non-matmul work of `n_layers` layers once for m new rows on a
    `context`-row cache (as a verification forward does), with implementation `name`."""
    H, KV, hd, dim, inter = shape
    ops = make_layer_ops(name, n_heads=H, kv_heads=KV, head_dim=hd, eps=eps)
    m_max = max(rows)
    max_len = context + m_max
    keys = [torch.randn(1, KV, max_len, hd, generator=g) for _ in range(n_layers)]
    values = [torch.randn(1, KV, max_len, hd, generator=g) for _ in range(n_layers)]
    cos, sin = torch.randn(max_len, hd, generator=g), torch.randn(max_len, hd, generator=g)
    ln = torch.ones(dim, device="cpu")
    inputs = {}
    for m in rows:
        attend = None if m == 1 else torch.ones(m, m, dtype=torch.bool,
                                                device="cpu").tril_()  # a chain: every row sees its ancestors
        mask = None if m == 1 else torch.cat([torch.ones(m, context, dtype=torch.bool, device="cpu"), attend],
                                             1)[None, None]  # [1, 1, m, end]
        step = Step(positions=torch.arange(context, context + m, device="cpu")[None], start=context, committed=context,
                    attend=attend,
                    mask=mask, cos_table=cos, sin_table=sin)
        inputs[m] = (step, torch.randn(1, m, dim, generator=g), 0.01 * torch.randn(1, m, dim, generator=g),
                     torch.randn(1, m, (H + 2 * KV) * hd, generator=g), torch.randn(1, m, 2 * inter, generator=g))

    def run(m: int) -> None:
        step, x, r, qkv, gu = inputs[m]
        for i in range(n_layers):
            x, h = ops.add_rmsnorm(x, r, ln)
            ops.rope_attention(qkv, None, step, keys[i], values[i])
            x, h = ops.add_rmsnorm(x, r, ln)
            ops.silu_mul(gu)

    return run


def _select(med: dict, runners: dict, classes: list[str], rows: list[int], *, pad_margin: float, invariant_margin: float):
    """Per class, from the median timings: the kernel and the padded row count for every row count,
    and the timings table (class -> kernel -> us per timed row count)."""
    choice, pad_to, timings = {}, {}, {}
    for c in classes:
        ks = [k for (cc, k) in runners if cc == c]
        timed = [m for m in rows if (c, ks[0], m) in med]
        timings[c] = {k: [round(med[(c, k, m)], 1) for m in timed] for k in ks}
        best = [_pick(ks, {k: med[(c, k, m)] for k in ks}, invariant_margin) for m in timed]
        best_t = [med[(c, best[i], m)] for i, m in enumerate(timed)]
        choice[c], pad_to[c] = [], []
        for i, m in enumerate(rows):
            if i >= len(timed):  # past the timed rows: the last timed kernel (torch's layer ops), unpadded
                choice[c].append(TORCH if c == LAYER_OPS else choice[c][-1])
                pad_to[c].append(m)
                continue
            # pad to the cheapest larger row count only where it beats this one by `pad_margin`
            # (matmuls only: the layer ops' cost is not what a padded matmul pays)
            j = i if c == LAYER_OPS else min(range(i, len(timed)), key=lambda j: best_t[j])
            if best_t[j] > (1 - pad_margin) * best_t[i]:
                j = i
            choice[c].append(best[j])
            pad_to[c].append(timed[j])
    return choice, pad_to, timings


def one_row_outputs(weight: Weight, kernel: str, x: torch.Tensor, rows: list[int]) -> dict[int, torch.Tensor]:
    """The outputs [1, out] of rows 0 and m - 1 (m in `rows`) of x, each computed alone with `kernel`."""
    return {i: weight.apply(kernel, x[i : i + 1]) for i in {0, *(m - 1 for m in rows)}}


def batch_invariant(weight: Weight, kernel: str, x: torch.Tensor, rows: list[int], alone: dict[int, torch.Tensor]) -> bool:
    """Whether `kernel` over the first m rows of x gives rows 0 and m - 1 bitwise the outputs `alone`
    (`one_row_outputs`: of this kernel, or of the kernel the table must agree with) for every m in `rows`."""
    for m in rows:
        y = weight.apply(kernel, x[:m])  # [m, out]
        if not (torch.equal(y[:1], alone[0]) and torch.equal(y[m - 1 : m], alone[m - 1])):
            return False
    return True


def _prepare_runners(weights, candidates, rows, shapes, layer_ops, lm_head_max_rows, g, require_invariant):
    """(class, kernel) -> a function of the row count that runs it once over every layer; the row
    limit per class; the candidates that cannot run here and why. Adds the layer ops' shape to `shapes`.

    With `require_invariant` every kernel of a class must give each row the bits the first native
    candidate (else the first candidate that runs) gives that row alone, at every row count: then a
    row's output does not depend on the row count nor on which kernel the table picks for it, and a
    kernel that fails on some class is refused."""
    unavailable = {}
    runners = {}  # (class, kernel) -> function of the row count
    for c, ws in weights.items():
        check_rows = [m for m in rows if c != "lm_head" or m <= lm_head_max_rows]
        x_check = torch.randn(max(check_rows), ws[0].shape[1], generator=g)  # fp32 rows, as the engine passes them
        alone = None  # the reference kernel's one-row outputs
        order = sorted(candidates, key=lambda k: not k.startswith("native"))  # natives first: the reference
        for k in order:
            if k in unavailable:
                continue
            try:
                wts = [Weight(w, {k}) for w in ws]
                wts[0].apply(k, torch.zeros(2, ws[0].shape[1], device="cpu"))
            except (RuntimeError, ValueError) as err:
                unavailable[k] = str(err).splitlines()[0]
                continue
            if require_invariant:
                alone = alone or one_row_outputs(wts[0], k, x_check, check_rows)
                if not batch_invariant(wts[0], k, x_check, check_rows, alone):
                    unavailable[k] = (f"not batch-invariant on '{c}' (a row's bits depend on the row count or differ "
                                      "from the reference kernel's)")
                    runners = {ck: r for ck, r in runners.items() if ck[1] != k}
                    continue
            xs = {m: torch.randn(m, shapes[c][1], generator=g) for m in rows if c != "lm_head" or m <= lm_head_max_rows}
            runners[(c, k)] = lambda m, wts=wts, k=k, xs=xs: [w.apply(k, xs[m]) for w in wts]
    max_rows = {"lm_head": lm_head_max_rows}
    if layer_ops is not None:
        shapes[LAYER_OPS] = list(layer_ops["shape"])
        max_rows[LAYER_OPS] = layer_ops["max_rows"]
        ops_rows = [m for m in rows if m <= layer_ops["max_rows"]]
        for k in (TORCH, *(k for k in candidates if k.startswith("native"))):
            try:
                runners[(LAYER_OPS, k)] = _layer_ops_runner(k, shapes[LAYER_OPS], layer_ops["n_layers"], layer_ops["eps"],
                                                            layer_ops["context"], ops_rows, g)
            except RuntimeError as err:
                unavailable[k] = str(err).splitlines()[0]
    return runners, max_rows, unavailable


def calibrate_kernels(
    weights: dict[str, list[torch.Tensor]],
    *,
    rows: list[int],
    reps: int = 5,
    candidates: tuple[str, ...] | None = None,
    layer_ops: dict | None = None,
    max_seconds: float = 300.0,
    lm_head_max_rows: int = 64,
    pad_margin: float = SELECTION["pad_margin"],
    invariant_margin: float = SELECTION["invariant_margin"],
    seed: int = 0,
    log=None,
) -> KernelTable:
    """Time every candidate kernel on every class and row count, over all of the class's layer
    weights in turn (so weights stream from memory as in a real forward, not from cache), in
    shuffled interleaved rounds; keep the fastest per (class, rows), then let a row count take
    the plan of a larger one that was measured cheaper (padding). `max_seconds` caps the timing:
    rounds stop early (at least one kept) once it is spent. A row count is padded only to one
    measured at least `pad_margin` cheaper (not on noise). The LM head is timed up to
    `lm_head_max_rows` (tree sizes; prefill computes one row of logits) and keeps that plan beyond.
    A native kernel measured within `invariant_margin` of the fastest is kept instead of it: within
    the timing noise, a batch-invariant kernel is worth more (a row's logits then do not depend on
    the tree size, so greedy decoding cannot flip on a near-tie, and two calibrations agree).
    Weights other than fp32 (bf16) admit batch-invariant kernels only (`batch_invariant`, checked
    on every class before timing).

    `layer_ops` ({"shape": layer_ops_shape(...), "n_layers", "eps", "context", "max_rows"}) also times the
    layers' non-matmul work: "torch" against the native ops on each thread count among the
    candidates, for row counts up to max_rows (tree sizes); longer prefills run torch's (SDPA's
    blocked attention is built for them; the native ops are not timed there)."""
    threads = torch.get_num_threads()
    if candidates is None:
        candidates = BASE_KERNELS + native_kernels(threads)
    rows = sorted(set(int(r) for r in rows))
    shapes = {c: list(ws[0].shape) for c, ws in weights.items()}
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    dtype = next(iter(weights.values()))[0].dtype
    runners, max_rows, unavailable = _prepare_runners(weights, candidates, rows, shapes, layer_ops, lm_head_max_rows, g,
                                                      require_invariant=dtype != torch.float32)
    if not any(c in weights for c, _ in runners):
        raise ValueError(f"no {str(dtype).removeprefix('torch.')} matmul kernel can run here: "
                         + "; ".join(f"{k}: {why}" for k, why in unavailable.items()))
    classes = list(weights) + ([LAYER_OPS] if layer_ops is not None else [])
    cells = [(c, k, m) for (c, k) in runners for m in rows if m <= max_rows.get(c, m)]
    times: dict[tuple[str, str, int], list[float]] = {cell: [] for cell in cells}
    # numpy's BLAS threads busy-wait after each call and slow whatever runs next on the same cores,
    # so its cells are timed in a phase of their own, after every other kernel's
    phases = [[cell for cell in cells if cell[1] != "numpy"], [cell for cell in cells if cell[1] == "numpy"]]
    t_start = time.perf_counter()
    for p, phase in enumerate(p for p in phases if p):
        t_phase = time.perf_counter()
        budget = max_seconds * len(phase) / len(cells)
        for r in range(reps + 1):  # round 0 is warm-up
            for i in rng.permutation(len(phase)):
                c, k, m = phase[i]
                run = runners[(c, k)]
                t0 = time.perf_counter()
                run(m)
                if r > 0:
                    times[(c, k, m)].append((time.perf_counter() - t0) * 1e6)
            if log is not None:
                log(f"kernel calibration phase {p + 1}, round {r}/{reps}: {time.perf_counter() - t_start:.0f} s")
            if r >= 1 and time.perf_counter() - t_phase > budget:
                break
    med = {cell: float(np.median(v)) for cell, v in times.items()}
    choice, pad_to, timings = _select(med, runners, classes, rows, pad_margin=pad_margin, invariant_margin=invariant_margin)
    return KernelTable(
        key=device_key("cpu", dtype), shapes=shapes, rows=rows, choice=choice, pad_to=pad_to, timings_us=timings,
        meta={"reps": reps, "seconds": round(time.perf_counter() - t_start, 1), "candidates": list(candidates),
              "unavailable": unavailable, "native_vector_width": native.vector_width(),
              **({"layer_ops_context": layer_ops["context"]} if layer_ops is not None else {})},
    )
