"""Stage `collect_records`: posterior verification records (docs/DESIGN.md §3).

Each cycle drafts the whole superset template T (`StaticTree(T)`), verifies it and commits the
accepted path as usual. Verification learns the same outcome two ways (`verify`): one target pass
over all of T (`tree`), or the accepted path one row at a time (`path`: the root, then each node its
parent accepted; `engine.verify.verify_path`), which costs one one-row step per committed token. On
a CPU past its roofline a forward over T's 82 rows costs several steps while a cycle commits about
two tokens, so `path` takes several times the requests in the same minutes (docs/BENCHMARKS.md,
`bench_record_verify.py`); on a GPU the tree pass costs about one step and wins. `auto` times both
forwards on this device at the start and takes, before each shard, the cheaper at the accepted length
the records have shown so far (2 before any). Nothing the learning reads differs but in rounding: the
accepted path and the match of every child of a path node are decided either way, the same (the
head's log-probs differ in the last digits: it reads the target's features from forwards of another
row count; at T>0 that rounding can, rarely, tip a draw at a boundary, and the request goes on as
another exact sample); `path` leaves the target's values of the other nodes undecided (null).

A *shard* covers `shard_size` consecutive prompts and is two parquet files, each carrying the same
key-value metadata ``ogspo_records`` (JSON: schema version, model checksum, drafter id, template rank
paths, temperature, seed, shard index, row counts, its seconds and `verify`, how it was verified).
``shard-XXXX.nodes.parquet`` is written first, ``shard-XXXX.cycles.parquet`` last (each via
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
| target_logp | f64 | target log-prob of the token at its parent's row: log_softmax(logits / T) (T=1 when T=0); null (1) |
| match | bool | T=0: token == target argmax at the parent, null (1); T>0: accepted by rejection sampling (False: never tried) |

(1) where the parent's row was not computed (`path`: a parent off the accepted path).

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
| verify_seconds | f64 | measured target forwards of the verification (`tree`: one; `path`: one per path node) |
| cycle_seconds | f64 | whole cycle |
| accepted_tnodes | list[i32] | accepted path as template node ids (root excluded) |
| accepted_paths | list[str] | the same as rank paths |
| accepted_length | i32 | tokens committed (accepted path + bonus) |
| committed | list[i64] | the committed tokens (accepted drafted tokens then the bonus) |
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
import torch

from ogspo.artifacts.records import (
    CYCLE_SCHEMA,
    NODE_SCHEMA,
    SCHEMA_VERSION,
    path_str,
    read_shard_meta,
    request_seed,
    shard_complete,
    shard_paths,
    template_index,
    write_shard_table,
)
from ogspo.drafter.budget import WRITE, DataBudget
from ogspo.engine.decode import VERIFY_MODES, CycleTrace, SpeculativeEngine
from ogspo.engine.drafters import TreeDrafter
from ogspo.engine.policies import StaticTree
from ogspo.engine.target import TreeLM, synchronize
from ogspo.engine.tree import Structure, node_rank_paths


@dataclass
class RecordsResult:
    out_dir: Path
    shards: list[Path]  # cycles files of every shard
    computed: list[int]  # shard indices computed by this call (the others were complete already)
    n_cycles: int  # cycles computed by this call
    seconds: float
    budget: dict = field(default_factory=dict)  # DataBudget.describe() of the shards taken
    verify: dict = field(default_factory=dict)  # how each computed shard was verified, and the timings `auto` chose by


def _node_rows(trace: CycleTrace, rid: str, tidx: dict, temperature: float) -> dict[str, list]:
    tree, verdict = trace.drafted, trace.verdict
    if len(trace.verified) != len(tree):
        raise ValueError("records need every drafted node verified (a static template policy)")
    n = len(tree)
    paths = node_rank_paths(tree.parents, tree.ranks)
    logp = torch.log_softmax(trace.logits.double() / (temperature if temperature > 0 else 1.0), dim=-1)  # [r, V]
    row_of = np.full(n, -1, dtype=np.int64)
    row_of[trace.rows] = np.arange(len(trace.rows))
    prow = row_of[tree.parents[1:]]  # [n-1] the parent's row; -1 where it was not computed (path verification)
    known = prow >= 0  # [n-1]
    tlogp = np.full(n - 1, np.nan)
    rows = torch.as_tensor(prow[known], device=logp.device)  # [k]
    tlogp[known] = logp[rows, torch.as_tensor(tree.tokens[1:][known], device=logp.device)].cpu().numpy()  # [k]
    matches = verdict.matches[1:].tolist()
    if temperature == 0:  # the argmax of an uncomputed row is unknown
        matches = [m if k else None for m, k in zip(matches, known.tolist())]
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
        "target_logp": [float(v) if k else None for v, k in zip(tlogp.tolist(), known.tolist())],
        "match": matches,
    }


def time_verification(target: TreeLM, template: Structure, context: list[int], *, reps: int = 3) -> dict[str, float]:
    """Median seconds of a target forward over the template's |T| + 1 rows and over one row, after
    `context` (interleaved, `reps` each after a warm-up of both): what `auto` weighs. Leaves the cache empty."""
    dev = target.device
    n = len(template) + 1
    times: dict[int, list[float]] = {n: [], 1: []}
    target.prefill(context)
    L = target.cache.length
    for rep in range(reps + 1):
        for m in (n, 1):
            tokens = torch.as_tensor(context[-1:] * m, device=dev)  # [m]
            positions = torch.arange(L, L + m, device=dev)  # [m]
            synchronize(dev)
            t0 = time.perf_counter()
            target.forward(tokens, positions, None)
            synchronize(dev)
            if rep:
                times[m].append(time.perf_counter() - t0)
            target.cache.commit(None)
    target.cache.reset()
    return {"tree_seconds": float(np.median(times[n])), "row_seconds": float(np.median(times[1])), "tree_rows": n}


def choose_verify(timing: dict[str, float], mean_accepted: float | None) -> str:
    """`path` when its one-row forwards (one per committed token) cost less than one forward over the
    template at the accepted length seen so far (2 before any record)."""
    a = 2.0 if mean_accepted is None else mean_accepted
    return "path" if a * timing["row_seconds"] < timing["tree_seconds"] else "tree"


def _cycle_row(trace: CycleTrace, rid: str, rseed: int, tidx: dict) -> dict:
    paths = node_rank_paths(trace.drafted.parents, trace.drafted.ranks)
    acc = trace.verdict.path[1:]
    s = trace.stats
    return {
        "request_id": rid, "cycle": trace.index, "request_seed": rseed, "seed": s.seed,
        "context_length": trace.context_length, "root_token": trace.root, "tree_size": s.tree_size,
        "draft_seconds": list(s.draft_seconds), "verify_seconds": s.verify_seconds, "cycle_seconds": s.cycle_seconds,
        "accepted_tnodes": [tidx[paths[v]] for v in acc], "accepted_paths": [path_str(paths[v]) for v in acc],
        "accepted_length": s.accepted, "committed": list(trace.committed),
    }


def read_calib_table(path: Path, n: int) -> pl.DataFrame:
    """The first `n` calib prompts of one workload table (by prompt id): the prompts records are collected on."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"workload file {path} does not exist")
    table = pl.read_parquet(path).filter(pl.col("split") == "calib").sort("prompt_id").head(n)
    if table.height == 0:
        raise ValueError(f"{path} has no calib prompts (workloads.<name>.calib_prompts)")
    return table


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
    minutes: float | None = None,
    verify: str = "tree",
) -> RecordsResult:
    """Draft and verify all of `template` every cycle over `prompts`; write resumable shards to `out_dir`.
    `verify`: `tree`, `path` or `auto` (see the module docstring); the records are the same either way
    but for the nodes `path` leaves undecided, and a shard's own mode is in its metadata (`verify`).

    Within `minutes` (None: every prompt): shards are taken in order while the seconds spent plus the
    next one's predicted seconds (at the rate of the shards measured so far, `DataBudget`) fit; the first
    is always taken. A complete shard from an earlier run counts the seconds it took then (its
    metadata), so a rerun takes the same shards; shards past the cut are removed, so the folder holds
    exactly the requests taken."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    if verify not in (*VERIFY_MODES, "auto"):
        raise ValueError(f"records verify must be one of {', '.join(VERIFY_MODES)}, auto; got {verify!r}")
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
        for k, v in _node_rows(trace, current["rid"], tidx, temperature).items():
            nodes[k].extend(v)
        for k, v in _cycle_row(trace, current["rid"], current["rseed"], tidx).items():
            cycles[k].append(v)

    engines = {mode: SpeculativeEngine(
        target=target, policy=StaticTree(template, name="records"), drafter=drafter, temperature=temperature,
        eos_token_id=eos_token_id, cycle_observer=observe, verify=mode,
    ) for mode in VERIFY_MODES}
    timing = time_verification(target, template, prompts[0]) if verify == "auto" and prompts else None
    accepted = {"tokens": 0, "cycles": 0}  # over the shards computed so far, for `auto`
    modes: dict[int, str] = {}
    n_shards = (len(prompts) + shard_size - 1) // shard_size
    shards, computed, n_cycles = [], [], 0
    budget = DataBudget(seconds=None if minutes is None else minutes * 60)
    for i in range(n_shards):
        meta = {**base_meta, "shard": i, "request_ids": request_ids[i * shard_size : (i + 1) * shard_size]}
        nodes_p, cycles_p = shard_paths(out_dir, i)
        n_req = len(meta["request_ids"])
        if not budget.admit("prompts", WRITE, n_req):
            for f in (nodes_p, cycles_p):  # a longer earlier run's shard past the cut
                f.unlink(missing_ok=True)
            continue
        shards.append(cycles_p)
        if shard_complete(out_dir, i, meta):
            budget.spend(WRITE, n_req, float(read_shard_meta(cycles_p).get("seconds", 0.0)))
            continue
        mode = verify
        if timing is not None:
            mode = choose_verify(timing, accepted["tokens"] / accepted["cycles"] if accepted["cycles"] else None)
        modes[i] = mode
        t_shard = time.perf_counter()
        for v in nodes.values():
            v.clear()
        for v in cycles.values():
            v.clear()
        for j in range(i * shard_size, min(len(prompts), (i + 1) * shard_size)):
            current["rid"] = request_ids[j]
            current["rseed"] = request_seed(seed, request_ids[j])
            engines[mode].generate(prompts[j], max_new_tokens=max_new_tokens, seed=current["rseed"])
            if progress is not None:
                progress(j)
        ndf = pl.DataFrame(nodes, schema=NODE_SCHEMA)
        cdf = pl.DataFrame(cycles, schema=CYCLE_SCHEMA)
        seconds = time.perf_counter() - t_shard
        budget.spend(WRITE, n_req, seconds)
        accepted["tokens"] += int(cdf["accepted_length"].sum())
        accepted["cycles"] += cdf.height
        full = {**meta, "n_node_rows": ndf.height, "n_cycle_rows": cdf.height, "seconds": round(seconds, 3), "verify": mode}
        write_shard_table(ndf, nodes_p, full)
        write_shard_table(cdf, cycles_p, full)
        computed.append(i)
        n_cycles += cdf.height
    return RecordsResult(out_dir=out_dir, shards=shards, computed=computed, n_cycles=n_cycles,
                         seconds=time.perf_counter() - t_start, budget=budget.describe(),
                         verify={"asked": verify, "shards": modes, **(timing or {})})


# ---------------------------------------------------------------- summary
