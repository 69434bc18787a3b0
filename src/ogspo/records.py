"""Stage `collect_records`: posterior verification records (docs/DESIGN.md §3).

Each cycle drafts the whole superset template T (`StaticTree(T)`), verifies all of T in one target
pass and commits the accepted path as usual. A *shard* covers `shard_size` consecutive prompts and
is two parquet files, each carrying the same key-value metadata ``ogspo_records`` (JSON: schema
version, model checksum, drafter id, template rank paths, temperature, seed, shard index, row
counts). ``shard-XXXX.nodes.parquet`` is written first, ``shard-XXXX.cycles.parquet`` last (each via
temp file + rename), so a shard is complete exactly when its cycles file exists and both files
agree. Collection skips complete shards: an interrupted run loses at most one shard.

Node table (one row per drafted node, root excluded):

| column | type | meaning |
|---|---|---|
| request_id | str | workload/prompt id |
| cycle | i32 | cycle index within the request (1-based, as in `cycle_seed`) |
| node | i32 | index in the cycle's drafted tree (breadth-first, root = 0) |
| tnode | i32 | index of the node's rank path in the template (1 + position in `Structure.to_list()`; root 0) |
| rank_path | str | ranks from depth 1 down, dot-separated (e.g. "0.2.1") |
| depth | i16 | depth (1 = child of the root) |
| parent | i32 | parent's `node` (0 = root) |
| token | i64 | drafted token |
| logq | f64 | drafter log-prob of the token at its parent |
| cum_logq | f64 | sum of `logq` from the root down |
| entropy | f64 | drafter entropy at the parent |
| target_logp | f64 | target log-prob of the token at its parent's row: log_softmax(logits / T) (T=1 when T=0) |
| match | bool | T=0: token == target argmax at the parent; T>0: node accepted by rejection sampling |

Cycle table (one row per cycle):

| column | type | meaning |
|---|---|---|
| request_id, cycle | | as above |
| request_seed | u64 | per-request seed (from the global seed and request id) |
| seed | u64 | the cycle's seed (`cycle_seed(request_seed, cycle)`; fixes its random numbers) |
| context_length | i32 | committed tokens before the cycle (the root is not among them) |
| root_token | i64 | the cycle's root (last committed token) |
| tree_size | i32 | drafted nodes (root excluded; may be < |T| for model-free drafters) |
| draft_seconds | list[f64] | measured drafter time per level |
| verify_seconds | f64 | measured target tree forward |
| cycle_seconds | f64 | whole cycle |
| accepted_tnodes | list[i32] | accepted path as template node ids (root excluded) |
| accepted_paths | list[str] | the same as rank paths |
| accepted_length | i32 | tokens committed (accepted path + bonus) |
| committed | list[i64] | the committed tokens (accepted drafted tokens then the bonus) |
"""

from __future__ import annotations

import json
import os
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
import torch

from ogspo.engine.decode import CycleTrace, SpeculativeEngine
from ogspo.engine.drafters import TreeDrafter
from ogspo.engine.policies import StaticTree
from ogspo.engine.target import TreeLM
from ogspo.engine.tree import Structure, node_rank_paths

SCHEMA_VERSION = 1
META_KEY = "ogspo_records"


def path_str(path) -> str:
    return ".".join(str(int(r)) for r in path)


def template_index(template: Structure) -> dict[tuple[int, ...], int]:
    """Rank path -> template node id (root () = 0, then `to_list()` order)."""
    return {(): 0, **{tuple(p): i + 1 for i, p in enumerate(template.to_list())}}


def request_seed(seed: int, request_id: str) -> int:
    """Per-request seed derived from the global seed and the request id."""
    crc = zlib.crc32(request_id.encode())
    return int(np.random.SeedSequence([int(seed) & (2**32 - 1), crc]).generate_state(2, np.uint32).view(np.uint64)[0] >> 1)


@dataclass
class RecordsResult:
    out_dir: Path
    shards: list[Path]  # cycles files of every shard
    computed: list[int]  # shard indices computed by this call (the others were complete already)
    n_cycles: int  # cycles computed by this call
    seconds: float


@dataclass
class Records:
    nodes: pl.DataFrame
    cycles: pl.DataFrame
    meta: dict  # common metadata (shard-specific keys removed)
    template: Structure


