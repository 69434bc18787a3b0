"""Paired ratios, geometric means and bootstrap intervals (ogspo.analysis.compare)."""

import numpy as np
import polars as pl
import pytest

from ogspo.analysis.compare import best_of_intervals, bootstrap_interval, ratio_intervals
from ogspo.analysis.summary import pooled_comparisons


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


def test_best_baseline_is_the_fastest_of_ar_tuned_and_sequoia_per_cell():
    rows = []
    for p in range(3):
        rows += [("a", 0.0, "ar", str(p), 10.0), ("a", 0.0, "eagle-tuned", str(p), 12.0), ("a", 0.0, "ogspo", str(p), 13.2),
                 ("a", 0.0, "sequoia", str(p), 11.0),
                 ("b", 0.0, "ar", str(p), 10.0), ("b", 0.0, "eagle-tuned", str(p), 8.0), ("b", 0.0, "ogspo", str(p), 11.0),
                 ("b", 0.0, "sequoia", str(p), 10.5),
                 ("a", 0.0, "ar-aa", str(p), 10.0), ("b", 0.0, "ar-aa", str(p), 10.0)]
    df = _requests(rows)
    res = best_of_intervals(df, "ogspo", ("ar", "eagle-tuned", "sequoia"))
    assert res["picked"] == {("a", 0.0): "eagle-tuned", ("b", 0.0): "sequoia"}
    assert res["pooled"].ratio == pytest.approx((1.1 * 11.0 / 10.5) ** 0.5)  # 13.2/12 and 11/10.5
    # picked on the calib prompts instead (here: ar in both cells), the eval requests only measure it
    pooled = pooled_comparisons(df, method="ogspo", calib_best={"T0": {"a": "ar", "b": "ar"}})
    assert pooled["vs_best"]["pooled"]["ratio"] == pytest.approx((1.32 * 1.1) ** 0.5)
    assert pooled["vs_best_eval"]["pooled"]["ratio"] == pytest.approx(res["pooled"].ratio)
    assert pooled["vs_sequoia"]["pooled"]["ratio"] == pytest.approx((1.2 * 11.0 / 10.5) ** 0.5)
    assert pooled["vs_ar"]["pooled"]["ratio"] == pytest.approx((1.32 * 1.1) ** 0.5)
    aa = pooled["aa_check"]["pooled"]
    assert aa["low"] <= 1.0 <= aa["high"]


def test_re_picking_the_best_per_resample_carries_the_winners_curse():
    """Two baselines equal in truth: the one that looks faster on these requests is picked, and re-picking
    it in every resample puts the interval below the interval against either baseline alone."""
    rng = np.random.default_rng(3)
    rows = []
    for p in range(12):
        rows += [("a", 0.0, "x", str(p), 10.0 * np.exp(0.05 * rng.standard_normal())),
                 ("a", 0.0, "ar", str(p), 10.0 * np.exp(0.05 * rng.standard_normal())),
                 ("a", 0.0, "sequoia", str(p), 10.0 * np.exp(0.05 * rng.standard_normal()))]
    df = _requests(rows)
    both = best_of_intervals(df, "x", ("ar", "sequoia"))["pooled"]
    for one in ("ar", "sequoia"):
        alone = ratio_intervals(df, "x", one)["pooled"]
        assert both.ratio <= alone.ratio + 1e-12 and both.low <= alone.low + 1e-12


def _aa_requests(slow: float, *, n: int = 24, noise: float = 0.02, drift: float = 0.03, seed: int = 0) -> pl.DataFrame:
    """Simulated evaluation: `ar` and `ar-aa` (made `slow` slower) in mirrored slot orders among three
    other methods, each request's throughput hit by a position effect exp(-drift * place) and lognormal noise."""
    from ogspo.methods.harness import slot_order

    rng = np.random.default_rng(seed)
    names = ["ar", "ar-aa", "m1", "m2", "m3"]
    rows = []
    for index in range(n):
        base = 20.0 * np.exp(0.3 * rng.standard_normal())  # prompts differ a lot; pairs share it
        for pos, j in enumerate(slot_order(len(names), 1000 + index // 2, index)):
            tp = base * np.exp(-drift * pos + noise * rng.standard_normal()) / (slow if names[j] == "ar-aa" else 1.0)
            rows.append(("w", 0.0, names[j], str(index), tp))
    return _requests(rows)


def test_aa_check_detects_a_method_5_percent_slower_and_not_an_equal_one():
    for seed in range(3):
        equal = ratio_intervals(_aa_requests(1.0, seed=seed), "ar-aa", "ar")["pooled"]
        assert equal.contains(1.0), (seed, equal.text())
        slower = ratio_intervals(_aa_requests(1.05, seed=seed), "ar-aa", "ar")["pooled"]
        assert slower.high < 1.0 and slower.contains(1 / 1.05), (seed, slower.text())


def test_mirrored_orders_cancel_a_position_effect_that_random_orders_leave():
    """With no noise, a strong position effect biases A/A under one random order per slot; mirrored pairs
    cancel it exactly in the pooled geometric mean."""
    mirrored = ratio_intervals(_aa_requests(1.0, noise=0.0, drift=0.05), "ar-aa", "ar")["pooled"]
    assert mirrored.ratio == pytest.approx(1.0, abs=1e-9)
    rng = np.random.default_rng(0)
    rows = []
    for index in range(24):
        for pos, m in enumerate(rng.permutation(["ar", "ar-aa", "m1", "m2", "m3"]).tolist()):
            rows.append(("w", 0.0, m, str(index), 20.0 * (1 - 0.05 * pos)))
    assert abs(ratio_intervals(_requests(rows), "ar-aa", "ar")["pooled"].ratio - 1.0) > 1e-3
