"""`ogspo` command line: one subcommand per workflow stage, each a thin call into the library.

A stage's command is its name with dashes (`ogspo.stages.registry.STAGES` declares it once: help,
config sections, aliases). To add one, declare the stage there, write ``_add_<name>(parser)`` and
``_run_<name>(args) -> int`` and list them in ``STAGE_COMMANDS``. Commands read config via
``--config FILE...`` (people) or ``--config-json`` (Snakemake rules pass exactly the stage's sections)
and ``_load_config(args)``. Errors (ConfigError / ValueError / FileNotFoundError) print one line
``ogspo: error: ...`` on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ogspo.analysis.summary import render_summary
from ogspo.api import load
from ogspo.artifacts.latency import LatencyModel
from ogspo.artifacts.records import temperature_tag
from ogspo.engine.kernels import describe, read_kernel_table, write_kernel_table
from ogspo.engine.model import load_target, load_tokenizer
from ogspo.engine.tree import Structure
from ogspo.methods.registry import (
    DRAFTERS,
    LoadedEngine,
    artifact_kinds,
    load_engine,
    method_names,
    method_specs,
    structure_policy,
)
from ogspo.stages.build_sequoia import build_sequoia
from ogspo.stages.calibrate_kernels import calibrate_device_kernels
from ogspo.stages.calibrate_latency import CALIBRATION_TEXT, calibrate_latency, write_calibration
from ogspo.stages.choose_on_device import run_choose_on_device
from ogspo.stages.collect_records import collect_records, read_calib_table
from ogspo.stages.config import ConfigError, check_temperature, load_config, run_elapsed_minutes
from ogspo.stages.evaluate import evaluate_methods, evaluate_minutes, load_prompts, oracle_throughputs, write_evaluation
from ogspo.stages.export_policy import run_export_policy
from ogspo.stages.export_tree import export_trees, write_export
from ogspo.stages.measure_drafter import measure_drafter, render_markdown, write_measure
from ogspo.stages.ogspo_rounds import run_rounds_stage
from ogspo.stages.prepare_model import prepare_model
from ogspo.stages.prepare_workloads import prepare_workloads
from ogspo.stages.registry import STAGES
from ogspo.stages.report import write_report
from ogspo.stages.resolve_device import resolve_device
from ogspo.stages.solve_oracle import run_solve_oracle
from ogspo.stages.summarize_records import summarize_records_dirs
from ogspo.stages.train_drafter import run_train_drafter
from ogspo.stages.train_gto import run_train_gto
from ogspo.stages.train_policy_only import run_train_policy
from ogspo.stages.train_routing import run_train_routing
from ogspo.stages.tune_eagle import tune_eagle, write_tuning


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    stage: str | None = None  # the workflow stage it runs (`ogspo.stages.registry.STAGES`)


def _add_config(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument(
        "--config", nargs="+", type=Path, metavar="YAML",
        help="config file(s), deep-merged in order (e.g. config/default.yaml config/quick.yaml)",
    )
    group.add_argument(
        "--config-json", metavar="JSON",
        help="the config sections this command reads, as one JSON object (what Snakemake rules pass)",
    )


def _load_config(args: argparse.Namespace) -> dict:
    """The config sections the command's stage reads (`ogspo.stages.registry.STAGES`), validated."""
    if args.config_json is not None:
        try:
            source = json.loads(args.config_json)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config error at '<json>': not valid JSON: {exc}") from None
        if not isinstance(source, dict):
            raise ConfigError("config error at '<json>': must be a JSON object")
    else:
        source = args.config
    return load_config(source, sections=STAGES[args.stage].sections)


# ---------------------------------------------------------------- prepare-model
def _add_prepare_model(p: argparse.ArgumentParser) -> None:
    _add_config(p)
    p.add_argument("--out", required=True, type=Path, help="folder to write the prepared model to")


def _run_prepare_model(args: argparse.Namespace) -> int:
    cfg = _load_config(args)
    prepared = prepare_model(source=cfg["model"], out_dir=args.out, dtype=cfg["dtype"], device=cfg["torch_device"])
    print(f"prepared {prepared.source} -> {prepared.path} (sha256 {prepared.checksum[:16]}..., "
          f"source load {prepared.load_seconds:.1f} s)")
    return 0


# ---------------------------------------------------------------- prepare-workloads
def _add_prepare_workloads(p: argparse.ArgumentParser) -> None:
    _add_config(p)
    p.add_argument("--model", required=True, type=Path, help="prepared model folder (for its tokenizer)")
    p.add_argument("--out", required=True, type=Path, help="folder to write {workload}.parquet to")


def _run_prepare_workloads(args: argparse.Namespace) -> int:
    cfg = _load_config(args)
    result = prepare_workloads(config=cfg, tokenizer=load_tokenizer(args.model), out_dir=args.out)
    for t in result.tables:
        print(f"{t.name}: {t.n_train} train + {t.n_calib} calib + {t.n_eval} eval prompts -> {t.path} "
              f"(max {t.max_tokens} tokens, {t.n_dropped} dropped as too long)")
    return 0


