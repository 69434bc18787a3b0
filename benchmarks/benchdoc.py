"""Shared helpers of the benchmark scripts: machine description, statistics, and rewriting one
script's own section of docs/BENCHMARKS.md (between `<!-- name:start -->` and `<!-- name:end -->`)."""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from ogspo.engine.kernels import cpu_model  # noqa: F401 (re-exported for the benchmark scripts)

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "BENCHMARKS.md"


def stats(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def head_dirs(specs: list[str], error) -> dict[str, Path]:
    """--head NAME=DIR arguments as {name: drafter folder}; `error` (ArgumentParser.error) on a bad one."""
    heads = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not Path(path, "drafter.json").is_file():
            error(f"--head takes NAME=DIR with DIR a drafter folder (drafter.json inside); got {spec!r}")
        heads[name] = Path(path)
    return heads


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def write_section(name: str, section: str) -> None:
    """Replace the section `name` of docs/BENCHMARKS.md (append it if absent); atomic write."""
    start, end = markers(name)
    body = f"{start}\n{section.strip()}\n{end}"
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = head + body + tail
    else:
        text = text.rstrip("\n") + "\n\n" + body + "\n"
    tmp = DOC.with_name(f".{DOC.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, DOC)
