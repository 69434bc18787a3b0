"""The report's plots (matplotlib Agg, written atomically): each method's speedup over autoregressive
decoding per workload, the latency model's fit, the OGSPO rounds, acceptance by depth, the chosen
structures drawn as trees."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import polars as pl

from ogspo.artifacts.latency import LatencyCalibration
from ogspo.methods.registry import REFERENCE


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


def plot_calibration(cal: LatencyCalibration, *, png_path: Path, dpi: int = 80) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = cal.model
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ns = np.arange(1, max(m.sizes) + 1)
    Ls = sorted(set(m.contexts) | {v["L"] for v in cal.validation})
    for i, L in enumerate(Ls):
        color = f"C{i}"
        ax1.plot(ns, 1e3 * m.t_verify(ns, L), "-", color=color, lw=1, label=f"model L={L}")
        if L in m.contexts:
            j = m.contexts.index(L)
            ax1.plot(m.sizes, 1e3 * np.asarray(m.verify_table)[:, j], "o", color=color, ms=3)
        pts = [v for v in cal.validation if v["L"] == L]
        if pts:
            ax1.plot([v["n"] for v in pts], [1e3 * v["measured"] for v in pts], "x", color=color, ms=6)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("tree tokens n (root included)")
    ax1.set_ylabel("t_verify (ms)")
    ax1.set_title(f"verify: table (o), held-out (x), MdAPE {100 * cal.mdape:.1f}%", fontsize=9)
    ax1.legend(fontsize=7)
    ws = np.arange(1, max(m.draft_widths) + 1)
    ax2.plot(m.draft_widths, 1e3 * np.asarray(m.draft_table), "o", ms=3, label="measured")
    ax2.plot(ws, 1e3 * m.t_draft(ws), "-", lw=1, label="model")
    ax2.set_xlabel("frontier width w")
    ax2.set_ylabel("t_draft (ms)")
    ax2.set_title(f"draft level ({m.meta.get('drafter', '?')}); t_fixed {1e3 * m.fixed:.1f} ms, + {1e6 * m.fixed_slope:.0f} "
                  f"us/node, AR {1e3 * m.fixed_ar:.2f} ms",
                  fontsize=9)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = png_path.with_name(f".{png_path.stem}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=dpi)
    plt.close(fig)
    os.replace(tmp, png_path)
