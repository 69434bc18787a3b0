"""The non-matmul work of a Llama decoder layer, in two implementations the kernel table picks from.

A layer is four matmuls (`engine.kernels`) and, between them, three pieces of small work:

- `add_rmsnorm(x, r, w)`: the residual add x + r (r None: none) and the RMSNorm of the sum;
- `rope_attention(qkv, bias, step, keys, values)`: bias, rotary embedding of queries and keys,
  the cache write of the new keys/values, and attention over the cache rows each new row may see;
- `silu_mul(gu)`: the SwiGLU gate silu(g) * u of the fused gate/up output.

`TorchLayerOps` ("torch") does it with torch ops (any batch size, any device): ~30 ops a layer,
a few microseconds of dispatch each. `NativeLayerOps` ("native1", "native2", ...: threads) does
it in three C calls a layer (`engine.native`, ops.c) for single-sequence CPU forwards; each row's
result is independent of how many rows share the forward (see ops.c). Which one runs at m rows
is the kernel table's `layer_ops` entry, measured per device like the matmuls.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from . import native

TORCH = "torch"


@dataclass
class Step:
    """Where a forward's new rows go and what they may attend to.

    positions [B, m] int64; the new rows are cache rows start..start+m. Single sequence (B = 1):
    rows 0..committed are visible to every new row, and of the pending rows committed..start+m a
    row sees those `attend` [m, start - committed + m] marks (None: causal). `mask` is the same
    as a boolean SDPA mask [B or 1, 1, m, start + m] (None: one causal token), the only form a
    batch of sequences (`LlamaTreeLM.forward_batch`) gives. `window_mask` (same shape) is the mask
    of sliding-window layers once a position reaches the window (None: `mask` holds for them too);
    only the torch ops read it."""

    positions: torch.Tensor
    start: int
    committed: int
    attend: torch.Tensor | None
    mask: torch.Tensor | None
    cos_table: torch.Tensor  # [max_len, hd]
    sin_table: torch.Tensor
    window_mask: torch.Tensor | None = None

    @property
    def m(self) -> int:
        return self.positions.shape[-1]

    @cached_property
    def row_inputs(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Single sequence: positions [m] and attend, contiguous (what C code reads)."""
        attend = None if self.attend is None else self.attend.contiguous()
        return self.positions[0].contiguous(), attend

    @cached_property
    def cos(self) -> torch.Tensor:
        return self.cos_table[self.positions][:, :, None]  # [B, m, 1, hd]

    @cached_property
    def sin(self) -> torch.Tensor:
        return self.sin_table[self.positions][:, :, None]  # [B, m, 1, hd]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


