"""Benchmark: every method side by side on held-out prompts, from the workflow's `evaluate` stage.

    PATH=.venv/bin:$PATH python benchmarks/bench_evaluate.py [--report results/cpu/report] [--write]

The measurement itself is the DAG's `evaluate` rule (the methods of a request slot side by side,
cycle by cycle, each on its own fork of the caches, T=0 and T=1, with the lossless check); this
script puts the run's `report/report.md` (the comparison against the best baseline, the A/A check,
what ogspo ships, the latency model against realised requests, throughput tables, time split) into
docs/BENCHMARKS.md, with the run's settings and stage durations (Snakemake `benchmark:` files).
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchdoc import REPO, git_commit, machine, write_section  # noqa: E402


def stage_seconds(bench_dir: Path) -> dict[str, float]:
    out = {}
    for f in sorted(bench_dir.glob("*.tsv")):
        rows = list(csv.DictReader(f.open(), delimiter="\t"))
        if rows:
            out[f.stem] = float(rows[-1]["s"])
    return out


def skipped_counts(cfg: dict) -> dict[str, int]:
    """Method -> in how many cells evaluate did not run it (`settings.skipped`)."""
    counts: dict[str, int] = {}
    for names in (cfg.get("skipped") or {}).values():
        for entry in names:
            m = entry.split(" ", 1)[0]
            counts[m] = counts.get(m, 0) + 1
    return counts


def settings_line(cfg: dict) -> str:
    if not cfg:
        return "see config/default.yaml, section evaluate"
    n = sorted({len(v) for v in cfg.get("prompts", {}).values()})
    names = ", ".join(m["name"] for m in cfg.get("methods", []))
    cells = len(cfg.get("prompts", {})) * len(cfg.get("temperatures", []))
    return (f"{'/'.join(map(str, n))} eval prompts per workload x {cfg.get('max_new_tokens')} new tokens x "
            f"{cfg.get('repeats')} repeat(s), T = {', '.join(f'{t:g}' for t in cfg.get('temperatures', []))}; methods: {names}; "
            f"timed {'side by side, cycle by cycle' if cfg.get('interleave') == 'cycles' else 'one request after another'}"
            + "".join(f"; {m} not run in {n} of {cells} cells (there the same tree as another method)"
                      for m, n in skipped_counts(cfg).items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report", type=Path, default=REPO / "results" / "cpu" / "report")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()

    results = args.report.parent
    cfg = json.loads((results / "evaluate" / "summary.json").read_text()).get("settings", {})
    body = (args.report / "report.md").read_text()  # the report itself: comparison, A/A, shipping, latency check
    body = body.split("\n## Plots")[0].replace("# ogspo evaluation report\n", "")
    body = body.replace("\n## ", "\n### ")
    stages = stage_seconds(results / "benchmarks")
    cmd = "PATH=.venv/bin:$PATH python benchmarks/bench_evaluate.py " + " ".join(sys.argv[1:])
    lines = [
        "## Evaluation: every method side by side (`rules/evaluate.smk`, `benchmarks/bench_evaluate.py`)",
        "",
        f"- date: {dt.datetime.now().strftime('%Y-%m-%d %H:%M')}, commit {git_commit()}; machine: {machine()}",
        f"- reproduce: `make run` (default config), then `{cmd.strip()}`",
        f"- settings: {settings_line(cfg)}",
        "- stage wall times (s): " + ", ".join(f"{k} {v:.0f}" for k, v in stages.items()) + f"; sum {sum(stages.values()):.0f} s",
        body,
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section("bench_evaluate", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
