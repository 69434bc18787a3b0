"""Do two runs agree on everything that does not depend on timing? For a refactor: run the quick
workflow on both commits from the same prepared model, workloads, kernel table and draft heads
(copied into the second results folder, then `snakemake --rerun-triggers mtime`), then

    PATH=.venv/bin:$PATH python benchmarks/compare_outputs.py RESULTS_A RESULTS_B

compares the posterior records (every column but times), the evaluation's tokens (T=0: every
method; T=1: the methods whose trees do not come from timing: ar, ar-aa, eagle-default) and the
lossless counts. Prints one line per comparison; exit status 1 when anything differs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import polars as pl

KEY = ["workload", "temperature", "method", "prompt_id", "repeat"]
FIXED_TREES = ["ar", "ar-aa", "eagle-default"]


def compare(a: Path, b: Path) -> list[tuple[bool, str]]:
    """(same?, what) per compared output of the two results folders."""
    out = []
    files = sorted(p.relative_to(a) for p in (a / "records").rglob("*.parquet"))
    if not files:
        raise SystemExit(f"{a / 'records'} holds no records")
    for rel in files:
        fa, fb = pl.read_parquet(a / rel), pl.read_parquet(b / rel)
        cols = [c for c in fa.columns if "seconds" not in c]
        out.append((fa.select(cols).equals(fb.select(cols)), f"{rel} ({fa.height} rows, {len(cols)} columns)"))
    ra, rb = (pl.read_parquet(p / "evaluate" / "requests.parquet") for p in (a, b))
    for what, sel in (("T=0, every method", pl.col("temperature") == 0.0),
                      ("T=1, " + " / ".join(FIXED_TREES), (pl.col("temperature") == 1.0) & pl.col("method").is_in(FIXED_TREES))):
        ja, jb = (r.filter(sel).select([*KEY, "tokens"]).sort(KEY) for r in (ra, rb))
        out.append((ja.equals(jb), f"evaluation tokens, {what}: {ja.height} requests"))
    la, lb = (json.loads((p / "evaluate" / "summary.json").read_text())["lossless"] for p in (a, b))
    out.append((la == lb, f"lossless: {la} / {lb}"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    args = ap.parse_args()
    results = compare(args.a, args.b)
    for same, what in results:
        print(f"{'same' if same else 'DIFF'} {what}")
    return 0 if all(same for same, _ in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
