"""Stage `train_policy_only`: the OGSPO policy head for a fixed structure (the oracle's), as a policy folder."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ogspo.artifacts.io import write_text
from ogspo.artifacts.latency import LatencyModel
from ogspo.artifacts.oracle import read_oracle
from ogspo.artifacts.records import load_records
from ogspo.learn.export import write_policy_folder
from ogspo.learn.policy import PolicyTrainResult, combine_data, offline_states, train_policy
from ogspo.methods.features import FEATURE_NAMES, FEATURES_VERSION


@dataclass
class PolicyStageResult:
    out_dir: Path
    train: PolicyTrainResult | None  # None when the oracle chose not to draft at all (empty structure)
    oracle_throughput: float | None
    export_seconds: float
    features_seconds: float


def run_train_policy(
    *, records_dirs: list[Path], latency_path: Path, oracle_path: Path | None, out_dir: Path, config: dict | None, seed: int,
) -> PolicyStageResult:
    """Stage `train_policy_only` (and `ogspo train-policy`): structure fixed, features + gains from records,
    train, evaluate, export. The structure is the oracle's (`oracle_path`) or, with `oracle_path=None`, the
    records' full template T (the policy-only ablation: no structure optimisation).

    Writes `out_dir`/policy.onnx, structure.json, export.json, train.json and train.md."""

    oracle_J = None
    if oracle_path is not None:
        S, oracle_J = read_oracle(oracle_path)
    out_dir = Path(out_dir)
    if oracle_path is not None and len(S) == 0:  # the oracle found no tree worth verifying: "never draft"
        out_dir.mkdir(parents=True, exist_ok=True)
        reason = ("the oracle's structure is empty: on this device and temperature no draft tree beats "
                  "autoregressive decoding on these records, so the ogspo method decodes autoregressively")
        write_policy_folder(head=None, structure=S, lam=None, out_dir=out_dir, info={"oracle": str(oracle_path), "seed": seed})
        report = {"autoregressive": True, "reason": reason, "oracle_throughput": oracle_J}
        write_text(out_dir / "train.json", json.dumps(report, indent=1) + "\n")
        write_text(out_dir / "train.md", f"No policy trained: {reason}.\n")
        return PolicyStageResult(out_dir=out_dir, train=None, oracle_throughput=oracle_J,
                                 export_seconds=0.0, features_seconds=0.0)
    t0 = time.perf_counter()
    records = [load_records(Path(d)) for d in records_dirs]
    if not records:
        raise ValueError("no records folders given")
    latency = LatencyModel.from_json(latency_path).at_temperature(records[0].meta["temperature"])
    if oracle_path is None:
        S = records[0].template
    parts = [offline_states(records=r, structure=S, latency=latency) for r in records]
    data = combine_data(parts)
    t_feat = time.perf_counter() - t0
    result = train_policy(data=data, seed=seed, config=config, oracle_throughput=oracle_J)
    source = str(oracle_path) if oracle_path is not None else "records template"
    exp = write_policy_folder(head=result.head, structure=S, lam=result.lam, out_dir=out_dir,
                              info={"structure_source": source, "seed": seed})
    report = {
        "features_version": FEATURES_VERSION, "feature_names": list(FEATURE_NAMES), "structure": S.to_list(),
        "structure_source": source,
        "lambda": result.lam, "lambdas": result.lambdas, "round_throughputs": result.round_throughputs,
        "train": asdict(result.train), "holdout": asdict(result.holdout) if result.holdout else None,
        "n_train_requests": result.n_train_requests, "n_holdout_requests": result.n_holdout_requests,
        "train_seconds": result.seconds, "features_seconds": t_feat, "export_seconds": exp.seconds,
        "settings": result.settings, "seed": seed, "records": [str(d) for d in records_dirs],
    }
    write_text(out_dir / "train.json", json.dumps(report, indent=1) + "\n")
    md = [f"### OGSPO policy (|S| = {len(S)}, depth {S.max_depth}, lambda {result.lam:.3f}, structure: {source})", "",
          result.train.to_markdown("train records")]
    if result.holdout is not None:
        md.append(result.holdout.to_markdown("held-out requests"))
    write_text(out_dir / "train.md", "\n".join(md))
    return PolicyStageResult(out_dir=out_dir, train=result, oracle_throughput=oracle_J, export_seconds=exp.seconds,
                             features_seconds=t_feat)