class TorchLayerOps:
    name = TORCH

    def __init__(self, *, n_heads: int, kv_heads: int, head_dim: int, eps: float):
        self.H, self.KV, self.hd, self.eps = n_heads, kv_heads, head_dim, eps

    def add_rmsnorm(self, x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if r is not None:
            x = x + r
        var = x.pow(2).mean(-1, keepdim=True)
        return x, x * torch.rsqrt(var + self.eps) * w

    def rope_attention(self, qkv, bias, step: Step, keys: torch.Tensor, values: torch.Tensor, *,
                       sliding: bool = False, qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """qkv [B, m, (H + 2KV) * hd] -> attention output [B, m, H * hd]; keys/values [B, KV, max_len, hd].
        `sliding`: a sliding-window layer (reads `step.window_mask`); `qk_norm`: per-head RMSNorm
        weights (q [hd], k [hd]) applied to queries and keys before the rotary embedding (Qwen3)."""
        B, m, _ = qkv.shape
        H, KV, hd = self.H, self.KV, self.hd
        start, end = step.start, step.start + m
        if bias is not None:
            qkv = qkv + bias
        heads = qkv.view(B, m, H + 2 * KV, hd)
        qk = heads[:, :, : H + KV]  # [B, m, H + KV, hd]: queries and keys get the rotary embedding at once
        if qk_norm is not None:
            w = torch.cat([qk_norm[0].expand(H, hd), qk_norm[1].expand(KV, hd)])  # [H + KV, hd]
            qk = qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + self.eps) * w
        qk = qk * step.cos + _rotate_half(qk) * step.sin
        q = qk[:, :, :H].transpose(1, 2)  # [B, H, m, hd]
        keys[:, :, start:end] = qk[:, :, H:].transpose(1, 2)  # [B, KV, m, hd]
        values[:, :, start:end] = heads[:, :, H + KV :].transpose(1, 2)
        mask = step.window_mask if sliding and step.window_mask is not None else step.mask
        o = F.scaled_dot_product_attention(
            q, keys[:, :, :end], values[:, :, :end], attn_mask=mask, enable_gqa=H != KV
        )  # [B, H, m, hd]
        return o.transpose(1, 2).reshape(B, m, H * hd)

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        g, u = gu.chunk(2, dim=-1)  # [B, m, inter] each
        return F.silu(g) * u


class NativeLayerOps:
    """ops.c on `threads` threads; single sequence, fp32, CPU."""

    def __init__(self, *, n_heads: int, kv_heads: int, head_dim: int, eps: float, threads: int):
        lib = native.load()
        if lib is None:
            raise RuntimeError(f"native layer ops unavailable: {native.unavailable_reason()}")
        if head_dim % native.vector_width():
            raise RuntimeError(f"native layer ops need a head dimension that is a multiple of {native.vector_width()}, not "
                               f"{head_dim}")
        self.H, self.KV, self.hd, self.eps, self.threads = n_heads, kv_heads, head_dim, eps, threads
        self.name = f"native{threads}"
        self._lib = lib
        self._scratch: torch.Tensor | None = None  # decoder_layer's work space, grown on demand
        self._counts: dict[tuple[int, ...], ctypes.Array] = {}  # decoder_layer's thread counts as C arrays

    def add_rmsnorm(self, x, r, w):
        """In place on x [1, m, dim] (contiguous): x += r; returns (x, rmsnorm(x) * w)."""
        _check_fp32(x, "x")
        if not x.is_contiguous():
            raise ValueError("native add_rmsnorm works in place on a contiguous x")
        if w.shape != x.shape[-1:] or (r is not None and r.shape != x.shape):
            raise ValueError(f"native add_rmsnorm: x {tuple(x.shape)}, residual {None if r is None else tuple(r.shape)} and "
                             f"weight {tuple(w.shape)} do not match")
        if not w.is_contiguous():
            w = w.contiguous()
        if r is not None and not r.is_contiguous():
            r = r.contiguous()
        h = torch.empty_like(x)
        rows = x.numel() // x.shape[-1]
        self._lib.ogspo_add_rmsnorm(x.data_ptr(), None if r is None else r.data_ptr(), w.data_ptr(), h.data_ptr(), rows,
                                    x.shape[-1], self.eps)
        return x, h

    def rope_attention(self, qkv, bias, step: Step, keys, values, *, sliding: bool = False, qk_norm=None):
        B, m, width = qkv.shape
        if B != 1:
            raise ValueError("native layer ops run single-sequence forwards only")
        if qk_norm is not None or (sliding and step.window_mask is not None):
            raise ValueError("native layer ops do neither QK-norm nor sliding windows: run the torch ops")
        H, KV, hd = self.H, self.KV, self.hd
        _check_fp32(qkv, "qkv")
        if width != (H + 2 * KV) * hd:
            raise ValueError(f"native attention: qkv rows of {width}, not (H + 2 KV) * hd = {(H + 2 * KV) * hd}")
        for name, t in (("keys", keys), ("values", values)):
            _check_fp32(t, name)
            if not t.is_contiguous() or t.dim() != 4 or t.shape[0] != 1 or t.shape[1] != KV or t.shape[3] != hd:
                raise ValueError(f"native attention: {name} must be a contiguous [1, {KV}, rows, {hd}] cache, got "
                                 f"{tuple(t.shape)}")
        if not qkv.is_contiguous():
            qkv = qkv.contiguous()
        positions, attend = step.row_inputs  # computed once per forward
        if positions.dtype != torch.int64 or positions.numel() != m:
            raise ValueError(f"native attention: positions must be {m} int64 values, got {positions.numel()} {positions.dtype}")
        if attend is not None and tuple(attend.shape) != (m, step.start - step.committed + m):
            raise ValueError(f"native attention: attend must be [m, pending rows] = [{m}, {step.start - step.committed + m}], "
                             f"got {tuple(attend.shape)}")
        if not (step.cos_table.is_contiguous() and step.sin_table.is_contiguous() and step.cos_table.shape == step.sin_table.shape
                and step.cos_table.shape[-1] == hd):
            raise ValueError(f"native attention: the rotary tables must be contiguous [rows, {hd}] pairs")
        out = torch.empty(1, m, H * hd, dtype=torch.float32, device="cpu")
        status = self._lib.ogspo_rope_attention(
            qkv.data_ptr(), None if bias is None else bias.data_ptr(), positions.data_ptr(), step.cos_table.data_ptr(),
            step.sin_table.data_ptr(), step.cos_table.shape[0], keys.data_ptr(), values.data_ptr(), keys.shape[2], step.start,
            step.committed, None if attend is None else attend.data_ptr(), m, H, KV, hd, out.data_ptr(), self.threads,
        )
        if status:
            raise (MemoryError if status == 4 else ValueError)(native.ROPE_ATTENTION_ERRORS[status])
        return out

    def decoder_layer(self, x, *, ln1, ln2, bias, weights, threads, step: Step, keys, values) -> None:
        """A whole decoder layer in one native call (`layer.c`), in place on x [1, m, dim] (contiguous
        fp32): the same operations as add_rmsnorm, the qkv matmul, rope_attention, o, add_rmsnorm,
        gate/up, silu_mul and down, with the MLP's residual added at the end. `weights`: the layer's
        packed qkv, o, gate_up and down (`native.PackedWeight`, all fp32 or all bf16); `threads`: the
        native thread count of each of the four matmuls."""
        _check_fp32(x, "x")
        B, m, dim = x.shape
        qkv_w, o_w, gu_w, down_w = weights
        H, KV, hd = self.H, self.KV, self.hd
        inter = down_w.in_features
        if B != 1 or not x.is_contiguous() or qkv_w.out_features != (H + 2 * KV) * hd or gu_w.out_features != 2 * inter:
            raise ValueError(f"native decoder layer: x {tuple(x.shape)} (one contiguous sequence) and the weights do not match")
        if len({w.dtype for w in weights}) != 1:
            raise ValueError("native decoder layer: the four weights must share one dtype")
        positions, attend = step.row_inputs
        size = m * (3 * dim + (H + 2 * KV) * hd + H * hd + 3 * inter)
        if self._scratch is None or self._scratch.numel() < size:
            self._scratch = torch.empty(size, dtype=torch.float32, device="cpu")
        counts = self._counts.get(threads)
        if counts is None:  # the C array of thread counts, once per combination
            counts = self._counts[threads] = (ctypes.c_int32 * 5)(*threads, self.threads)
        status = self._lib.ogspo_decoder_layer(
            x.data_ptr(), m, dim, inter, ln1.data_ptr(), ln2.data_ptr(), self.eps, qkv_w.data.data_ptr(), o_w.data.data_ptr(),
            gu_w.data.data_ptr(), down_w.data.data_ptr(), int(qkv_w.dtype == torch.bfloat16), counts,
            None if bias is None else bias.data_ptr(), positions.data_ptr(), step.cos_table.data_ptr(), step.sin_table.data_ptr(),
            step.cos_table.shape[0], keys.data_ptr(), values.data_ptr(), keys.shape[2], step.start, step.committed,
            None if attend is None else attend.data_ptr(), H, KV, hd, self._scratch.data_ptr(),
        )
        if status:
            raise (MemoryError if status == 4 else ValueError)(native.ROPE_ATTENTION_ERRORS[status])

    def silu_mul(self, gu):
        _check_fp32(gu, "gate/up")
        if gu.shape[-1] % 2:
            raise ValueError(f"native silu_mul takes fused gate/up rows of even width, got {gu.shape[-1]}")
        if not gu.is_contiguous():
            gu = gu.contiguous()
        inter = gu.shape[-1] // 2
        a = torch.empty(*gu.shape[:-1], inter, dtype=torch.float32, device="cpu")
        self._lib.ogspo_silu_mul(gu.data_ptr(), a.data_ptr(), gu.numel() // gu.shape[-1], inter)
        return a


def _check_fp32(t: torch.Tensor, name: str) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu":
        raise ValueError(f"native layer ops take fp32 CPU tensors: {name} is {t.dtype} on {t.device}")


def make_layer_ops(name: str, *, n_heads: int, kv_heads: int, head_dim: int, eps: float):
    """The implementation called `name`: "torch" or "native<threads>"."""
    if name == TORCH:
        return TorchLayerOps(n_heads=n_heads, kv_heads=kv_heads, head_dim=head_dim, eps=eps)
    if name.startswith("native") and name[len("native") :].isdigit():
        return NativeLayerOps(n_heads=n_heads, kv_heads=kv_heads, head_dim=head_dim, eps=eps, threads=int(name[len("native") :]))
    raise ValueError(f"unknown layer ops '{name}'; allowed: torch, native<threads>")
