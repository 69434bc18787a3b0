"""Stop policies with few parameters that nest the static trees (docs/DESIGN.md §5, "Threshold policy").

After drafting level d of structure S (d = 1..D-1) a policy of this kind continues only while one state
feature clears that level's threshold: continue iff x_d > theta_d; depth D always stops. Thresholds
that never stop before level d (theta = -1, below every feature value) and always stop there (theta = 2,
above: every feature a class reads is a probability or a sum of probabilities of disjoint paths, so
at most 1) reproduce the static tree S_{<=d} exactly, so a class holds every fixed depth; D - 1 numbers
cannot memorise requests the way an MLP over the state features can.

**Classes** (`STOP_CLASSES`, the simplest first): a threshold per level on the frontier's best
cumulative probability (`max_cum_prob`), on the sum of its four best (`top4_cum_prob`, LTD's top-k draft
scores) and on `next_gain` (the drafter's estimate of the tokens the next level adds), each searched on
the records; and the **marginal-gain rule** (SMART/BASTION's expand-while-it-pays), which searches
nothing: continue while next_gain > J_ref * dt_d, the tokens the next level is predicted to add against
what its drafting and verification cost at the throughput J_ref of the best fixed depth, dt_d the
latency model's median extra seconds of depth d + 1 over depth d on the cycles at hand.

Search (`fit_thresholds`): coordinate ascent of J = sum A / sum t over the levels, each level's
candidates the midpoints between consecutive distinct feature values there (never a value itself, so
the float32 head decides every record cycle as the float64 search did) plus never / always stop, from
the best fixed depth, until a pass changes nothing; one level's candidates are scored together from
sorted partial sums (`_scan`). Held out (`kfold_depths`): K folds over the record requests, each
request's cycles decided by thresholds fitted on the other folds, so every request is held out once and
the keep/drop rule (`learn.ship`) tests on all of them. Which class ships is chosen inside each fold as
well (`nested_depths`: the class with the best K-fold J on that fold's training requests), so the
held-out figure of the chosen policy carries no winner's curse over the classes. Shipped as a
`PolicyHead` whose network computes x_f - theta(level) exactly (`threshold_head`): the ONNX export, the
engine's stop hook and the offline replay need nothing new.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ogspo.learn.policy import PolicyData, PolicyHead, policy_depths
from ogspo.methods.features import FEATURE_NAMES, N_FEATURES

NEVER, ALWAYS = -1.0, 2.0  # thresholds below / above every value of a probability at levels 1..D-1

Fit = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray]  # (x, level, A, t) [C, D] -> theta [D - 1]


def threshold_depths(x: np.ndarray, level: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """Stop depth per cycle: the first decision d < D with x[:, d-1] <= the threshold of its level feature
    (d itself, or the last level a drafter that ran out of candidates reached), else D.
    x, level [C, D], thresholds [D - 1] -> [C] (1-based)."""
    C, D = x.shape
    stop = np.ones((C, D), dtype=bool)
    if D > 1:
        lv = np.clip(level[:, : D - 1].astype(np.int64), 1, D - 1)  # [C, D - 1]
        stop[:, : D - 1] = x[:, : D - 1] <= np.asarray(thresholds)[lv - 1]
    return stop.argmax(axis=1) + 1


def feature_table(data: PolicyData, feature: str) -> tuple[np.ndarray, np.ndarray]:
    """(x, level) [C, D]: the feature and the level feature of every decision of the record cycles."""
    return (data.features[:, :, FEATURE_NAMES.index(feature)].astype(np.float64),
            data.features[:, :, FEATURE_NAMES.index("level")].astype(np.float64))


def _ratio(A: np.ndarray, t: np.ndarray, d: np.ndarray) -> float:
    rows = np.arange(len(d))
    return float(A[rows, d - 1].sum() / t[rows, d - 1].sum())


def _scan(x: np.ndarray, level: np.ndarray, A: np.ndarray, t: np.ndarray, theta: np.ndarray, d: int,
          cands: np.ndarray) -> np.ndarray:
    """J of every candidate threshold of level d [K], the other levels' thresholds as in `theta`.

    A cycle's depth depends on theta_d only if it reaches a decision of level d: it stops there when its
    feature there is <= theta_d (the depth under theta_d = ALWAYS), else goes on as under theta_d = NEVER
    (a repeated level-d state continues too). So J(theta_d) is the NEVER outcome plus the switch of the
    cycles whose value is <= theta_d: partial sums over the cycles sorted by that value."""
    rows = np.arange(len(x))
    stop, go = theta.copy(), theta.copy()
    stop[d - 1], go[d - 1] = ALWAYS, NEVER
    d_stop, d_go = threshold_depths(x, level, stop), threshold_depths(x, level, go)  # [C]
    A_go, t_go = A[rows, d_go - 1], t[rows, d_go - 1]
    hit = d_stop != d_go  # the cycles that reach a level-d decision, first at column d_stop - 1
    v = x[rows[hit], d_stop[hit] - 1]
    order = np.argsort(v, kind="stable")
    cA = np.concatenate([[0.0], np.cumsum((A[rows, d_stop - 1] - A_go)[hit][order])])
    ct = np.concatenate([[0.0], np.cumsum((t[rows, d_stop - 1] - t_go)[hit][order])])
    n = np.searchsorted(v[order], cands, side="right")  # [K] how many of them stop
    return (A_go.sum() + cA[n]) / (t_go.sum() + ct[n])


def fit_thresholds(x: np.ndarray, level: np.ndarray, A: np.ndarray, t: np.ndarray, *, max_passes: int = 6) -> np.ndarray:
    """Per-level thresholds [D - 1] maximising sum A / sum t of the cycles x, level, A, t [C, D] (see the
    module docstring); with D = 1 there is nothing to decide."""
    C, D = A.shape
    fixed = A.sum(0) / t.sum(0)  # [D] J of each fixed depth
    best = int(np.argmax(fixed)) + 1
    theta = np.array([NEVER if d < best else ALWAYS for d in range(1, D)], dtype=np.float64)
    cands = []
    for d in range(1, D):
        u = np.unique(x[:, d - 1])
        mid = ((u[1:] + u[:-1]) / 2).astype(np.float32).astype(np.float64)  # what the float32 head compares with
        mid = mid[(mid > u[:-1]) & (mid < u[1:])]  # strictly between its neighbours after rounding
        cands.append(np.concatenate([[NEVER, ALWAYS], mid]))
    J = _ratio(A, t, threshold_depths(x, level, theta))
    for _ in range(max_passes):
        moved = False
        for d in range(1, D):
            Js = _scan(x, level, A, t, theta, d, cands[d - 1])
            k = int(np.argmax(Js))
            if Js[k] > J * (1 + 1e-12):
                theta = theta.copy()
                theta[d - 1], J, moved = cands[d - 1][k], float(Js[k]), True
        if not moved:
            break
    return theta


def marginal_thresholds(x: np.ndarray, level: np.ndarray, A: np.ndarray, t: np.ndarray) -> np.ndarray:
    """The marginal-gain rule's thresholds [D - 1]: theta_d = J_ref * dt_d (J_ref: the best fixed depth's
    sum A / sum t on these cycles; dt_d: the median over them of t(d + 1) - t(d)), rounded to float32 so
    the shipped head compares as this does. `x` and `level` are not read: nothing is searched."""
    J_ref = float((A.sum(0) / t.sum(0)).max())
    dt = np.median(np.diff(t, axis=1), axis=0)  # [D - 1]
    return np.clip(J_ref * dt, NEVER, ALWAYS).astype(np.float32).astype(np.float64)


@dataclass(frozen=True)
class StopClass:
    """One class of per-level threshold policies: the feature it reads and how its thresholds are set."""

    name: str
    feature: str
    fit: Fit

    def depths(self, data: PolicyData, theta: np.ndarray) -> np.ndarray:
        x, level = feature_table(data, self.feature)
        return threshold_depths(x, level, theta)

    def thresholds(self, data: PolicyData) -> np.ndarray:
        x, level = feature_table(data, self.feature)
        return self.fit(x, level, data.accepted, data.seconds)


STOP_CLASSES: tuple[StopClass, ...] = (
    StopClass("threshold on max_cum_prob", "max_cum_prob", fit_thresholds),
    StopClass("threshold on top4_cum_prob", "top4_cum_prob", fit_thresholds),
    StopClass("threshold on next_gain", "next_gain", fit_thresholds),
    StopClass("marginal gain", "next_gain", marginal_thresholds),
)


def request_folds(requests: np.ndarray, *, folds: int, seed: int) -> np.ndarray:
    """Fold of every cycle [C]: the requests split into `folds` folds (at least 2, at most one per request),
    so a request's cycles are held out together."""
    names = np.array(sorted(set(requests.tolist())), dtype=object)
    k = max(2, min(folds, len(names)))
    fold_of = dict(zip(names.tolist(), np.random.default_rng(seed).permutation(len(names)) % k))
    return np.array([fold_of[r] for r in requests.tolist()], dtype=np.int64)


