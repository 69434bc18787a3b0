"""Stage `choose_on_device`: what `ogspo` ships per workload, decided on the device among the few
trees its records rank best (`learn.on_device`: the why and the rule), with the settings of config
section `on_device`.

The output is the policy folder again, with workloads.json saying each workload's choice (its entry
gains `on_device`: candidates, replayed and measured tokens/s) and device.json holding the table.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path

from ogspo.artifacts.io import write_json
from ogspo.artifacts.latency import LatencyModel
from ogspo.artifacts.policy_folder import EXPORT_FILE, POLICY_FILE, WORKLOADS_FILE
from ogspo.artifacts.size_rule import SIZE_FILE
from ogspo.artifacts.structure import STRUCTURE_FILE, load_structure
from ogspo.learn.on_device import OWN, WorkloadChoice, choose_on_device
from ogspo.methods.ogspo import workload_choice

DEVICE_FILE = "device.json"


def on_device_settings(config: Mapping | None) -> dict:
    s = dict((config or {}).get("on_device") or {})
    for key in ("candidates", "prompts_per_workload", "max_new_tokens", "margin", "confidence"):
        if key not in s:
            raise ValueError(f"on_device.{key} is missing (config/default.yaml has every key)")
    return s


def write_choice(choices: list[WorkloadChoice], *, policy_dir: Path, out_dir: Path, meta: dict) -> None:
    """The policy folder at `policy_dir` copied to `out_dir`, its workloads.json saying each workload's
    choice (the own entry where the own choice stays, else the chosen static tree; `on_device` beside it)
    and device.json with the whole table."""
    policy_dir, out_dir = Path(policy_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in (POLICY_FILE, STRUCTURE_FILE, EXPORT_FILE, SIZE_FILE):
        if (policy_dir / name).is_file():
            shutil.copyfile(policy_dir / name, out_dir / name)
        elif (out_dir / name).exists():
            (out_dir / name).unlink()
    works = {}
    for c in choices:
        entry = dict(workload_choice(policy_dir, c.workload) or {})
        if not entry:  # the folder's one choice everywhere
            entry = {"shipped": c.own, "structure": c.candidates[OWN]}
        if c.chosen != OWN:
            entry.update(shipped=c.chosen, structure=c.candidates[c.chosen])
        entry["on_device"] = {"chosen": c.chosen, "own": c.own,
                              "tokens_per_second": {n: c.gmean(n) for n in c.candidates}, "replayed": c.replayed,
                              "sample_factor": c.sample_factor}
        works[c.workload] = entry
    write_json(out_dir / WORKLOADS_FILE, works)
    write_json(out_dir / DEVICE_FILE, {**meta, "policy": str(policy_dir), "workloads": [asdict(c) for c in choices]})


def read_device_choice(path: Path) -> dict:
    """device.json of a `choose_on_device` folder (the folder or the file)."""
    path = Path(path)
    path = path / DEVICE_FILE if path.is_dir() else path
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a choose_on_device table ({exc.__class__.__name__})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("workloads"), list):
        raise ValueError(f"{path}: not a choose_on_device table (no 'workloads' list)")
    return doc


def run_choose_on_device(*, target, drafter, policy_dir: Path, records_dirs: Mapping[str, Path], latency_path: Path,
                         sequoia_path: Path | None, prompts, temperature: float, config: Mapping, seed: int, interleave: str,
                         out_dir: Path, progress: Callable[[str], None] | None = None) -> list[WorkloadChoice]:
    """Stage `choose_on_device`: the choices, written as a policy folder at `out_dir`."""
    t0 = time.perf_counter()
    latency = LatencyModel.from_json(latency_path).at_temperature(temperature)
    sequoia = load_structure(sequoia_path) if sequoia_path is not None else None
    s = on_device_settings(config)
    choices = choose_on_device(target=target, drafter=drafter, policy_dir=policy_dir, records_dirs=records_dirs,
                               latency=latency, sequoia=sequoia, prompts=prompts, temperature=temperature,
                               candidates=int(s["candidates"]), max_new_tokens=int(s["max_new_tokens"]),
                               margin=float(s["margin"]), confidence=float(s["confidence"]), seed=seed,
                               interleave=interleave, progress=progress)
    write_choice(choices, policy_dir=policy_dir, out_dir=out_dir,
                 meta={"temperature": float(temperature), "settings": s, "interleave": interleave,
                       "seconds": time.perf_counter() - t0})
    return choices
