"""Stage `export_tree`: what a run learned, in the settings vLLM and SGLang take (`ogspo.offline.serving`).

Per temperature tag: the structure `ogspo` ships (per workload, as rule choose_on_device chose it;
where it shipped the stop policy, the policy folder's whole structure, which the engines verify, with
the stop policy named as not exported), Sequoia's tree and tuned EAGLE-3's winners. Each
static tree goes out as vLLM's `speculative_token_tree` (exact where vLLM drafts it as written, else
marked not exact with the best uniform tree for the cell beside it) and as SGLang's nearest dynamic
tree; tuned EAGLE-3's winners as SGLang's three settings. An empty structure (autoregressive decoding
shipped) exports as "no speculation". With the run's records and latency model, every exported
structure carries `replayed` tokens/s, so what a non-exact export costs is a number.
"""

from __future__ import annotations

import json
from pathlib import Path

from ogspo.artifacts.io import write_json
from ogspo.artifacts.latency import LatencyModel
from ogspo.artifacts.policy_folder import EXPORT_FILE, WORKLOADS_FILE
from ogspo.artifacts.records import load_records
from ogspo.engine.tree import Structure
from ogspo.offline.replay import replay_cycles, template_cum_logq
from ogspo.offline.serving import VLLM_NOTES, best_uniform, replayed, sglang_nearest, sglang_settings, vllm_children, vllm_tree


def _structure_file(path: Path) -> Structure | None:
    return Structure(json.loads(path.read_text())["structure"]) if path.is_file() else None


def export_trees(results: Path, tags: list[str]) -> dict:
    """Per temperature tag: what `ogspo` ships (per workload where it chose per workload), Sequoia's
    tree and tuned EAGLE-3's winners, in vLLM's and SGLang's settings. Parts a run did not produce
    are left out and named in `missing`."""
    results = Path(results)
    out: dict = {"results": str(results), "vllm_notes": list(VLLM_NOTES), "temperatures": {}, "missing": []}
    lat = results / "latency" / "latency.json"
    model = LatencyModel.from_json(lat) if lat.is_file() else None
    if model is None:
        out["missing"].append(f"{lat} (no replayed tokens/s)")
    for tag in tags:
        doc: dict = {}
        folders = {p.parent.name: p for p in sorted((results / "records").glob(f"*/{tag}")) if p.is_dir()}
        records = {w: (replay_cycles(rec), template_cum_logq(rec)) for w, rec in
                   ((w, load_records(p)) for w, p in folders.items())} if model is not None else {}  # read once per tag

        def cell(workload: str) -> list:
            return [records[workload]] if workload in records else list(records.values())

        def entry_of(s: Structure, workload: str) -> dict:
            recs = cell(workload)
            uniform = best_uniform(recs, model) if recs and len(s) and vllm_children(s) is None else None
            entry = {"structure": s.to_list(), "vllm": vllm_tree(s, uniform), "sglang": sglang_nearest(s)}
            if recs and len(s):
                entry["replayed"] = replayed(s, recs, model)
            return entry

        policy = results / "ogspo" / tag  # the policy folder with the choice made on the device (rule choose_on_device)
        shipped = _structure_file(policy / "structure.json")
        if shipped is None:
            out["missing"].append(f"{policy}/structure.json")
        else:
            export = json.loads((policy / EXPORT_FILE).read_text()) if (policy / EXPORT_FILE).is_file() else {}
            per = json.loads((policy / WORKLOADS_FILE).read_text()) if (policy / WORKLOADS_FILE).is_file() else {}
            # a workload that ships the stop policy verifies the policy folder's whole structure
            choices = {w: (v["shipped"], shipped if v["shipped"] == "policy" else Structure(v["structure"] or []))
                       for w, v in per.items()} or \
                {"*": ("policy" if not export.get("static", True) and len(shipped) else "static", shipped)}
            doc["ogspo"] = {}
            for w, (what, s) in choices.items():
                entry = entry_of(s, w)
                if what == "policy":
                    entry["stop_policy"] = "not exported: vLLM and SGLang verify the whole tree; this is its structure"
                doc["ogspo"][w] = entry
        seq = _structure_file(results / "sequoia" / tag / "structure.json")
        if seq is None:
            out["missing"].append(f"{results}/sequoia/{tag}/structure.json")
        else:
            doc["sequoia"] = entry_of(seq, "*")
        tune = results / "evaluate" / f"tune_{tag}.json"
        if not tune.is_file():
            out["missing"].append(str(tune))
        else:
            winners = json.loads(tune.read_text())["winners"]
            doc["eagle_tuned"] = {w: {"tree": list(t), "sglang": sglang_settings(*t)} for w, t in winners.items()}
        out["temperatures"][tag] = doc
    return out


def write_export(doc: dict, path: Path) -> None:
    write_json(Path(path), doc)
