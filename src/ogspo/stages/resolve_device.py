"""Stage `resolve_device`: structure and stop policy for another device, from records and its latency table.

Acceptance records depend on the target, the drafter, the workload and the temperature, never on the
device: only times do (docs/DESIGN.md §5). So a user with records from one machine and a latency.json
calibrated on another (`ogspo calibrate-latency` there, same model) re-solves the oracle
(`offline.solve.solve_oracle`) and re-trains the stop policy on the oracle's structure
(`stages.train_policy_only.run_train_policy`) without decoding anything here. What this path cannot do:
same-trace corrections (they run the engine on the device) and the size rule (fitted after them).

The records template bounds what can be found: when the new optimum touches the template's depth or
one of its per-level widths, a larger template (records.template) may hold a better structure for
that device, and the result says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ogspo.artifacts.io import write_text
from ogspo.artifacts.latency import LatencyModel
from ogspo.artifacts.oracle import OracleResult, write_oracle
from ogspo.artifacts.records import load_records
from ogspo.engine.tree import Structure
from ogspo.offline.replay import replay_cycles
from ogspo.offline.solve import combine_cycles, solve_oracle
from ogspo.stages.train_policy_only import PolicyStageResult, run_train_policy

ORACLE_FILE = "oracle.json"
POLICY_DIR = "policy"


@dataclass
class ResolveResult:
    oracle: OracleResult
    policy: PolicyStageResult
    template_edges: list[str]  # where the structure touches the records template's limits


def template_edges(structure: Structure, template: Structure) -> list[str]:
    """Limits of the template the structure reaches: its depth, or a parent's full width of children."""
    out = []
    if len(structure) and structure.max_depth == template.max_depth:
        out.append(f"depth {template.max_depth}")
    for p in sorted(structure.paths):
        if p[-1] == template.n_children[p[:-1]] - 1:  # the last child the template drafts under this parent
            out.append(f"all {p[-1] + 1} children of {list(p[:-1])}")
    return out


def resolve_device(*, records_dirs: list[Path], latency_path: Path, out_dir: Path, config: dict, seed: int) -> ResolveResult:
    """`out_dir`/oracle.json, `out_dir`/policy/ (as train_policy writes it) and `out_dir`/resolve.json."""
    records = [load_records(Path(d)) for d in records_dirs]
    if not records:
        raise ValueError("no records folders given")
    latency = LatencyModel.from_json(latency_path).at_temperature(records[0].meta["temperature"])
    for d, r in zip(records_dirs, records):  # the same prepared model and head: only the device differs
        for key, what in (("model_checksum", "model"), ("drafter", "drafter")):
            if latency.meta.get(key) != r.meta.get(key):
                raise ValueError(f"{latency_path} was calibrated for {what} {str(latency.meta.get(key))[:24]}, the records "
                                 f"{d} are for {str(r.meta.get(key))[:24]}: calibrate the same model and head on that device")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    oracle = solve_oracle(cycles=combine_cycles([replay_cycles(r) for r in records]), latency=latency,
                          config=config.get("solve"))
    write_oracle(oracle, out_dir / ORACLE_FILE)
    policy = run_train_policy(records_dirs=records_dirs, latency_path=latency_path, oracle_path=out_dir / ORACLE_FILE,
                              out_dir=out_dir / POLICY_DIR, config=config.get("policy"), seed=seed)
    edges = template_edges(Structure(oracle.structure), records[0].template)
    doc = {
        "latency": str(latency_path), "device": latency.meta.get("device"), "records": [str(d) for d in records_dirs],
        "oracle_throughput": oracle.throughput, "structure": Structure(oracle.structure).to_list(),
        "policy_throughput": policy.train.train.throughput if policy.train else None,
        "template_edges": edges,
        "note": ("the structure reaches the records template's limits (" + "; ".join(edges) + "): a larger "
                 "records.template may hold a better structure for this device") if edges else None,
    }
    write_text(out_dir / "resolve.json", json.dumps(doc, indent=1) + "\n")
    return ResolveResult(oracle=oracle, policy=policy, template_edges=edges)
