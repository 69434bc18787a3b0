"""`ogspo export-tree`: what a run learned, in the settings vLLM and SGLang take.

- **vLLM** verifies a static tree given as `speculative_config={"method": "eagle3", "model": HEAD,
  "num_speculative_tokens": K, "speculative_token_tree": "[(0,), (1,), (0, 0), ...]"}`: the tree's
  nodes below the root as rank paths (ogspo's own naming: (1, 0) is the first child of the root's
  second child), level by level, K of them. Every ogspo structure is such a tree, so the structure
  `ogspo` ships (policy folder, per workload where the keep/drop rule chose per workload) and
  Sequoia's are exported exactly; a shipped stop policy is not (vLLM verifies the whole tree), and
  its structure is exported with that said.
- **SGLang** drafts EAGLE-3's dynamic tree from three settings: `--speculative-num-steps` (depth),
  `--speculative-eagle-topk` (children per expanded node and frontier width) and
  `--speculative-num-draft-tokens` (the nodes verified, root included). Tuned EAGLE-3's winners
  ([total_tokens, depth, top_k], root excluded) are exported exactly; a static tree is not
  representable there, and the dynamic tree of the same depth, widest level and size is given as
  the nearest, marked so.
An empty structure (autoregressive decoding shipped) exports as "no speculation".

Where the run's records and latency model are there, every exported structure carries `replayed`:
tokens/s on the records (the workload's, or all of them) under the latency model, of the structure
itself, of its nearest SGLang tree (`offline.replay.replay_dynamic`; where the records template is
narrower than that tree, the reason instead) and of autoregressive decoding, so what a non-exact
export costs is a number.
"""

from __future__ import annotations

import json
from pathlib import Path

from ogspo.artifacts.io import write_json
from ogspo.artifacts.latency import LatencyModel
from ogspo.artifacts.policy_folder import EXPORT_FILE, WORKLOADS_FILE
from ogspo.artifacts.records import load_records
from ogspo.engine.tree import Structure
from ogspo.offline.replay import replay, replay_cycles, replay_dynamic, template_cum_logq


def vllm_tree(structure: Structure) -> dict:
    """vLLM's `speculative_config` entries for verifying `structure` (empty: no speculation)."""
    if len(structure) == 0:
        return {"speculation": False}
    paths = [tuple(p) for p in structure.to_list()]  # level by level, rank order within a level
    return {"speculation": True, "num_speculative_tokens": len(paths), "speculative_token_tree": str(paths)}


def parse_vllm_tree(text: str) -> Structure:
    """The `Structure` of a vLLM `speculative_token_tree` string (tuples of ints only)."""
    import ast

    try:
        paths = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ValueError(f"speculative_token_tree {text[:60]!r} is not a Python list of int tuples") from None
    if not isinstance(paths, list) or not all(isinstance(p, tuple) and all(isinstance(r, int) for r in p) for p in paths):
        raise ValueError(f"speculative_token_tree {text[:60]!r} is not a list of int tuples")
    return Structure(paths)


def sglang_settings(total_tokens: int, depth: int, top_k: int) -> dict:
    """SGLang's flags for EAGLE-3's dynamic tree [total_tokens, depth, top_k] (total_tokens: drafted
    nodes verified, root excluded, as ogspo's `DynamicTree` counts them)."""
    if total_tokens == 0:
        return {"speculation": False}
    return {"speculation": True, "speculative_num_steps": depth, "speculative_eagle_topk": top_k,
            "speculative_num_draft_tokens": total_tokens + 1}


def sglang_nearest(structure: Structure) -> dict:
    """SGLang cannot verify a static tree; the dynamic tree of the same depth, widest level and size."""
    if len(structure) == 0:
        return {"speculation": False}
    return sglang_settings(len(structure), structure.max_depth, max(structure.level_sizes())) | {
        "exact": False, "why": "SGLang drafts dynamic trees (top-k per level, reranked), not a given static tree"}


