"""The per-device latency model (docs/DESIGN.md §4): latency.json, its reader and writer, and the fit.

t_verify(n, L) is a measured table over tree tokens n x context L, piecewise linear in n between
table sizes and linear in L (per-size or global slope, whichever predicts the table better by
leave-one-L-out, `fit_verify`); t_draft(w) is piecewise linear in the frontier width, t_draft(0) = 0;
t_fixed is the per-cycle overhead, by cycle kind: `fixed_ar` for an autoregressive step (the root
alone verified, nothing drafted: no drafter bookkeeping, a one-row sample), and for a speculative cycle
`fixed + fixed_slope * (n - 1)` (greedy/rejection checks over n rows, the drafter's bookkeeping and
cache compaction grow with the tree). A drafted cycle that commits A tokens also leaves A - 1 accepted
tokens for the drafter to re-encode at the next cycle's first level (the EAGLE head's catch-up): that
cost, t_catchup(A) = catchup[0] + ... + catchup[A - 2] (the j-th accepted token adds catchup[j - 1]; past
the table, nothing), is booked on the cycle that commits them, so t_c depends on A like J does, and stays
a sum over accepted path nodes (linear in the solvers' acceptance indicators). Measured by the stage
`calibrate_latency` (`ogspo.stages.calibrate_latency`).

The tables hold the machine's mean state. A shared CPU changes state within minutes, and not uniformly
across shapes: on the 2-core AMD EPYC a one-row forward flips between ~7.5 and ~11 ms while an 8-row
forward stays near 12 ms (memory bandwidth taken by a neighbour slows the bandwidth-bound one-row
forward most). `drift_elasticity[i]` is how t_verify(sizes[i]) moves with t_verify(1): relative change
over the one-row forward's relative change (1 at n = 1, ~0.2 at n = 8 there). `t_cycle(..., speed=f)`
predicts a cycle when a one-row forward runs f times its table value (`speed_ratio` of a probe). The
drafter's levels and the per-cycle overheads move with the state too (on the 2-core AMD EPYC Zen 3 a state
that slowed the one-row forward by 11% slowed them by 5-10%): by `draft_elasticity`, measured on the draft
table's timings like the verify table's.

A sampled cycle (T > 0) costs more than a greedy one outside the forward (the rows' softmax and draws:
+0.5 ms a cycle on the Zen 3, 2% of a cycle): `fixed_sampled`, booked by the model of that temperature
(`at_temperature`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from ogspo.artifacts.io import write_json

SCHEMA_VERSION = 4  # 2: fixed_ar, the overhead of an autoregressive step; 3: drift_elasticity, probe_level;
# 4: draft_elasticity, fixed_sampled


def _interp(x, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Piecewise linear through (xs, ys), linearly extrapolated from the end segments."""
    x = np.asarray(x, dtype=np.float64)
    if len(xs) == 1:
        return np.full_like(x, ys[0], dtype=np.float64)
    y = np.interp(x, xs, ys)
    lo = x < xs[0]
    hi = x > xs[-1]
    if lo.any():
        y = np.where(lo, ys[0] + (x - xs[0]) * (ys[1] - ys[0]) / (xs[1] - xs[0]), y)
    if hi.any():
        y = np.where(hi, ys[-1] + (x - xs[-1]) * (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), y)
    return y


