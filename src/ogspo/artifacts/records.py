"""Posterior verification records (docs/DESIGN.md §3): the shard format, its reader and writer.

Written by the stage `collect_records` (`ogspo.stages.collect_records`); see there for the node and cycle tables.
A *shard* covers consecutive prompts and is two parquet files carrying the same key-value metadata
``ogspo_records`` (JSON: schema version, model checksum, drafter id, template rank paths,
temperature, seed, shard index, row counts); ``shard-XXXX.nodes.parquet`` is written first,
``shard-XXXX.cycles.parquet`` last (each via temp file + rename), so a shard is complete exactly
when its cycles file exists and both files agree.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from ogspo.artifacts.io import atomic_write
from ogspo.engine.tree import Structure

SCHEMA_VERSION = 1


META_KEY = "ogspo_records"


def path_str(path) -> str:
    return ".".join(str(int(r)) for r in path)


def template_index(template: Structure) -> dict[tuple[int, ...], int]:
    """Rank path -> template node id (root () = 0, then `to_list()` order)."""
    return {(): 0, **{tuple(p): i + 1 for i, p in enumerate(template.to_list())}}


def temperature_tag(temperature: float) -> str:
    """0 -> T0, 1.0 -> T1, 0.7 -> T0.7 (as the records, solve and policy folders are named)."""
    return f"T{float(temperature):g}"


def request_seed(seed: int, request_id: str) -> int:
    """Per-request seed derived from the global seed and the request id."""
    crc = zlib.crc32(request_id.encode())
    return int(np.random.SeedSequence([int(seed) & (2**32 - 1), crc]).generate_state(2, np.uint32).view(np.uint64)[0] >> 1)


@dataclass
class Records:
    nodes: pl.DataFrame
    cycles: pl.DataFrame
    meta: dict  # common metadata (shard-specific keys removed)
    template: Structure


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


def shard_paths(out_dir: Path, i: int) -> tuple[Path, Path]:
    return out_dir / f"shard-{i:04d}.nodes.parquet", out_dir / f"shard-{i:04d}.cycles.parquet"


def read_shard_meta(path: Path) -> dict:
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


def check_shard_meta(meta: dict, path: Path, *, expect_model, expect_drafter, expect_template, expect_temperature=None):
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


def shard_complete(out_dir: Path, i: int, meta: dict) -> bool:
    """True when shard i exists, reads, and matches `meta` (other content -> False, recomputed)."""
    nodes_p, cycles_p = shard_paths(out_dir, i)
    if not (nodes_p.is_file() and cycles_p.is_file()):
        return False
    try:
        mn, mc = read_shard_meta(nodes_p), read_shard_meta(cycles_p)
    except ValueError:
        return False
    want = {k: v for k, v in meta.items()}
    return mn == mc and {k: mc.get(k) for k in want} == want


def write_shard_table(df: pl.DataFrame, path: Path, meta: dict) -> None:
    atomic_write(path, lambda tmp: df.write_parquet(tmp, metadata={META_KEY: json.dumps(meta, sort_keys=True)}))


# metadata of one shard alone (a folder's shards agree on the rest): its position, requests, sizes, seconds and
# how it was verified (records.verify `auto` may verify shards differently; the records agree either way)
SHARD_OWN = ("shard", "request_ids", "n_node_rows", "n_cycle_rows", "seconds", "verify")


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
            raise ValueError(f"records folder {path} has an incomplete shard ({len(node_only)} node files, {len(cycle_files)} "
                             "cycle files)")
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
        mc, mn = read_shard_meta(cp), read_shard_meta(np_)
        if mc != mn:
            raise ValueError(f"records shard {cp}: node and cycle files come from different runs")
        check_shard_meta(mc, cp, expect_model=expect_model, expect_drafter=expect_drafter, expect_template=expect_template,
                    expect_temperature=expect_temperature)
        base = {k: v for k, v in mc.items() if k not in SHARD_OWN}
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


@dataclass
class RecordsSummary:
    n_requests: int
    n_cycles: int
    tau: float  # mean accepted length (bonus included) under the full template
    match_by_depth: list[float]  # P(match) of nodes at depth d (index d-1) whose parent the accepted path reached
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
            "| depth | P(match), parent reached | P(reach) |",
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
    # a node's match counts where its parent is the root or on the accepted path: the nodes either verification
    # decides (a tree pass also decides the rest; records verified by path leave them null)
    reached = (cycles.select("request_id", "cycle", pl.col("accepted_paths").alias("parent_path")).explode("parent_path")
               .drop_nulls("parent_path").with_columns(reached=pl.lit(True)))
    nodes = (nodes.with_columns(parent_path=pl.col("rank_path").str.replace(r"\.?[0-9]+$", ""))
             .join(reached, on=["request_id", "cycle", "parent_path"], how="left")
             .filter((pl.col("depth") == 1) | pl.col("reached").fill_null(False)))
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
