"""Keep or drop the learned stop policy: OGSPO never ships a policy that loses to a static tree.

After the rounds, two stop policies over the structure S are compared with every static tree the
records offer: the threshold policy (`learn.threshold`: one threshold per level on one feature of the
drafted frontier, or the marginal-gain rule; each class holds every S_{<=d}, and which class ships is
chosen inside every fold) on K-fold predictions, so every record request is held out once, and the
rounds' MLP pi on the record requests its head was *not* trained on (the incumbent round's held-out
split), kept only where it also beats the threshold policy there. Every class is also scored alone on
the same folds (`figures["threshold"]["classes"]`), for the report. The static trees: S cut at each
fixed depth d (S_{<=d}, verified whole every cycle), Sequoia's tree (`baselines.sequoia`) and the
one- and two-token chains of the top-1 path. All are replayed on the same held-out cycles with the same
latency model, J = sum A / sum t. The comparison is paired by request: a bootstrap resamples the
held-out requests, and in every resample the best static tree is picked again (the largest of
several noisy J's), so the interval carries that winner's curse against the policy.

A policy is kept only when the interval of J(pi) / J(best static) lies above 1 + margin (its
lower bound excludes "no gain"). The figures say what the test could see: the smallest gain it
detects (the interval's half-width) beside the stop-only bound of S (each cycle at its best depth,
knowing the outcome: what any stop policy could add over the best fixed depth) and the share of that
bound the threshold policy (and each class) captures held out. Otherwise the static tree with the highest J over all record
cycles ships instead, as a plain structure (no policy head), and the decision says why.
Autoregressive decoding (the empty tree) is one of the static trees.

**Per workload.** Acceptance differs by workload far more than by anything a policy observes, so
the same comparison is also made per workload (the request id's prefix) over that workload's record
cycles: it ships the policy where the policy was kept and is fastest there, else the fastest static
tree there (`ShipDecision.workloads`). The method then picks its workload's choice at decode time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ogspo.artifacts.latency import LatencyModel
from ogspo.artifacts.records import Records
from ogspo.engine.tree import Structure
from ogspo.learn.policy import PolicyHead, combine_data, offline_states, policy_depths, posterior_bound, split_requests
from ogspo.learn.threshold import STOP_CLASSES, StopClass, check_head, class_depths, nested_depths, select_class, threshold_head
from ogspo.offline.replay import replay, replay_cycles
from ogspo.offline.solve import combine_cycles


@dataclass
class ShipDecision:
    keep_policy: bool  # ship a stop policy over S (False: ship `structure` as a static tree)
    structure: Structure  # what ships: S with the policy, or the best static tree
    shipped: str  # "policy" (the rounds' MLP), "threshold", "S<=d", "sequoia" or "ar"
    reason: str
    figures: dict = field(default_factory=dict)
    workloads: dict[str, dict] = field(default_factory=dict)  # workload -> {"shipped", "structure", "J"}
    head: PolicyHead | None = None  # the head that ships when it is not the rounds' own (the threshold policy)


CHAINS = (1, 2)  # the chains of the top-1 path among the static candidates: chain1 is tuned EAGLE-3's [1, 1, 1]


def static_candidates(structure: Structure, sequoia: Structure | None) -> dict[str, Structure]:
    """The static trees a policy over `structure` must beat: S cut at each depth, Sequoia's tree, the
    one- and two-token chains of the top-1 path (`CHAINS`; where not already an S cut), and
    autoregressive decoding (the empty tree)."""
    out = {f"S<={d}": Structure([p for p in structure.paths if len(p) <= d]) for d in range(1, structure.max_depth + 1)}
    if sequoia is not None:
        out["sequoia"] = sequoia
    for k in CHAINS:
        chain = Structure([(0,) * j for j in range(1, k + 1)])
        if all(s.paths != chain.paths for s in out.values()):
            out[f"chain{k}"] = chain
    out["ar"] = Structure([])
    return out


def stop_only_bound(A_depth: np.ndarray, t_depth: np.ndarray) -> dict:
    """What any stop policy over S could add on these cycles: A_depth, t_depth [C, D] (each cycle stopped
    at depth d = 1..D). The best fixed depth, its J, and the stop-only posterior bound (each cycle at its
    own best depth, knowing the outcome: `posterior_bound`) with its gain over that depth."""
    fixed = A_depth.sum(0) / t_depth.sum(0)  # [D]
    _, bound = posterior_bound(A_depth, t_depth)
    d = int(np.argmax(fixed))
    bound = max(bound, float(fixed[d]))  # a fixed depth is one choice of depths: the bound is never below it (rounding)
    return {"best_fixed_depth": d + 1, "best_fixed_J": float(fixed[d]), "bound_J": bound,
            "bound_gain": float(bound / fixed[d] - 1.0)}


def per_workload(*, A: np.ndarray, t: np.ndarray, requests: np.ndarray, names: list[str], cands: dict[str, Structure],
                 keep_policy: bool, A_depth: np.ndarray, t_depth: np.ndarray) -> dict[str, dict]:
    """Per workload (request id prefix): the fastest on its record cycles among the static trees (rows
    1..K of A, t [K + 1, C]; always named, as `static`: the tree the policy replaces where it ships), and
    the policy (row 0) only where it was kept; beside it, the stop-only bound of S on its cycles
    (`stop_only_bound` of A_depth, t_depth [C, D])."""
    work = np.array([str(r).split("/", 1)[0] for r in requests.tolist()], dtype=object)
    out = {}
    for w in sorted(set(work.tolist())):
        rows = work == w
        J = A[:, rows].sum(1) / t[:, rows].sum(1)  # [K + 1]
        best = 1 + int(np.argmax(J[1:]))
        pick = 0 if keep_policy and J[0] >= J[best] else best
        name = "policy" if pick == 0 else names[pick - 1]
        structure = cands[names[best - 1]] if pick else None
        out[w] = {"shipped": name, "structure": None if structure is None else structure.to_list(),
                  "static": names[best - 1], "static_structure": cands[names[best - 1]].to_list(),
                  "J": dict(zip(["policy", *names], J.tolist())), "n_cycles": int(rows.sum()),
                  "stop_only": stop_only_bound(A_depth[rows], t_depth[rows])}
    return out


def _sums_by_request(requests: np.ndarray, names: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Per request name (in `names` order) the sum of x over its cycles. x [K, C] -> [K, R]."""
    index = {n: i for i, n in enumerate(names.tolist())}
    col = np.array([index[r] for r in requests.tolist()], dtype=np.int64)
    out = np.zeros((x.shape[0], len(names)))
    np.add.at(out.T, col, x.T)
    return out


