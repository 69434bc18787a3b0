"""The OGSPO size decision on top of the learned stop policy (docs/DESIGN.md §5 "Size decision").

With the structure and the stop policy of the OGSPO rounds fixed, fit the size rule
(`offline.size.fit_size_rule`) on the train requests' record cycles at the policy's own stop depths,
and keep it only if it raises the surrogate J = sum A / sum t over verifying everything drafted (by
more than `tolerance`) on the train and on the held-out requests alike. The figures beside it: the stop-only posterior bound
for S and the extended oracle over (stop depth, size), which bounds every stop + size policy over S.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ogspo.artifacts.latency import LatencyModel
from ogspo.artifacts.records import Records
from ogspo.artifacts.size_rule import SizeRule
from ogspo.engine.tree import Structure
from ogspo.learn.policy import PolicyHead, combine_data, offline_states, policy_depths, posterior_bound, split_requests
from ogspo.offline.size import (
    SizeData,
    extended_bound,
    fit_size_rule,
    full_sizes,
    rule_sizes,
    size_data,
    size_tables,
    throughput_at,
)


@dataclass
class SizeDecision:
    rule: SizeRule | None  # None: verifying everything drafted is as good on held-out requests
    figures: dict = field(default_factory=dict)


def combine_size_data(parts: list[SizeData]) -> SizeData:
    S = parts[0].structure
    return SizeData(S, np.concatenate([p.cum for p in parts]), parts[0].depths,
                    np.concatenate([p.on_path for p in parts]), np.concatenate([p.context_lengths for p in parts]),
                    np.concatenate([p.requests for p in parts]), np.concatenate([p.order for p in parts]))


def fit_size_decision(*, records: list[Records], structure: Structure, head: PolicyHead, latency: LatencyModel,
                      lam: float, seed: int, holdout_fraction: float, tolerance: float) -> SizeDecision:
    """Fit the size rule on train requests, keep it if it helps held-out requests (figures for both)."""
    pdata = combine_data([offline_states(records=r, structure=structure, latency=latency) for r in records])
    sdata = combine_size_data([size_data(r, structure) for r in records])
    depths = policy_depths(head, pdata)  # [C]
    A, t, legal = size_tables(sdata, latency)  # [C, D, N + 1]
    tr, ho = split_requests(sdata.requests, fraction=holdout_fraction, seed=seed)
    rule = fit_size_rule(data=sdata.subset(tr), depths=depths[tr], latency=latency, lam=lam,
                         meta={"structure": structure.to_list(), "seed": seed})
    figs: dict = {"n_train_cycles": int(len(tr)), "n_holdout_cycles": int(len(ho)), "lambda": rule.lam}
    for name, rows in (("train", tr), ("holdout", ho), ("all", np.arange(len(depths)))):
        if len(rows) == 0:
            continue
        sub = sdata.subset(rows)
        full = throughput_at(A[rows], t[rows], depths[rows], full_sizes(sub, depths[rows]))
        sizes = rule_sizes(rule, sub, depths[rows])
        figs[name] = {"full_J": full, "size_J": throughput_at(A[rows], t[rows], depths[rows], sizes),
                      "mean_size": float(sizes.mean()), "mean_full_size": float(full_sizes(sub, depths[rows]).mean())}
    D = A.shape[1]
    full_A = np.stack([A[:, d, sdata.level_sizes()[d]] for d in range(D)], axis=1)  # [C, D] verify all of S_<=d
    full_t = np.stack([t[:, d, sdata.level_sizes()[d]] for d in range(D)], axis=1)
    figs["stop_bound_J"] = posterior_bound(full_A, full_t)[1]
    figs["extended_bound_J"] = extended_bound(A, t, legal)[1]
    # kept only when the train and the held-out requests agree that it pays
    figs["kept"] = all(figs[k]["size_J"] > figs[k]["full_J"] * (1 + tolerance) for k in ("train", "holdout") if k in figs)
    return SizeDecision(rule=rule if figs["kept"] else None, figures=figs)