def _node_rows(trace: CycleTrace, rid: str, tidx: dict, temperature: float) -> dict[str, list]:
    tree, verdict = trace.drafted, trace.verdict
    if len(trace.verified) != len(tree):
        raise ValueError("records need every drafted node verified (a static template policy)")
    n = len(tree)
    paths = node_rank_paths(tree.parents, tree.ranks)
    logits = trace.logits.double()  # [n, V]
    logp = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)  # [n, V]
    par = torch.from_numpy(tree.parents[1:])  # [n-1]
    tok = torch.from_numpy(tree.tokens[1:])  # [n-1]
    tlogp = logp[par, tok].numpy()  # [n-1]
    return {
        "request_id": [rid] * (n - 1),
        "cycle": [trace.index] * (n - 1),
        "node": list(range(1, n)),
        "tnode": [tidx[p] for p in paths[1:]],
        "rank_path": [path_str(p) for p in paths[1:]],
        "depth": tree.depths[1:].tolist(),
        "parent": tree.parents[1:].tolist(),
        "token": tree.tokens[1:].tolist(),
        "logq": tree.logq[1:].tolist(),
        "cum_logq": tree.cum_logq[1:].tolist(),
        "entropy": tree.entropy[1:].tolist(),
        "target_logp": tlogp.tolist(),
        "match": verdict.matches[1:].tolist(),
    }


NODE_SCHEMA = {
    "request_id": pl.String, "cycle": pl.Int32, "node": pl.Int32, "tnode": pl.Int32, "rank_path": pl.String,
    "depth": pl.Int16, "parent": pl.Int32, "token": pl.Int64, "logq": pl.Float64, "cum_logq": pl.Float64,
    "entropy": pl.Float64, "target_logp": pl.Float64, "match": pl.Boolean,
}
CYCLE_SCHEMA = {
    "request_id": pl.String, "cycle": pl.Int32, "request_seed": pl.UInt64, "seed": pl.UInt64,
    "context_length": pl.Int32, "root_token": pl.Int64, "tree_size": pl.Int32,
    "draft_seconds": pl.List(pl.Float64), "verify_seconds": pl.Float64, "cycle_seconds": pl.Float64,
    "accepted_tnodes": pl.List(pl.Int32), "accepted_paths": pl.List(pl.String), "accepted_length": pl.Int32,
    "committed": pl.List(pl.Int64),
}


def _shard_paths(out_dir: Path, i: int) -> tuple[Path, Path]:
    return out_dir / f"shard-{i:04d}.nodes.parquet", out_dir / f"shard-{i:04d}.cycles.parquet"


def _read_meta(path: Path) -> dict:
    try:
        kv = pl.read_parquet_metadata(path)
    except Exception as exc:  # noqa: BLE001 - polars raises several error types for damaged files
        raise ValueError(f"records shard {path} is corrupt or truncated ({exc.__class__.__name__})") from None
    if META_KEY not in kv:
        raise ValueError(f"records shard {path} has no '{META_KEY}' metadata (not written by collect_records)")
    try:
        return json.loads(kv[META_KEY])
    except json.JSONDecodeError:
        raise ValueError(f"records shard {path} has unreadable '{META_KEY}' metadata") from None


def _check_meta(meta: dict, path: Path, *, expect_model, expect_drafter, expect_template, expect_temperature=None):
    if meta.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"records shard {path}: schema version {meta.get('schema_version')!r}, expected {SCHEMA_VERSION}")
    if expect_model is not None and meta.get("model_checksum") != expect_model:
        raise ValueError(
            f"records shard {path} is for model {str(meta.get('model_checksum'))[:16]}..., not {str(expect_model)[:16]}..."
        )
    if expect_drafter is not None and meta.get("drafter") != expect_drafter:
        raise ValueError(f"records shard {path} is for drafter '{meta.get('drafter')}', not '{expect_drafter}'")
    if expect_template is not None and meta.get("template") != expect_template.to_list():
        raise ValueError(f"records shard {path} was drafted with another template ({len(meta.get('template', []))} nodes)")
    if expect_temperature is not None and meta.get("temperature") != float(expect_temperature):
        raise ValueError(f"records shard {path} is at temperature {meta.get('temperature')}, not {expect_temperature}")


def _shard_complete(out_dir: Path, i: int, meta: dict) -> bool:
    """True when shard i exists, reads, and matches `meta` (other content -> False, recomputed)."""
    nodes_p, cycles_p = _shard_paths(out_dir, i)
    if not (nodes_p.is_file() and cycles_p.is_file()):
        return False
    try:
        mn, mc = _read_meta(nodes_p), _read_meta(cycles_p)
    except ValueError:
        return False
    want = {k: v for k, v in meta.items()}
    return mn == mc and {k: mc.get(k) for k in want} == want


