"""Stage `build_sequoia`: the Sequoia-style static tree (`offline.sequoia`) from records folders."""

from __future__ import annotations

import json
from pathlib import Path

from ogspo.artifacts.io import write_text
from ogspo.artifacts.latency import LatencyModel
from ogspo.artifacts.records import load_records
from ogspo.artifacts.structure import STRUCTURE_FILE, write_structure
from ogspo.offline.replay import replay_cycles
from ogspo.offline.sequoia import REPORT_FILE, SequoiaResult, sequoia_tree
from ogspo.offline.solve import combine_cycles


def build_sequoia(*, records_dirs: list[Path], latency_path: Path, config: dict | None, out_dir: Path) -> SequoiaResult:
    """Stage `build_sequoia`: writes `out_dir`/structure.json (empty list = autoregressive) and sequoia.json."""
    if not records_dirs:
        raise ValueError("build-sequoia needs at least one records folder")
    records = [load_records(Path(d)) for d in records_dirs]
    cycles = combine_cycles([replay_cycles(r) for r in records])
    latency = LatencyModel.from_json(latency_path).at_temperature(records[0].meta["temperature"])
    result = sequoia_tree(cycles=cycles, latency=latency, config=config)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_structure(result.structure, out_dir / STRUCTURE_FILE)
    report = {**result.to_json(), "records": [str(d) for d in records_dirs], "latency": str(latency_path)}
    write_text(out_dir / REPORT_FILE, json.dumps(report, indent=1) + "\n")
    result.out_dir = out_dir
    return result
