"""Benchmark: records verified by one forward over the template or along the accepted path.

    PATH=.venv/bin:$PATH python benchmarks/bench_record_verify.py [--prompts 2] [--write]

Needs a finished default run (results/cpu: its model, kernel table, head and workloads). On the first
`--prompts` calib prompts of every workload, at T=0 and T=1, `stages.collect_records.collect_records`
records each request twice with the run's template, once per `records.verify` mode ("tree": one
target forward over all of T a cycle; "path": the accepted path one row at a time), the two modes in
alternating order from request to request, same seeds. Per request: the seconds of its shard in each
mode and whether the two records agree (cycles identical but for the timings; every node's identity and
token identical; every match the path verification decides identical; and the largest difference of the
continuous values, which forwards of other row counts round differently). Per
temperature: the median seconds, the paired ratio tree / path (geometric mean, 95% bootstrap
interval over requests), and what `auto` measured and chose on this machine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchdoc import REPO, git_commit, load_run, machine, require_run, write_section  # noqa: E402

from ogspo.analysis.compare import bootstrap_interval  # noqa: E402
from ogspo.artifacts.records import load_records, read_shard_meta  # noqa: E402
from ogspo.engine.tree import Structure  # noqa: E402
from ogspo.stages.collect_records import choose_verify, collect_records, read_calib_table, time_verification  # noqa: E402
from ogspo.stages.config import load_config  # noqa: E402

TIMING = ["draft_seconds", "verify_seconds", "cycle_seconds"]
IDS = ["request_id", "cycle", "node", "tnode", "rank_path", "depth", "parent", "token"]
VALUES = ["logq", "cum_logq", "entropy", "target_logp"]


def compare(tree_dir: Path, path_dir: Path) -> dict:
    """What the two records of one request share. `same` when every cycle (but its timings), every
    node's identity and token and every match the path verification decides are identical. At T>0 the
    two can part where a uniform falls within rounding of an acceptance or inverse-CDF boundary (each
    is an exact sample): `parted` names the first cycle and field that differ. `max_diff`: the largest
    difference of a node's values (head log-probs and entropy, and the target's log-prob where both
    have it) over the cycles before any parting: the head reads the target's features, and the
    log-probs come, from forwards of another row count, which round differently."""
    rt, rp = load_records(tree_dir), load_records(path_dir)
    parted, first = None, None
    for a, b in zip(rp.cycles.drop(TIMING).iter_rows(named=True), rt.cycles.drop(TIMING).iter_rows(named=True)):
        field = next((k for k in a if a[k] != b[k]), None)
        if field is not None:
            parted, first = f"cycle {a['cycle']} ({field}: {a[field]} / {b[field]})", a["cycle"]
            break
    shorter = min(rp.cycles.height, rt.cycles.height)
    if parted is None and rp.cycles.height != rt.cycles.height:
        parted, first = f"after cycle {shorter} (one ended)", shorter + 1
    keep = (lambda df: df) if first is None else (lambda df: df.filter(pl.col("cycle") < first))
    np_, nt = keep(rp.nodes), keep(rt.nodes)
    decided = np_["match"].is_not_null()
    differs = None  # the first node whose identity, token or decided match differs (a near-tie of the head's top-k)
    if np_.height == nt.height:
        for a, b, d in zip(np_.select(*IDS, "match").iter_rows(named=True), nt.select(*IDS, "match").iter_rows(named=True),
                           decided.to_list()):
            field = next((k for k in (*IDS, "match") if a[k] != b[k] and (k != "match" or d)), None)
            if field is not None:
                differs = f"cycle {a['cycle']} node {a['rank_path']} ({field}: {a[field]} / {b[field]})"
                break
    same = parted is None and differs is None and np_.height == nt.height
    diff = 0.0
    for col in VALUES:
        a, b = np_[col].to_numpy(), nt[col].to_numpy()
        ok = ~np.isnan(a)
        diff = max(diff, float(np.abs(a[ok] - b[ok]).max()) if ok.any() else 0.0)
    return {"same": bool(same), "max_diff": diff, "parted": parted, "differs": differs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=REPO / "results" / "cpu")
    ap.add_argument("--config", type=Path, nargs="+", default=[REPO / "config" / "default.yaml"])
    ap.add_argument("--prompts", type=int, default=2, help="calib prompts per workload")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--write", action="store_true", help="rewrite this section of docs/BENCHMARKS.md")
    args = ap.parse_args()
    res = args.results
    require_run(res, ap.error)
    cfg = load_config(args.config, check_paths=False)
    rc = cfg["records"]
    template = Structure.full(rc["template"]["widths"])
    checksum, tok, target, drafter = load_run(res)
    requests = []
    for w in cfg["workloads"]:
        table = read_calib_table(res / "workloads" / f"{w}.parquet", args.prompts)
        requests += [(f"{w}/{i}", tok(t, add_special_tokens=False).input_ids)
                     for i, t in zip(table["prompt_id"].to_list(), table["prompt"].to_list())]
    timing = time_verification(target, template, requests[0][1], reps=5)
    t_all = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for temperature in args.temperatures:
            for k, (rid, prompt) in enumerate(requests):
                order = ("tree", "path") if k % 2 == 0 else ("path", "tree")
                seconds, dirs, cycles = {}, {}, 0
                for mode in order:
                    d = Path(tmp) / f"{temperature:g}-{k}-{mode}"
                    r = collect_records(target=target, drafter=drafter, template=template, prompts=[prompt], request_ids=[rid],
                                        temperature=temperature, seed=cfg["seed"], max_new_tokens=rc["max_new_tokens"],
                                        out_dir=d, shard_size=1, model_checksum=checksum, drafter_id=drafter.drafter_id,
                                        eos_token_id=tok.eos_token_id, verify=mode)
                    seconds[mode] = float(read_shard_meta(r.shards[0])["seconds"])
                    dirs[mode] = d
                    cycles = r.n_cycles
                accepted = int(load_records(dirs["path"]).cycles["accepted_length"].sum())
                rows.append({"T": temperature, "request": rid, "tree": seconds["tree"], "path": seconds["path"],
                             "cycles": cycles, "tokens": accepted, **compare(dirs["tree"], dirs["path"])})
                print(rows[-1], flush=True)
    df = pl.DataFrame(rows)
    lines = ["| T | requests | cycles | tokens / cycle | tree s / request | path s / request | tree / path [95%] | "
             "records the same | largest value difference |", "|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for temperature in args.temperatures:
        s = df.filter(pl.col("T") == temperature)
        r = bootstrap_interval(np.log((s["tree"] / s["path"]).to_numpy()), n_boot=4000)
        lines.append(f"| {temperature:g} | {s.height} | {s['cycles'].sum()} | {s['tokens'].sum() / s['cycles'].sum():.2f} | "
                     f"{s['tree'].median():.1f} | {s['path'].median():.1f} | {r.ratio:.2f} [{r.low:.2f}, {r.high:.2f}] | "
                     f"{int(s['same'].sum())}/{s.height} | {s['max_diff'].max():.1e} |")
    parted = [f"{r['request']} at T={r['T']:g}, {r['parted']}" for r in rows if r["parted"]]
    said = ": " + "; ".join(parted) if parted else ""
    drafts = [f"{r['request']} at T={r['T']:g}, {r['differs']}" for r in rows if r["differs"] and not r["parted"]]
    said_drafts = ("; the drafts differ without parting (a near-tie of the head's top-k tipped by the features' rounding) in "
                   + "; ".join(drafts) if drafts else "")
    ms = {k: 1e3 * timing[k] for k in ("tree_seconds", "row_seconds")}
    a_all = df["tokens"].sum() / df["cycles"].sum()
    text = f"""## Records: the template verified by one forward or along the accepted path (`benchmarks/bench_record_verify.py`)

