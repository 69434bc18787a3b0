"""Stage `solve_oracle`: OGSPO step 0, the posterior-optimal structure and stop depths of the records
under the device's latency model (`ogspo.offline.solve.solve_oracle`, docs/DESIGN.md §5)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ogspo.artifacts.latency import LatencyModel
from ogspo.artifacts.oracle import OracleResult, write_oracle
from ogspo.artifacts.records import load_records
from ogspo.offline.replay import replay_cycles
from ogspo.offline.solve import combine_cycles, solve_oracle


def run_solve_oracle(*, records_dirs: list[Path], latency_path: Path, config: Mapping, out: Path) -> OracleResult:
    """Solve the oracle on the records folders (one template) and write its JSON to `out`."""
    records = [load_records(d) for d in records_dirs]
    cycles = combine_cycles([replay_cycles(r) for r in records])
    latency = LatencyModel.from_json(latency_path).at_temperature(records[0].meta["temperature"])
    result = solve_oracle(cycles=cycles, latency=latency, config=config)
    write_oracle(result, out)
    return result