@dataclass
class LatencyModel:
    """Plain data + methods. Times in seconds. Vectorised: n, L and w may be numpy arrays."""

    sizes: list[int]  # n of the t_verify table (tree tokens, root included)
    contexts: list[int]  # L of the t_verify table
    verify_table: list[list[float]]  # [len(sizes)][len(contexts)] medians
    verify_intercept: list[float]  # a(n) per table size: t_verify(n, L) = a(n) + b(n) * L
    verify_slope: list[float]  # b(n) per table size (all equal when slope_mode == "global")
    slope_mode: str  # "per-size" or "global"
    draft_widths: list[int]
    draft_table: list[float]  # medians per width
    fixed: float  # t_fixed of a speculative cycle (drafted tree verified)
    fixed_ar: float  # t_fixed of an autoregressive step (root alone, nothing drafted)
    fixed_slope: float  # seconds per verified node beyond the root, on top of `fixed`
    catchup: list[float]  # seconds the j-th accepted token (j = 1..) adds to the next cycle's first draft level
    drift_elasticity: list[float] = field(default_factory=list)  # per table size; empty: 1 for every size
    probe_level: float = 1.0  # what a speed probe reads over t_verify(1, L) in the tables' mean state
    draft_elasticity: float = 0.0  # how the draft levels and per-cycle overheads move with the state (0: they do not)
    fixed_sampled: float = 0.0  # seconds a sampled cycle (T > 0) adds to t_fixed, both cycle kinds (`at_temperature`)
    meta: dict = field(default_factory=dict)  # model checksum, drafter id, device, torch version, ...

    def t_verify(self, n, L, speed: float = 1.0):
        """Seconds of a target forward over n tree tokens on L committed ones; `speed`: the machine state
        (a one-row forward's time over its table value), applied through `drift_elasticity`."""
        xs = np.asarray(self.sizes, dtype=np.float64)
        a = _interp(n, xs, np.asarray(self.verify_intercept))
        b = _interp(n, xs, np.asarray(self.verify_slope))
        # not extrapolated below the smallest calibrated context: a noisy line's intercept can be far below
        # anything measured (even negative for large n), a shorter context's forward costs about the same
        t = a + b * np.maximum(np.asarray(L, dtype=np.float64), float(self.contexts[0]))
        return t if speed == 1.0 else t * (1.0 + self.elasticity(n) * (speed - 1.0))

    def elasticity(self, n) -> np.ndarray:
        """Relative change of t_verify(n) per relative change of t_verify(1), interpolated between table
        sizes (constant past the ends)."""
        n = np.asarray(n, dtype=np.float64)
        if not self.drift_elasticity:
            return np.ones_like(n)
        return np.interp(n, np.asarray(self.sizes, dtype=np.float64), np.asarray(self.drift_elasticity))

    def speed_ratio(self, probe_seconds: float, L) -> float:
        """The machine state from a probe (`methods.harness.probe_speed`: a one-row forward on L committed
        tokens): its time over what it reads in the tables' mean state."""
        return float(probe_seconds) / (self.probe_level * float(self.t_verify(1, L)))

    def at_temperature(self, temperature: float) -> "LatencyModel":
        """The model of decoding at `temperature`: at T > 0 every cycle, autoregressive step or drafted,
        books `fixed_sampled` more in t_fixed (and the returned model's `fixed_sampled` is 0, so a second
        call adds nothing); at T = 0 the model itself."""
        if float(temperature) <= 0 or self.fixed_sampled == 0:
            return self
        return replace(self, fixed=self.fixed + self.fixed_sampled, fixed_ar=self.fixed_ar + self.fixed_sampled,
                       fixed_sampled=0.0, meta={**self.meta, "temperature": float(temperature)})

    def t_draft(self, w):
        w = np.asarray(w, dtype=np.float64)
        xs = np.concatenate([[0.0], np.asarray(self.draft_widths, dtype=np.float64)])
        ys = np.concatenate([[0.0], np.asarray(self.draft_table)])
        return np.where(w <= 0, 0.0, _interp(w, xs, ys))

    def t_fixed(self, n_verify, drafted=None):
        """Per-cycle overhead of a cycle verifying n nodes (root included): `fixed_ar` for an autoregressive
        step (n = 1 and nothing drafted; `drafted` defaults to n > 1), else fixed + fixed_slope * (n - 1)."""
        n = np.asarray(n_verify, dtype=np.float64)
        drafted = n > 1 if drafted is None else np.asarray(drafted)
        return np.where(drafted, self.fixed + self.fixed_slope * (n - 1), self.fixed_ar)

    def fixed_offset(self, n_verify, drafted=None):
        """t_fixed(n) - fixed: what a solver that books `fixed` per cycle adds to t_verify(n, L)."""
        return self.t_fixed(n_verify, drafted) - self.fixed

    def catchup_cum(self, k: int) -> np.ndarray:
        """[k + 1] t_catchup(A) for A - 1 = 0..k (accepted drafted tokens)."""
        inc = np.zeros(k)
        m = min(k, len(self.catchup))
        inc[:m] = self.catchup[:m]
        return np.concatenate([[0.0], np.cumsum(inc)])

    def t_catchup(self, accepted):
        """The drafter's re-encoding of a drafted cycle's A committed tokens (A may be fractional: an
        expectation, interpolated)."""
        a = np.asarray(accepted, dtype=np.float64) - 1.0
        cum = self.catchup_cum(len(self.catchup))
        return np.interp(a, np.arange(len(cum), dtype=np.float64), cum)

    def t_cycle(self, level_widths, n_verify, L, accepted=1, speed: float = 1.0):
        """docs/DESIGN.md §4: sum_l t_draft(w_l) + t_verify(n, L) + t_fixed(n) + t_catchup(A) (level_widths:
        frontier widths; A: tokens the cycle commits). A cycle that drafted nothing and verifies the root
        alone is an autoregressive step (no drafter, so no catch-up either). `speed`: the machine state
        (see `t_verify`); the target's forward moves by its size's `drift_elasticity`, the head's levels and
        the per-cycle overheads by `draft_elasticity`."""
        widths = np.asarray(list(level_widths), dtype=np.float64)
        draft = float(np.sum(self.t_draft(widths))) if len(widths) else 0.0
        n = np.asarray(n_verify)
        drafted = (n > 1) | bool((widths > 0).any())
        rest = draft + self.t_fixed(n, drafted) + np.where(drafted, self.t_catchup(accepted), 0.0)
        return self.t_verify(n, L, speed) + rest * (1.0 + self.draft_elasticity * (speed - 1.0))

    # ---- JSON
    def to_json(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, **asdict(self)}

    @classmethod
    def from_json(
        cls, data: dict | str | Path, *, expect_model: str | None = None, expect_drafter: str | None = None
    ) -> "LatencyModel":
        """From a dict or a latency.json path (the file may hold {"model": {...}, ...} as written by
        `write_calibration`). Refuses wrong keys and a file for another model checksum or drafter id."""
        src = "latency model"
        if isinstance(data, (str, Path)):
            src = str(data)
            try:
                data = json.loads(Path(data).read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(f"latency model {src}: unreadable ({exc.__class__.__name__}: {exc})") from None
        if isinstance(data, dict) and "model" in data and isinstance(data["model"], dict):
            data = data["model"]
        if not isinstance(data, dict):
            raise ValueError(f"{src}: not a JSON object")
        data = dict(data)
        version = data.pop("schema_version", None)
        if version != SCHEMA_VERSION:
            raise ValueError(f"{src}: schema version {version!r}, expected {SCHEMA_VERSION}")
        want = set(cls.__dataclass_fields__)
        if set(data) != want:
            missing, extra = sorted(want - set(data)), sorted(set(data) - want)
            raise ValueError(f"{src}: wrong keys (missing {missing}, unexpected {extra})")
        model = cls(**data)
        if len(model.verify_table) != len(model.sizes) or any(len(r) != len(model.contexts) for r in model.verify_table):
            raise ValueError(f"{src}: verify_table shape does not match sizes x contexts")
        if len(model.draft_table) != len(model.draft_widths) or len(model.verify_slope) != len(model.sizes):
            raise ValueError(f"{src}: table lengths do not match their axes")
        if model.drift_elasticity and len(model.drift_elasticity) != len(model.sizes):
            raise ValueError(f"{src}: drift_elasticity has {len(model.drift_elasticity)} values for {len(model.sizes)} table "
                             "sizes")
        if not 0.0 <= model.draft_elasticity <= 1.0:
            raise ValueError(f"{src}: draft_elasticity must be in [0, 1], got {model.draft_elasticity}")
        if not model.fixed_sampled >= 0.0:
            raise ValueError(f"{src}: fixed_sampled must be >= 0 seconds, got {model.fixed_sampled}")
        if not model.probe_level > 0:
            raise ValueError(f"{src}: probe_level must be > 0, got {model.probe_level}")
        got_model, got_drafter = model.meta.get("model_checksum"), model.meta.get("drafter")
        if expect_model is not None and got_model != expect_model:
            raise ValueError(
                f"{src}: calibrated for model {str(got_model)[:16]}..., not {expect_model[:16]}... (recalibrate)"
            )
        if expect_drafter is not None and got_drafter != expect_drafter:
            raise ValueError(f"{src}: calibrated for drafter '{got_drafter}', not '{expect_drafter}' (recalibrate)")
        return model


def fit_verify(sizes: list[int], contexts: list[int], table: np.ndarray) -> tuple[list[float], list[float], str]:
    """Intercepts/slopes in L per size (slopes >= 0); per-size vs global slope chosen by leave-one-L-out error."""
    Ls = np.asarray(contexts, dtype=np.float64)
    table = np.asarray(table, dtype=np.float64)  # [S, C]

    def fit(cols: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
        x, y = Ls[cols], table[:, cols]  # [c], [S, c]
        if len(cols) == 1:
            return y[:, 0], np.zeros(len(sizes))
        xc = x - x.mean()
        if mode == "per-size":
            b = (y - y.mean(1, keepdims=True)) @ xc / (xc @ xc)  # [S]
        else:
            b = np.full(len(sizes), float(((y - y.mean(1, keepdims=True)) @ xc).sum() / (len(sizes) * (xc @ xc))))
        b = np.maximum(b, 0.0)  # a longer context never makes a forward cheaper: a negative slope is noise (flat then)
        return y.mean(1) - b * x.mean(), b

    best = None
    for mode in ("per-size", "global"):
        errs = []
        if len(contexts) >= 3:
            for out in range(len(contexts)):
                cols = np.array([c for c in range(len(contexts)) if c != out])
                a, b = fit(cols, mode)
                errs.append(np.abs(a + b * Ls[out] - table[:, out]) / table[:, out])
        score = float(np.median(np.concatenate(errs))) if errs else 0.0
        if best is None or score < best[0] - 1e-12:
            best = (score, mode)
    a, b = fit(np.arange(len(contexts)), best[1])
    return [float(v) for v in a], [float(v) for v in b], best[1]


@dataclass
class LatencyCalibration:
    model: LatencyModel
    validation: list[dict]  # held-out shapes: {"n", "L", "measured", "predicted", "ape"}
    mdape: float  # median absolute percentage error on held-out shapes (fraction, 0.05 = 5%)
    fixed_samples: list[list[float]]  # speculative cycles: [n verified, seconds outside draft and verify], per cycle
    fixed_ar_samples: list[float]  # autoregressive steps: the same
    catchup_samples: list[list[float]]  # [b, seconds of the first draft level with b tokens to re-encode]
    seconds: float  # wall time of the calibration


def write_latency(cal: LatencyCalibration, path: str | Path) -> None:
    """latency.json: {"model", "validation", "mdape", "fixed_samples", "fixed_ar_samples", "catchup_samples", "seconds"}."""
    write_json(path, {"model": cal.model.to_json(), "validation": cal.validation, "mdape": cal.mdape,
                      "fixed_samples": cal.fixed_samples, "fixed_ar_samples": cal.fixed_ar_samples,
                      "catchup_samples": cal.catchup_samples, "seconds": cal.seconds})
