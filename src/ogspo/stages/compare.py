"""Paired comparisons of decoding methods with bootstrap intervals (stages `evaluate` and `report`).

Every request slot (workload, temperature, prompt, repeat) ran every method on the same prompt and
seed, interleaved, so a method's speed against a baseline is a set of per-request ratios. We quote
their **geometric mean** (ratios multiply; a 2x and a 0.5x cancel) with a 95% **bootstrap interval**:
requests are resampled with replacement *within each cell* (workload x temperature) and the pooled
figure is the geometric mean over all cells' requests, so a cell with more requests weighs more and
the interval keeps the cells' sizes fixed.

The **best baseline** of a cell is whichever of autoregressive decoding and tuned EAGLE-3 has the
higher geometric-mean throughput there: what a user would otherwise run. Choosing it from the same
requests favours the baseline slightly (the larger of two noisy means), never the method compared.
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


def best_baselines(df: pl.DataFrame, candidates: tuple[str, ...]) -> pl.DataFrame:
    """Per cell, the candidate method with the highest geometric-mean throughput (columns: cell keys, baseline)."""
    present = [c for c in candidates if c in set(df["method"].to_list())]
    if not present:
        return pl.DataFrame(schema={"workload": pl.String, "temperature": pl.Float64, "baseline": pl.String})
    g = (df.filter(pl.col("method").is_in(present) & (pl.col("throughput") > 0))
         .group_by([*CELL_KEYS, "method"], maintain_order=True)
         .agg(pl.col("throughput").log().mean().alias("log_tps")))
    return (g.sort("log_tps", descending=True).group_by(list(CELL_KEYS), maintain_order=True)
            .agg(pl.col("method").first().alias("baseline")).sort(list(CELL_KEYS)))


def intervals_json(res: dict) -> dict:
    """`ratio_intervals` output as JSON-ready lists."""
    return {
        "cells": [{"workload": w, "temperature": t, **(iv.to_dict() if iv else {})} for (w, t), iv in res["cells"].items()],
        "by_temperature": {f"{t:g}": iv.to_dict() for t, iv in res["by_temperature"].items() if iv},
        "pooled": res["pooled"].to_dict() if res["pooled"] else None,
    }
