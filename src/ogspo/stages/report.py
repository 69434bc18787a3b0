"""Stage `report`: tables, ratios and plots from the evaluation and the stages before it.

`results/{device}/report/` gets `summary.json` (one row per method x workload x temperature,
recomputed from `evaluate/requests.parquet` with `ogspo.analysis.summary.summarize_requests`), `report.md`
and PNG plots (matplotlib Agg): each method's speedup over autoregressive decoding per workload, the latency model fit, OGSPO
rounds (when `rounds/T*/rounds.parquet` exist), acceptance by depth from the records summary and
the chosen OGSPO structure drawn as a tree. Inputs that are absent leave their plot out; report.md
says which.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from ogspo.analysis.markdown import (
    OGSPO,
    gain_statements,
    latency_check,
    limiting_factors,
    ogspo_ratios,
    records_figures,
    render_comparison,
    render_heads,
    render_latency_check,
    render_on_device,
    render_report,
    render_shipping,
)
from ogspo.analysis.plots import plot_acceptance, plot_calibration, plot_rounds, plot_structures, plot_throughput
from ogspo.analysis.summary import pooled_comparisons, summarize_requests
from ogspo.artifacts.io import json_safe, write_text
from ogspo.artifacts.latency import LatencyCalibration, LatencyModel
from ogspo.artifacts.structure import load_structure
from ogspo.methods.registry import REFERENCE, TUNED
from ogspo.stages.choose_on_device import read_device_choice

REQUEST_COLUMNS = ("workload", "temperature", "method", "prompt_id", "repeat", "throughput", "wall_seconds",
                   "prefill_seconds", "draft_seconds", "policy_seconds", "verify_seconds", "other_seconds", "cycles",
                   "tau", "mean_tree_size", "predicted_throughput", "predicted_seconds", "new_tokens", "lossless")
ROUNDS_COLUMNS = ("round", "surrogate_J", "oracle_bound", "same_trace_J", "corrected_J", "accepted", "structure_size")


@dataclass
class ReportResult:
    summary_path: Path
    markdown_path: Path
    plots: list[Path]
    missing: list[str] = field(default_factory=list)  # inputs that were absent, and what was left out
    ratios: dict[str, dict[str, float]] = field(default_factory=dict)  # tag -> workload -> ogspo / eagle-tuned


def _read_json(path: Path, what: str) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} {path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {path} must hold a JSON object")
    return data


def read_requests(path: Path) -> pl.DataFrame:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"evaluation requests {path} does not exist")
    df = pl.read_parquet(path)
    missing = [c for c in REQUEST_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"{path} is not an evaluate requests table: missing columns {', '.join(missing)}")
    return df


def read_rounds(path: Path) -> pl.DataFrame:
    df = pl.read_parquet(path)
    missing = [c for c in ROUNDS_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"{path} is not an OGSPO rounds table: missing columns {', '.join(missing)}")
    return df.sort("round")


# ---------------------------------------------------------------- plots


def plot_latency(latency_path: Path, path: Path) -> Path:
    """Re-plot the latency model fit from latency.json (as `calibrate_latency` wrote it)."""

    doc = _read_json(latency_path, "latency file")
    need = ("model", "validation", "mdape")
    if any(k not in doc for k in need):
        raise ValueError(f"latency file {latency_path} lacks keys {', '.join(k for k in need if k not in doc)}")
    cal = LatencyCalibration(model=LatencyModel.from_json(doc), validation=doc["validation"], mdape=float(doc["mdape"]),
                             fixed_samples=list(doc.get("fixed_samples", [])),
                             fixed_ar_samples=list(doc.get("fixed_ar_samples", [])),
                             catchup_samples=list(doc.get("catchup_samples", [])), seconds=float(doc.get("seconds", 0.0)))
    plot_calibration(cal, png_path=path)
    return path


# ---------------------------------------------------------------- markdown


def read_shipping(rounds_json: Path) -> dict | None:
    """The keep/drop rule's decision of a rounds folder (rounds.json "ship"), None when absent."""
    if not Path(rounds_json).is_file():
        return None
    return _read_json(Path(rounds_json), "rounds summary").get("ship")


# ---------------------------------------------------------------- stage


def draw_plots(rows: list[dict], out_dir: Path, *, latency: Path | None, rounds: Mapping[str, Path] | None,
               records_summary: Path | None, structures: Mapping[str, Path] | None):
    """The report's plots from what exists: (plots written, what was left out and why, the latency
    document, rounds tables per tag, OGSPO structures per tag)."""
    missing: list[str] = []
    plots = [plot_throughput(rows, out_dir / "throughput.png")]
    latency_doc = None
    if latency is not None and Path(latency).is_file():
        latency_doc = _read_json(latency, "latency file")
        plots.append(plot_latency(Path(latency), out_dir / "latency.png"))
    else:
        missing.append(f"latency model fit: {latency} not found" if latency else "latency model fit: no latency.json given")
    rounds_frames = {tag: read_rounds(Path(p)) for tag, p in (rounds or {}).items() if Path(p).is_file()}
    absent = [str(p) for tag, p in (rounds or {}).items() if not Path(p).is_file()]
    if rounds_frames:
        plots.append(plot_rounds(rounds_frames, out_dir / "rounds.png"))
    if absent or not rounds:
        missing.append("OGSPO rounds plot: " + (f"{', '.join(absent)} not found (the alternating-rounds stage has not "
                                                  "produced them)" if absent else "no rounds tables given"))
    if records_summary is not None and Path(records_summary).is_file():
        plots.append(plot_acceptance(_read_json(records_summary, "records summary"), out_dir / "acceptance.png"))
    else:
        missing.append(f"acceptance by depth: records summary {records_summary} not found")
    paths = {}
    for tag, p in (structures or {}).items():
        if Path(p).is_file():
            paths[tag] = [tuple(x) for x in load_structure(Path(p)).to_list()]
        else:
            missing.append(f"OGSPO structure {tag}: {p} not found")
    if paths:
        plots.append(plot_structures(paths, out_dir / "structure.png"))
    return plots, missing, latency_doc, rounds_frames, paths


