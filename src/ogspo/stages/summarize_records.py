"""Stage `summarize_records`: per records folder, acceptance by depth and the records' size, as JSON
and markdown (`ogspo.artifacts.records.summarize_records`)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from ogspo.artifacts.io import write_text
from ogspo.artifacts.records import load_records, summarize_records
from ogspo.engine.model import read_manifest


def summarize_records_dirs(records_dirs: list[Path], *, model: Path | None, drafter: str | None, out_json: Path,
                           out_md: Path) -> dict:
    """Summarise every records folder ({workload}/T{temperature}); with `model` (a prepared folder) or
    `drafter` (an id), refuse records of another model or head. Returns the JSON document."""
    checksum = read_manifest(model)["checksum_sha256"] if model else None
    out, md = {}, ["# Posterior verification records", ""]
    for d in map(Path, records_dirs):
        s = summarize_records(load_records(d, expect_model=checksum, expect_drafter=drafter))
        name = f"{d.parent.name}/{d.name}"
        out[name] = asdict(s)
        md.append(s.to_markdown(name))
    write_text(out_json, json.dumps(out, indent=1) + "\n")
    write_text(out_md, "\n".join(md))
    return out
