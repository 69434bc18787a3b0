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


def machine() -> str:
    """The machine as the sections name it: CPU count, model, family/model numbers and the vector
    instruction sets the kernels care about (`lscpu`'s model name alone does not tell a Zen 3 from a Zen 4)."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        return f"{os.cpu_count()} CPUs ({cpu_model()})"
    flags = set(info.get("flags", "").split())
    have = [name for flag, name in (("avx2", "AVX2"), ("fma", "FMA"), ("avx512f", "AVX-512"), ("avx512_bf16", "AVX512-BF16"),
                                    ("amx_tile", "AMX")) if flag in flags]
    lacks = [name for flag, name in (("avx512f", "AVX-512"), ("avx512_bf16", "AVX512-BF16"), ("amx_tile", "AMX"))
             if flag not in flags]
    return (f"{os.cpu_count()} CPUs ({cpu_model()}, family {info.get('cpu family', '?')} model {info.get('model', '?')}; "
            f"{', '.join(have) or 'no AVX2'}{'; no ' + ', '.join(lacks) if lacks else ''})")


RUN_OUTPUTS = ("model", "workloads", "drafter", "kernels/kernels.json", "latency/latency.json", "evaluate/summary.json")


def require_run(results: Path, error, extra: tuple[str, ...] = ()) -> None:
    """`error` (ArgumentParser.error) naming the first output of the default run missing from `results`."""
    for need in (*RUN_OUTPUTS, *extra):
        if not (results / need).exists():
            error(f"{results / need} is missing: run the default workflow first (make run)")


def git_commit() -> str:
    """The short hash of the checkout the benchmark runs (its sections name it)."""
    return os.popen(f"git -C {REPO} rev-parse --short HEAD").read().strip()


def head_dirs(specs: list[str], error) -> dict[str, Path]:
    """--head NAME=DIR arguments as {name: drafter folder}; `error` (ArgumentParser.error) on a bad one."""
    heads = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not Path(path, "drafter.json").is_file():
            error(f"--head takes NAME=DIR with DIR a drafter folder (drafter.json inside); got {spec!r}")
        heads[name] = Path(path)
    return heads


def paired_tables(df, pairs, *, seed: int = 0) -> tuple[list[str], dict, dict]:
    """Two markdown tables of a T=0 request frame (columns method, workload, throughput and the slot
    keys): median complete-request tokens/s per method and workload, and the paired ratios
    (`analysis.compare.ratio_intervals`) of every (method, baseline) in `pairs` that ran. Returns
    (lines, medians {(method, workload): tokens/s}, ratios {"method / baseline": intervals})."""
    import polars as pl

    from ogspo.analysis.compare import ratio_intervals

    methods = list(dict.fromkeys(df["method"].to_list()))
    workloads = list(dict.fromkeys(df["workload"].to_list()))
    sel = lambda m, w: df.filter((pl.col("method") == m) & (pl.col("workload") == w))  # noqa: E731
    med = {(m, w): statistics.median(sel(m, w)["throughput"].to_list()) for m in methods for w in workloads if sel(m, w).height}
    ratios = {f"{m} / {b}": ratio_intervals(df, m, b, seed=seed) for m, b in pairs if m in methods and b in methods}
    lines = ["Complete-request throughput, median tokens/s per workload:", "",
             "| method | " + " | ".join(workloads) + " |", "|---|" + "---:|" * len(workloads)]
    for m in methods:
        lines.append(f"| {m} | " + " | ".join(f"{med[(m, w)]:.1f}" if (m, w) in med else "" for w in workloads) + " |")
    lines += ["", "Paired ratios (geometric mean of per-request ratios, 95% bootstrap interval):", "",
              "| ratio | pooled | " + " | ".join(workloads) + " |", "|---|---:|" + "---:|" * len(workloads)]
    for name, r in ratios.items():
        cells = [f"{r['cells'][(w, 0.0)].ratio:.3f}" if (w, 0.0) in r["cells"] else "" for w in workloads]
        lines.append(f"| {name} | {r['pooled'].text()} | " + " | ".join(cells) + " |")
    return lines, med, ratios


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


def load_run(results: Path, max_len: int = 2048):
    """(model checksum, tokenizer, target, EAGLE drafter) of a `make run` folder: its prepared model, kernel
    table and draft head, as the workflow's rules load them."""
    from ogspo.engine.kernels import read_kernel_table
    from ogspo.engine.model import load_target, read_manifest
    from ogspo.methods.registry import make_drafter, make_target

    checksum = read_manifest(results / "model")["checksum_sha256"]
    model, tok = load_target(results / "model")
    kernels = read_kernel_table(results / "kernels/kernels.json")
    drafter = make_drafter("eagle", target_model=model, max_len=max_len, path=results / "drafter", target_checksum=checksum,
                           kernels=kernels)
    return checksum, tok, make_target(model, max_len=max_len, drafter=drafter, kernels=kernels), drafter