def kfold_depths(x: np.ndarray, level: np.ndarray, A: np.ndarray, t: np.ndarray, requests: np.ndarray, *, folds: int,
                 seed: int, fit: Fit = fit_thresholds) -> np.ndarray:
    """Held-out stop depths [C]: each fold's cycles (`request_folds`) decided by thresholds `fit` on the others."""
    f = request_folds(requests, folds=folds, seed=seed)
    out = np.zeros(len(requests), dtype=np.int64)
    for i in np.unique(f):
        held = f == i
        out[held] = threshold_depths(x[held], level[held], fit(x[~held], level[~held], A[~held], t[~held]))
    return out


def class_depths(cls: StopClass, data: PolicyData, *, folds: int, seed: int) -> np.ndarray:
    """`kfold_depths` of one class over all of `data`'s cycles. [C]"""
    x, level = feature_table(data, cls.feature)
    return kfold_depths(x, level, data.accepted, data.seconds, data.requests, folds=folds, seed=seed, fit=cls.fit)


def select_class(data: PolicyData, classes: tuple[StopClass, ...], *, folds: int, seed: int) -> StopClass:
    """The class with the highest K-fold J on `data` (the simplest, first in order, on a tie; the first
    with fewer than two requests to fold)."""
    if len(classes) == 1 or len(set(data.requests.tolist())) < 2:
        return classes[0]
    rows = np.arange(len(data.requests))
    Js = [float(data.accepted[rows, d - 1].sum() / data.seconds[rows, d - 1].sum())
          for d in (class_depths(c, data, folds=folds, seed=seed) for c in classes)]
    return classes[int(np.argmax(Js))]