# ---------------------------------------------------------------- generate
def _add_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="prompt text")
    p.add_argument("--model", required=True, type=Path, help="prepared model folder")
    p.add_argument("--method", default="eagle", help=f"one of {', '.join(method_names())} (default eagle)")
    p.add_argument("--drafter", default="lookup", help=f"one of {', '.join(DRAFTERS)} (default lookup)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--k", type=int, default=4, help="chain length (method chain)")
    p.add_argument("--structure", help="rank paths as JSON, or a JSON file (method static)")
    p.add_argument("--policy", type=Path, help="policy folder with policy.onnx + structure.json (method ogspo)")
    p.add_argument("--router", type=Path, help="router.json or its folder, from train-routing (method routing)")
    p.add_argument("--total-tokens", type=int, default=60, help="EAGLE-3 dynamic tree size (method eagle)")
    p.add_argument("--depth", type=int, default=5, help="EAGLE-3 dynamic tree depth (method eagle)")
    p.add_argument("--top-k", type=int, default=10, help="EAGLE-3 dynamic tree top_k (method eagle)")
    p.add_argument("--early-exit-layers", type=int, default=6, help="layers of the early-exit drafter")
    p.add_argument("--drafter-path", type=Path, help="trained head folder (drafter eagle)")
    p.add_argument("--max-len", type=int, default=4096, help="KV cache rows")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="model dtype (default: the dtype it was prepared in)")
    _add_kernels(p)


def _run_generate(args: argparse.Namespace) -> int:
    if args.drafter == "eagle" and args.drafter_path is None and args.method != "ar":
        raise ValueError("drafter 'eagle' needs the trained head's folder (--drafter-path)")
    drafter = None if args.method == "ar" else args.drafter_path if args.drafter == "eagle" else args.drafter
    decoder = load(args.model, drafter=drafter, policy=args.method, device=args.device, dtype=args.dtype, max_len=args.max_len,
                   kernels=_read_kernels(args), early_exit_layers=args.early_exit_layers, k=args.k, structure=args.structure,
                   total_tokens=args.total_tokens, depth=args.depth, top_k=args.top_k, policy_path=args.policy,
                   router_path=args.router)
    result = decoder.generate(args.prompt, args.max_new_tokens, args.temperature, top_p=args.top_p, seed=args.seed,
                              chat=args.chat, on_text=lambda text: print(text, end="", flush=True))
    r, split = result.generation, result.generation.time_split()
    print(f"\n--- {result.method}: {len(r.tokens)} tokens in {r.wall_seconds:.2f} s = {r.throughput:.1f} tok/s, "
          f"tau {r.tau:.2f}, {len(r.cycles)} cycles; prefill {split['prefill']:.2f} s, draft {split['draft']:.2f} s, "
          f"verify {split['verify']:.2f} s, other {split['other']:.2f} s", file=sys.stderr)
    return 0


# ---------------------------------------------------------------- latency, records
def _add_records(p: argparse.ArgumentParser) -> None:
    p.add_argument("--records", nargs="+", required=True, type=Path, metavar="DIR", help="records folders (one template)")
    p.add_argument("--latency", required=True, type=Path, help="latency.json of the device")


def _add_model_drafter(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, type=Path, help="prepared model folder")
    p.add_argument("--drafter", required=True, help=f"drafter: {', '.join(DRAFTERS)} (ogspo.methods.registry.make_drafter)")
    p.add_argument("--drafter-path", type=Path, help="drafter folder (trained drafters), passed to make_drafter as path=")
    p.add_argument("--max-len", type=int, default=2048, help="KV cache rows")
    _add_kernels(p)


