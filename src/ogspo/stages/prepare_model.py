"""Stage `prepare_model`: turn a model source (GGUF or Hugging Face) into a plain safetensors folder.

The prepared folder (read by `ogspo.engine.model`) loads in a few seconds, unlike the GGUF file
(dequantised on every load). A local Hugging Face folder that already holds safetensors weights is
used in place: the prepared folder links to its files instead of copying them (the manifest records
the weights' checksum, so a changed source is noticed). The dtype `auto` is measured on the CPU
(`ogspo.engine.model.choose_dtype`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm.auto import tqdm

from ogspo.artifacts.prompts import find_package_dir
from ogspo.engine.model import (
    MANIFEST,
    as_torch_dtype,
    choose_dtype,
    complete_tokenizer,
    gguf_tokenizer_metadata,
    weights_checksum,
)

AUTO = "auto"  # prepare_model's dtype: measured (`choose_dtype`)


@dataclass(frozen=True)
class PreparedModel:
    path: Path
    checksum: str  # sha256 over the safetensors weight file(s), in name order
    load_seconds: float  # time to load the source (GGUF dequantisation included)
    source: str  # human-readable description of the source


def describe_source(source: Mapping) -> str:
    if "gguf_package" in source:
        return f"gguf_package:{source['gguf_package']}/{source['gguf_file']}"
    if "gguf_path" in source:
        return f"gguf_path:{source['gguf_path']}"
    if "path" in source:
        return f"path:{source['path']}"
    if "hub_id" in source:
        rev = source.get("revision")
        return f"hub_id:{source['hub_id']}" + (f"@{rev}" if rev else "")
    raise ValueError(f"model source has none of gguf_package, gguf_path, path, hub_id: {dict(source)}")



def resolve_gguf(source: Mapping) -> tuple[Path, str] | None:
    """(folder, file name) of a GGUF source, or None for Hugging Face sources."""
    if "gguf_package" in source:
        pkg_dir = find_package_dir(source["gguf_package"])
        if pkg_dir is None:
            raise FileNotFoundError(f"package {source['gguf_package']} is not installed")
        gguf = pkg_dir / source["gguf_file"]
    elif "gguf_path" in source:
        gguf = Path(source["gguf_path"])
    else:
        return None
    gguf = gguf.expanduser()
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF file {gguf} does not exist")
    return gguf.parent, gguf.name


def _linkable(folder: Path) -> bool:
    """A local Hugging Face folder that can be used in place: safetensors weights, a config, a tokenizer."""
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors")) and any(
        (folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))


def _link_folder(source: Path, tmp: Path) -> None:
    """Link every file of `source` into `tmp` (absolute links: the prepared folder can move)."""
    for f in sorted(source.iterdir()):
        if f.is_file() and f.name != MANIFEST:
            (tmp / f.name).symlink_to(f.resolve())


def prepare_model(*, source: Mapping, out_dir: Path, dtype: str = AUTO, device: str = "cpu") -> PreparedModel:
    """Load the model source and save it as a safetensors folder at ``out_dir`` (atomically), in
    `dtype` (`auto`: `choose_dtype` measures, for the CPU; on another `device` (torch_device) it is float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    requested = dtype
    torch_dtype = as_torch_dtype("float32" if dtype == AUTO else dtype)
    desc = describe_source(source)
    gguf = resolve_gguf(source)
    if gguf is not None:
        folder, fname = gguf
        load_kwargs = {"gguf_file": fname}
        name_or_path = str(folder)
    elif "path" in source:
        name_or_path = str(Path(source["path"]).expanduser())
        if not Path(name_or_path).is_dir():
            raise FileNotFoundError(f"model folder {name_or_path} does not exist")
        load_kwargs = {}
    else:
        name_or_path = source["hub_id"]
        load_kwargs = {"revision": source["revision"]} if source.get("revision") else {}

    if "path" in source and _linkable(Path(name_or_path)):
        choice = None
        if dtype == AUTO:  # measured on the folder's weights; the links stay, the manifest's dtype says how to load them
            choice = choose_dtype(AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch_dtype),
                                  device=str(device).split(":")[0])
            dtype = choice["dtype"]
        return _prepare_in_place(Path(name_or_path), out_dir=out_dir, source=source, desc=desc, dtype=dtype,
                                 extra={"dtype_requested": requested, **({"dtype_choice": choice} if choice else {})})

    with tqdm(total=2, desc=f"load {desc}", leave=False, disable=None) as bar:
        t0 = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, **load_kwargs)
        bar.update(1)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch_dtype, **load_kwargs)
        load_seconds = time.perf_counter() - t0
        bar.update(1)
    filled = complete_tokenizer(tokenizer, gguf_tokenizer_metadata(Path(*gguf))) if gguf is not None else []

    choice = None
    if requested == AUTO:
        choice = choose_dtype(model, device=str(device).split(":")[0])
        dtype = choice["dtype"]
        model.to(as_torch_dtype(dtype))

    # GGUF weights come back dequantised, but the model still carries the quantizer, and
    # save_pretrained refuses to save a "quantized" model: drop both.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    def write(tmp: Path) -> None:
        with tqdm(total=1, desc="save safetensors", leave=False, disable=None) as bar:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            bar.update(1)

    checksum = _write_prepared(out_dir, write, {"source": desc, "source_config": dict(source), "dtype": dtype,
                                                "dtype_requested": requested, **({"dtype_choice": choice} if choice else {}),
                                                "source_load_seconds": round(load_seconds, 3), "from_gguf_metadata": filled})
    return PreparedModel(path=out_dir, checksum=checksum, load_seconds=load_seconds, source=desc)


def _prepare_in_place(folder: Path, *, out_dir: Path, source: Mapping, desc: str, dtype: str, extra: dict) -> PreparedModel:
    """A prepared folder of links to `folder`'s files: no copy of the weights (loaded in `dtype`)."""
    t0 = time.perf_counter()
    checksum = _write_prepared(out_dir, lambda tmp: _link_folder(folder, tmp),
                               {"source": desc, "source_config": dict(source), "dtype": dtype, **extra,
                                "linked_from": str(folder.resolve())})
    return PreparedModel(path=out_dir, checksum=checksum, load_seconds=time.perf_counter() - t0, source=desc)


def _write_prepared(out_dir: Path, write, manifest: dict) -> str:
    """Write a prepared folder at `out_dir` atomically: `write(tmp)` fills a temporary folder, then
    the manifest (with the weights' checksum) joins it and it replaces `out_dir`. Returns the checksum."""
    import torch

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        write(tmp)
        checksum = weights_checksum(tmp)
        manifest = {"checksum_sha256": checksum, **manifest, "torch": torch.__version__}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes 0700 folders; some writers make 0600 files
        for f in tmp.iterdir():
            if not f.is_symlink():
                f.chmod(0o644)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return checksum


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``; an existing ``dst`` is moved aside first and removed after."""
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def summary(prepared: PreparedModel) -> dict:
    d = asdict(prepared)
    d["path"] = str(prepared.path)
    return d
