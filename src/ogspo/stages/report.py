"""Stage `report`: tables, ratios and plots from the evaluation and the stages before it.

`results/{device}/report/` gets `summary.json` (one row per method x workload x temperature,
recomputed from `evaluate/requests.parquet` with `ogspo.stages.summary.summarize_requests`), `report.md`
and PNG plots (matplotlib Agg): each method's speedup over autoregressive decoding per workload, the latency model fit, OGSPO
rounds (when `rounds/T*/rounds.parquet` exist), acceptance by depth from the records summary and
the chosen OGSPO structure drawn as a tree. Inputs that are absent leave their plot out; report.md
says which.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from ogspo.artifacts.io import json_safe, write_text
from ogspo.artifacts.latency import LatencyCalibration, LatencyModel
from ogspo.artifacts.structure import load_structure
from ogspo.methods.registry import AA_CHECK, REFERENCE, TUNED
from ogspo.stages.calibrate import plot_calibration
from ogspo.stages.summary import pooled_comparisons, summarize_requests, temperature_tag

REQUEST_COLUMNS = ("workload", "temperature", "method", "prompt_id", "repeat", "throughput", "wall_seconds",
                   "prefill_seconds", "draft_seconds", "policy_seconds", "verify_seconds", "other_seconds", "cycles",
                   "tau", "mean_tree_size", "predicted_throughput", "predicted_seconds", "new_tokens", "lossless")
ROUNDS_COLUMNS = ("round", "surrogate_J", "oracle_bound", "same_trace_J", "corrected_J", "accepted", "structure_size")
OGSPO = "ogspo"


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


def ogspo_ratios(rows: list[dict], method: str = OGSPO) -> dict[str, dict[str, float]]:
    """Temperature tag -> workload -> median paired throughput ratio of `method` to eagle-tuned."""
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        if r["method"] == method and r.get("vs_eagle_tuned") is not None:
            out.setdefault(temperature_tag(r["temperature"]), {})[r["workload"]] = float(r["vs_eagle_tuned"])
    return out


# ---------------------------------------------------------------- plots


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path, dpi: int = 80) -> Path:
    plt = _plt()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}.png")
    fig.tight_layout()
    fig.savefig(tmp, dpi=dpi)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def plot_throughput(rows: list[dict], path: Path) -> Path:
    """Each method's speedup over autoregressive decoding, one panel per T: a row per method, a dot per
    workload at the geometric mean of its paired per-request ratios with the 95% interval as a bar,
    a line at 1. Without autoregressive requests to pair with, the median tokens/s with its IQR."""
    plt = _plt()
    paired = any(r.get("speedup_gm") for r in rows)
    if paired:
        rows = [r for r in rows if r["method"] != REFERENCE and r.get("speedup_gm")]
    temps = sorted({r["temperature"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    cell = {(r["temperature"], r["workload"], r["method"]): r for r in rows}

    def point(r: dict) -> tuple[float, float, float]:  # value, low, high
        if paired:
            g = r["speedup_gm"]
            return g["ratio"], g["low"], g["high"]
        return r["throughput"], r["throughput_q25"], r["throughput_q75"]

    height = 0.9 + 0.32 * max(len(methods), 1) * (1 + 0.25 * len(workloads))
    fig, axes = plt.subplots(1, len(temps), figsize=(4.6 * len(temps), height), sharey=True, squeeze=False)
    step = 0.7 / max(len(workloads), 1)
    for ax, t in zip(axes[0], temps):
        for j, w in enumerate(workloads):
            ys, xs, lo, hi = [], [], [], []
            for i, m in enumerate(methods):
                r = cell.get((t, w, m))
                if r is None:
                    continue
                v, low, high = point(r)
                ys.append(i + (j - (len(workloads) - 1) / 2) * step)
                xs.append(v)
                lo.append(max(v - low, 0.0))
                hi.append(max(high - v, 0.0))
            ax.errorbar(xs, ys, xerr=[lo, hi], fmt="o", ms=4, capsize=2, color=f"C{j % 10}", label=w)
        if paired:
            ax.axvline(1.0, color="0.4", lw=1, ls="--")
        ax.set_yticks(range(len(methods)), methods)
        ax.set_ylim(len(methods) - 0.5, -0.5)
        ax.grid(axis="x", color="0.9")
        ax.set_xlabel("speedup over autoregressive (paired, 95% interval)" if paired else "tokens/s (median, IQR)",
                      fontsize=8)
        ax.set_title(f"T={t:g}", fontsize=9)
    axes[0][-1].legend(fontsize=7, loc="lower right")
    return _save(fig, path, dpi=100)


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


def plot_rounds(rounds: Mapping[str, pl.DataFrame], path: Path) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, len(rounds), figsize=(5 * len(rounds), 3.6), squeeze=False)
    for ax, (tag, df) in zip(axes[0], rounds.items()):
        x = df["round"].to_numpy()
        for col, style in (("surrogate_J", "o-"), ("oracle_bound", "--"), ("same_trace_J", "s-"), ("corrected_J", "^-")):
            ax.plot(x, df[col].cast(pl.Float64).to_numpy(), style, ms=4, label=col)
        acc = df["accepted"].to_numpy().astype(bool)
        if acc.any():
            ax.plot(x[acc], df["surrogate_J"].cast(pl.Float64).to_numpy()[acc], "k*", ms=9, label="accepted update")
        ax.set_xlabel("round")
        ax.set_ylabel("J (tokens/s)")
        ax.set_title(f"OGSPO rounds, {tag}", fontsize=9)
        ax.legend(fontsize=7)
    return _save(fig, path)


def plot_acceptance(records_summary: dict, path: Path) -> Path:
    """Per records folder: share of cycles whose accepted path reaches depth d (records summary)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for i, (name, s) in enumerate(records_summary.items()):
        acc = s.get("accept_by_depth") if isinstance(s, dict) else None
        if not acc:
            continue
        style = "-" if name.endswith("T0") else "--"
        ax.plot(range(1, len(acc) + 1), acc, style, marker="o", ms=3, color=f"C{i // 2 % 10}",
                label=f"{name} (tau {s.get('tau', float('nan')):.2f})")
    ax.set_xlabel("depth d")
    ax.set_ylabel("P(accepted path reaches depth d)")
    ax.set_title("acceptance by depth (posterior records, template T)", fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, path)


