"""Stage `export_policy`: the final head of an OGSPO rounds folder as a policy folder."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ogspo.artifacts.io import write_json
from ogspo.artifacts.policy_folder import WORKLOADS_FILE
from ogspo.artifacts.size_rule import SIZE_FILE, read_size_rule, write_size_rule
from ogspo.artifacts.structure import STRUCTURE_FILE, load_structure
from ogspo.engine.tree import Structure
from ogspo.learn.export import ExportResult, write_policy_folder
from ogspo.learn.policy import HEAD_FILE, load_head


def _ship(rounds_dir: Path) -> dict:
    """The keep/drop rule's decision in the rounds folder's rounds.json ({} when absent)."""
    try:
        return json.loads((rounds_dir / "rounds.json").read_text()).get("ship") or {}
    except (OSError, json.JSONDecodeError):
        return {}


def _policy_dropped(rounds_dir: Path) -> bool:
    """True when the rounds folder's rounds.json says the keep/drop rule shipped a static tree."""
    return _ship(rounds_dir).get("keep_policy") is False


@dataclass
class ExportStageResult:
    out_dir: Path
    structure: Structure
    export: ExportResult | None  # None for an empty structure (autoregressive) or a shipped static tree


def run_export_policy(*, rounds_dir: Path, out_dir: Path) -> ExportStageResult:
    """Stage `export_policy`: the final head of an OGSPO rounds folder (policy.pt + structure.json, and
    size.json when the size rule was kept) as a policy folder that `load_policy_dir` / the `ogspo` method read."""

    rounds_dir = Path(rounds_dir)
    if not (rounds_dir / STRUCTURE_FILE).is_file():
        raise FileNotFoundError(f"rounds folder {rounds_dir} has no {STRUCTURE_FILE}")
    structure = load_structure(rounds_dir / STRUCTURE_FILE)
    static = len(structure) > 0 and not (rounds_dir / HEAD_FILE).is_file() and _policy_dropped(rounds_dir)
    head, meta = (None, {}) if len(structure) == 0 or static else load_head(rounds_dir / HEAD_FILE)
    if head is not None and meta["structure"] != structure.to_list():
        raise ValueError(f"rounds folder {rounds_dir}: {STRUCTURE_FILE} differs from the structure of {HEAD_FILE}")
    info = {"source": str(rounds_dir), **{k: meta[k] for k in ("round", "seed") if k in meta}}
    if static:
        info["static"] = True  # the keep/drop rule shipped a static tree (rounds.json "ship")
    exp = write_policy_folder(head=head, structure=structure, lam=meta.get("lambda"), out_dir=out_dir, info=info)
    works = _ship(rounds_dir).get("workloads")
    if works:  # the keep/drop rule's choice per workload
        write_json(Path(out_dir) / WORKLOADS_FILE, {w: {k: v[k] for k in ("shipped", "structure", "static", "static_structure")}
                                                    for w, v in works.items()})
    elif (Path(out_dir) / WORKLOADS_FILE).exists():
        (Path(out_dir) / WORKLOADS_FILE).unlink()
    if head is not None and (rounds_dir / SIZE_FILE).is_file():  # the size rule the rounds kept
        write_size_rule(read_size_rule(rounds_dir / SIZE_FILE), Path(out_dir) / SIZE_FILE)
    elif (Path(out_dir) / SIZE_FILE).exists():
        (Path(out_dir) / SIZE_FILE).unlink()
    return ExportStageResult(out_dir=Path(out_dir), structure=structure, export=exp)
