"""Benchmark: the engine's fp32 and bf16 targets and transformers on SmolLM2, side by side in one run.

    .venv/bin/python benchmarks/bench_engine.py [--model results/.test-cache/smollm2] [--head DIR] [--write]

The model folder is prepared in fp32; the bf16 target is the same weights rounded to bf16 (what
`dtype: bfloat16` / `auto` prepares). Each dtype gets its own kernel table (calibrated, cached).

1. Autoregressive tokens/s: the engine's `ar` in fp32 and in bf16 vs transformers
   `generate(do_sample=False)` (fp32), interleaved prompt by prompt, repeated; bf16/fp32 paired.
2. Verification cost: one target forward over a tree of n nodes (root included) on a 256-token
   cache vs a one-token step, fp32 and bf16, each against its memory floor (weight bytes over the
   read bandwidth of a 1 GiB fp32 sum, printed).
3. One draft-head level at w=1 (the EAGLE-3 head on the table's kernels in the target's dtype, run
   right after a target step so its weights come from memory), against its own memory floor.
4. End-to-end speed of speculative methods (model-free and early-exit drafters) vs `ar`, per dtype.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchdoc import REPO, cpu_model, git_commit, stats, write_section  # noqa: E402

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
    matmul_params = sum(p.numel() for n,
                        p in model.named_parameters() if n.endswith("proj.weight")) + model.lm_head.weight.numel()
    return {"bandwidth_gbs": float(np.median(bw)), "peak_gflops": max(peak), "matmul_params": matmul_params,
            "kv_bytes_per_row": 2 * cfg.num_hidden_layers * cfg.num_key_value_heads
                                 * (cfg.hidden_size // cfg.num_attention_heads) * 4}


def floor_seconds(roof: dict, n: int, context: int, bytes_per_weight: int) -> float:
    """Memory floor of a forward of n rows: the matmul weights (in their dtype) and the fp32 KV cache
    read once at the measured bandwidth (the arithmetic is far below it at these row counts)."""
    read = bytes_per_weight * roof["matmul_params"] + roof["kv_bytes_per_row"] * (context + n)
    return read / (roof["bandwidth_gbs"] * 1e9)


def bench_ar(model, tok, targets: dict, n_tokens: int, reps: int) -> dict[str, list[float]]:
    from ogspo.engine.decode import SpeculativeEngine
    from ogspo.engine.policies import Autoregressive

    engines = {f"engine ar {name}": SpeculativeEngine(target=t, policy=Autoregressive()) for name, t in targets.items()}
    out: dict[str, list[float]] = {"transformers generate": []} | {k: [] for k in engines}
    for r in range(reps + 1):
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt").input_ids
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_tokens, min_new_tokens=n_tokens,
                               do_sample=False)
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
                model(input_ids=toks[None], attention_mask=mask, position_ids=(context + depths)[None], cache=hf_cache,
                      use_cache=True)
            t_hf = time.perf_counter() - t0
            hf_cache.crop(-n)
            if r >= 2:
                for name, t in t_eng.items():
                    res.setdefault((name, n), []).append(t)
                res.setdefault(("transformers", n), []).append(t_hf)
    return res


def bench_head(heads: dict, targets: dict, context: int, reps: int) -> dict[str, list[float]]:
    """Seconds of one head level at w=1 (`EagleHead.step` + the draft distribution's top-k) on a
    `context`-row head cache, per dtype, each right after a one-token step of that dtype's target
    (so the head's weights are read from memory, as in decoding)."""
    from ogspo.engine.target import KVCache

    res: dict[str, list[float]] = {name: [] for name in heads}
    for name, head in heads.items():
        c = head.cfg
        head.bench_cache = KVCache(n_layers=1, kv_heads=c.kv_heads, head_dim=c.head_dim, max_len=context + 8, dtype=torch.float32,
                                   device="cpu")
    g = torch.Generator().manual_seed(0)
    for r in range(reps + 2):
        for name, head in heads.items():
            target = targets[name]
            target.forward(torch.tensor([5]), torch.tensor([context]), None)
            target.cache.commit(None)
            feat = torch.randn(1, head.cfg.hidden, generator=g)
            kv = head.bench_cache
            t0 = time.perf_counter()
            _, logits = head.step(torch.tensor([7]), feat, torch.tensor([context]), kv.keys[0], kv.values[0], context, context,
                                  None)
            torch.log_softmax(logits, -1).topk(4)
            if r >= 2:
                res[name].append(time.perf_counter() - t0)
    return res


def head_floor_seconds(head, roof: dict, bytes_per_weight: int) -> float:
    """The head's matmul weights (q/k/v, o, MLP, the draft LM head) read once at the measured bandwidth."""
    n = sum(m.weight.numel() for m in (head.q, head.k, head.v, head.o, head.gate, head.up, head.down)) + head.lm_rows.numel()
    return bytes_per_weight * n / (roof["bandwidth_gbs"] * 1e9)


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
        engines.append((label,
                        SpeculativeEngine(target=target, policy=make_policy(method, **args), drafter=drafter,
                                          eos_token_id=tok.eos_token_id), drafter))
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


def render(args, roof, tables, ar, ver, head_t, heads, methods) -> str:
    import transformers

    from ogspo.engine.kernels import describe

    cmd = "PATH=.venv/bin:$PATH python benchmarks/bench_engine.py " + " ".join(sys.argv[1:])
    commit = git_commit()
    L = [
        "## Engine in fp32 and bf16 vs transformers, SmolLM2-135M (`benchmarks/bench_engine.py`)",
        "",
        f"- date: {dt.datetime.now().strftime('%Y-%m-%d %H:%M')}, commit {commit}",
        f"- machine: {os.cpu_count()} CPUs ({cpu_model()}; bf16 instructions: {bf16_flags() or 'none'}), torch "
        f"{torch.__version__} "
        f"(threads {torch.get_num_threads()}), transformers {transformers.__version__}",
        f"- reproduce: `{cmd.strip()}`",
        f"- {len(PROMPTS)} prompts, decoders interleaved prompt by prompt, {args.reps} rounds; medians [min, max]",
        "",
        f"**Autoregressive, {args.tokens} new tokens (tokens/s):**",
        "",
        "| decoder | median | min | max |",
        "|---|---:|---:|---:|",
    ]
    for k, xs in ar.items():
        L.append(f"| {k} | {stats(xs)[0]:.1f} | {stats(xs)[1]:.1f} | {stats(xs)[2]:.1f} |")
    hf = ar["transformers generate"]
    for name in tables:
        ratio = [a / b for a, b in zip(ar[f"engine ar {name}"], hf)]
        L.append(f"\nEngine {name} / transformers fp32, paired per prompt: median {np.median(ratio):.2f}x [{min(ratio):.2f}, "
                 f"{max(ratio):.2f}]")
    if "bf16" in tables:
        ratio = [a / b for a, b in zip(ar["engine ar bf16"], ar["engine ar fp32"])]
        L.append(f"\n**Engine bf16 / fp32, paired per prompt: median {np.median(ratio):.2f}x [{min(ratio):.2f}, "
                 f"{max(ratio):.2f}]**")
    floors = {name: (lambda n, b=BYTES[name]: floor_seconds(roof, n, args.context, b)) for name in tables}
    L += [
        "",
        f"**Floors of this device:** read bandwidth {roof['bandwidth_gbs']:.1f} GB/s (median sum of a 1 GiB fp32 tensor); a "
        "forward reads "
        f"{roof['matmul_params'] / 1e6:.0f}M matmul weights ({4 * roof['matmul_params'] / 1e6:.0f} MB in fp32, "
        f"{2 * roof['matmul_params'] / 1e6:.0f} MB in bf16) "
        f"plus the fp32 KV cache: 1-row floor {1e3 * floors['fp32'](1):.1f} ms fp32"
        + (f", {1e3 * floors['bf16'](1):.1f} ms bf16." if "bf16" in tables else "."),
        "",
        f"**One target forward over a tree of n nodes on a {args.context}-token cache (ms, median of {args.reps * 3}), each "
        "dtype on its kernel table; "
        "transformers (fp32) as is:**",
        "",
        "| n | " + " | ".join(f"{k} ms | {k} / {k}(1) | {k} / floor" for k in tables)
        + " | transformers ms | / transformers(1) |",
        "|---:|" + "---:|---:|---:|" * len(tables) + "---:|---:|",
    ]
    one = {k: stats(ver[(k, 1)])[0] for k in (*tables, "transformers")}
    for n in args.sizes:
        cells = []
        for k in tables:
            e = stats(ver[(k, n)])[0]
            cells.append(f"{e * 1e3:.1f} | {e / one[k]:.2f}x | {e / floors[k](n):.2f}x")
        h = stats(ver[("transformers", n)])[0]
        L.append(f"| {n} | " + " | ".join(cells) + f" | {h * 1e3:.1f} | {h / one['transformers']:.2f}x |")
    if head_t:
        L += ["", f"**One draft-head level at w=1** ({args.head or 'an untrained EAGLE-3 head of the target (timing only)'}; "
              f"head cache of {args.context} rows; right after a target step; ms, median [min, max] of "
              f"{len(next(iter(head_t.values())))}):", "",
              "| dtype | head level ms | floor ms | / floor | / target 1-row step |", "|---|---:|---:|---:|---:|"]
        for k, xs in head_t.items():
            f = head_floor_seconds(heads[k], roof, BYTES[k])
            m, lo, hi = stats(xs)
            L.append(f"| {k} | {1e3 * m:.2f} [{1e3 * lo:.2f}, {1e3 * hi:.2f}] | {1e3 * f:.2f} | {m / f:.2f}x "
                     f"| {m / one[k]:.2f} |")
    for k, table in tables.items():
        L += ["",
              f"**Kernel table, {k}** ({table.key['model']}, {table.key['threads']} threads; {table.meta.get('seconds', '?')} s "
              "of timing; "
              "`kernel->m` = padded to m rows):", "", "```", describe(table), "```"]
    for k, rows in methods.items():
        L += [
            "",
            f"**Speculative methods, {k} target, {args.tokens} new tokens (complete-request tokens/s, tau with bonus, share of "
            "cycle time outside model forwards):**",
            "",
            "| method | tokens/s | speedup vs ar | tau | outside forwards |",
            "|---|---:|---:|---:|---:|",
        ]
        base = rows["ar"]["tps"]
        for label, r in rows.items():
            sp = [a / b for a, b in zip(r["tps"], base)]
            L.append(
                f"| {label} | {np.median(r['tps']):.1f} | {np.median(sp):.2f}x [{min(sp):.2f}, {max(sp):.2f}] | "
                f"{np.median(r['tau']):.2f} | {100 * np.median(r['outside']):.1f}% |"
            )
    return "\n".join(L)


BYTES = {"fp32": 4, "bf16": 2}


def bf16_flags() -> str:
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")).split()
    except (OSError, StopIteration):
        return ""
    return ", ".join(f for f in ("avx512_bf16", "amx_bf16") if f in flags)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=REPO / "results" / ".test-cache" / "smollm2",
                    help="a model folder prepared in fp32")
    ap.add_argument("--head", type=Path,
                    help="a trained draft head folder (default: an untrained head of the target, for timing)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64])
    ap.add_argument("--write", action="store_true", help="update this script's section of docs/BENCHMARKS.md")
    args = ap.parse_args()

    from ogspo.drafter.head import EagleHead, HeadConfig
    from ogspo.drafter.runtime import load_head
    from ogspo.engine import native
    from ogspo.engine.model import load_target
    from ogspo.methods.registry import make_target
    from ogspo.stages.calibrate_kernels import calibrate_device_kernels
    from ogspo.stages.config import load_config

    model, tok = load_target(args.model, dtype="float32")
    models = {"fp32": model}
    if native.bf16_available():
        models["bf16"] = copy.deepcopy(model).to(torch.bfloat16)
    else:
        print(f"no native bf16 kernel here ({native.unavailable_reason() or 'no avx512_bf16'}): fp32 only", file=sys.stderr)
    kcfg = load_config(REPO / "config" / "default.yaml")["kernels"]
    tables = {k: calibrate_device_kernels(m, kcfg)[0] for k, m in models.items()}
    roof = roofline(model)
    targets = {k: make_target(m, max_len=1024, kernels=tables[k]) for k, m in models.items()}
    heads = {}
    for k, m in models.items():
        if args.head is not None:
            head = load_head(args.head, target_model=m)[0]
        else:
            emb = m.get_input_embeddings().weight
            cfg = HeadConfig.for_target(m, draft_vocab=8192)
            head = EagleHead(cfg, embed=emb, lm_rows=emb[: cfg.draft_vocab], d2t=torch.arange(cfg.draft_vocab)).eval()
        head.use_kernels(tables[k], next(m.parameters()).dtype)
        heads[k] = head
    ar = bench_ar(model, tok, targets, args.tokens, args.reps)
    ver = bench_verify(model, targets, args.sizes, args.context, args.reps * 3)
    head_t = bench_head(heads, targets, args.context, args.reps * 10)
    methods = {k: bench_methods(models[k], tok, targets[k], args.tokens, args.reps, tables[k]) for k in models}
    section = render(args, roof, tables, ar, ver, head_t, heads, methods)
    print(section)
    if args.write:
        write_section("bench_engine", section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