def nested_depths(data: PolicyData, classes: tuple[StopClass, ...], *, folds: int, seed: int) -> tuple[np.ndarray, list[str]]:
    """Held-out stop depths [C] of choosing a class and its thresholds on the other folds' requests (the
    class by `select_class` within them, seed + 1), with the class each fold chose."""
    f = request_folds(data.requests, folds=folds, seed=seed)
    out = np.zeros(len(data.requests), dtype=np.int64)
    chosen = []
    for i in np.unique(f):
        held, train = np.nonzero(f == i)[0], data.subset(np.nonzero(f != i)[0])
        cls = select_class(train, classes, folds=folds, seed=seed + 1)
        out[held] = cls.depths(data.subset(held), cls.thresholds(train))
        chosen.append(cls.name)
    return out, chosen


def threshold_head(feature: str, thresholds: np.ndarray, *, hidden: int = 32) -> PolicyHead:
    """A `PolicyHead` whose advantage is exactly x[feature] - thresholds[level - 1] at the integer levels
    1..D-1 (stop when <= 0, as `threshold_depths`): layer 1 holds x and relu(level - k), k = 0..D; layer 2
    the hats relu(r_{k-1} - 2 r_k + r_{k+1}), 1 at level k and 0 elsewhere (small integers: exact in
    float32); layer 3 x - sum_k theta_k hat_k, one rounding that keeps the sign. Inputs not standardised."""
    theta = np.asarray(thresholds, dtype=np.float32)
    D = len(theta) + 1
    head = PolicyHead(N_FEATURES, max(hidden, D + 2))
    f, lv = FEATURE_NAMES.index(feature), FEATURE_NAMES.index("level")
    with torch.no_grad():
        for p in head.net.parameters():
            p.zero_()
        l1, l2, l3 = head.net[0], head.net[2], head.net[4]
        l1.weight[0, f] = 1.0  # unit 0: x (>= 0)
        for k in range(D + 1):  # unit 1 + k: relu(level - k)
            l1.weight[1 + k, lv], l1.bias[1 + k] = 1.0, -float(k)
        l2.weight[0, 0] = 1.0
        for k in range(1, D):  # unit k: the hat of level k
            l2.weight[k, k], l2.weight[k, 1 + k], l2.weight[k, 2 + k] = 1.0, -2.0, 1.0
            l3.weight[0, k] = -float(theta[k - 1])
        l3.weight[0, 0] = 1.0
    return head.eval()


def check_head(head: PolicyHead, data: PolicyData, feature: str, thresholds: np.ndarray) -> None:
    """The shipped head decides every cycle as the search did (re-checked like every solution here)."""
    x, level = feature_table(data, feature)
    want, got = threshold_depths(x, level, thresholds), policy_depths(head, data)
    if not np.array_equal(want, got):
        bad = int(np.argmax(want != got))
        raise AssertionError(f"threshold head stops cycle {bad} at depth {got[bad]}, the thresholds at {want[bad]}")