def _write_parquet(df: pl.DataFrame, path: Path, meta: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    df.write_parquet(tmp, metadata={META_KEY: json.dumps(meta, sort_keys=True)})
    os.replace(tmp, path)


def collect_records(
    *,
    target: TreeLM,
    drafter: TreeDrafter,
    template: Structure,
    prompts: list[list[int]],
    request_ids: list[str] | None = None,
    temperature: float,
    seed: int,
    max_new_tokens: int,
    out_dir: Path,
    shard_size: int,
    model_checksum: str,
    drafter_id: str,
    eos_token_id: int | None = None,
    progress=None,
) -> RecordsResult:
    """Draft and verify all of `template` every cycle over `prompts`; write resumable shards to `out_dir`."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    if request_ids is None:
        request_ids = [f"p{i}" for i in range(len(prompts))]
    if len(request_ids) != len(prompts) or len(set(request_ids)) != len(request_ids):
        raise ValueError("request_ids must be unique, one per prompt")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    tidx = template_index(template)
    tlist = template.to_list()
    base_meta = {
        "schema_version": SCHEMA_VERSION,
        "model_checksum": model_checksum,
        "drafter": drafter_id,
        "template": tlist,
        "temperature": float(temperature),
        "seed": int(seed),
        "max_new_tokens": int(max_new_tokens),
        "shard_size": int(shard_size),
        "n_prompts": len(prompts),
    }
    nodes: dict[str, list] = {k: [] for k in NODE_SCHEMA}
    cycles: dict[str, list] = {k: [] for k in CYCLE_SCHEMA}
    current = {"rid": "", "rseed": 0}

    def observe(trace: CycleTrace) -> None:
        rid = current["rid"]
        for k, v in _node_rows(trace, rid, tidx, temperature).items():
            nodes[k].extend(v)
        paths = node_rank_paths(trace.drafted.parents, trace.drafted.ranks)
        acc = trace.verdict.path[1:]
        s = trace.stats
        row = {
            "request_id": rid, "cycle": trace.index, "request_seed": current["rseed"], "seed": s.seed,
            "context_length": trace.context_length, "root_token": trace.root, "tree_size": s.tree_size,
            "draft_seconds": list(s.draft_seconds), "verify_seconds": s.verify_seconds, "cycle_seconds": s.cycle_seconds,
            "accepted_tnodes": [tidx[paths[v]] for v in acc], "accepted_paths": [path_str(paths[v]) for v in acc],
            "accepted_length": s.accepted, "committed": list(trace.committed),
        }
        for k, v in row.items():
            cycles[k].append(v)

    engine = SpeculativeEngine(
        target=target, policy=StaticTree(template, name="records"), drafter=drafter, temperature=temperature,
        eos_token_id=eos_token_id, cycle_observer=observe,
    )
    n_shards = (len(prompts) + shard_size - 1) // shard_size
    shards, computed, n_cycles = [], [], 0
    for i in range(n_shards):
        meta = {**base_meta, "shard": i, "request_ids": request_ids[i * shard_size : (i + 1) * shard_size]}
        nodes_p, cycles_p = _shard_paths(out_dir, i)
        shards.append(cycles_p)
        if _shard_complete(out_dir, i, meta):
            continue
        for v in nodes.values():
            v.clear()
        for v in cycles.values():
            v.clear()
        for j in range(i * shard_size, min(len(prompts), (i + 1) * shard_size)):
            current["rid"] = request_ids[j]
            current["rseed"] = request_seed(seed, request_ids[j])
            engine.generate(prompts[j], max_new_tokens=max_new_tokens, seed=current["rseed"])
            if progress is not None:
                progress(j)
        ndf = pl.DataFrame(nodes, schema=NODE_SCHEMA)
        cdf = pl.DataFrame(cycles, schema=CYCLE_SCHEMA)
        full = {**meta, "n_node_rows": ndf.height, "n_cycle_rows": cdf.height}
        _write_parquet(ndf, nodes_p, full)
        _write_parquet(cdf, cycles_p, full)
        computed.append(i)
        n_cycles += cdf.height
    return RecordsResult(out_dir=out_dir, shards=shards, computed=computed, n_cycles=n_cycles, seconds=time.perf_counter() - t_start)


def load_records(
    path: Path,
    *,
    expect_model: str | None = None,
    expect_drafter: str | None = None,
    expect_template: Structure | None = None,
    expect_temperature: float | None = None,
) -> Records:
    """All shards of a records folder (or one `*.cycles.parquet` file), checked; one-line ValueError otherwise."""
    path = Path(path)
    if path.is_dir():
        cycle_files = sorted(path.glob("shard-*.cycles.parquet"))
        node_only = sorted(path.glob("shard-*.nodes.parquet"))
        if not cycle_files:
            raise ValueError(f"no records shards in {path}")
        if len(node_only) != len(cycle_files):
            raise ValueError(f"records folder {path} has an incomplete shard ({len(node_only)} node files, {len(cycle_files)} cycle files)")
    elif path.is_file():
        cycle_files = [path]
    else:
        raise FileNotFoundError(f"records {path} do not exist")
    common = None
    nframes, cframes = [], []
    for cp in cycle_files:
        np_ = cp.with_name(cp.name.replace(".cycles.parquet", ".nodes.parquet"))
        if not np_.is_file():
            raise ValueError(f"records shard {cp} has no node file {np_.name}")
        mc, mn = _read_meta(cp), _read_meta(np_)
        if mc != mn:
            raise ValueError(f"records shard {cp}: node and cycle files come from different runs")
        _check_meta(mc, cp, expect_model=expect_model, expect_drafter=expect_drafter, expect_template=expect_template,
                    expect_temperature=expect_temperature)
        base = {k: v for k, v in mc.items() if k not in ("shard", "request_ids", "n_node_rows", "n_cycle_rows")}
        if common is None:
            common = base
        elif base != common:
            raise ValueError(f"records shard {cp} was collected with other settings than {cycle_files[0].name}")
        try:
            c = pl.read_parquet(cp)
            n = pl.read_parquet(np_)
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"records shard {cp} is corrupt or truncated ({exc.__class__.__name__})") from None
        if c.height != mc["n_cycle_rows"] or n.height != mc["n_node_rows"]:
            raise ValueError(f"records shard {cp}: row counts differ from its metadata (truncated?)")
        if dict(c.schema) != CYCLE_SCHEMA or dict(n.schema) != NODE_SCHEMA:
            raise ValueError(f"records shard {cp}: columns differ from schema version {SCHEMA_VERSION}")
        cframes.append(c)
        nframes.append(n)
    return Records(
        nodes=pl.concat(nframes), cycles=pl.concat(cframes), meta=common, template=Structure(common["template"])
    )


# ---------------------------------------------------------------- summary


@dataclass
class RecordsSummary:
    n_requests: int
    n_cycles: int
    tau: float  # mean accepted length (bonus included) under the full template
    match_by_depth: list[float]  # P(match) of nodes at depth d (index d-1)
    accept_by_depth: list[float]  # P(accepted path reaches depth d)
    accept_by_rank: dict[str, float]  # share of accepted nodes with sibling rank r
    off_top1: float  # share of cycles whose accepted path leaves the top-1 chain
    mean_draft_seconds: float
    mean_verify_seconds: float
    meta: dict = field(default_factory=dict)

    def to_markdown(self, title: str) -> str:
        lines = [
            f"### {title}",
            "",
            f"{self.n_requests} requests, {self.n_cycles} cycles, tau {self.tau:.3f}, "
            f"accepted path off the top-1 chain in {100 * self.off_top1:.1f}% of cycles; "
            f"mean draft {1e3 * self.mean_draft_seconds:.1f} ms, verify {1e3 * self.mean_verify_seconds:.1f} ms per cycle.",
            "",
            "| depth | P(match) | P(reach) |",
            "|---|---|---|",
        ]
        for d, (m, a) in enumerate(zip(self.match_by_depth, self.accept_by_depth), 1):
            lines.append(f"| {d} | {m:.3f} | {a:.3f} |")
        lines += ["", "| rank | share of accepted nodes |", "|---|---|"]
        lines += [f"| {r} | {v:.3f} |" for r, v in self.accept_by_rank.items()]
        return "\n".join(lines) + "\n"


def summarize_records(records: Records) -> RecordsSummary:
    nodes, cycles = records.nodes, records.cycles
    depth = records.template.max_depth
    by_depth = nodes.group_by("depth").agg(pl.col("match").mean()).sort("depth")
    match = dict(zip(by_depth["depth"].to_list(), by_depth["match"].to_list()))
    acc_len = (cycles["accepted_length"] - 1).to_numpy()  # [C] accepted drafted nodes
    paths = cycles["accepted_paths"].to_list()
    ranks = [int(r) for p in paths for s in p for r in s.split(".")[-1:]]
    rank_counts = np.bincount(ranks, minlength=1) if ranks else np.zeros(1)
    off = [any(any(r != "0" for r in s.split(".")) for s in p) for p in paths]
    C = max(cycles.height, 1)
    return RecordsSummary(
        n_requests=cycles["request_id"].n_unique(),
        n_cycles=cycles.height,
        tau=float(cycles["accepted_length"].mean() or 0.0),
        match_by_depth=[float(match.get(d, 0.0)) for d in range(1, depth + 1)],
        accept_by_depth=[float((acc_len >= d).sum() / C) for d in range(1, depth + 1)],
        accept_by_rank={str(r): float(c / max(rank_counts.sum(), 1)) for r, c in enumerate(rank_counts)},
        off_top1=float(np.mean(off)) if off else 0.0,
        mean_draft_seconds=float(np.mean([sum(x) for x in cycles["draft_seconds"].to_list()])) if cycles.height else 0.0,
        mean_verify_seconds=float(cycles["verify_seconds"].mean() or 0.0),
        meta={k: records.meta[k] for k in ("model_checksum", "drafter", "temperature", "seed") if k in records.meta},
    )