def compare_to_static(*, A: np.ndarray, t: np.ndarray, requests: np.ndarray, names: list[str], seed: int,
                      n_boot: int = 2000) -> dict:
    """Per-cycle tables of the policy (row 0) and of the static trees `names` (rows 1..K): A, t [K + 1, C],
    `requests` [C]. J per row over all cycles, the best static tree, and J(policy) / J(best static) with a
    95% bootstrap interval over requests, the best static tree re-picked in every resample."""
    rnames = np.array(sorted(set(requests.tolist())), dtype=object)
    As, ts = _sums_by_request(requests, rnames, A), _sums_by_request(requests, rnames, t)  # [K + 1, R]
    J = As.sum(1) / ts.sum(1)  # [K + 1]
    pick = np.random.default_rng(seed).integers(0, len(rnames), size=(n_boot, len(rnames)))  # [B, R]
    Jb = As[:, pick].sum(2) / ts[:, pick].sum(2)  # [K + 1, B]
    ratio_b = Jb[0] / Jb[1:].max(0)  # [B]
    lo, hi = np.quantile(ratio_b, [0.025, 0.975])
    best = int(np.argmax(J[1:]))
    return {"J": dict(zip(["policy", *names], J.tolist())), "best_static": names[best],
            "ratio": float(J[0] / J[1 + best]), "interval": [float(lo), float(hi)], "n_requests": int(len(rnames))}