{dt.date.today()}, commit {git_commit()}, {machine()}; the default run's target (`dtype: {cfg['dtype']}`, prepared as
{target.dtype}), head and template ({len(template)} nodes, widths {rc['template']['widths']}); the first {args.prompts} calib
prompts of each workload x {rc['max_new_tokens']} new tokens, each request recorded once per mode, the modes in alternating
order, same seeds; seconds of the request's shard (drafting, verification, bookkeeping). "Records the same": every
cycle identical but for its timings (accepted paths, committed tokens), every drafted node's identity and token
identical, and every match the path verification decides identical (the path's children; it leaves the rest null).
"Largest value difference": of the head's log-probs and entropies and the target's log-probs, where both records have
them (the forwards differ in row count, so their kernels and roundings do; the head reads the target's features
from them), over the cycles before any parting. At T>0 two exact samplers part where a uniform falls within rounding
of an acceptance or inverse-CDF boundary; here {len(parted)} of {len(rows)} requests did{said}{said_drafts}
(path / tree). Total {time.perf_counter() - t_all:.0f} s.

{chr(10).join(lines)}

What `records.verify: auto` measured at the start (5 interleaved repetitions after one untimed): a forward over the
template's {timing['tree_rows']} rows {ms['tree_seconds']:.1f} ms, a one-row forward {ms['row_seconds']:.1f} ms
({timing['tree_seconds'] / timing['row_seconds']:.1f} rows' worth of steps); before any record it assumes 2 tokens a cycle and
picks `{choose_verify(timing, None)}`; at the {a_all:.2f} tokens a cycle measured here it picks `{choose_verify(timing, a_all)}`.
"""
    print(text)
    if args.write:
        write_section("bench_record_verify", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
