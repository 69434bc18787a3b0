"""Stage `ogspo_rounds`: OGSPO's alternating rounds (`learn.rounds`) on records, written to a rounds folder."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import polars as pl

from ogspo.artifacts.io import atomic_write, write_text
from ogspo.artifacts.latency import LatencyModel
from ogspo.artifacts.oracle import read_oracle
from ogspo.artifacts.records import load_records
from ogspo.artifacts.size_rule import SIZE_FILE, write_size_rule
from ogspo.artifacts.structure import STRUCTURE_FILE, load_structure, write_structure
from ogspo.engine.drafters import TreeDrafter
from ogspo.engine.target import TreeLM
from ogspo.learn.policy import HEAD_FILE, policy_settings, save_head
from ogspo.learn.rounds import RoundRow, RoundsResult, SameTraceSetup, rounds_settings, run_rounds, sample_requests
from ogspo.learn.ship import ShipDecision, decide_shipping
from ogspo.learn.size import SizeDecision, fit_size_decision

ROUND_SCHEMA = {
    k: (pl.Int32 if k in ("round", "structure_size", "structure_depth", "same_trace_cycles", "explored_decisions")
        else pl.Boolean if k == "accepted" else pl.Float64)
    for k in RoundRow.__dataclass_fields__
}


def plot_rounds(result: RoundsResult, path: Path, dpi: int = 80) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=dpi)
    if not result.rows:
        ax.text(0.5, 0.5, "empty oracle structure:\nautoregressive decoding is best", ha="center", va="center")
        ax.set_axis_off()
    else:
        x = [r.round for r in result.rows]
        for key, label, style in (
            ("surrogate_J", "surrogate J", "o-"), ("corrected_J", "corrected J", "s-"),
            ("same_trace_J", "same-trace J (realised)", "^--"), ("posterior_bound", "posterior bound (same S)", ":"),
        ):
            ax.plot(x, [getattr(r, key) for r in result.rows], style, label=label)
        if result.oracle_throughput is not None:
            ax.axhline(result.oracle_throughput, color="k", lw=0.8, ls="--", label="oracle")
        rej = [r for r in result.rows if not r.accepted]
        if rej:
            ax.plot([r.round for r in rej], [r.corrected_J for r in rej], "rx", ms=10, label="rejected")
        ax.set_xlabel("round")
        ax.set_ylabel("tokens / s")
        ax.set_xticks(x)
        ax.legend(fontsize=7)
    ax.set_title("OGSPO rounds")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)


def write_rounds(result: RoundsResult, out_dir: Path, *, seed: int, records_dirs: list[str],
                 size: SizeDecision | None = None, ship: ShipDecision | None = None) -> None:
    """rounds.parquet, same_trace.parquet, rounds.png, rounds.json, structure.json (what ships), the
    incumbent head as policy.pt when the policy ships, and size.json when the size rule was kept. When
    the keep/drop rule (`learn.ship`) drops the policy, structure.json is the static tree that ships
    and there is no policy.pt."""

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = pl.DataFrame([asdict(r) for r in result.rows] or None, schema=ROUND_SCHEMA)
    atomic_write(out_dir / "rounds.parquet", rows.write_parquet)
    atomic_write(out_dir / "same_trace.parquet", result.same_trace.write_parquet)
    plot_rounds(result, out_dir / "rounds.png")
    head_path = out_dir / HEAD_FILE
    keep = result.head is not None and (ship is None or ship.keep_policy)
    if keep:
        shipped = result.head if ship is None or ship.head is None else ship.head
        save_head(head=shipped, structure=result.structure, lam=result.lam, path=head_path,
                  meta={"round": result.incumbent_round, "seed": seed, "policy": "policy" if ship is None else ship.shipped})
    elif head_path.exists():
        head_path.unlink()
    write_structure(result.structure if ship is None else ship.structure, out_dir / STRUCTURE_FILE)
    if keep and size is not None and size.rule is not None:
        write_size_rule(size.rule, out_dir / SIZE_FILE)
    elif (out_dir / SIZE_FILE).exists():
        (out_dir / SIZE_FILE).unlink()
    report = {
        "autoregressive": result.autoregressive, "stop_reason": result.stop_reason,
        "incumbent_round": result.incumbent_round, "structure": result.structure.to_list(), "lambda": result.lam,
        "oracle_throughput": result.oracle_throughput, "rounds": [asdict(r) for r in result.rows],
        "structures": result.structures, "settings": result.settings, "seed": seed, "records": records_dirs,
        "size_decision": size.figures if size is not None else None,
        "ship": None if ship is None else {"keep_policy": ship.keep_policy, "shipped": ship.shipped, "reason": ship.reason,
                                           "structure": ship.structure.to_list(), "workloads": ship.workloads,
                                           **ship.figures},
    }
    write_text(out_dir / "rounds.json", json.dumps(_finite(report), indent=1) + "\n")


def _finite(obj):
    """JSON-safe copy: NaN / inf floats become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def record_prompts(*, workloads_dir: Path, tokenizer, request_ids: list[str]) -> dict[str, list[int]]:
    """Prompt tokens of record requests `{workload}/{prompt_id}`, tokenised as `collect-records` does."""
    out: dict[str, list[int]] = {}
    by_workload: dict[str, list[str]] = {}
    for rid in request_ids:
        by_workload.setdefault(rid.split("/", 1)[0], []).append(rid)
    for w, ids in by_workload.items():
        path = Path(workloads_dir) / f"{w}.parquet"
        if not path.is_file():
            raise FileNotFoundError(f"workload file {path} (for record request '{ids[0]}') does not exist")
        table = pl.read_parquet(path)
        texts = dict(zip([f"{a}/{b}" for a, b in zip(table["workload"].to_list(), table["prompt_id"].to_list())],
                         table["prompt"].to_list()))
        for rid in ids:
            if rid not in texts:
                raise ValueError(f"record request '{rid}' is not in {path}")
            out[rid] = tokenizer(texts[rid], add_special_tokens=False).input_ids
    return out