def decide_shipping(*, records: list[Records], structure: Structure, head: PolicyHead, latency: LatencyModel,
                    sequoia: Structure | None, seed: int, holdout_fraction: float, margin: float = 0.0,
                    n_boot: int = 2000, folds: int = 5, classes: tuple[StopClass, ...] = STOP_CLASSES) -> ShipDecision:
    """Keep a stop policy over `structure` only if it beats every static tree on held-out record requests
    with a bootstrap interval above 1 + margin (see the module docstring). Two policies are tested: the
    threshold policy (`learn.threshold`, its class among `classes` chosen in each fold) on K-fold
    predictions, every request held out once, and the rounds' MLP `head` on the requests its training split left out
    (`seed`: the seed of that split, `split_requests`), kept only where it also beats the threshold
    policy there."""
    data = combine_data([offline_states(records=r, structure=structure, latency=latency) for r in records])
    cycles = combine_cycles([replay_cycles(r) for r in records])
    # Sequoia sizes its tree from positional acceptance, so it may hold nodes the records' template never
    # drafted; the records cannot answer such a tree, so it is left out of the candidates (and said so).
    outside = sequoia is not None and not all(p in cycles.template for p in sequoia.paths)
    cands = {n: s for n, s in static_candidates(structure, None if outside else sequoia).items()
             if all(p in cycles.template for p in s.paths)}  # a chain deeper than the template: not a candidate
    names = list(cands)
    # the replay books an empty tree (depth 0) as autoregressive steps
    rep = replay(cycles=cycles, structures=[cands[n] for n in names], depths=np.array([cands[n].max_depth for n in names]),
                 model=latency)
    C = len(data.requests)
    rows = np.arange(C)
    d = policy_depths(head, data)
    d_k, chosen = nested_depths(data, classes, folds=folds, seed=seed)
    A = np.vstack([data.accepted[rows, d - 1], rep.accepted])  # [K + 1, C] row 0: the MLP, then the static trees
    t = np.vstack([data.seconds[rows, d - 1], rep.seconds])
    A_k = np.vstack([data.accepted[rows, d_k - 1], rep.accepted])  # row 0: the threshold policy, held out
    t_k = np.vstack([data.seconds[rows, d_k - 1], rep.seconds])
    _, ho = split_requests(data.requests, fraction=holdout_fraction, seed=seed)
    J_all = A.sum(1) / t.sum(1)  # [K + 1]
    best_all = names[int(np.argmax(J_all[1:]))]
    so = stop_only_bound(data.accepted, data.seconds)
    figs: dict = {"candidates": {n: cands[n].to_list() for n in names}, "J_all": dict(zip(["policy", *names], J_all.tolist())),
                  "margin": margin, "n_holdout_cycles": int(len(ho)), "sequoia_outside_template": outside, "stop_only": so}
    depth_tables = {"A_depth": data.accepted, "t_depth": data.seconds}

    def held_out(A0: np.ndarray, t0: np.ndarray) -> dict:  # a policy's row 0 against the static trees, all requests
        cmp = compare_to_static(A=np.vstack([A0, rep.accepted]), t=np.vstack([t0, rep.seconds]), requests=data.requests,
                                names=names, seed=seed, n_boot=n_boot)
        gain = cmp["J"]["policy"] / so["best_fixed_J"] - 1.0
        cmp.update({"detectable_gain": float((cmp["interval"][1] - cmp["interval"][0]) / 2), "gain_over_best_fixed": gain,
                    "share_of_bound": gain / so["bound_gain"] if so["bound_gain"] > 0 else None})
        return cmp

    # the threshold policy (its class chosen inside each fold), every request held out once; each class alone beside it
    kf = held_out(A_k[0], t_k[0])
    kf["classes"] = {}
    for c in classes:
        dc = class_depths(c, data, folds=folds, seed=seed)
        kf["classes"][c.name] = {"feature": c.feature, **held_out(data.accepted[rows, dc - 1], data.seconds[rows, dc - 1])}
    cls = select_class(data, classes, folds=folds, seed=seed + 1)
    theta = cls.thresholds(data)
    t_head = threshold_head(cls.feature, theta)
    check_head(t_head, data, cls.feature, theta)
    kf.update({"class": cls.name, "feature": cls.feature, "thresholds": theta.tolist(), "folds": folds,
               "chosen_per_fold": chosen})
    gain_k = kf["gain_over_best_fixed"]
    figs["threshold"] = kf
    lo_k, hi_k = kf["interval"]
    said_k = (f"threshold policy (class chosen in each fold; on all records: {cls.name}) / best static tree "
              f"({kf['best_static']}) on {folds}-fold held-out "
              f"predictions of {kf['n_requests']} record requests {kf['ratio']:.3f} [{lo_k:.3f}, {hi_k:.3f}] (smallest gain "
              f"this test detects ~{100 * kf['detectable_gain']:.1f}%; stop-only bound over the best fixed depth "
              f"+{100 * so['bound_gain']:.1f}%, of which it captures {100 * gain_k:+.1f}%)")
    keep_k = bool(lo_k > 1.0 + margin)

    # the rounds' MLP on its own held-out requests
    keep_mlp, said = False, "no held-out record requests to test the MLP policy on"
    if len(ho):
        cmp = compare_to_static(A=A[:, ho], t=t[:, ho], requests=data.requests[ho], names=names, seed=seed, n_boot=n_boot)
        lo, hi = cmp["interval"]
        # a bootstrap over one request has no spread: no power
        cmp["detectable_gain"] = float((hi - lo) / 2) if cmp["n_requests"] > 1 else None
        cmp["threshold_J_same_requests"] = float(A_k[0, ho].sum() / t_k[0, ho].sum())
        figs["holdout"] = cmp
        power = ("one held-out request: this test detects no gain" if cmp["detectable_gain"] is None
                 else f"smallest gain this test detects ~{100 * cmp['detectable_gain']:.1f}%")
        said = (f"MLP policy / best static tree ({cmp['best_static']}) on {cmp['n_requests']} held-out record requests "
                f"{cmp['ratio']:.3f} [{lo:.3f}, {hi:.3f}] ({power})")
        keep_mlp = bool(lo > 1.0 + margin) and cmp["J"]["policy"] >= cmp["threshold_J_same_requests"]

    if keep_mlp:
        works = per_workload(A=A, t=t, requests=data.requests, names=names, cands=cands, keep_policy=True, **depth_tables)
        return ShipDecision(True, structure, "policy", f"{said}: above 1 + {margin:g} and above the threshold policy there, "
                            f"the MLP policy ships; {said_k}" + _by_workload(works), figs, works)
    works = per_workload(A=A_k, t=t_k, requests=data.requests, names=names, cands=cands, keep_policy=keep_k, **depth_tables)
    if keep_k:
        return ShipDecision(True, structure, "threshold", f"{said_k}: above 1 + {margin:g}, the threshold policy ships; "
                            f"{said}" + _by_workload(works), figs, works, head=t_head)
    return ShipDecision(False, cands[best_all], best_all,
                        f"{said_k} and {said} do not exclude 1 + {margin:g}: the static tree {best_all} ships (best on all "
                        f"record cycles)" + _by_workload(works), figs, works)


def _by_workload(works: dict[str, dict]) -> str:
    return "; per workload: " + ", ".join(f"{w} {v['shipped']}" for w, v in works.items())
