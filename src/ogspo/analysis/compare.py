"""Paired comparisons of decoding methods with bootstrap intervals (stages `evaluate` and `report`).

Every request slot (workload, temperature, prompt, repeat) ran every method on the same prompt and
seed, interleaved, so a method's speed against a baseline is a set of per-request ratios. We quote
their **geometric mean** (ratios multiply; a 2x and a 0.5x cancel) with a 95% **bootstrap interval**:
requests are resampled with replacement *within each cell* (workload x temperature) and the pooled
figure is the geometric mean over all cells' requests, so a cell with more requests weighs more and
the interval keeps the cells' sizes fixed.

The **best baseline** of a cell is whichever of autoregressive decoding, tuned EAGLE-3 and Sequoia's
static tree is fastest there: what a user would otherwise run. It is quoted two ways:
- picked on the calib prompts (`tune_eagle` runs the three side by side there), then fixed: the
  eval requests only measure it (`ratio_intervals` with a per-cell baseline table);
- picked on the eval requests themselves (`best_of_intervals`): per cell the candidate with the
  highest geometric-mean throughput, **re-picked inside every bootstrap resample**, so the interval
  carries the winner's curse (the largest of three noisy means), which favours the baseline.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import polars as pl

SLOT_KEYS = ("workload", "temperature", "prompt_id", "repeat")
CELL_KEYS = ("workload", "temperature")


@dataclass(frozen=True)
class Interval:
    """Geometric mean of paired ratios with its 95% bootstrap interval."""

    ratio: float
    low: float
    high: float
    n: int  # paired requests

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high

    def text(self) -> str:
        return f"{self.ratio:.3f} [{self.low:.3f}, {self.high:.3f}] (n={self.n})"

    def to_dict(self) -> dict:
        return asdict(self)


def paired_log_ratios(df: pl.DataFrame, method: str, baseline: str | pl.DataFrame) -> pl.DataFrame:
    """Per request slot log(throughput of `method` / throughput of the baseline), with the cell keys.
    `baseline` is a method name or a table (cell keys -> `baseline` column) naming one per cell."""
    a = df.filter(pl.col("method") == method).select([*SLOT_KEYS, "throughput"])
    if isinstance(baseline, str):
        b = df.filter(pl.col("method") == baseline)
    else:
        b = df.join(baseline, on=list(CELL_KEYS)).filter(pl.col("method") == pl.col("baseline"))
    b = b.select([*SLOT_KEYS, pl.col("throughput").alias("base")])
    j = a.join(b, on=list(SLOT_KEYS), how="inner").filter((pl.col("base") > 0) & (pl.col("throughput") > 0))
    return j.select([*CELL_KEYS, (pl.col("throughput") / pl.col("base")).log().alias("log_ratio")])


def bootstrap_interval(log_ratios: np.ndarray, strata: np.ndarray | None = None, *, n_boot: int = 2000,
                       seed: int = 0) -> Interval | None:
    """exp(mean log ratio) and the 2.5/97.5% quantiles of its bootstrap, resampling within strata. None when empty."""
    x = np.asarray(log_ratios, dtype=np.float64)
    if len(x) == 0:
        return None
    strata = np.zeros(len(x), dtype=np.int64) if strata is None else np.unique(strata, return_inverse=True)[1]
    rng = np.random.default_rng(seed)
    sums = np.zeros(n_boot)
    for s in np.unique(strata):
        xs = x[strata == s]
        pick = rng.integers(0, len(xs), size=(n_boot, len(xs)))  # [B, n_s]
        sums += xs[pick].sum(axis=1)
    boot = sums / len(x)
    lo, hi = np.quantile(boot, [0.025, 0.975])
    return Interval(ratio=float(np.exp(x.mean())), low=float(np.exp(lo)), high=float(np.exp(hi)), n=len(x))


def ratio_intervals(df: pl.DataFrame, method: str, baseline: str | pl.DataFrame, *, seed: int = 0) -> dict:
    """{'cells': {(workload, temperature): Interval}, 'pooled': Interval | None, 'by_temperature': {T: Interval}}."""
    lr = paired_log_ratios(df, method, baseline)
    cells = {}
    for (w, t), g in lr.group_by(list(CELL_KEYS), maintain_order=True):
        cells[(w, float(t))] = bootstrap_interval(g["log_ratio"].to_numpy(), seed=seed)
    strata = (lr["workload"] + "/" + lr["temperature"].cast(pl.String)).to_numpy() if lr.height else None
    by_t = {}
    for (t,), g in lr.group_by(["temperature"], maintain_order=True):
        by_t[float(t)] = bootstrap_interval(g["log_ratio"].to_numpy(), g["workload"].to_numpy(), seed=seed)
    return {"cells": cells, "pooled": bootstrap_interval(lr["log_ratio"].to_numpy(), strata, seed=seed),
            "by_temperature": by_t}


def best_of_intervals(df: pl.DataFrame, method: str, candidates: tuple[str, ...], *, n_boot: int = 2000,
                      seed: int = 0) -> dict:
    """`method` against the best of `candidates` per cell, the best picked on these same requests and
    re-picked in every bootstrap resample. Only slots where `method` and every present candidate ran
    count. Per cell the log ratio to the best is min over candidates of the mean log ratio (the fastest
    geometric mean over the same slots); pooled = the request-weighted mean over cells.
    Returns `ratio_intervals`' keys plus 'picked' {(workload, T): candidate} and 'pick_stability'
    {(workload, T): share of resamples that picked the same candidate}."""
    present = [c for c in candidates if c in set(df["method"].to_list())]
    empty = {"cells": {}, "pooled": None, "by_temperature": {}, "picked": {}, "pick_stability": {}}
    if not present or method not in set(df["method"].to_list()):
        return empty
    j = df.filter(pl.col("method") == method).select([*SLOT_KEYS, pl.col("throughput").alias("m")])
    for c in present:
        b = df.filter(pl.col("method") == c).select([*SLOT_KEYS, pl.col("throughput").alias(c)])
        j = j.join(b, on=list(SLOT_KEYS), how="inner")
    j = j.filter(pl.all_horizontal([pl.col(c) > 0 for c in ["m", *present]]))
    if j.height == 0:
        return empty
    rng = np.random.default_rng(seed)
    cells, picked, stability, draws = {}, {}, {}, {}
    for (w, t), g in j.group_by(list(CELL_KEYS), maintain_order=True):
        lr = np.log(g["m"].to_numpy())[:, None] - np.log(g.select(present).to_numpy())  # [n, K]
        n = lr.shape[0]
        full = lr.mean(0)  # [K]
        pick = rng.integers(0, n, size=(n_boot, n))  # [B, n]
        boot = lr[pick].mean(1)  # [B, K]
        best_b = boot.min(1)  # [B]
        lo, hi = np.quantile(best_b, [0.025, 0.975])
        key = (w, float(t))
        cells[key] = Interval(ratio=float(np.exp(full.min())), low=float(np.exp(lo)), high=float(np.exp(hi)), n=n)
        picked[key] = present[int(full.argmin())]
        stability[key] = float((boot.argmin(1) == full.argmin()).mean())
        draws[key] = (n, float(full.min()), best_b)

    def pool(keys: list) -> Interval:
        N = sum(draws[k][0] for k in keys)
        point = sum(draws[k][0] * draws[k][1] for k in keys) / N
        boot = sum(draws[k][0] * draws[k][2] for k in keys) / N  # [B]
        lo, hi = np.quantile(boot, [0.025, 0.975])
        return Interval(ratio=float(np.exp(point)), low=float(np.exp(lo)), high=float(np.exp(hi)), n=N)

    temps = sorted({t for _, t in draws})
    return {"cells": cells, "pooled": pool(list(draws)),
            "by_temperature": {t: pool([k for k in draws if k[1] == t]) for t in temps},
            "picked": picked, "pick_stability": stability}


def intervals_json(res: dict) -> dict:
    """`ratio_intervals` output as JSON-ready lists."""
    picked, stable = res.get("picked", {}), res.get("pick_stability", {})
    cells = []
    for (w, t), iv in res["cells"].items():
        extra = {"baseline": picked[(w, t)], "pick_stability": stable[(w, t)]} if (w, t) in picked else {}
        cells.append({"workload": w, "temperature": t, **(iv.to_dict() if iv else {}), **extra})
    return {
        "cells": cells,
        "by_temperature": {f"{t:g}": iv.to_dict() for t, iv in res["by_temperature"].items() if iv},
        "pooled": res["pooled"].to_dict() if res["pooled"] else None,
    }
