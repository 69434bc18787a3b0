"""Trees in the settings serving engines take, and what they cost on the records (numpy only).

- **vLLM** (`vllm/v1/spec_decode/eagle.py` and `vllm/config/speculative.py`, read at commit
  f7eef1b6987f): `speculative_token_tree` is sorted breadth-first, and the tree proposer takes, per
  level, children = nodes at the level // nodes at the level above, that many top-k tokens under
  *every* node of the level above. So only per-level-uniform trees (`Structure.full(children)`) are
  drafted as written (`vllm_children`); for any other structure `best_uniform` picks, on the records
  under a latency model, the uniform tree vLLM can draft that replays fastest. Tree drafting needs
  vLLM's tree attention backend, and its tree path at T > 0 is not complete (`VLLM_NOTES`).
- **SGLang** drafts EAGLE-3's dynamic tree from three settings (`sglang_settings`); a static tree is
  not representable there, and `sglang_nearest` gives the dynamic tree of the same depth, widest level
  and size.
- `replayed`: tokens/s on the records of a structure, of its nearest SGLang tree (replayed cycle by
  cycle with its rerank, `replay.replay_dynamic`) and of autoregressive decoding; a structure that
  leaves the records' template has none (`not_replayed`).
"""

from __future__ import annotations

import ast

import numpy as np

from ogspo.artifacts.latency import LatencyModel
from ogspo.engine.tree import Structure
from ogspo.offline.replay import replay, replay_dynamic

VLLM_NOTES = (
    "Tree drafting runs only with vLLM's tree attention backend (--attention-backend TREE_ATTN); with any other "
    "backend vLLM drafts num_speculative_tokens tokens as a chain.",
    "vLLM drafts the same number of top-k children under every node of a level, so only per-level-uniform trees are "
    "drafted as written (\"exact\": true); a structure that is not one is exported with \"exact\": false and the best "
    "uniform tree beside it.",
    "vLLM's tree path at T > 0 is not complete (its tree rejection sampler was not merged): use these trees at T = 0.",
)


