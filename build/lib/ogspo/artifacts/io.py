"""Atomic writes and strict JSON, once for every artifact writer.

A file is written to a temporary name beside its destination and renamed over it, so a reader
never sees half a file and an interrupted run leaves the old file (or none) behind.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> None:
    """Call `write(tmp)` for a temporary path beside `path`, then rename it to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_bytes(path: str | Path, data: bytes) -> None:
    atomic_write(path, lambda tmp: tmp.write_bytes(data))


def write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text))


def json_default(x):
    """numpy scalars as Python numbers (json.dumps `default=`)."""
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def json_safe(x):
    """NaN and infinities -> None, recursively (strict JSON)."""
    if isinstance(x, float) and not np.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [json_safe(v) for v in x]
    return x


def write_json(path: str | Path, doc, *, indent: int | None = 1) -> None:
    """Strict JSON (NaN -> null), numpy scalars converted, newline-terminated, written atomically."""
    write_text(path, json.dumps(json_safe(doc), indent=indent, default=json_default) + "\n")


def read_json(path: str | Path, what: str) -> dict:
    """A JSON object from `path`, or one line naming the file and what it should have been."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist")
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{what} {path} is not readable JSON ({exc.__class__.__name__}: {exc})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{what} {path} is not a JSON object")
    return doc