def replayed(structure: Structure, records: list, model: LatencyModel) -> dict:
    """Tokens/s on `records` ((`ReplayCycles`, `template_cum_logq`) per records folder) of `structure`,
    of its nearest SGLang tree and of AR."""
    acc = {"structure": 0.0, "ar": 0.0, "sglang": 0.0}
    sec = dict.fromkeys(acc, 0.0)
    near = sglang_nearest(structure)
    why = None
    for cyc, cum in records:
        for key, s in (("structure", structure), ("ar", Structure([]))):
            r = replay(cycles=cyc, structures=[s], depths=[s.max_depth if len(s) else 0], model=model)
            acc[key] += float(r.accepted.sum())
            sec[key] += float(r.seconds.sum())
        if near.get("speculation") and why is None:
            try:
                r = replay_dynamic(cycles=cyc, cum_logq=cum, total_tokens=len(structure),
                                   depth=near["speculative_num_steps"], top_k=near["speculative_eagle_topk"], model=model)
                acc["sglang"] += float(r.accepted.sum())
                sec["sglang"] += float(r.seconds.sum())
            except ValueError as exc:
                why = str(exc)
    out = {"tokens_per_second": acc["structure"] / sec["structure"], "ar_tokens_per_second": acc["ar"] / sec["ar"],
           "cycles": int(sum(len(cyc.paths) for cyc, _ in records))}
    if near.get("speculation"):
        out["sglang_nearest_tokens_per_second"] = None if why else acc["sglang"] / sec["sglang"]
        if why:
            out["sglang_not_replayed"] = why
    return out


def _structure_file(path: Path) -> Structure | None:
    return Structure(json.loads(path.read_text())["structure"]) if path.is_file() else None


def export_trees(results: Path, tags: list[str]) -> dict:
    """Per temperature tag: what `ogspo` ships (per workload where it chose per workload), Sequoia's
    tree and tuned EAGLE-3's winners, in vLLM's and SGLang's settings. Parts a run did not produce
    are left out and named in `missing`."""
    results = Path(results)
    out: dict = {"results": str(results), "temperatures": {}, "missing": []}
    lat = results / "latency" / "latency.json"
    model = LatencyModel.from_json(lat) if lat.is_file() else None
    if model is None:
        out["missing"].append(f"{lat} (no replayed tokens/s)")
    for tag in tags:
        doc: dict = {}
        folders = {p.parent.name: p for p in sorted((results / "records").glob(f"*/{tag}")) if p.is_dir()}
        records = {w: (replay_cycles(rec), template_cum_logq(rec)) for w, rec in
                   ((w, load_records(p)) for w, p in folders.items())} if model is not None else {}  # read once per tag

        def with_replay(entry: dict, s: Structure, workload: str) -> dict:
            recs = [records[workload]] if workload in records else list(records.values())
            if recs and len(s):
                entry["replayed"] = replayed(s, recs, model)
            return entry

        policy = results / "policy" / tag
        shipped = _structure_file(policy / "structure.json")
        if shipped is None:
            out["missing"].append(f"{policy}/structure.json")
        else:
            export = json.loads((policy / EXPORT_FILE).read_text()) if (policy / EXPORT_FILE).is_file() else {}
            per = json.loads((policy / WORKLOADS_FILE).read_text()) if (policy / WORKLOADS_FILE).is_file() else {}
            choices = {w: (v["shipped"], Structure(v["structure"] or [])) for w, v in per.items()} or \
                {"*": ("policy" if not export.get("static", True) and len(shipped) else "static", shipped)}
            doc["ogspo"] = {}
            for w, (what, s) in choices.items():
                entry = with_replay({"structure": s.to_list(), "vllm": vllm_tree(s), "sglang": sglang_nearest(s)}, s, w)
                if what == "policy":
                    entry["stop_policy"] = "not exported: vLLM and SGLang verify the whole tree; this is its structure"
                doc["ogspo"][w] = entry
        seq = _structure_file(results / "sequoia" / tag / "structure.json")
        if seq is None:
            out["missing"].append(f"{results}/sequoia/{tag}/structure.json")
        else:
            doc["sequoia"] = with_replay({"structure": seq.to_list(), "vllm": vllm_tree(seq), "sglang": sglang_nearest(seq)},
                                         seq, "*")
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
