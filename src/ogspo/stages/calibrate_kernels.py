"""Stage `calibrate_kernels`: which matmul kernel is fastest per weight class and row count on this
device (`ogspo.engine.kernels`), cached per machine so a rerun of the workflow does not time it again."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ogspo.engine import kernels as K
from ogspo.engine.target import LlamaTreeLM, fast_path_refusal


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
        return K.reference_table({}, device, dtype,
                                 f"the transformers backend runs this model ({refusal}): no kernels to choose"), False
    lm = LlamaTreeLM(hf_model, max_len=8)  # reference kernels only: just to collect the fused weights
    weights = {c: [w.w for w in lm.mm[c].weights] for c in K.CLASSES}
    shapes = {c: list(ws[0].shape) for c, ws in weights.items()}
    if device != "cpu":
        return K.reference_table(shapes, device, lm.dtype, f"only the reference kernel is used on {device}"), False
    threads = torch.get_num_threads()
    candidates = tuple(k for name in cfg["candidates"] for k in (K.native_kernels(threads) if name == "native" else (name,)))
    layer_ops = {"shape": lm.layer_ops_shape, "n_layers": len(lm.layers), "eps": lm.eps, "context": cfg["layer_ops_context"],
                 "max_rows": 64}
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