def run_rounds_stage(
    *,
    records_dirs: list[Path],
    latency_path: Path,
    oracle_path: Path,
    out_dir: Path,
    load_engine: Callable[[], tuple[TreeLM, TreeDrafter, object, str, str]],
    workloads_dir: Path,
    config: dict | None,
    seed: int,
    sequoia_path: Path | None = None,
) -> RoundsResult:
    """Stage `ogspo_rounds`. `load_engine()` -> (target, drafter, tokenizer, model checksum, drafter id),
    called only when the oracle's structure is not empty; records of another model or drafter are refused.
    After the rounds the keep/drop rule (`learn.ship.decide_shipping`) keeps the policy only if it beats
    every static tree (S at each depth, Sequoia's tree at `sequoia_path`) on held-out record requests."""
    structure, oracle_J = read_oracle(oracle_path)
    records = [load_records(Path(d)) for d in records_dirs] if len(structure) else []
    latency = LatencyModel.from_json(latency_path).at_temperature(records[0].meta["temperature"]) if records else None

    def setup() -> SameTraceSetup:
        target, drafter, tokenizer, checksum, drafter_id = load_engine()
        for d, rec in zip(records_dirs, records):
            if rec.meta.get("model_checksum") != checksum or rec.meta.get("drafter") != drafter_id:
                raise ValueError(f"records {d} are for model {str(rec.meta.get('model_checksum'))[:16]}... / drafter "
                                 f"'{rec.meta.get('drafter')}', not {checksum[:16]}... / '{drafter_id}'")
        n = int(rounds_settings(config)["prompts_per_workload"])
        ids = [rid for rec in records for rid in sample_requests(rec, n)]
        return SameTraceSetup(target=target, drafter=drafter,
                              prompts=record_prompts(workloads_dir=workloads_dir, tokenizer=tokenizer, request_ids=ids))

    result = run_rounds(records=records, latency=latency, structure=structure, oracle_throughput=oracle_J, setup=setup,
                        config=config, seed=seed)
    size = ship = None
    if result.head is not None:
        holdout = float(policy_settings(config)["holdout_fraction"])
        sequoia = load_structure(sequoia_path) if sequoia_path is not None else None
        ship = decide_shipping(records=records, structure=result.structure, head=result.head, latency=latency,
                               sequoia=sequoia, seed=seed + int(result.incumbent_round), holdout_fraction=holdout,
                               margin=float(rounds_settings(config)["keep_margin"]))
        if ship.keep_policy and rounds_settings(config)["size_decision"]:
            size = fit_size_decision(records=records, structure=result.structure, head=ship.head or result.head, latency=latency,
                                     lam=result.lam, seed=seed, holdout_fraction=holdout,
                                     tolerance=float(rounds_settings(config)["tolerance"]))
    result.ship = ship
    write_rounds(result, out_dir, seed=seed, records_dirs=[str(d) for d in records_dirs], size=size, ship=ship)
    return result