def tree_layout(paths: list[tuple[int, ...]]) -> dict[tuple[int, ...], tuple[float, int]]:
    """x (leaves in rank order, parents centred over their children) and depth of each rank path."""
    children: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for p in sorted(paths, key=lambda p: (len(p), p)):
        children.setdefault(p[:-1], []).append(p)
    pos: dict[tuple[int, ...], tuple[float, int]] = {}
    next_x = [0.0]

    def place(node: tuple[int, ...]) -> float:
        kids = sorted(children.get(node, []))
        if not kids:
            x = next_x[0]
            next_x[0] += 1.0
        else:
            x = float(np.mean([place(k) for k in kids]))
        pos[node] = (x, len(node))
        return x

    place(())
    return pos


def plot_structures(structures: Mapping[str, list[tuple[int, ...]]], path: Path) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, len(structures), figsize=(5 * len(structures), 4), squeeze=False)
    for ax, (tag, paths) in zip(axes[0], structures.items()):
        pos = tree_layout(paths)
        for node, (x, d) in pos.items():
            if node:
                px, pd = pos[node[:-1]]
                ax.plot([px, x], [-pd, -d], "-", color="0.5", lw=1)
        for node, (x, d) in pos.items():
            ax.plot(x, -d, "o", ms=14 if node else 16, color="C0" if node else "C3")
            ax.text(x, -d, "root" if not node else str(node[-1]), ha="center", va="center", fontsize=6, color="white")
        ax.set_title(f"OGSPO structure {tag}: {len(paths)} nodes, depth {max((len(p) for p in paths), default=0)}"
                     + (" (empty: autoregressive)" if not paths else ""), fontsize=9)
        depth = max((len(p) for p in paths), default=0)
        ax.set_yticks([-d for d in range(depth + 1)], [str(d) for d in range(depth + 1)])
        ax.set_ylabel("depth")
        ax.set_xticks([])
        ax.set_xlabel("node labels: rank among siblings")
    return _save(fig, path)


# ---------------------------------------------------------------- markdown


def _fmt(x, spec=".2f", none="-") -> str:
    return none if x is None or (isinstance(x, float) and not np.isfinite(x)) else format(x, spec)


