"""Benchmark: the engine against transformers on SmolLM2, side by side in one run.

    .venv/bin/python benchmarks/bench_engine.py [--model results/.test-cache/smollm2] [--write]

1. Autoregressive tokens/s: the engine's `ar` method vs transformers `generate(do_sample=False)`,
   interleaved prompt by prompt, repeated.
2. Verification cost: one target forward over a tree of n nodes (root included) on a 256-token
   cache vs a one-token step, for the engine and for transformers as is (DynamicCache + 4-D mask).
3. Cycle time split of speculative methods: share of cycle time spent outside model forwards.
4. End-to-end speed of speculative methods (model-free and early-exit drafters) vs `ar`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchdoc import REPO, cpu_model, stats, write_section  # noqa: E402

PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village by the sea,",
    "import numpy as np\n\ndef normalize(x):\n",
]


def timed_forwards(lm):
    """Wrap lm.forward to accumulate the seconds spent in it."""
    orig = lm.forward
    lm.forward_seconds = 0.0

    def forward(*a, **k):
        t0 = time.perf_counter()
        out = orig(*a, **k)
        lm.forward_seconds += time.perf_counter() - t0
        return out

    lm.forward = forward
    return lm


def roofline(model, reps: int = 5) -> dict:
    """Read bandwidth (GB/s), fp32 GEMM peak (GFLOP/s), and the bytes and FLOPs of a forward."""
    big = torch.ones(256 * 1024 * 1024 // 4 * 4)  # 1 GiB, larger than any cache
    bw = []
    for _ in range(reps):
        t0 = time.perf_counter()
        big.sum()
        bw.append(big.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    del big
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    peak = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        peak.append(2 * 2048**3 / (time.perf_counter() - t0) / 1e9)
    cfg = model.config
    matmul_params = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight")) + model.lm_head.weight.numel()
    return {"bandwidth_gbs": max(bw), "peak_gflops": max(peak), "weight_bytes": 4 * matmul_params, "matmul_params": matmul_params,
            "kv_bytes_per_row": 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4}


def floor_seconds(roof: dict, n: int, context: int) -> float:
    read = roof["weight_bytes"] + roof["kv_bytes_per_row"] * (context + n)
    return max(read / (roof["bandwidth_gbs"] * 1e9), 2 * n * roof["matmul_params"] / (roof["peak_gflops"] * 1e9))


def bench_ar(model, tok, targets: dict, n_tokens: int, reps: int) -> dict[str, list[float]]:
    from ogspo.engine.decode import SpeculativeEngine
    from ogspo.engine.policies import Autoregressive

    engines = {f"engine ar ({name})": SpeculativeEngine(target=t, policy=Autoregressive()) for name, t in targets.items()}
    out: dict[str, list[float]] = {"transformers generate": []} | {k: [] for k in engines}
    for r in range(reps + 1):
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt").input_ids
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_tokens, min_new_tokens=n_tokens, do_sample=False)
            t_hf = time.perf_counter() - t0
            if r > 0:  # first round is warm-up
                out["transformers generate"].append(n_tokens / t_hf)
            for label, engine in engines.items():
                res = engine.generate(ids[0].tolist(), max_new_tokens=n_tokens)
                if r > 0:
                    out[label].append(len(res.tokens) / res.wall_seconds)
    return out


def bench_verify(model, targets: dict, sizes: list[int], context: int, reps: int) -> dict[tuple[str, int], list[float]]:
    from transformers import DynamicCache

    from ogspo.engine.tree import Structure, ancestor_matrix

    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, model.config.vocab_size, (context,), generator=g)
    for target in targets.values():
        target.cache.reset()
        target.forward(ctx, torch.arange(context), None)
        target.cache.commit_prefix(context)
    hf_cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=ctx[None], cache=hf_cache, use_cache=True)
    trees = {}
    for n in sizes:  # a bushy tree of n nodes: breadth-first over widths (4, 3, 2, 1, ...)
        paths = sorted(Structure.full([4, 3, 2, 2, 1, 1]).paths, key=lambda p: (len(p), p))[: n - 1]
        s = Structure(paths) if paths else None
        parents, depths = [-1], [0]
        index = {(): 0}
        for p in paths:
            index[p] = len(parents)
            parents.append(index[p[:-1]])
            depths.append(len(p))
        parents, depths = np.array(parents), np.array(depths)
        trees[n] = (torch.from_numpy(ancestor_matrix(parents, depths)), torch.from_numpy(depths))
        del s
    res: dict[tuple[str, int], list[float]] = {}
    for r in range(reps + 2):
        for n in sizes:
            anc, depths = trees[n]
            toks = torch.randint(0, model.config.vocab_size, (n,), generator=g)
            t_eng = {}
            for name, target in targets.items():
                t0 = time.perf_counter()
                target.forward(toks, context + depths, None if n == 1 else anc)
                t_eng[name] = time.perf_counter() - t0
                target.cache.commit(None)
            mask = torch.zeros(1, 1, n, context + n)
            mask[0, 0, :, context:] = torch.where(anc, 0.0, float("-inf"))
            t0 = time.perf_counter()
            with torch.inference_mode():
                model(input_ids=toks[None], attention_mask=mask, position_ids=(context + depths)[None], cache=hf_cache, use_cache=True)
            t_hf = time.perf_counter() - t0
            hf_cache.crop(-n)
            if r >= 2:
                for name, t in t_eng.items():
                    res.setdefault((name, n), []).append(t)
                res.setdefault(("transformers", n), []).append(t_hf)
    return res


def bench_methods(model, tok, target, n_tokens: int, reps: int, table):
    from ogspo.engine.decode import SpeculativeEngine
    from ogspo.engine.drafters import LMDrafter
    from ogspo.methods.registry import make_drafter, make_policy

    timed_forwards(target)
    configs = [
        ("ar", "ar", {}, None),
        ("chain4 + lookup", "chain", {"k": 4}, "lookup"),
        ("eagle 16/4/4 + lookup", "eagle", {"total_tokens": 16, "depth": 4, "top_k": 4}, "lookup"),
        ("chain3 + early-exit(6)", "chain", {"k": 3}, "early-exit"),
        ("eagle 16/4/4 + early-exit(6)", "eagle", {"total_tokens": 16, "depth": 4, "top_k": 4}, "early-exit"),
    ]
    engines = []
    for label, method, args, dname in configs:
        drafter = None
        if dname:
            drafter = make_drafter(dname, target_model=model, max_len=1024, kernels=table)
            if isinstance(drafter, LMDrafter):
                timed_forwards(drafter.lm)
        engines.append((label, SpeculativeEngine(target=target, policy=make_policy(method, **args), drafter=drafter, eos_token_id=tok.eos_token_id), drafter))
    rows: dict[str, dict[str, list[float]]] = {label: {"tps": [], "tau": [], "outside": []} for label, *_ in engines}
    for r in range(reps):
        for p in PROMPTS:
            ids = tok(p).input_ids
            for label, engine, drafter in engines:
                target.forward_seconds = 0.0
                if isinstance(drafter, LMDrafter):
                    drafter.lm.forward_seconds = 0.0
                res = engine.generate(ids, max_new_tokens=n_tokens)
                fwd = target.forward_seconds + (drafter.lm.forward_seconds if isinstance(drafter, LMDrafter) else 0.0)
                cycle_s = sum(c.cycle_seconds for c in res.cycles)
                pre_fwd = res.prefill_seconds  # prefill is all forward
                rows[label]["tps"].append(res.throughput)
                rows[label]["tau"].append(res.tau)
                rows[label]["outside"].append(1 - (fwd - pre_fwd) / cycle_s if cycle_s > 0 else 0.0)
    return rows


def render(args, roof, table, ar, ver, methods) -> str:
    import transformers

    from ogspo.engine.kernels import describe

    cmd = "PATH=.venv/bin:$PATH python benchmarks/bench_engine.py " + " ".join(sys.argv[1:])
    L = [
        "## Engine vs transformers, SmolLM2-135M fp32 (`benchmarks/bench_engine.py`)",
        "",
        f"- date: {dt.datetime.now().strftime('%Y-%m-%d %H:%M')}",
        f"- machine: {os.cpu_count()} CPUs ({cpu_model()}), torch {torch.__version__} (threads {torch.get_num_threads()}), transformers {transformers.__version__}",
        f"- reproduce: `{cmd.strip()}`",
        f"- {len(PROMPTS)} prompts, methods interleaved prompt by prompt, {args.reps} rounds; medians [min, max]",
        "",
        f"**Autoregressive, {args.tokens} new tokens (tokens/s):**",
        "",
        "| decoder | median | min | max |",
        "|---|---:|---:|---:|",
    ]
    for k, xs in ar.items():
        L.append(f"| {k} | {stats(xs)[0]:.1f} | {stats(xs)[1]:.1f} | {stats(xs)[2]:.1f} |")
    hf = ar["transformers generate"]
    for name in ("table", "reference"):
        ratio = [a / b for a, b in zip(ar[f"engine ar ({name})"], hf)]
        L.append(f"\nEngine ({name} kernels) / transformers, paired per prompt: median {np.median(ratio):.2f}x [{min(ratio):.2f}, {max(ratio):.2f}]")
    L += [
        "",
        f"**Roofline of this device:** read bandwidth {roof['bandwidth_gbs']:.1f} GB/s (1 GiB fp32 sum), fp32 GEMM peak "
        f"{roof['peak_gflops']:.0f} GFLOP/s (2048^3 matmul); a forward reads {roof['weight_bytes'] / 1e6:.0f} MB of matmul weights "
        f"plus the KV cache and does 2 x {roof['matmul_params'] / 1e6:.0f}M FLOPs per row: floor(n) = max(bytes / bandwidth, FLOPs / peak).",
        "",
        f"**One target forward over a tree of n nodes on a {args.context}-token cache (ms, median of {args.reps * 3}): "
        "the engine with this device's kernel table, with the reference kernel (F.linear), and transformers as is:**",
        "",
        "| n | floor ms | engine (table) ms | / engine(1) | / floor | engine (reference) ms | / engine(1) | transformers ms | / transformers(1) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    e1 = stats(ver[("table", 1)])[0]
    r1 = stats(ver[("reference", 1)])[0]
    h1 = stats(ver[("transformers", 1)])[0]
    for n in args.sizes:
        e, r, h = (stats(ver[(k, n)])[0] for k in ("table", "reference", "transformers"))
        f = floor_seconds(roof, n, args.context)
        L.append(f"| {n} | {f * 1e3:.1f} | {e * 1e3:.1f} | {e / e1:.2f}x | {e / f:.2f}x | {r * 1e3:.1f} | {r / r1:.2f}x | {h * 1e3:.1f} | {h / h1:.2f}x |")
    L += ["", f"**Kernel table** ({table.key['model']}, {table.key['threads']} threads; {table.meta.get('seconds', '?')} s of timing; "
          "`kernel->m` = padded to m rows):", "", "```", describe(table), "```"]
    L += [
        "",
        f"**Speculative methods, {args.tokens} new tokens (complete-request tokens/s, tau with bonus, share of cycle time outside model forwards):**",
        "",
        "| method | tokens/s | speedup vs ar | tau | outside forwards |",
        "|---|---:|---:|---:|---:|",
    ]
    base = methods["ar"]["tps"]
    for label, r in methods.items():
        sp = [a / b for a, b in zip(r["tps"], base)]
        L.append(
            f"| {label} | {np.median(r['tps']):.1f} | {np.median(sp):.2f}x [{min(sp):.2f}, {max(sp):.2f}] | "
            f"{np.median(r['tau']):.2f} | {100 * np.median(r['outside']):.1f}% |"
        )
    return "\n".join(L)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=REPO / "results" / ".test-cache" / "smollm2")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64])
    ap.add_argument("--kernels", type=Path, help="kernel table (default: calibrate with config/default.yaml, cached per machine)")
    ap.add_argument("--write", action="store_true", help="update this script's section of docs/BENCHMARKS.md")
    args = ap.parse_args()

    from ogspo.engine.kernels import read_kernel_table
    from ogspo.methods.registry import make_target
    from ogspo.stages.calibrate import calibrate_device_kernels
    from ogspo.stages.config import load_config
    from ogspo.stages.model import load_target

    model, tok = load_target(args.model)
    if args.kernels is not None:
        table = read_kernel_table(args.kernels)
    else:
        table, _ = calibrate_device_kernels(model, load_config(REPO / "config" / "default.yaml")["kernels"])
    roof = roofline(model)
    targets = {"table": make_target(model, max_len=1024, kernels=table), "reference": make_target(model, max_len=1024)}
    ar = bench_ar(model, tok, targets, args.tokens, args.reps)
    ver = bench_verify(model, targets, args.sizes, args.context, args.reps * 3)
    methods = bench_methods(model, tok, targets["table"], args.tokens, args.reps, table)
    section = render(args, roof, table, ar, ver, methods)
    print(section)
    if args.write:
        write_section("bench_engine", section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
