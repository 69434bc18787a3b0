"""Prepared target models: load them, check them, and choose the dtype they run in.

A prepared folder (stage `prepare_model`, `ogspo.stages.prepare_model`) holds ``model.safetensors``
(or shards), ``config.json``, the tokenizer files and ``ogspo_model.json`` (checksum, source, load
time, dtype). The dtype (config key `dtype`): float32, bfloat16, float16, or `auto` (the default),
which measures one-row products of the model's own weights with the engine's fp32 and bf16 kernels
and prepares bf16 where the CPU has a bf16 kernel (AVX512-BF16) and it is faster (`choose_dtype`;
the figures go to the manifest). A bf16 model loaded on a CPU without that kernel runs its
(bf16-valued) weights in fp32: the same model, without the speed (`runtime_dtype`). A GGUF file's
chat template and special tokens come from its metadata when the converted tokenizer lacks them
(`gguf_tokenizer_metadata`, `complete_tokenizer`).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from pathlib import Path

from tqdm.auto import tqdm

from ogspo.engine import native
from ogspo.engine.target import fast_path_refusal

MANIFEST = "ogspo_model.json"
DTYPES = ("float32", "bfloat16", "float16")


def as_torch_dtype(dtype: str):
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return getattr(torch, dtype)



GGUF_TOKEN_KEYS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                   "unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id"}


def gguf_tokenizer_metadata(path: Path) -> dict:
    """The chat template (`chat_template`, or None) and special-token ids (`bos_token`, ...) a GGUF
    file's metadata holds."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    out: dict = {"chat_template": fields["tokenizer.chat_template"].contents() if "tokenizer.chat_template" in fields else None}
    for name, key in GGUF_TOKEN_KEYS.items():
        if key in fields:
            out[name] = int(fields[key].contents())
    return out


def complete_tokenizer(tokenizer, meta: Mapping) -> list[str]:
    """Fill what the converted tokenizer lacks from GGUF metadata `meta`: the chat template and the
    special tokens. Returns the names of what was filled."""
    filled = []
    if not tokenizer.chat_template and meta.get("chat_template"):
        tokenizer.chat_template = meta["chat_template"]
        filled.append("chat_template")
    for name in GGUF_TOKEN_KEYS:
        if name in meta and getattr(tokenizer, name) is None and 0 <= meta[name] < len(tokenizer):
            setattr(tokenizer, name, tokenizer.convert_ids_to_tokens(meta[name]))
            filled.append(name)
    return filled


