"""A stop policy with few parameters that nests the static trees (docs/DESIGN.md §5, "Threshold policy").

After drafting level d of structure S (d = 1..D-1) the policy continues only while the frontier's
confidence clears that level's threshold: continue iff x_d > theta_d, where x_d is one state feature
(`THRESHOLD_FEATURE`: `max_cum_prob`, the drafter's best cumulative probability of a level-d node);
depth D always stops. Thresholds that never stop before level d (theta = -1, below every
feature value) and always stop there (theta = 2, above) reproduce the static tree S_{<=d} exactly,
so the class holds every fixed depth and starts from the best of them; D - 1 numbers cannot memorise
requests the way an MLP over 11 features can.

Fit (`fit_thresholds`): coordinate ascent of J = sum A / sum t over the levels, each level's candidates
the midpoints between consecutive distinct feature values there (never a value itself, so the float32
head decides every record cycle as the float64 search did) plus never / always stop, from the best
fixed depth, until a pass changes nothing. Held out (`kfold_depths`): K folds over the record
requests, each request's cycles decided by thresholds fitted on the other folds, so every request is
held out once and the keep/drop rule (`learn.ship`) tests on all of them. Shipped as a `PolicyHead`
whose network computes x_f - theta(level) exactly (`threshold_head`): the ONNX export, the engine's
stop hook and the offline replay need nothing new.
"""

from __future__ import annotations

import numpy as np
import torch

from ogspo.learn.policy import PolicyData, PolicyHead, policy_depths
from ogspo.methods.features import FEATURE_NAMES, N_FEATURES

THRESHOLD_FEATURE = "max_cum_prob"  # the frontier's confidence the shipped policy reads (fixed, not picked on the records)
NEVER, ALWAYS = -1.0, 2.0  # thresholds below / above every value of a probability at levels 1..D-1


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
            trial = np.repeat(theta[None, :], len(cands[d - 1]), axis=0)  # [K, D - 1]
            trial[:, d - 1] = cands[d - 1]
            Js = np.array([_ratio(A, t, threshold_depths(x, level, th)) for th in trial])
            k = int(np.argmax(Js))
            if Js[k] > J * (1 + 1e-12):
                theta, J, moved = trial[k], float(Js[k]), True
        if not moved:
            break
    return theta


def request_folds(requests: np.ndarray, *, folds: int, seed: int) -> np.ndarray:
    """Fold of every cycle [C]: the requests split into `folds` folds (at least 2, at most one per request),
    so a request's cycles are held out together."""
    names = np.array(sorted(set(requests.tolist())), dtype=object)
    k = max(2, min(folds, len(names)))
    fold_of = dict(zip(names.tolist(), np.random.default_rng(seed).permutation(len(names)) % k))
    return np.array([fold_of[r] for r in requests.tolist()], dtype=np.int64)


def kfold_depths(x: np.ndarray, level: np.ndarray, A: np.ndarray, t: np.ndarray, requests: np.ndarray, *, folds: int,
                 seed: int) -> np.ndarray:
    """Held-out stop depths [C]: each fold's cycles (`request_folds`) decided by thresholds fitted on the others."""
    f = request_folds(requests, folds=folds, seed=seed)
    out = np.zeros(len(requests), dtype=np.int64)
    for i in np.unique(f):
        held = f == i
        out[held] = threshold_depths(x[held], level[held], fit_thresholds(x[~held], level[~held], A[~held], t[~held]))
    return out


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