def write_report(
    *,
    evaluate_summary: Path,
    requests: Path,
    out_dir: Path,
    latency: Path | None = None,
    records_summary: Path | None = None,
    structures: Mapping[str, Path] | None = None,
    rounds: Mapping[str, Path] | None = None,
    drafter_eval: Path | None = None,
    heads: Mapping[str, Path] | None = None,
    sequoia: Mapping[str, Path] | None = None,
    on_device: Mapping[str, Path] | None = None,
) -> ReportResult:
    """report/summary.json, report/report.md and the plots. `structures` and `rounds` map a temperature
    tag (T0, T1) to policy/T*/structure.json and rounds/T*/rounds.parquet; absent rounds files leave
    the rounds plot out (said in report.md). `drafter_eval` (drafter_eval/acceptance.json) and `heads`
    (label -> drafter folder) add the draft heads side by side; `on_device` (tag -> ogspo/T*/device.json)
    what `ogspo` ships per workload as rule choose_on_device chose it."""

    out_dir = Path(out_dir)
    ev = _read_json(evaluate_summary, "evaluation summary")
    df = read_requests(requests)
    oracle = ev.get("oracle") or {}
    calib_best = ev.get("best_baseline_calib") or {}
    rows = summarize_requests(df, oracle=oracle, calib_best=calib_best)
    if not rows:
        raise ValueError(f"{requests} holds no requests")
    ratios = ogspo_ratios(rows)
    plots, missing, latency_doc, rounds_frames, paths = draw_plots(rows, out_dir, latency=latency, rounds=rounds,
                                                                   records_summary=records_summary, structures=structures)
    limits = limiting_factors(rows, latency_doc=latency_doc, structures=paths)
    lossless = ev.get("lossless") or {}
    tuned = ev.get("eagle_tuned") or {}
    allv = [v for per in ratios.values() for v in per.values()]
    pooled = pooled_comparisons(df, method=OGSPO, calib_best=calib_best)
    shipping = {tag: read_shipping(Path(p).with_name("rounds.json")) for tag, p in (rounds or {}).items()}
    shipping = {tag: v for tag, v in shipping.items() if v is not None}
    checked = latency_check(rows)
    device_docs = {tag: read_device_choice(Path(p)) for tag, p in (on_device or {}).items()}
    sequoia_docs = {tag: _read_json(Path(p), "sequoia summary") for tag, p in (sequoia or {}).items() if Path(p).is_file()}
    rec_figs = records_figures(oracle=oracle, sequoia=sequoia_docs, rounds=rounds_frames)
    statements = gain_statements(rows, rec_figs)
    doc = json_safe({
        "rows": rows,
        "comparisons": {OGSPO: pooled}, "statements": statements, "records_figures": rec_figs,
        "ogspo_vs_eagle_tuned": {"by_temperature": ratios,
                                 "mean_by_temperature": {t: float(np.mean(list(v.values()))) for t, v in ratios.items()},
                                 "mean": float(np.mean(allv)) if allv else None},
        "lossless": lossless, "eagle_tuned": tuned, "oracle": oracle, "best_baseline_calib": calib_best,
        "shipping": shipping, "on_device": device_docs, "latency_check": checked,
        "plots": [p.name for p in plots], "left_out": missing, "limits": limits,
        "reference": REFERENCE, "baseline": TUNED,
    })
    summary_path = out_dir / "summary.json"
    md_path = out_dir / "report.md"
    md = render_report(rows=rows, ratios=ratios, lossless=lossless, missing=missing, plots=plots, limits=limits, tuned=tuned,
                       stability=(ev.get("settings") or {}).get("tune_winner_stability"),
                       target=(ev.get("settings") or {}).get("target"),
                       comparison=render_comparison(statements, pooled) + render_shipping(shipping)
                       + render_on_device(device_docs) + render_latency_check(checked))
    if drafter_eval is not None:
        metas = {h: _read_json(Path(d) / "drafter.json", f"drafter {h}") if (Path(d) / "drafter.json").is_file()
                 else {"published": str(d)} for h,
                 d in (heads or {}).items()}  # a head given as drafter.path has no training figures
        md += "\n" + "\n".join(render_heads(_read_json(drafter_eval, "drafter acceptance"), metas))
    for path, text in ((summary_path, json.dumps(doc, indent=1) + "\n"), (md_path, md)):
        write_text(path, text)
    return ReportResult(summary_path=summary_path, markdown_path=md_path, plots=plots, missing=missing, ratios=ratios)
