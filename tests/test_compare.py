"""Paired ratios, geometric means and bootstrap intervals (ogspo.stages.compare)."""

import numpy as np
import polars as pl
import pytest

from ogspo.stages.compare import best_baselines, bootstrap_interval, ratio_intervals
from ogspo.stages.evaluate import pooled_comparisons


def _requests(rows):
    return pl.DataFrame([{"workload": w, "temperature": t, "method": m, "prompt_id": p, "repeat": 0, "throughput": x}
                         for w, t, m, p, x in rows])


def test_interval_of_constant_ratios_is_the_ratio():
    iv = bootstrap_interval(np.log(np.full(7, 1.2)))
    assert iv.ratio == pytest.approx(1.2) and iv.low == pytest.approx(1.2) and iv.high == pytest.approx(1.2)
    assert iv.n == 7 and bootstrap_interval(np.array([])) is None


def test_interval_covers_the_geometric_mean_and_narrows_with_more_requests():
    rng = np.random.default_rng(1)
    small = bootstrap_interval(np.log(1.1) + 0.1 * rng.standard_normal(10))
    large = bootstrap_interval(np.log(1.1) + 0.1 * rng.standard_normal(1000))
    assert small.low < small.ratio < small.high
    assert large.low < 1.1 < large.high
    assert (large.high - large.low) < (small.high - small.low) / 4


def test_pooled_ratio_is_the_geometric_mean_over_cells_with_strata_kept():
    rows = []
    for w, r in (("a", 2.0), ("b", 0.5)):
        for p in range(4):
            rows += [(w, 0.0, "ar", str(p), 10.0), (w, 0.0, "x", str(p), 10.0 * r)]
    res = ratio_intervals(_requests(rows), "x", "ar")
    assert res["pooled"].ratio == pytest.approx(1.0)
    # every bootstrap draw keeps 4 requests per cell, each cell constant: the interval is the point
    assert res["pooled"].low == pytest.approx(1.0) and res["pooled"].high == pytest.approx(1.0)
    assert res["cells"][("a", 0.0)].ratio == pytest.approx(2.0)


def test_best_baseline_is_the_faster_of_ar_and_tuned_per_cell():
    rows = []
    for p in range(3):
        rows += [("a", 0.0, "ar", str(p), 10.0), ("a", 0.0, "eagle-tuned", str(p), 12.0), ("a", 0.0, "ogspo", str(p), 13.2),
                 ("b", 0.0, "ar", str(p), 10.0), ("b", 0.0, "eagle-tuned", str(p), 8.0), ("b", 0.0, "ogspo", str(p), 11.0),
                 ("a", 0.0, "ar-aa", str(p), 10.0), ("b", 0.0, "ar-aa", str(p), 10.0)]
    df = _requests(rows)
    best = {w: b for w, _, b in best_baselines(df, ("ar", "eagle-tuned")).iter_rows()}
    assert best == {"a": "eagle-tuned", "b": "ar"}
    pooled = pooled_comparisons(df, method="ogspo")
    assert pooled["vs_best"]["pooled"]["ratio"] == pytest.approx(1.1)  # 13.2/12 and 11/10
    assert pooled["vs_ar"]["pooled"]["ratio"] == pytest.approx((1.32 * 1.1) ** 0.5)
    aa = pooled["aa_check"]["pooled"]
    assert aa["low"] <= 1.0 <= aa["high"]