def _add_kernels(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kernels", type=Path, help="kernel table from calibrate-kernels (default: torch's F.linear everywhere)")


def _read_kernels(args: argparse.Namespace):
    return None if args.kernels is None else read_kernel_table(args.kernels)


def _load_engine(args: argparse.Namespace, cfg: dict) -> LoadedEngine:
    return load_engine(args.model, drafter=args.drafter, drafter_path=args.drafter_path, max_len=args.max_len,
                       kernels=_read_kernels(args), device=cfg["torch_device"])


def _add_calibrate_kernels(p: argparse.ArgumentParser) -> None:
    _add_config(p)
    p.add_argument("--model", required=True, type=Path, help="prepared model folder")
    p.add_argument("--out", required=True, type=Path, help="kernels.json to write")
    p.add_argument("--cache-dir", type=Path, help="where measured tables are kept for reuse (default ~/.cache/ogspo/kernels)")


def _run_calibrate_kernels(args: argparse.Namespace) -> int:
    cfg = _load_config(args)
    model, _ = load_target(args.model, device=cfg["torch_device"])
    table, cached = calibrate_device_kernels(model, cfg["kernels"], device=cfg["torch_device"], cache=args.cache_dir,
                                             log=lambda m: print(m, flush=True))
    write_kernel_table(table, args.out)
    how = "reused from the cache" if cached else f"measured in {table.meta['seconds']:.0f} s"
    print(f"kernel table for {table.key['model']} ({table.key['threads']} threads), {how} -> {args.out}\n{describe(table)}")
    return 0


def _add_calibrate_latency(p: argparse.ArgumentParser) -> None:
    _add_config(p)
    _add_model_drafter(p)
    p.add_argument("--out-json", required=True, type=Path, help="latency.json to write")
    p.add_argument("--out-png", type=Path, help="latency.png to write")


def _run_calibrate_latency(args: argparse.Namespace) -> int:
    cfg = _load_config(args)
    lat = cfg["latency"]
    e = _load_engine(args, cfg)
    target, drafter, checksum, drafter_id, tok = e.target, e.drafter, e.model_checksum, e.drafter_id, e.tokenizer
    cal = calibrate_latency(target=target, drafter=drafter, tree_sizes=lat["tree_sizes"], context_lengths=lat["context_lengths"],
                            draft_widths=lat["draft_widths"], reps=lat["reps"], warmup=lat["warmup"], seed=cfg["seed"],
                            fixed_tokens=lat["fixed_tokens"], meta={"model_checksum": checksum, "drafter": drafter_id},
                            text_prompt=tok(CALIBRATION_TEXT, add_special_tokens=False).input_ids)
    write_calibration(cal, json_path=args.out_json, png_path=args.out_png)
    m, (n, L) = cal.model, (cal.model.sizes[-1], cal.model.contexts[-1])
    print(f"latency model ({m.slope_mode} slope in L): t_verify(1, {m.contexts[0]}) "
          f"{1e3 * float(m.t_verify(1, m.contexts[0])):.1f} ms, t_verify({n}, {L}) {1e3 * float(m.t_verify(n, L)):.1f} ms, "
          f"t_draft(1) {1e3 * float(m.t_draft(1)):.1f} ms, t_fixed {1e3 * m.fixed:.1f} ms; held-out MdAPE "
          f"{100 * cal.mdape:.1f}% over {len(cal.validation)} shapes; {cal.seconds:.0f} s -> {args.out_json}")
    return 0


def _add_collect_records(p: argparse.ArgumentParser) -> None:
    _add_config(p)
    _add_model_drafter(p)
    p.add_argument("--workload-file", required=True, type=Path, help="workloads/{workload}.parquet (calib split is used)")
    p.add_argument("--temperature", required=True, type=float)
    p.add_argument("--out", required=True, type=Path, help="folder for the shards")


def _run_collect_records(args: argparse.Namespace) -> int:
    cfg = _load_config(args)
    rc = cfg["records"]
    tpl = rc["template"]
    check_temperature(args.temperature, cfg)
    table = read_calib_table(args.workload_file, rc["prompts_per_workload"])
    e = _load_engine(args, cfg)
    target, drafter, checksum, drafter_id, tok = e.target, e.drafter, e.model_checksum, e.drafter_id, e.tokenizer
    prompts = [tok(t, add_special_tokens=False).input_ids for t in table["prompt"].to_list()]
    ids = [f"{w}/{i}" for w, i in zip(table["workload"].to_list(), table["prompt_id"].to_list())]
    res = collect_records(target=target, drafter=drafter, template=Structure.full(tpl["widths"]), prompts=prompts,
                          request_ids=ids, temperature=args.temperature, seed=cfg["seed"], max_new_tokens=rc["max_new_tokens"],
                          out_dir=args.out, shard_size=rc["shard_size"], model_checksum=checksum, drafter_id=drafter_id,
                          eos_token_id=tok.eos_token_id, minutes=rc["minutes"], verify=rc["verify"])
    print(f"verification {res.verify}; {len(prompts)} prompts asked, {len(res.shards)} shards taken "
          f"({len(res.computed)} computed, {len(res.shards) - len(res.computed)} already complete), {res.n_cycles} cycles in "
          f"{res.seconds:.0f} s -> {args.out}; budget {res.budget}")
    return 0


def _add_summarize_records(p: argparse.ArgumentParser) -> None:
    p.add_argument("records", nargs="+", type=Path, help="records folders ({workload}/T{temperature})")
    p.add_argument("--model", type=Path, help="prepared model folder: refuse records of another model")
    p.add_argument("--drafter", help="drafter id the records must carry (as written by collect-records)")
    p.add_argument("--out-json", required=True, type=Path)
    p.add_argument("--out-md", required=True, type=Path)


def _run_summarize_records(args: argparse.Namespace) -> int:
    summarize_records_dirs(args.records, model=args.model, drafter=args.drafter, out_json=args.out_json, out_md=args.out_md)
    print(f"summarised {len(args.records)} records folders -> {args.out_json}, {args.out_md}")
    return 0


# ---------------------------------------------------------------- drafter
def _fortunes_dir(cfg: dict) -> str | None:
    """The fortunes folder the drafter's extra training prompts come from (None without that workload)."""
    return (cfg["workloads"].get("fortunes") or {}).get("dir")


def _add_train_drafter(p: argparse.ArgumentParser) -> None:
    _add_config(p)
    p.add_argument("--model", required=True, type=Path, help="prepared model folder")
    p.add_argument("--workloads", required=True, type=Path, help="folder of {workload}.parquet (train split is used)")
    p.add_argument("--out", required=True, type=Path, help="drafter folder to write")
    p.add_argument("--work", required=True, type=Path, help="folder for checkpoints (resume)")
    _add_kernels(p)


def _run_train_drafter(args: argparse.Namespace) -> int:
    cfg = _load_config(args)
    r = run_train_drafter(model_dir=args.model, workloads_dir=args.workloads, out_dir=args.out, work_dir=args.work,
                          fortunes_dir=_fortunes_dir(cfg), config=cfg["drafter"], seed=cfg["seed"], device=cfg["torch_device"],
                          kernels_path=args.kernels)
    print(f"trained {r.steps} steps on {r.train_tokens} tokens (data {r.data_seconds:.0f} s, training {r.train_seconds:.0f} s); "
          f"held-out top-1 by TTT step {[round(a, 3) for a in r.val_top1]} -> {r.path}")
    return 0


def _add_train_gto(p: argparse.ArgumentParser) -> None:
    _add_config(p)
    p.add_argument("--model", required=True, type=Path, help="prepared model folder")
    p.add_argument("--drafter", required=True, type=Path, help="the train_drafter head folder (the reference head)")
    p.add_argument("--workloads", required=True, type=Path, help="folder of {workload}.parquet (train split is used)")
    p.add_argument("--out", required=True, type=Path, help="drafter folder to write")


def _run_train_gto(args: argparse.Namespace) -> int:
    cfg = _load_config(args)
    r = run_train_gto(model_dir=args.model, drafter_dir=args.drafter, workloads_dir=args.workloads, out_dir=args.out,
                      fortunes_dir=_fortunes_dir(cfg), config=cfg["drafter"], seed=cfg["seed"], device=cfg["torch_device"])
    print(f"GTO: {r.steps} steps in {r.seconds:.0f} s; held-out Draft Tree Reward {r.reward_before:.3f} -> {r.reward_after:.3f}, "
          f"accepted tokens per tree {r.accepted_before:.3f} -> {r.accepted_after:.3f} -> {args.out}")
    return 0


def _add_measure_drafter(p: argparse.ArgumentParser) -> None:
    _add_config(p)
    p.add_argument("--model", required=True, type=Path, help="prepared model folder")
    p.add_argument("--drafter", required=True, type=Path, help="the train_drafter head folder (label base)")
    p.add_argument("--gto-drafter", type=Path, help="its GTO fine-tune (label gto), measured side by side")
    p.add_argument("--workloads", required=True, type=Path, help="folder of {workload}.parquet (eval split is used)")
    p.add_argument("--out-json", required=True, type=Path)
    p.add_argument("--out-md", required=True, type=Path)
    _add_kernels(p)


def _run_measure_drafter(args: argparse.Namespace) -> int:
    cfg = _load_config(args)
    m = cfg["measure_drafter"]
    heads = {"base": args.drafter} | ({"gto": args.gto_drafter} if args.gto_drafter else {})
    result = measure_drafter(model_dir=args.model, drafter_dirs=heads, workloads_dir=args.workloads,
                             prompts_per_workload=m["prompts_per_workload"], max_new_tokens=m["max_new_tokens"],
                             temperatures=tuple(m["temperatures"]), trees=tuple(tuple(t) for t in m["trees"]),
                             chain_depth=m["chain_depth"], speed_prompts_per_workload=m["speed_prompts_per_workload"],
                             seed=cfg["seed"], minutes=m["minutes"], kernels=_read_kernels(args), device=cfg["torch_device"])
    write_measure(result, args.out_json, args.out_md)
    print(render_markdown(result))
    return 0


# ---------------------------------------------------------------- solve-oracle
def _add_solve_oracle(p: argparse.ArgumentParser) -> None:
    _add_config(p)
    _add_records(p)
    p.add_argument("--out", required=True, type=Path, help="oracle JSON to write")


def _run_solve_oracle(args: argparse.Namespace) -> int:
    cfg = _load_config(args)
    result = run_solve_oracle(records_dirs=args.records, latency_path=args.latency, config=cfg, out=args.out)
    print(f"oracle: {result.throughput:.3f} tokens/s (bound {result.ratio_upper_bound:.3f}), |S| = {len(result.structure)}, "
          f"{result.iterations} Dinkelbach iterations, {result.solve_seconds:.1f} s, {result.n_cycles} cycles in "
          f"{result.n_groups} groups -> {args.out}")
    return 0


# ---------------------------------------------------------------- train-policy
def _add_train_policy(p: argparse.ArgumentParser) -> None:
    _add_config(p)
    _add_records(p)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--oracle", type=Path, help="oracle JSON: its structure is kept fixed")
    which.add_argument("--template", action="store_true",
                       help="keep the records' full template as the structure (the policy-only ablation)")
    p.add_argument("--out", required=True, type=Path,
                   help="policy folder to write (policy.onnx, structure.json, export.json, train.json, train.md)")


def _run_train_policy(args: argparse.Namespace) -> int:
    cfg = _load_config(args)
    r = run_train_policy(records_dirs=args.records, latency_path=args.latency, oracle_path=args.oracle,
                         out_dir=args.out, config=cfg["policy"], seed=cfg["seed"])
    if r.train is None:
        print(f"policy: none trained, the oracle's structure is empty (autoregressive decoding is best) -> {args.out}")
        return 0
    tr, ho = r.train.train, r.train.holdout
    held = f", held-out {ho.throughput:.3f} vs best fixed {ho.best_fixed_throughput:.3f}" if ho else ""
    oracle = f", oracle {r.oracle_throughput:.3f}" if r.oracle_throughput is not None else ""
    print(f"policy: J {tr.throughput:.3f} tokens/s on {tr.n_cycles} train cycles (best fixed depth {tr.best_fixed_depth}: "
          f"{tr.best_fixed_throughput:.3f}, posterior bound {tr.posterior_bound:.3f}{oracle}){held}; "
          f"features {r.features_seconds:.1f} s, training {r.train.seconds:.1f} s -> {args.out}")
    return 0


# ---------------------------------------------------------------- resolve-device
def _add_resolve_device(p: argparse.ArgumentParser) -> None:
    _add_config(p)
    p.add_argument("--records", nargs="+", required=True, type=Path, metavar="DIR",
                   help="records folders (one template, one temperature)")
    p.add_argument("--latency", required=True, type=Path,
                   help="latency.json calibrated on the other device (same model and head)")
    p.add_argument("--out", required=True, type=Path, help="folder to write (oracle.json, policy/, resolve.json)")


def _run_resolve_device(args: argparse.Namespace) -> int:
    cfg = _load_config(args)
    r = resolve_device(records_dirs=args.records, latency_path=args.latency, out_dir=args.out, config=cfg, seed=cfg["seed"])
    pol = f", policy J {r.policy.train.train.throughput:.3f}" if r.policy.train else ", autoregressive"
    edge = f"; at the template's limits: {'; '.join(r.template_edges)}" if r.template_edges else ""
    print(f"resolve: oracle {r.oracle.throughput:.3f} tokens/s, |S| = {len(r.oracle.structure)}{pol}{edge} -> {args.out}")
    return 0


# ---------------------------------------------------------------- ogspo-rounds, export-policy
def _add_ogspo_rounds(p: argparse.ArgumentParser) -> None:
    _add_config(p)
    _add_model_drafter(p)
    _add_records(p)
    p.add_argument("--oracle", required=True, type=Path, help="oracle JSON (the rounds start from its structure)")
    p.add_argument("--workloads", required=True, type=Path, help="folder of {workload}.parquet (the records' prompts)")
    p.add_argument("--sequoia", type=Path, help="Sequoia's structure.json: a static tree the policy must beat to ship")
    p.add_argument("--out", required=True, type=Path,
                   help="rounds folder to write (rounds.parquet/png/json, same_trace.parquet, policy.pt, structure.json)")


def _run_ogspo_rounds(args: argparse.Namespace) -> int:
    cfg = _load_config(args)

    def load_engine():
        e = _load_engine(args, cfg)
        return e.target, e.drafter, e.tokenizer, e.model_checksum, e.drafter_id

    r = run_rounds_stage(records_dirs=args.records, latency_path=args.latency, oracle_path=args.oracle, out_dir=args.out,
                         load_engine=load_engine, workloads_dir=args.workloads, config=cfg, seed=cfg["seed"],
                         sequoia_path=args.sequoia)
    if r.autoregressive:
        print(f"ogspo rounds: none run, the oracle's structure is empty (autoregressive decoding is best) -> {args.out}")
        return 0
    for row in r.rows:
        print(f"round {row.round}: |S| {row.structure_size}, surrogate J {row.surrogate_J:.3f}, same-trace "
              f"{row.same_trace_J:.3f} (predicted {row.predicted_J:.3f}), corrected {row.corrected_J:.3f}, posterior bound "
              f"{row.posterior_bound:.3f}, {'accepted' if row.accepted else 'rejected'}")
    print(f"ogspo rounds: kept round {r.incumbent_round} (|S| = {len(r.structure)}); {r.stop_reason}; {r.ship.reason} "
          f"-> {args.out}")
    return 0


def _add_export_policy(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", required=True, type=Path, help="rounds folder (policy.pt + structure.json)")
    p.add_argument("--out", required=True, type=Path, help="policy folder to write (policy.onnx, structure.json, export.json)")


def _run_export_policy(args: argparse.Namespace) -> int:
    r = run_export_policy(rounds_dir=args.rounds, out_dir=args.out)
    what = (f"policy.onnx ({r.export.bytes} bytes)" if r.export is not None else "a static tree (no policy.onnx)"
            if len(r.structure) else "autoregressive (empty structure, no policy.onnx)")
    print(f"exported {args.rounds}: {what}, |S| = {len(r.structure)} -> {args.out}")
    return 0


# ---------------------------------------------------------------- baselines: build-sequoia, train-routing
def _add_build_sequoia(p: argparse.ArgumentParser) -> None:
    _add_config(p)
    _add_records(p)
    p.add_argument("--out", required=True, type=Path, help="folder to write (structure.json, sequoia.json)")


def _run_build_sequoia(args: argparse.Namespace) -> int:
    cfg = _load_config(args)
    r = build_sequoia(records_dirs=args.records, latency_path=args.latency, config=cfg["baselines"]["sequoia"], out_dir=args.out)
    replayed = (f"replayed {r.replayed[r.size]:.3f} tokens/s on {r.n_cycles} record cycles" if r.inside_template
                else "outside the records template (no replay figure)")
    kind = "autoregressive (empty tree)" if r.size == 0 else f"{r.size} nodes, depth {r.structure.max_depth}"
    print(f"sequoia: {kind}, modelled {r.throughput:.3f} tokens/s at L = {r.context_length:.0f}, {replayed}; "
          f"autoregressive replayed {r.replayed_autoregressive:.3f} -> {args.out}")
    return 0


def _add_train_routing(p: argparse.ArgumentParser) -> None:
    _add_config(p)
    _add_records(p)
    p.add_argument("--out", required=True, type=Path, help="folder to write (router.json, train.json)")


def _run_train_routing(args: argparse.Namespace) -> int:
    cfg = _load_config(args)
    r = run_train_routing(records_dirs=args.records, latency_path=args.latency, config=cfg["baselines"]["routing"],
                          seed=cfg["seed"], out_dir=args.out)
    tr, ho = r.train, r.holdout
    held = f"; held-out {ho.throughput:.3f} vs best template {ho.best_fixed} {ho.best_fixed_throughput:.3f}" if ho else ""
    print(f"routing: J {tr.throughput:.3f} tokens/s on {tr.n_cycles} train cycles (best template {tr.best_fixed} "
          f"{tr.best_fixed_throughput:.3f}, per-cycle bound {tr.per_cycle_bound:.3f}){held}; {r.seconds:.1f} s -> {args.out}")
    return 0


# ---------------------------------------------------------------- tune-eagle, evaluate, report
def _key_paths(pairs: list[str] | None, what: str, allowed: tuple[str, ...] | None = None) -> dict[str, str]:
    """KEY=PATH arguments as a dict (one clear line on a malformed or unknown KEY)."""
    out = {}
    for item in pairs or []:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"{what} '{item}' is not KEY=PATH")
        if allowed is not None and key not in allowed:
            raise ValueError(f"{what} '{item}': unknown key '{key}'; allowed: {', '.join(allowed)}")
        out[key] = value
    return out


def _add_calib_decoding(p: argparse.ArgumentParser) -> None:
    """The arguments of a stage that decodes calib prompts at one temperature."""
    _add_config(p)
    _add_model_drafter(p)
    p.add_argument("--workloads", nargs="+", required=True, type=Path, metavar="PARQUET",
                   help="workload files (calib split is used)")
    p.add_argument("--temperature", required=True, type=float)


def _add_tune_eagle(p: argparse.ArgumentParser) -> None:
    _add_calib_decoding(p)
    p.add_argument("--static", type=Path, help="Sequoia's structure.json at this temperature: run beside the grid, so the "
                   "best baseline (ar, eagle-tuned, sequoia) is picked on calib prompts")
    p.add_argument("--out", required=True, type=Path, help="tuning JSON to write (grid, winners and best baseline per workload)")


def _run_tune_eagle(args: argparse.Namespace) -> int:
    cfg = _load_config(args)
    ev = cfg["evaluate"]
    check_temperature(args.temperature, cfg)
    e = _load_engine(args, cfg)
    target, drafter, tok = e.target, e.drafter, e.tokenizer
    prompts = load_prompts(args.workloads, tok, split="calib", n=ev["tune_prompts_per_workload"])
    static = None if args.static is None else structure_policy(args.static, "sequoia")
    res = tune_eagle(target=target, drafter=drafter, prompts=prompts, grid=ev["eagle_grid"], temperature=args.temperature,
                     max_new_tokens=ev["tune_max_new_tokens"], seed=cfg["seed"], static=static,
                     progress=lambda line: print(line, flush=True), interleave=ev["interleave"])
    write_tuning(res, args.out)
    print(f"tuned EAGLE-3 at T={args.temperature:g}: {res.winners} in {res.seconds:.0f} s -> {args.out}")
    return 0


def _add_choose_on_device(p: argparse.ArgumentParser) -> None:
    _add_calib_decoding(p)
    _add_records(p)
    p.add_argument("--policy", required=True, type=Path, help="the policy folder (rule export_policy) at this temperature")
    p.add_argument("--sequoia", type=Path, help="Sequoia's structure.json at this temperature (a static candidate)")
    p.add_argument("--out", required=True, type=Path, help="policy folder to write (the choice per workload in workloads.json)")


def _run_choose_on_device(args: argparse.Namespace) -> int:
    cfg = _load_config(args)
    check_temperature(args.temperature, cfg)
    e = _load_engine(args, cfg)
    choices = run_choose_on_device(
        target=e.target, drafter=e.drafter, policy_dir=args.policy, records_dirs={Path(d).parent.name: d for d in args.records},
        latency_path=args.latency, sequoia_path=args.sequoia, temperature=args.temperature, config=cfg, seed=cfg["seed"],
        prompts=load_prompts(args.workloads, e.tokenizer, split="calib", n=cfg["on_device"]["prompts_per_workload"]),
        interleave=cfg["evaluate"]["interleave"], out_dir=args.out, progress=lambda line: print(line, flush=True))
    print(f"ogspo at T={args.temperature:g} as chosen on the device: "
          + ", ".join(f"{c.workload} {c.own if c.chosen == 'own' else c.chosen}" for c in choices) + f" -> {args.out}")
    return 0


def _add_evaluate(p: argparse.ArgumentParser) -> None:
    _add_config(p)
    _add_model_drafter(p)
    p.add_argument("--workloads", nargs="+", required=True, type=Path, metavar="PARQUET",
                   help="workload files (eval split is used)")
    p.add_argument("--latency", type=Path, help="latency.json (surrogate-predicted throughput)")
    p.add_argument("--oracle", nargs="*", metavar="TAG=PATH",
                   help="oracle JSON per temperature tag, e.g. T0=results/cpu/solve/oracle_T0.json")
    p.add_argument("--artifact", nargs="*", metavar="KIND=PATH",
                   help=f"artifact path template per method kind, {{T}} = temperature "
                   f"tag; kinds: {', '.join(artifact_kinds())}")
    p.add_argument("--out-requests", required=True, type=Path, help="requests.parquet to write")
    p.add_argument("--out-summary", required=True, type=Path, help="summary.json to write")


def _run_evaluate(args: argparse.Namespace) -> int:
    cfg = _load_config(args)
    ev = cfg["evaluate"]
    specs = method_specs(ev["methods"], ev)
    artifacts = _key_paths(args.artifact, "--artifact", artifact_kinds())
    lacking = sorted({s.kind for s in specs if s.kind in artifact_kinds()} - set(artifacts))
    if lacking:
        raise ValueError(f"evaluate.methods needs --artifact for {', '.join(lacking)} (KIND=PATH with {{T}})")
    temperatures = [float(t) for t in cfg["records"]["temperatures"]]
    oracle = oracle_throughputs({k: Path(v) for k, v in _key_paths(args.oracle, "--oracle").items()})
    unknown = sorted(set(oracle) - {temperature_tag(t) for t in temperatures})
    if unknown:
        raise ValueError(f"--oracle {unknown[0]}: not a temperature tag of records.temperatures {cfg['records']['temperatures']}")
    e = _load_engine(args, cfg)
    target, drafter, checksum, drafter_id, tok = e.target, e.drafter, e.model_checksum, e.drafter_id, e.tokenizer
    latency = None if args.latency is None else LatencyModel.from_json(args.latency, expect_model=checksum,
                                                                       expect_drafter=drafter_id)
    prompts = load_prompts(args.workloads, tok, split="eval", n=ev["prompts_per_workload"])
    res = evaluate_methods(target=target, drafter=drafter, prompts=prompts, methods=specs, temperatures=temperatures,
                           max_new_tokens=ev["max_new_tokens"], repeats=ev["repeats"], seed=cfg["seed"], artifacts=artifacts,
                           latency=latency, oracle=oracle, policy_device=cfg["torch_device"],
                           light_methods=tuple(ev["light_methods"]), light_prompts=ev["light_prompts_per_workload"],
                           progress=lambda line: print(line, flush=True), interleave=ev["interleave"],
                           minutes=evaluate_minutes(ev, cfg["run"], elapsed=run_elapsed_minutes()))
    write_evaluation(res, requests_path=args.out_requests, summary_path=args.out_summary)
    print(render_summary(res.summary))
    print(f"{len(res.rows)} requests in {res.seconds:.0f} s; lossless: {res.checked} T=0 requests compared, "
          f"{len(res.near_ties)} near-ties -> {args.out_requests}, {args.out_summary}")
    return 0


def _add_report(p: argparse.ArgumentParser) -> None:
    p.add_argument("--evaluate-summary", required=True, type=Path, help="evaluate/summary.json")
    p.add_argument("--requests", required=True, type=Path, help="evaluate/requests.parquet")
    p.add_argument("--latency", type=Path, help="latency.json (latency model fit plot)")
    p.add_argument("--records-summary", type=Path, help="records/summary.json (acceptance by depth plot)")
    p.add_argument("--structure", nargs="*", metavar="TAG=PATH", help="OGSPO structure.json per temperature tag")
    p.add_argument("--rounds", nargs="*", metavar="TAG=PATH", help="rounds.parquet per temperature tag (absent: no plot)")
    p.add_argument("--drafter-eval", type=Path, help="drafter_eval/acceptance.json (the draft heads side by side)")
    p.add_argument("--head", nargs="*", metavar="LABEL=PATH", help="drafter folder per head label (base, gto): training figures")
    p.add_argument("--sequoia", nargs="*", metavar="TAG=PATH", help="sequoia.json per temperature tag (replayed figures)")
    p.add_argument("--on-device", nargs="*", metavar="TAG=PATH", help="device.json per temperature tag: what ogspo ships")
    p.add_argument("--out", required=True, type=Path, help="report folder")


def _run_report(args: argparse.Namespace) -> int:
    r = write_report(evaluate_summary=args.evaluate_summary, requests=args.requests, out_dir=args.out, latency=args.latency,
                     records_summary=args.records_summary, structures=_key_paths(args.structure, "--structure"),
                     rounds=_key_paths(args.rounds, "--rounds"), drafter_eval=args.drafter_eval,
                     heads=_key_paths(args.head, "--head", ("base", "gto")), sequoia=_key_paths(args.sequoia, "--sequoia"),
                     on_device=_key_paths(args.on_device, "--on-device"))
    print(f"report: {len(r.plots)} plots, OGSPO / tuned EAGLE-3 {r.ratios or 'n/a'} -> {r.markdown_path}")
    for m in r.missing:
        print(f"left out: {m}")
    return 0


def _add_export_tree(p: argparse.ArgumentParser) -> None:
    p.add_argument("--results", required=True, type=Path, help="a run's results folder (results/DEVICE)")
    p.add_argument("--temperatures", nargs="+", default=["T0", "T1"], help="temperature tags (T0, T1)")
    p.add_argument("--out", type=Path, help="also write the settings here as JSON")


def _run_export_tree(args: argparse.Namespace) -> int:
    doc = export_trees(args.results, args.temperatures)
    if args.out:
        write_export(doc, args.out)
    print(json.dumps(doc, indent=1))
    return 0


# stage name -> (its arguments, its run); help, config sections and aliases come from the stage's declaration
STAGE_COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "prepare_model": (_add_prepare_model, _run_prepare_model),
    "prepare_workloads": (_add_prepare_workloads, _run_prepare_workloads),
    "train_drafter": (_add_train_drafter, _run_train_drafter),
    "train_gto": (_add_train_gto, _run_train_gto),
    "measure_drafter": (_add_measure_drafter, _run_measure_drafter),
    "calibrate_kernels": (_add_calibrate_kernels, _run_calibrate_kernels),
    "calibrate_latency": (_add_calibrate_latency, _run_calibrate_latency),
    "collect_records": (_add_collect_records, _run_collect_records),
    "summarize_records": (_add_summarize_records, _run_summarize_records),
    "solve_oracle": (_add_solve_oracle, _run_solve_oracle),
    "train_policy_only": (_add_train_policy, _run_train_policy),
    "resolve_device": (_add_resolve_device, _run_resolve_device),
    "ogspo_rounds": (_add_ogspo_rounds, _run_ogspo_rounds),
    "export_policy": (_add_export_policy, _run_export_policy),
    "build_sequoia": (_add_build_sequoia, _run_build_sequoia),
    "train_routing": (_add_train_routing, _run_train_routing),
    "tune_eagle": (_add_tune_eagle, _run_tune_eagle),
    "choose_on_device": (_add_choose_on_device, _run_choose_on_device),
    "evaluate": (_add_evaluate, _run_evaluate),
    "report": (_add_report, _run_report),
    "export_tree": (_add_export_tree, _run_export_tree),
}

COMMANDS: dict[str, Command] = {
    "generate": Command("decode one prompt with a speculative method, streaming", _add_generate, _run_generate),
    **{STAGES[name].command: Command(STAGES[name].help, add, run, stage=name) for name, (add, run) in STAGE_COMMANDS.items()},
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ogspo", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        aliases = STAGES[cmd.stage].aliases if cmd.stage else ()
        p = sub.add_parser(name, aliases=list(aliases), help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run, stage=cmd.stage)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args._run(args)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"ogspo: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
