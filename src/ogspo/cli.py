"""`ogspo` command line: one subcommand per workflow stage, each a thin call into the library.

To add a subcommand, write ``_add_<name>(parser)`` and ``_run_<name>(args) -> int`` and register
them in ``COMMANDS``. Commands read config via ``--config FILE...`` (people) or ``--config-json``
(Snakemake rules pass exactly the sections the stage reads) and ``_load_config(args, sections)``. Errors (ConfigError / ValueError / FileNotFoundError) print one line
``ogspo: error: ...`` on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


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


def _load_config(args: argparse.Namespace, sections: tuple[str, ...]) -> dict:
    import json

    from ogspo.config import ConfigError, load_config

    if args.config_json is not None:
        try:
            source = json.loads(args.config_json)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config error at '<json>': not valid JSON: {exc}") from None
        if not isinstance(source, dict):
            raise ConfigError("config error at '<json>': must be a JSON object")
    else:
        source = args.config
    return load_config(source, sections=sections)


# ---------------------------------------------------------------- prepare-model


def _add_prepare_model(p: argparse.ArgumentParser) -> None:
    _add_config(p)
    p.add_argument("--out", required=True, type=Path, help="folder to write the prepared model to")


def _run_prepare_model(args: argparse.Namespace) -> int:
    from ogspo.assets import prepare_model

    cfg = _load_config(args, ("model", "dtype"))
    prepared = prepare_model(source=cfg["model"], out_dir=args.out, dtype=cfg["dtype"])
    print(
        f"prepared {prepared.source} -> {prepared.path} "
        f"(sha256 {prepared.checksum[:16]}..., source load {prepared.load_seconds:.1f} s)"
    )
    return 0


# ---------------------------------------------------------------- prepare-workloads


def _add_prepare_workloads(p: argparse.ArgumentParser) -> None:
    _add_config(p)
    p.add_argument("--model", required=True, type=Path, help="prepared model folder (for its tokenizer)")
    p.add_argument("--out", required=True, type=Path, help="folder to write {workload}.parquet to")


def _run_prepare_workloads(args: argparse.Namespace) -> int:
    from ogspo.assets import load_tokenizer
    from ogspo.workloads import prepare_workloads

    cfg = _load_config(args, ("workloads", "seed"))
    result = prepare_workloads(config=cfg, tokenizer=load_tokenizer(args.model), out_dir=args.out)
    for t in result.tables:
        print(
            f"{t.name}: {t.n_train} train + {t.n_eval} eval prompts -> {t.path} "
            f"(max {t.max_tokens} tokens, {t.n_dropped} dropped as too long)"
        )
    return 0


# ---------------------------------------------------------------- generate


def _add_generate(p: argparse.ArgumentParser) -> None:
    from ogspo.methods import DRAFTERS, METHODS

    p.add_argument("prompt", help="prompt text")
    p.add_argument("--model", required=True, type=Path, help="prepared model folder")
    p.add_argument("--method", default="eagle", help=f"one of {', '.join(METHODS)} (default eagle)")
    p.add_argument("--drafter", default="lookup", help=f"one of {', '.join(DRAFTERS)} (default lookup)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--k", type=int, default=4, help="chain length (method chain)")
    p.add_argument("--structure", help="rank paths as JSON, or a JSON file (method static)")
    p.add_argument("--total-tokens", type=int, default=60, help="EAGLE-3 dynamic tree size (method eagle)")
    p.add_argument("--depth", type=int, default=5, help="EAGLE-3 dynamic tree depth (method eagle)")
    p.add_argument("--top-k", type=int, default=10, help="EAGLE-3 dynamic tree top_k (method eagle)")
    p.add_argument("--early-exit-layers", type=int, default=6, help="layers of the early-exit drafter")
    p.add_argument("--max-len", type=int, default=4096, help="KV cache rows")


def _run_generate(args: argparse.Namespace) -> int:
    from ogspo.generate import generate_text

    result = generate_text(
        model_dir=args.model,
        prompt=args.prompt,
        method=args.method,
        drafter=args.drafter,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        chat=args.chat,
        policy_args=dict(k=args.k, structure=args.structure, total_tokens=args.total_tokens, depth=args.depth, top_k=args.top_k),
        early_exit_layers=args.early_exit_layers,
        max_len=args.max_len,
        stream=lambda text: print(text, end="", flush=True),
    )
    r = result.generation
    split = r.time_split()
    print(
        f"\n--- {result.method}: {len(r.tokens)} tokens in {r.wall_seconds:.2f} s = {r.throughput:.1f} tok/s, "
        f"tau {r.tau:.2f}, {len(r.cycles)} cycles; prefill {split['prefill']:.2f} s, draft {split['draft']:.2f} s, "
        f"verify {split['verify']:.2f} s, other {split['other']:.2f} s",
        file=sys.stderr,
    )
    return 0


# ---------------------------------------------------------------- registry

COMMANDS: dict[str, Command] = {
    "prepare-model": Command("prepare the target model as a safetensors folder", _add_prepare_model, _run_prepare_model),
    "prepare-workloads": Command("build the prompt sets", _add_prepare_workloads, _run_prepare_workloads),
    "generate": Command("decode one prompt with a speculative method, streaming", _add_generate, _run_generate),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ogspo", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    from ogspo.config import ConfigError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args._run(args)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"ogspo: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