def render_report(*, rows: list[dict], ratios: dict[str, dict[str, float]], lossless: dict, missing: list[str],
                  plots: list[Path], limits: list[str], tuned: dict, comparison: list[str] = (),
                  stability: Mapping[str, Mapping[str, float]] | None = None, target: Mapping | None = None) -> str:
    stability = stability or {}
    lines = ["# ogspo evaluation report", ""]
    if target:  # what ran: the evaluation's target dtype and machine
        lines += [f"Target weights in {target.get('dtype', '?')} on {target.get('machine', '?')} "
                  f"({target.get('threads', '?')} threads, matmul kernels from `{target.get('kernels', '?')}`).", ""]
    lines += [*comparison]
    temps = sorted({r["temperature"] for r in rows})
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for t in temps:
        lines += [f"## Throughput, T={t:g} (median tokens/s [IQR], speedup over autoregressive)", "",
                  "| method | " + " | ".join(workloads) + " |", "|---|" + "---:|" * len(workloads)]
        for m in methods:
            cells = []
            for w in workloads:
                r = next((r for r in rows if r["temperature"] == t and r["workload"] == w and r["method"] == m), None)
                cells.append("-" if r is None else f"{r['throughput']:.1f} [{r['throughput_q25']:.1f}-"
                             f"{r['throughput_q75']:.1f}] {_fmt(r['speedup'])}x")
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines += ["", "| method | workload | tau | tree nodes/cycle | predicted tok/s | predicted/realised | oracle bound "
                  "| draft | policy | verify | prefill | other |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in (r for r in rows if r["temperature"] == t):
            s = r["time_split"]
            lines.append(
                f"| {r['method']} | {r['workload']} | {r['tau']:.2f} | {r['mean_tree_size']:.1f} | "
                f"{_fmt(r['predicted_throughput'], '.1f')} | {_fmt(r['predicted_over_realised'])} | "
                f"{_fmt(r['oracle_throughput'], '.1f')} | "
                + " | ".join(f"{100 * s[k]:.0f}%" for k in ("draft", "policy", "verify", "prefill", "other")) + " |")
        lines.append("")
    lines += ["## OGSPO / tuned EAGLE-3 (median of per-request throughput ratios)", ""]
    if ratios:
        lines += ["| T | " + " | ".join(workloads) + " | mean |", "|---|" + "---:|" * (len(workloads) + 1)]
        for tag, per in ratios.items():
            vals = [per.get(w) for w in workloads]
            got = [v for v in vals if v is not None]
            lines.append(f"| {tag} | " + " | ".join(_fmt(v) for v in vals) + f" | {_fmt(float(np.mean(got)) if got else None)} |")
        allv = [v for per in ratios.values() for v in per.values()]
        lines += ["", f"Mean over workloads and temperatures: **{np.mean(allv):.2f}**."]
    else:
        lines.append("Not available: the evaluation ran without `ogspo` or without `eagle-tuned`.")
    if tuned:
        lines += ["", "Tuned EAGLE-3 trees [total_tokens, depth, top_k] (rule tune_eagle, calib prompts; in brackets the "
                  "share of bootstrap resamples of the tuning prompts that pick the same tree): "
                  + "; ".join(f"{tag} " + ", ".join(f"{w} {v}" + (f" [{stability[tag][w]:.0%}]" if w in stability.get(tag, {}) else "")
                                                    for w, v in per.items()) for tag, per in tuned.items())]
    near = lossless.get("near_ties", [])
    lines += [""] + render_latency(rows)
    lines += ["## Lossless check (T=0, every method against autoregressive decoding)", "",
              f"{lossless.get('checked', 0)} requests compared, {lossless.get('mismatches', 0)} real mismatches "
              f"(a mismatch stops the evaluation), {len(near)} float near-ties (top-2 logit margin < 1e-4):"]
    lines += [f"- {n['method']} on {n['workload']} prompt {n['prompt_id']} (repeat {n['repeat']}): token {n['token']}, "
              f"margin {n['margin']:.1e}" for n in near] or ["- none"]
    lines += ["", "## What limits it", ""] + [f"- {x}" for x in limits]
    lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    if missing:
        lines += ["", "## Left out", ""] + [f"- {m}" for m in missing]
    lines += ["", "Throughput is complete-request (generated tokens / wall time, prefill included). The predicted "
              "throughput replaces each cycle's measured time by the latency model's t_draft + t_verify + t_fixed "
              "(measured prefill kept). The oracle bound is the posterior optimum on the records' calib prompts in "
              "the latency model's units (cycles only, no prefill), so it is a reference, not a paired figure. The "
              "stop policy's time is measured around the stop hook and taken out of 'other'.", ""]
    return "\n".join(lines)


def _iv(d: dict | None) -> str:
    return "-" if not d else f"{d['ratio']:.3f} [{d['low']:.3f}, {d['high']:.3f}]"


WANTED_GAIN = 1.10  # the acceptance bar: OGSPO / best baseline where the oracle bound allows it


def records_figures(*, oracle: Mapping[str, float], sequoia: Mapping[str, dict], rounds: Mapping[str, pl.DataFrame]) -> dict[str, dict]:
    """Per temperature tag, the records' own figures in the latency model's units (same cycles, same
    model): autoregressive decoding and the Sequoia tree replayed (sequoia.json), the OGSPO policy's
    surrogate J (its incumbent round) and the oracle bound (solve/oracle_T*.json)."""
    out = {}
    for tag, J in oracle.items():
        sq = sequoia.get(tag)
        if sq is None or not sq.get("replayed_autoregressive"):
            continue
        fig = {"oracle": float(J), "ar": float(sq["replayed_autoregressive"])}
        if sq.get("replayed_throughput") is not None:  # None: Sequoia's tree leaves the records' template
            fig["static"] = float(sq["replayed_throughput"])
        rf = rounds.get(tag)
        if rf is not None and rf.filter(pl.col("accepted")).height:
            fig["policy"] = float(rf.filter(pl.col("accepted"))["surrogate_J"][-1])
        out[tag] = fig
    return out


def gain_statements(rows: list[dict], records: Mapping[str, dict], method: str = OGSPO) -> list[dict]:
    """Per workload and temperature: `method` against the best baseline (with its interval), and the
    oracle bound in the same units. The bound is a records figure (calib prompts, the records' context
    lengths), so it is carried over as a ratio to autoregressive decoding, which shares those effects:
    bound / best = (oracle / AR on records) / (best baseline / AR realised in the cell), and in tokens/s
    the bound is that ratio times the cell's realised AR throughput (cycles only, prefill out, as the
    oracle is). The share of the oracle's gain over the best static tree (Sequoia's) that the policy
    captures is (policy - static) / (oracle - static), on the records."""
    out = []
    cells = list(dict.fromkeys((r["workload"], r["temperature"]) for r in rows))
    for w, t in cells:
        at = {r["method"]: r for r in rows if r["workload"] == w and r["temperature"] == t}
        me, ar = at.get(method), at.get(REFERENCE)
        if me is None or ar is None or me.get("best_baseline") not in at:
            continue
        base = at[me["best_baseline"]]
        rec = records.get(temperature_tag(t))
        best_over_ar = 1.0 if base["method"] == REFERENCE else (base.get("speedup_gm") or {}).get("ratio")
        bound_over_ar = rec["oracle"] / rec["ar"] if rec else None
        share = None
        if rec and "policy" in rec and "static" in rec and rec["oracle"] > rec["static"]:
            share = (rec["policy"] - rec["static"]) / (rec["oracle"] - rec["static"])
        out.append({
            "workload": w, "temperature": t, "best_baseline": me["best_baseline"], "vs_best": me.get("vs_best"),
            "best_baseline_eval": me.get("best_baseline_eval"), "vs_best_eval": me.get("vs_best_eval"),
            "vs_ar": me.get("speedup_gm"), "cycles_throughput": me.get("cycles_throughput"),
            "oracle_over_ar_records": bound_over_ar,
            "oracle_vs_best": bound_over_ar / best_over_ar if bound_over_ar and best_over_ar else None,
            "oracle_realised_cycles_throughput": (bound_over_ar * ar["cycles_throughput"]
                                                  if bound_over_ar and ar.get("cycles_throughput") else None),
            "records": rec, "share_of_oracle_gain": share,
        })
    return out


def render_comparison(statements: list[dict], pooled: dict, method: str = OGSPO) -> list[str]:
    """OGSPO against the best baseline per cell and pooled, with the oracle bound; the A/A check."""
    lines = [f"## {method.upper()} against the best baseline (geometric mean of paired per-request ratios, "
             "95% bootstrap interval)", "",
             "The best baseline of a cell is the fastest (geometric mean) of autoregressive decoding, tuned "
             "EAGLE-3 and Sequoia's static tree, picked on the calib prompts (rule tune_eagle runs the three side by "
             "side there) and then only measured here; 'picked here' re-picks it on these requests inside every "
             "bootstrap resample, so its interval carries the winner's curse. Every method of a slot generates the "
             "same number of tokens. The oracle bound comes from the records (calib prompts, latency model, cycles only): "
             "it is carried over as its ratio to autoregressive decoding on the same records, i.e. bound / best = "
             "(oracle / AR on records) / (best / AR here), and in tokens/s = that ratio x this cell's AR (cycles "
             "only, prefill out). The share of the oracle's gain over the best static tree (Sequoia) that the "
             "policy captures is measured on the records (per temperature).", "",
             f"| T | workload | best baseline (calib) | {method} / best | best picked here | {method} / it | "
             f"{method} / ar | {method} tok/s (cycles) | "
             "oracle bound (tok/s, cycles) | bound / best | share of oracle gain over best static tree |",
             "|---:|---|---|---|---|---|---|---:|---:|---:|---:|"]
    for st in statements:
        lines.append(f"| {st['temperature']:g} | {st['workload']} | {st['best_baseline']} | {_iv(st['vs_best'])} | "
                     f"{st.get('best_baseline_eval') or '-'} | {_iv(st.get('vs_best_eval'))} | "
                     f"{_iv(st['vs_ar'])} | {_fmt(st['cycles_throughput'], '.1f')} | "
                     f"{_fmt(st['oracle_realised_cycles_throughput'], '.1f')} | {_fmt(st['oracle_vs_best'])} | "
                     f"{_fmt(st['share_of_oracle_gain'])} |")
    lines.append("")
    for key, label in (("vs_best", "best baseline (picked on calib prompts)"),
                       ("vs_best_eval", "best baseline (re-picked on these requests per resample)"),
                       ("vs_ar", "autoregressive"), ("vs_eagle_tuned", "tuned EAGLE-3"), ("vs_sequoia", "Sequoia")):
        p = pooled.get(key)
        if not p:
            continue
        per_t = "; ".join(f"T={t}: {_iv(iv)}" for t, iv in p["by_temperature"].items())
        lines.append(f"- Pooled {method} / {label}: **{_iv(p['pooled'])}** (n={p['pooled']['n']}); {per_t}.")
    for tag in dict.fromkeys(temperature_tag(st["temperature"]) for st in statements):
        rec = next((st["records"] for st in statements if temperature_tag(st["temperature"]) == tag and st["records"]), None)
        if rec:
            pol = f", policy {rec['policy']:.2f} ({rec['policy'] / rec['ar']:.3f}x)" if "policy" in rec else ""
            static = (f"best static tree (Sequoia) {rec['static']:.2f} ({rec['static'] / rec['ar']:.3f}x)" if "static" in rec
                      else "Sequoia's tree leaves the records' template (not replayed)")
            lines.append(f"- {tag} on the records (tok/s, latency model, cycles only): autoregressive {rec['ar']:.2f}, "
                         f"{static}{pol}, oracle {rec['oracle']:.2f} ({rec['oracle'] / rec['ar']:.3f}x).")
    for st in statements:
        ob = st["oracle_vs_best"]
        vb = st["vs_best"]
        if ob is None or vb is None:
            continue
        where = f"T={st['temperature']:g} {st['workload']}"
        if ob >= WANTED_GAIN:
            verdict = ("reaches" if vb["ratio"] >= WANTED_GAIN and vb["low"] > 1 else "does not reach")
            lines.append(f"- {where}: the oracle bound exceeds the best baseline ({st['best_baseline']}) by "
                         f"{100 * (ob - 1):.0f}%; {method} {verdict} {WANTED_GAIN:.2f}x with its interval above 1 "
                         f"({_iv(vb)}).")
        else:
            lines.append(f"- {where}: the oracle bound is only {ob:.2f}x the best baseline ({st['best_baseline']}), "
                         f"below {WANTED_GAIN:.2f}x: no policy over this structure and records template can gain "
                         "10% here.")
    aa = pooled.get("aa_check")
    lines += ["", "### A/A check", ""]
    if aa and aa["pooled"]:
        ok = aa["pooled"]["low"] <= 1.0 <= aa["pooled"]["high"]
        cells = "; ".join(f"{c['workload']} T={c['temperature']:g}: {_iv(c)}" for c in aa["cells"] if "ratio" in c)
        half = (aa["pooled"]["high"] - aa["pooled"]["low"]) / 2
        lines.append(f"`{AA_CHECK}` (autoregressive decoding run again, in the same mirrored seeded slot orders) / "
                     f"`{REFERENCE}`: pooled **{_iv(aa['pooled'])}** (half-width {100 * half:.1f}%), which "
                     f"{'contains' if ok else 'does NOT contain'} 1.00; per cell {cells}.")
    else:
        lines.append(f"Not run: add `{AA_CHECK}` to evaluate.methods.")
    return lines + [""]


def read_shipping(rounds_json: Path) -> dict | None:
    """The keep/drop rule's decision of a rounds folder (rounds.json "ship"), None when absent."""
    if not Path(rounds_json).is_file():
        return None
    return _read_json(Path(rounds_json), "rounds summary").get("ship")


def render_shipping(shipping: Mapping[str, dict]) -> list[str]:
    """What the ogspo method ships per temperature: the stop policy, or the static tree that beat it."""
    if not shipping:
        return []
    lines = ["### What `ogspo` ships (keep/drop rule, held-out record requests)", ""]
    for tag, sh in shipping.items():
        what = "the learned stop policy over its structure" if sh.get("keep_policy") else (
            f"the static tree {sh.get('shipped')} ({len(sh.get('structure', []))} nodes), not the stop policy")
        lines.append(f"- {tag}: {what}. {sh.get('reason', '')}")
        for w, v in (sh.get("workloads") or {}).items():
            n = "-" if v.get("structure") is None else len(v["structure"])
            so = v.get("stop_only")
            bound = "" if so is None else (
                f"; stop-only bound of S {so['bound_J']:.1f} = +{100 * so['bound_gain']:.1f}% over its best fixed depth "
                f"d={so['best_fixed_depth']} ({so['best_fixed_J']:.1f})")
            lines.append(f"  - {w}: {v['shipped']} ({n} nodes; J on its record cycles "
                         + ", ".join(f"{k} {x:.1f}" for k, x in v.get("J", {}).items()) + bound + ")")
    return lines + [""]


LATENCY_CHECKED = (REFERENCE, TUNED, "sequoia", OGSPO)
LATENCY_BAND = (0.95, 1.05)


def latency_check(rows: list[dict]) -> dict:
    """The latency model against realised requests: per method of `LATENCY_CHECKED`, the per-cell medians
    of predicted / realised throughput and whether all lie within `LATENCY_BAND`."""
    out = {}
    for m in LATENCY_CHECKED:
        cells = {f"{r['workload']}/T{r['temperature']:g}": r["predicted_over_realised"] for r in rows
                 if r["method"] == m and r.get("predicted_over_realised") is not None}
        if cells:
            out[m] = {"cells": cells, "within": all(LATENCY_BAND[0] <= v <= LATENCY_BAND[1] for v in cells.values())}
    return out


def render_latency_check(check: dict) -> list[str]:
    if not check:
        return []
    lines = [f"### Latency model against realised requests (median predicted / realised per cell; band "
             f"{LATENCY_BAND[0]:.2f}-{LATENCY_BAND[1]:.2f})", ""]
    for m, c in check.items():
        vals = list(c["cells"].values())
        lines.append(f"- {m}: {min(vals):.3f}-{max(vals):.3f} over {len(vals)} cells, "
                     f"{'all within' if c['within'] else 'NOT all within'} the band.")
    return lines + [""]


def render_latency(rows: list[dict]) -> list[str]:
    """Time to first token and request latency percentiles beside throughput, per method and cell."""
    lines = ["## Latency (seconds: time to first token p50; whole request p50 / p90)", "",
             "| T | workload | method | requests | TTFT p50 | latency p50 | latency p90 | tok/s (median) |",
             "|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['temperature']:g} | {r['workload']} | {r['method']} | {r['n_requests']} | "
                     f"{_fmt(r.get('ttft_p50'), '.3f')} | {_fmt(r.get('latency_p50'), '.2f')} | "
                     f"{_fmt(r.get('latency_p90'), '.2f')} | {r['throughput']:.1f} |")
    return lines + [""]


def render_heads(acceptance: dict, metas: Mapping[str, dict]) -> list[str]:
    """The draft heads side by side (stage measure_drafter, same eval prompts, interleaved): top-1
    acceptance by depth of a chain, the best EAGLE-3 tree's tau and its speedup, per head; and each
    head's training figures (held-out TTT top-1; GTO's held-out Draft Tree Reward before and after)."""
    figs = acceptance.get("figures", [])
    heads = list(dict.fromkeys(f["head"] for f in figs if f.get("head")))
    lines = ["## Draft heads (stage measure_drafter: held-out eval prompts, heads interleaved prompt by prompt)", "",
             "Chain acceptance by depth d: P(depth d accepted | depth d-1 reached) [cycles that reached d-1]. First-token "
             "ceiling: the target's mean largest probability at the chain's roots, which a drafted token (a point mass) "
             "is accepted with at most, at T > 0.", "",
             "| workload | T | head | chain acceptance by depth | first-token ceiling | best tree | tau | speedup vs ar |",
             "|---|---:|---|---|---:|---|---:|---:|"]
    keys = list(dict.fromkeys((f["workload"], f["temperature"]) for f in figs))
    for w, t in keys:
        for h in heads:
            mine = [f for f in figs if f["workload"] == w and f["temperature"] == t and f.get("head") == h]
            chain_ = next((f for f in mine if f["method"].startswith("chain")), None)
            trees = [f for f in mine if f["method"].startswith("eagle")]
            best = max(trees, key=lambda f: f["tau"]) if trees else None
            acc = "-"
            if chain_:
                counts = chain_.get("depth_trials") or [None] * len(chain_["accept_by_depth"])
                acc = ", ".join(f"{a:.2f}" + (f" [{n}]" if n is not None else "") for a, n in zip(chain_["accept_by_depth"], counts))
                acc += f" ({chain_['prompts']} prompts)" if chain_.get("prompts") else ""
            ceiling = _fmt(chain_.get("first_token_ceiling") if chain_ else None, ".3f")
            lines.append(f"| {w} | {t:g} | {h} | {acc} | {ceiling} | {best['method'] if best else '-'} | "
                         f"{_fmt(best['tau'] if best else None)} | {_fmt(best['speedup'] if best else None)}x |")
    for h, meta in metas.items():
        top1 = [round(a, 3) for a in meta.get("metrics", {}).get("val_top1", [])]
        m = meta.get("metrics", {})
        text = f"- {h}: held-out TTT top-1 {top1}" if "published" not in meta else f"- {h}: the EAGLE-3 head at {meta['published']} (drafter.path)"
        d = m.get("data")
        if d:
            made = "read from the cache" if d["cached"] else (
                f"{d['generation_tokens_per_second']:.0f} tokens/s of generation, {d['annotation_tokens_per_second']:.0f} "
                f"tokens/s of reading text at {d['annotate_rows']} rows"
                + (f", on the {d['bulk']['write']} / {d['bulk']['read']} kernels" if d.get("bulk") else ""))
            text += (f"; {m['train_tokens']} training tokens ({d['generated_tokens']} written by the target, "
                     f"{d['annotated_tokens']} read as text, "
                     f"{d['self_instructions']} self-written requests, {d['near_held_out']} prompts dropped as near an "
                     f"eval/calib prompt; {made}); data {m['data_seconds'] / 60:.1f} min, {m['steps']} steps "
                     f"{m['train_seconds'] / 60:.1f} min")
        g = meta.get("gto_metrics")
        if g:
            text += (f"; GTO {g['steps']} steps ({g['seconds'] / 60:.1f} min), held-out Draft Tree Reward "
                     f"{g['reward_before']:.3f} -> {g['reward_after']:.3f}, accepted tokens per tree "
                     f"{g['accepted_before']:.3f} -> {g['accepted_after']:.3f}")
        lines.append(text)
    return lines + [""]


def limiting_factors(rows: list[dict], *, latency_doc: dict | None, structures: Mapping[str, list]) -> list[str]:
    """Data-driven statements about what bounds the speedup on this device."""
    out = []
    if latency_doc is not None:
        m = LatencyModel.from_json(latency_doc)
        L = float(np.median(m.contexts))
        t1 = float(m.t_verify(1, L))
        parts = [f"n={n}: {float(m.t_verify(n, L)) / t1:.2f}x" for n in (2, 4, 8, 16, 32) if n <= max(m.sizes)]
        out.append(f"Verification cost relative to one token at L={L:.0f} (latency model): {', '.join(parts)}; one "
                   f"draft level costs {1e3 * float(m.t_draft(1)):.1f} ms against {1e3 * t1:.1f} ms for a one-token "
                   f"target pass, t_fixed {1e3 * m.fixed:.1f} ms. A cycle must commit more tokens than its relative "
                   "cost to beat autoregressive decoding.")
    for t in sorted({r["temperature"] for r in rows}):
        at = [r for r in rows if r["temperature"] == t]
        # a method that verified no drafted node (an empty structure, "do not speculate") is not speculative
        best = max((r for r in at if r["method"] not in (REFERENCE, AA_CHECK) and r["speedup"] is not None
                    and r["mean_tree_size"] > 0), key=lambda r: r["speedup"], default=None)
        if best is not None:
            out.append(f"T={t:g}: fastest speculative method/workload is {best['method']} on {best['workload']} at "
                       f"{best['speedup']:.2f}x autoregressive (tau {best['tau']:.2f}, verify "
                       f"{100 * best['time_split']['verify']:.0f}% and draft {100 * best['time_split']['draft']:.0f}% "
                       "of its wall time).")
        og = [r for r in at if r["method"] == OGSPO]
        if og:
            tau = np.mean([r["tau"] for r in og])
            pol = np.mean([r["time_split"]["policy"] for r in og])
            pr = [r["predicted_over_realised"] for r in og if r["predicted_over_realised"] is not None]
            orc = [r for r in og if r["oracle_throughput"] is not None]
            text = f"T={t:g}: OGSPO commits {tau:.2f} tokens per cycle; its stop policy takes {100 * pol:.1f}% of wall time"
            if pr:
                text += f"; the latency model predicts {np.mean(pr):.2f}x the realised throughput"
            if orc:
                text += (f"; realised median {np.mean([r['throughput'] for r in orc]):.1f} tok/s against an oracle "
                         f"bound of {orc[0]['oracle_throughput']:.1f} (records, cycles only)")
            out.append(text + ".")
    for tag, paths in structures.items():
        depth = max((len(p) for p in paths), default=0)
        out.append(f"{tag}: the OGSPO structure has {len(paths)} nodes, depth {depth}"
                   + (" (empty: the oracle found drafting not worth its cost here)." if not paths else "."))
    return out


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
) -> ReportResult:
    """report/summary.json, report/report.md and the plots. `structures` and `rounds` map a temperature
    tag (T0, T1) to policy/T*/structure.json and rounds/T*/rounds.parquet; absent rounds files leave
    the rounds plot out (said in report.md). `drafter_eval` (drafter_eval/acceptance.json) and `heads`
    (label -> drafter folder) add the draft heads side by side."""

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
        "shipping": shipping, "latency_check": checked,
        "plots": [p.name for p in plots], "left_out": missing, "limits": limits,
        "reference": REFERENCE, "baseline": TUNED,
    })
    summary_path = out_dir / "summary.json"
    md_path = out_dir / "report.md"
    md = render_report(rows=rows, ratios=ratios, lossless=lossless, missing=missing, plots=plots, limits=limits, tuned=tuned,
                       stability=(ev.get("settings") or {}).get("tune_winner_stability"), target=(ev.get("settings") or {}).get("target"),
                       comparison=render_comparison(statements, pooled) + render_shipping(shipping)
                       + render_latency_check(checked))
    if drafter_eval is not None:
        metas = {h: _read_json(Path(d) / "drafter.json", f"drafter {h}") if (Path(d) / "drafter.json").is_file()
                 else {"published": str(d)} for h, d in (heads or {}).items()}  # a head given as drafter.path has no training figures
        md += "\n" + "\n".join(render_heads(_read_json(drafter_eval, "drafter acceptance"), metas))
    for path, text in ((summary_path, json.dumps(doc, indent=1) + "\n"), (md_path, md)):
        write_text(path, text)
    return ReportResult(summary_path=summary_path, markdown_path=md_path, plots=plots, missing=missing, ratios=ratios)
