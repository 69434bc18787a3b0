"""structure.json: a structure's rank paths ({"structure": [[0], [1], [0, 0], ...]}; [] = autoregressive)."""

from __future__ import annotations

import json
from pathlib import Path

from ogspo.artifacts.io import write_text
from ogspo.engine.tree import Structure

STRUCTURE_FILE = "structure.json"


def load_structure(spec: str | Path | list) -> Structure:
    """A structure from a list of rank paths, a JSON string of one, or a JSON file holding one."""
    if isinstance(spec, (str, Path)):
        text = str(spec)
        if Path(text).is_file():
            text = Path(text).read_text()
        try:
            spec = json.loads(text)
        except json.JSONDecodeError:
            raise ValueError(f"structure {str(spec)[:60]!r} is neither a JSON list of rank paths nor a JSON file") from None
        if isinstance(spec, dict):
            spec = spec.get("structure", spec.get("paths"))
    if not isinstance(spec, list) or not all(isinstance(p, list) and all(isinstance(r, int) for r in p) for p in spec):
        raise ValueError("a structure is a JSON list of rank paths, e.g. [[0], [1], [0, 0]]")
    return Structure(spec)


def write_structure(structure: Structure, path: str | Path) -> None:
    write_text(path, json.dumps({"structure": structure.to_list()}) + "\n")