def weights_checksum(folder: Path) -> str:
    """Streaming sha256 over the folder's *.safetensors files (sorted by name)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {folder}")
    digest = hashlib.sha256()
    total = sum(f.stat().st_size for f in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc="sha256", leave=False, disable=None) as bar:
        for f in files:
            with f.open("rb") as fh:
                while chunk := fh.read(1 << 20):
                    digest.update(chunk)
                    bar.update(len(chunk))
    return digest.hexdigest()


def choose_dtype(model, reps: int = 7, device: str = "cpu") -> dict:
    """bfloat16 or float32 for `model` (fp32 weights) on this CPU: every 2-D weight of its decoder
    layers and LM head multiplied by one row with the engine's native fp32 and bf16 kernels, in turn,
    `reps` times (medians). bf16 needs the native bf16 kernel (AVX512-BF16) and must measure faster.
    Returns {"dtype", "why", and the medians in ms where measured}."""
    import numpy as np
    import torch

    if device != "cpu":
        return {"dtype": "float32", "why": f"auto measures CPU kernels only; on {device} set dtype to bfloat16 to run bf16"}
    refusal = fast_path_refusal(model.config)
    if refusal is not None:
        return {"dtype": "float32", "why": BF16_NEEDS_FAST_PATH.format(refusal)}
    if not native.bf16_available():
        why = native.unavailable_reason() or ("no native bf16 kernel here (no avx512_bf16 in the CPU flags, "
                                              f"or ${native.NO_BF16} set)")
        return {"dtype": "float32", "why": why}
    weights = [p.detach() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n]
    if model.get_output_embeddings() is not None and model.get_output_embeddings().weight.dim() == 2:
        weights.append(model.get_output_embeddings().weight.detach())  # tied to the embedding in many models
    threads = torch.get_num_threads()
    packed = {dt: [native.PackedWeight(w.to(dt)) for w in weights] for dt in (torch.float32, torch.bfloat16)}
    xs = {w.shape[1]: torch.randn(1, w.shape[1]) for w in weights}
    times = {dt: [] for dt in packed}
    for r in range(reps + 1):
        for dt, ws in packed.items():
            t0 = time.perf_counter()
            for w in ws:
                w.matmul(xs[w.in_features], threads)
            if r > 0:
                times[dt].append(time.perf_counter() - t0)
    f32, bf16 = (1e3 * float(np.median(times[dt])) for dt in (torch.float32, torch.bfloat16))
    faster = bf16 < f32
    return {"dtype": "bfloat16" if faster else "float32", "fp32_ms": round(f32, 2), "bf16_ms": round(bf16, 2),
            "why": f"one-row products of every weight: bf16 {bf16:.1f} ms, fp32 {f32:.1f} ms ({threads} threads)"
                   + ("" if faster else ": bf16 is not faster here")}


BF16_NEEDS_FAST_PATH = ("bf16 runs on the engine's own batch-invariant kernels only, and this model runs on the "
                        "transformers backend ({}), whose bf16 products depend on the row count (a verified tree "
                        "could differ from step-by-step decoding): float32")


def runtime_dtype(dtype: str, device: str = "cpu", config=None) -> str:
    """The dtype a model prepared in `dtype` runs in on `device`: bfloat16 on a CPU without the native
    bf16 kernel, or for a model (`config`) the engine's fast path refuses, runs in float32 (its weights
    are exact in fp32; torch's bf16 products are not batch-invariant, `engine.kernels`)."""
    if dtype == "bfloat16" and device == "cpu" and (not native.bf16_available()
                                                     or (config is not None and fast_path_refusal(config) is not None)):
        return "float32"
    return dtype


def read_manifest(path: Path) -> dict:
    """The ``ogspo_model.json`` of a prepared folder."""
    f = Path(path) / MANIFEST
    if not f.is_file():
        raise FileNotFoundError(f"{path} is not a prepared model folder (no {MANIFEST})")
    return json.loads(f.read_text())


def check_model_dir(path: Path) -> Path:
    """Raise one clear line unless ``path`` is a folder with a Hugging Face model config."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model folder {path} does not exist")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a model folder (no config.json)")
    return path


def model_checksum(path: Path) -> str:
    """The weights checksum recorded when the folder was prepared (hashed now if there is no manifest)."""
    path = check_model_dir(path)
    manifest = path / MANIFEST
    if manifest.is_file():
        return json.loads(manifest.read_text())["checksum_sha256"]
    return weights_checksum(path)


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(check_model_dir(path)))


def load_target(path: Path, *, dtype: str | None = None, device: str = "cpu"):
    """Load a prepared model folder (or any local Hugging Face folder): returns ``(model, tokenizer)``,
    model in eval mode on ``device``, in ``dtype`` (default: the dtype the folder was prepared in,
    config key `dtype` of prepare_model; float32 for an unprepared folder; `runtime_dtype` says
    when bf16 runs in fp32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = check_model_dir(path)
    prepared = (path / MANIFEST).is_file()
    config = AutoConfig.from_pretrained(str(path))  # read once: it decides the dtype and builds the model
    torch_dtype = as_torch_dtype(runtime_dtype(dtype or (read_manifest(path).get("dtype", "float32") if prepared else "float32"),
                                             str(device).split(":")[0], config))
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(str(path), config=config, dtype=torch_dtype)
    model.to(device)
    model.eval()
    return model, tokenizer


DEFAULT_WEIGHTS_MB = 540  # SmolLM2-135M in fp32: the estimate before a model folder exists


def model_memory_mb(path: Path, extra_mb: int) -> int:
    """Memory (MB) of a job that loads the prepared model in `path`: `extra_mb` plus four copies of its
    weights (the transformers model, the engine's layouts, headroom). Before the folder exists (a
    dry run) the default model's size stands in."""
    weights = Path(path) / "model.safetensors"
    size = weights.stat().st_size / 2**20 if weights.is_file() else DEFAULT_WEIGHTS_MB
    return int(extra_mb + 4 * size)