def vllm_children(structure: Structure) -> list[int] | None:
    """The children per level vLLM's tree proposer drafts for `structure` (nodes at a level // nodes at the
    level above), where that rule drafts exactly `structure`; None otherwise."""
    sizes = structure.level_sizes()
    children = [sizes[0], *(b // a for a, b in zip(sizes, sizes[1:]))]
    drafted = Structure.full(children)
    return children if set(drafted.paths) == set(structure.paths) else None


def vllm_settings(structure: Structure) -> dict:
    """vLLM's `speculative_config` entries for the tree `structure` (empty: no speculation)."""
    if len(structure) == 0:
        return {"speculation": False}
    paths = [tuple(p) for p in structure.to_list()]  # breadth-first, as vLLM sorts it
    return {"speculation": True, "num_speculative_tokens": len(paths), "speculative_token_tree": str(paths)}


def vllm_tree(structure: Structure, uniform: dict | None = None) -> dict:
    """vLLM's settings for `structure`: exact where vLLM drafts it as written; else marked not exact, with
    `uniform` (the best uniform tree for the cell, `best_uniform`, or the largest one inside `structure`)
    beside it."""
    if len(structure) == 0 or vllm_children(structure) is not None:
        return vllm_settings(structure) | {"exact": True}
    if uniform is None:
        inside = largest_uniform_inside(structure)
        uniform = {"children_per_level": inside, "chosen": "the largest uniform tree inside the structure (no records to "
                   "choose on)", **vllm_settings(Structure.full(inside)), "exact": True}
    return {"exact": False, "why": "vLLM drafts the same number of top-k children under every node of a level; this "
                                   f"structure ({len(structure)} nodes) is not such a tree", "uniform": uniform}


def largest_uniform_inside(structure: Structure) -> list[int]:
    """Children per level of the largest per-level-uniform tree contained in `structure`."""
    paths, children, level = set(structure.paths), [], [()]
    while True:
        c = min(next(r for r in range(len(paths) + 1) if p + (r,) not in paths) for p in level)  # children: ranks 0..c-1
        if c == 0:
            return children
        children.append(c)
        level = [p + (r,) for p in level for r in range(c)]


def uniform_candidates(template: Structure, max_nodes: int = 128) -> list[list[int]]:
    """Children per level of every per-level-uniform tree inside the records `template` (at most
    `max_nodes` nodes): the trees vLLM can draft that the records can replay."""
    inside, out, frontier = set(template.paths), [], [[]]
    while frontier:
        nxt = []
        for c in frontier:
            for k in range(1, len(inside) + 1):
                s = Structure.full(c + [k])
                if len(s) > max_nodes or not set(s.paths) <= inside:
                    break
                out.append(c + [k])
                nxt.append(c + [k])
        frontier = nxt
    return out


def best_uniform(records: list, model: LatencyModel) -> dict:
    """The per-level-uniform tree with the highest tokens/s on `records` ((`ReplayCycles`, cum log q) per
    records folder) under `model`, against AR; {"speculation": false} where none beats AR."""
    cands = uniform_candidates(records[0][0].template)
    ar, *tps = replay_tps([Structure([]), *(Structure.full(c) for c in cands)], records, model)
    best_tps, best = max(zip(tps, cands), key=lambda x: x[0]) if cands else (0.0, [])
    if best_tps <= ar:
        return {"speculation": False, "exact": True, "chosen": "on the records: no uniform tree beats AR",
                "replayed_tokens_per_second": ar}
    return {"children_per_level": best, "chosen": f"on the records: the best of {len(cands)} uniform trees",
            **vllm_settings(Structure.full(best)), "exact": True, "replayed_tokens_per_second": best_tps,
            "ar_tokens_per_second": ar}


def parse_vllm_tree(text: str) -> Structure:
    """The `Structure` of a vLLM `speculative_token_tree` string (tuples of ints only)."""
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


def replay_tps(structures: list[Structure], records: list, model: LatencyModel) -> list[float]:
    """Tokens/s of each static tree, verified whole every cycle, on `records` under `model`: one replay of all
    of them per records folder."""
    depths = [s.max_depth if len(s) else 0 for s in structures]
    acc = np.zeros(len(structures))
    sec = np.zeros(len(structures))
    for cyc, _ in records:
        r = replay(cycles=cyc, structures=structures, depths=depths, model=model)  # [K, C] each
        acc += r.accepted.sum(axis=1)
        sec += r.seconds.sum(axis=1)
    return (acc / sec).tolist()


def replayed(structure: Structure, records: list, model: LatencyModel) -> dict:
    """Tokens/s on `records` ((`ReplayCycles`, `template_cum_logq`) per records folder) of `structure`,
    of its nearest SGLang tree and of AR. A structure with a node outside the records' template (Sequoia
    builds its tree from acceptance by rank and may leave it) has no record figure: `not_replayed` says
    which node, beside AR's."""
    outside = next((p for cyc, _ in records for p in structure.paths if p not in cyc.template), None)
    if outside is not None:
        (ar,) = replay_tps([Structure([])], records, model)
        return {"tokens_per_second": None, "ar_tokens_per_second": ar,
                "not_replayed": f"node {list(outside)} is not in the records' template"}
    own, ar = replay_tps([structure, Structure([])], records, model)
    near = sglang_nearest(structure)
    acc = sec = 0.0
    why = None
    for cyc, cum in records:
        if near.get("speculation") and why is None:
            try:
                r = replay_dynamic(cycles=cyc, cum_logq=cum, total_tokens=len(structure),
                                   depth=near["speculative_num_steps"], top_k=near["speculative_eagle_topk"], model=model)
                acc, sec = acc + float(r.accepted.sum()), sec + float(r.seconds.sum())
            except ValueError as exc:
                why = str(exc)
    out = {"tokens_per_second": own, "ar_tokens_per_second": ar, "cycles": int(sum(len(cyc.paths) for cyc, _ in records))}
    if near.get("speculation"):
        out["sglang_nearest_tokens_per_second"] = None if why else acc / sec
        if why:
            out["sglang_not_replayed"] = why
    return out
