"""How much of the stop-only bound each class of stop policy captures, on a finished run's records.

Replay only (records, latency model and the rounds' structure S of a run), no decoding. For each
temperature: every record cycle replayed under S stopped at each depth d (A, t [C, D]); the best fixed
depth, and the stop-only posterior bound (each cycle at its own best depth, knowing the outcome). Each
policy class of `learn.threshold.STOP_CLASSES` sets its thresholds as the keep/drop rule does (searched
on sum A / sum t, or the marginal-gain rule from the latency model) and is scored in-sample (what the
class can express) and on 5-fold predictions across requests (every request held out once, as the
keep/drop rule tests):

    share of the bound = (J_policy / J_best_fixed_depth - 1) / (J_bound / J_best_fixed_depth - 1)

Classes: the best fixed depth per workload; each of `STOP_CLASSES` (pooled, and per workload); the
class chosen inside each fold (`learn.threshold.nested_depths`, what the keep/drop rule tests); and,
as a reference no decoder can run, one threshold
per level on the target's largest probability among the cycle's own first-level drafted tokens (known
only after verification): what knowing the target's confidence at the root would be worth.

    .venv/bin/python benchmarks/bench_stop_classes.py [--results results/cpu] [--write]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchdoc import REPO, cpu_model, git_commit, write_section  # noqa: E402

from ogspo.artifacts.latency import LatencyModel  # noqa: E402
from ogspo.artifacts.records import Records, load_records  # noqa: E402
from ogspo.engine.tree import Structure  # noqa: E402
from ogspo.learn.policy import combine_data, offline_states, posterior_bound  # noqa: E402
from ogspo.learn.threshold import STOP_CLASSES, Fit, fit_thresholds, nested_depths, request_folds, threshold_depths  # noqa: E402
from ogspo.methods.features import FEATURE_NAMES  # noqa: E402

FOLDS = 5


def root_target_prob(records: Records) -> np.ndarray:
    """Per cycle (cycle-table order) the target's largest probability among the first-level drafted tokens:
    exp(max target_logp) over the depth-1 nodes. [C]"""
    d1 = (records.nodes.filter(pl.col("depth") == 1).group_by(["request_id", "cycle"])
          .agg(pl.col("target_logp").max().exp().alias("p")))
    out = records.cycles.select(["request_id", "cycle"]).join(d1, on=["request_id", "cycle"], how="left")
    return out["p"].fill_null(0.0).to_numpy().astype(np.float64)


def kfold(requests: np.ndarray, fit_predict: Callable[[np.ndarray, np.ndarray], np.ndarray], seed: int = 0) -> np.ndarray:
    """Held-out stop depths [C]: each fold's requests (`request_folds`, as the keep/drop rule splits them)
    decided by what `fit_predict(train_mask, held_mask)` fits on the others."""
    fold = request_folds(requests, folds=FOLDS, seed=seed)
    out = np.zeros(len(requests), dtype=np.int64)
    for i in np.unique(fold):
        held = fold == i
        out[held] = fit_predict(~held, held)
    return out


def measure(results: Path, tag: str) -> dict | None:
    rounds = results / "rounds" / tag / "rounds.json"
    S = Structure([tuple(p) for p in json.loads(rounds.read_text())["structure"]])
    if len(S) == 0:
        return None
    latency = LatencyModel.from_json(results / "latency" / "latency.json")
    records = [load_records(d) for d in sorted((results / "records").glob(f"*/{tag}")) if (d / "complete.flag").is_file()]
    data = combine_data([offline_states(records=r, structure=S, latency=latency) for r in records])
    A, t, req = data.accepted, data.seconds, data.requests  # [C, D], [C, D], [C]
    C, D = A.shape
    rows = np.arange(C)
    work = np.array([r.split("/", 1)[0] for r in req.tolist()], dtype=object)
    level = data.features[:, :, FEATURE_NAMES.index("level")].astype(np.float64)  # [C, D]
    fixed = A.sum(0) / t.sum(0)  # [D]
    best = float(fixed.max())
    bound = max(posterior_bound(A, t)[1], best)

    def gain(d: np.ndarray) -> float:
        return float(A[rows, d - 1].sum() / t[rows, d - 1].sum() / best - 1.0)

    def threshold_rule(x: np.ndarray, per_workload: bool,
                       fit: Fit = fit_thresholds) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
        def fit_predict(train: np.ndarray, held: np.ndarray) -> np.ndarray:
            out = np.zeros(C, dtype=np.int64)
            groups = sorted(set(work.tolist())) if per_workload else [None]
            for w in groups:
                g = np.ones(C, dtype=bool) if w is None else work == w
                tr, ho = train & g, held & g
                if ho.any():
                    out[ho] = threshold_depths(x[ho], level[ho], fit(x[tr], level[tr], A[tr], t[tr]))
            return out[held]
        return fit_predict

    def fixed_per_workload(train: np.ndarray, held: np.ndarray) -> np.ndarray:
        out = np.zeros(C, dtype=np.int64)
        for w in set(work.tolist()):
            tr, ho = train & (work == w), held & (work == w)
            out[ho] = int(np.argmax(A[tr].sum(0) / t[tr].sum(0))) + 1
        return out[held]

    classes: list[tuple[str, Callable]] = [("best fixed depth per workload", fixed_per_workload)]
    for c in STOP_CLASSES:
        x = data.features[:, :, FEATURE_NAMES.index(c.feature)].astype(np.float64)
        classes += [(c.name, threshold_rule(x, False, c.fit)), (f"{c.name}, per workload", threshold_rule(x, True, c.fit))]
    root = np.concatenate([root_target_prob(r) for r in records])  # [C]
    classes.append(("reference, not causal: threshold on the target's root probability",
                    threshold_rule(np.repeat(root[:, None], D, axis=1), False)))
    all_rows = np.ones(C, dtype=bool)
    out = []
    for name, fit_predict in classes:
        g_in, g_ho = gain(fit_predict(all_rows, all_rows)), gain(kfold(req, fit_predict))
        out.append({"class": name, "in_sample": g_in, "held_out": g_ho})
    d_nested, chosen = nested_depths(data, STOP_CLASSES, folds=FOLDS, seed=0)
    out.append({"class": f"the class chosen in each fold (the keep/drop rule's; chose {', '.join(sorted(set(chosen)))})",
                "in_sample": None, "held_out": gain(d_nested)})
    return {"tag": tag, "cycles": C, "requests": len(set(req.tolist())), "depth": D, "nodes": len(S),
            "best_fixed_depth": int(np.argmax(fixed)) + 1, "best_fixed_J": best, "bound_gain": bound / best - 1.0,
            "classes": out}


def render(figs: list[dict], results: Path) -> str:
    lines = ["## Stop-policy classes against the stop-only bound (`benchmarks/bench_stop_classes.py`)", "",
             f"- date: {dt.datetime.now():%Y-%m-%d %H:%M}; machine: 2 CPUs ({cpu_model()}); commit {git_commit()}; "
             f"records, latency model and rounds of `{results}`",
             "- reproduce: `make run`, then `PATH=.venv/bin:$PATH python benchmarks/bench_stop_classes.py --write`",
             "- gain over the best fixed depth of the rounds' structure S (replayed J = sum A / sum t); in brackets the "
             f"share of the stop-only bound; held out: {FOLDS}-fold predictions across requests", ""]
    for f in figs:
        lines += [f"### {f['tag']}: S has {f['nodes']} nodes, depth {f['depth']}; {f['cycles']} cycles of {f['requests']} "
                  f"requests; best fixed depth {f['best_fixed_depth']} ({f['best_fixed_J']:.1f} tok/s); stop-only bound "
                  f"{100 * f['bound_gain']:+.1f}%", "",
                  "| policy class | in-sample | held out |", "|---|---:|---:|"]
        for c in f["classes"]:
            cell = ["-" if c[k] is None else f"{100 * c[k]:+.1f}% ({c[k] / f['bound_gain']:+.2f})" if f["bound_gain"] > 0
                    else f"{100 * c[k]:+.1f}%" for k in ("in_sample", "held_out")]
            lines.append(f"| {c['class']} | {cell[0]} | {cell[1]} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=REPO / "results" / "cpu")
    ap.add_argument("--write", action="store_true", help="write the section of docs/BENCHMARKS.md")
    args = ap.parse_args()
    if not (args.results / "rounds").is_dir():
        raise SystemExit(f"bench_stop_classes: {args.results}/rounds not found: run `make run` first")
    figs = [f for tag in ("T0", "T1") if (f := measure(args.results, tag)) is not None]
    text = render(figs, args.results.relative_to(REPO) if args.results.is_relative_to(REPO) else args.results)
    print(text)
    if args.write:
        write_section("bench_stop_classes", text)


if __name__ == "__main__":
    main()
