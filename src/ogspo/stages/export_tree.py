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
"""

from __future__ import annotations

import json
from pathlib import Path

from ogspo.artifacts.io import write_json
from ogspo.artifacts.policy_folder import EXPORT_FILE, WORKLOADS_FILE
from ogspo.engine.tree import Structure


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


def _structure_file(path: Path) -> Structure | None:
    return Structure(json.loads(path.read_text())["structure"]) if path.is_file() else None


def export_trees(results: Path, tags: list[str]) -> dict:
    """Per temperature tag: what `ogspo` ships (per workload where it chose per workload), Sequoia's
    tree and tuned EAGLE-3's winners, in vLLM's and SGLang's settings. Parts a run did not produce
    are left out and named in `missing`."""
    results = Path(results)
    out: dict = {"results": str(results), "temperatures": {}, "missing": []}
    for tag in tags:
        doc: dict = {}
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
                entry = {"structure": s.to_list(), "vllm": vllm_tree(s), "sglang": sglang_nearest(s)}
                if what == "policy":
                    entry["stop_policy"] = "not exported: vLLM and SGLang verify the whole tree; this is its structure"
                doc["ogspo"][w] = entry
        seq = _structure_file(results / "sequoia" / tag / "structure.json")
        if seq is None:
            out["missing"].append(f"{results}/sequoia/{tag}/structure.json")
        else:
            doc["sequoia"] = {"structure": seq.to_list(), "vllm": vllm_tree(seq), "sglang": sglang_nearest(seq)}
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
