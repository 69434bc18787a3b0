"""Solver results (oracle_T*.json, the structure update's result): the dataclasses, reader and writer."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ogspo.artifacts.io import write_text
from ogspo.engine.tree import Structure

SCHEMA_VERSION = 1


@dataclass
class OracleResult:
    structure: list[list[int]]  # rank paths of S
    group_depths: list[int]  # chosen stop depth per group
    group_paths: list[list[int]]  # accepted template node ids per group
    group_weights: list[int]
    throughput: float  # surrogate tokens/s = sum A / sum t (replayed)
    accepted: float  # sum_c A_c
    seconds_total: float  # sum_c t_c
    mean_accepted: float
    mean_depth: float  # cycle-weighted
    lambdas: list[float]
    iterations: int
    gaps: list[float]
    statuses: list[str]
    solve_seconds: float
    ratio_upper_bound: float
    n_groups: int
    n_cycles: int
    start: str  # how lambda_0 was obtained
    settings: dict = field(default_factory=dict)


@dataclass
class StructureResult:
    structure: list[list[int]]
    throughput: float
    accepted: float
    seconds_total: float
    lambdas: list[float]
    iterations: int
    gaps: list[float]
    statuses: list[str]
    solve_seconds: float
    ratio_upper_bound: float
    n_cycles: int


def write_oracle(result: OracleResult | StructureResult, path: Path) -> None:
    write_text(path, json.dumps({"schema_version": SCHEMA_VERSION, **asdict(result)}, indent=1) + "\n")


def read_oracle(path: str | Path) -> tuple[Structure, float | None]:
    """(structure, throughput) of an oracle JSON written by solve-oracle; one-line error otherwise."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"oracle {path} does not exist")
    try:
        oracle = json.loads(path.read_text())
        S = Structure(oracle["structure"])
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ValueError(f"oracle {path} is not an oracle JSON written by solve-oracle") from None
    return S, (float(oracle["throughput"]) if oracle.get("throughput") is not None else None)
