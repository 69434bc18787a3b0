"""The engine on a CUDA machine that may have no package registry, no network and a small upload:
this uses that machine's own torch / transformers / numpy (no snakemake, polars or pyscipopt) and
imports only ogspo's engine and draft-head runtime from `src/` (run it through gpu_check.sh).

1. Lossless on the device, with tiny Llama models built here: in fp32 a chain, a static tree and an
   EAGLE-3 dynamic tree (early-exit drafter and an EAGLE-style head) equal transformers' greedy
   decoding token for token; in bf16 they are compared with bf16 autoregressive decoding of the
   same engine, and every difference is reported with the target's top-2 margin there (near-ties).
   T=1 runs too (same seed twice, same tokens).
2. The `ogspo` method as it decodes: a policy head (random weights: the decisions vary, the lossless
   property must not) exported to ONNX by `learn.export`, loaded by `methods.ogspo` with the device's
   onnxruntime providers (the faster per call is kept) and called as the stop hook after every level;
   fp32 decoding equals transformers' greedy decoding. Reports the providers and seconds per call.
3. Timing on a model of SmolLM2-135M's shape with random weights (timing does not depend on weight
   values; the GGUF need not travel): autoregressive decoding by the engine and by transformers'
   `generate`, verify(n)/verify(1) for tree sizes up to 128, and one draft-head level over w
   frontier nodes, and whole speculative cycles (EAGLE-3 dynamic trees and a chain with the random head:
   drafting, verification and the rest per cycle, against one autoregressive step). CUDA events time
   every region; medians over repeats.

Prints one Markdown table (and writes it to $OUT/gpu_check.md where $OUT is set)."""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from ogspo.drafter.head import EagleHead, HeadConfig  # noqa: E402
from ogspo.drafter.runtime import EagleDrafter  # noqa: E402
from ogspo.engine.decode import SpeculativeEngine  # noqa: E402
from ogspo.engine.drafters import LMDrafter  # noqa: E402
from ogspo.engine.policies import Autoregressive, DynamicTree, StaticTree, chain  # noqa: E402
from ogspo.engine.target import LlamaTreeLM, build_tree_lm, synchronize  # noqa: E402
from ogspo.engine.tree import DraftTree, Structure, ancestor_matrix  # noqa: E402
from ogspo.learn.export import write_policy_folder  # noqa: E402
from ogspo.methods.features import FEATURE_NAMES  # noqa: E402
from ogspo.methods.ogspo import make_ogspo  # noqa: E402

# SmolLM2-135M-Instruct's shape (its config.json)
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
               tie_word_embeddings=True)
PROMPTS = ([3, 7, 11], [9, 1, 4, 4, 20, 33, 2])


def tiny_llama(seed: int, *, dtype, device, layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, bos_token_id=0,
                      eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def random_head(model, draft_vocab: int, seed: int = 0) -> EagleHead:
    torch.manual_seed(seed)
    cfg = HeadConfig.for_target(model, draft_vocab=draft_vocab)
    dev = model.model.embed_tokens.weight.device
    d2t = torch.arange(draft_vocab, device=dev) + (model.config.vocab_size - draft_vocab)
    head = EagleHead(cfg, embed=model.model.embed_tokens.weight, lm_rows=model.lm_head.weight[d2t], d2t=d2t)
    for p in head.parameters():
        p.data.normal_(0, 0.3)
    return head.eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _policies():
    return [chain(4), StaticTree(Structure([[0], [1], [0, 0], [1, 0], [0, 0, 0]])),
            DynamicTree(total_tokens=12, depth=4, top_k=3)]


def check_lossless(device: torch.device, n: int = 30) -> list[str]:
    """Rows of the lossless table; raises on an fp32 mismatch."""
    rows = []
    target_model = tiny_llama(0, dtype=torch.float32, device=device)
    eagle = EagleDrafter(random_head(target_model, 48), max_len=256)
    target = LlamaTreeLM(target_model, max_len=256, feature_layers=eagle.feature_layers)
    early = LMDrafter(LlamaTreeLM(tiny_llama(1, dtype=torch.float32, device=device), max_len=256))
    checked = 0
    for prompt in PROMPTS:
        ref = hf_greedy(target_model, prompt, n)
        for policy in _policies():
            for drafter in (early, eagle):
                got = SpeculativeEngine(target=target, policy=policy, drafter=drafter).generate(prompt, max_new_tokens=n).tokens
                if got != ref:
                    raise AssertionError(f"fp32 {policy.name} + {drafter.name} differs from greedy on {device}: {got} vs {ref}")
                checked += 1
        a = SpeculativeEngine(target=target, policy=_policies()[2], drafter=eagle,
                              temperature=1.0).generate(prompt, max_new_tokens=n, seed=4)
        b = SpeculativeEngine(target=target, policy=_policies()[2], drafter=eagle,
                              temperature=1.0).generate(prompt, max_new_tokens=n, seed=4)
        if a.tokens != b.tokens:
            raise AssertionError(f"T=1 decoding with one seed is not reproducible on {device}")
    rows.append(f"| fp32 T=0: 3 policies x 2 drafters x {len(PROMPTS)} prompts vs transformers greedy | {checked}/{checked} "
                "identical |")
    rows.append("| fp32 T=1: dynamic tree, same seed twice | identical |")
    bf = tiny_llama(0, dtype=torch.bfloat16, device=device)
    bt = LlamaTreeLM(bf, max_len=256)
    bd = LMDrafter(LlamaTreeLM(tiny_llama(1, dtype=torch.bfloat16, device=device), max_len=256))
    same, ties = 0, []
    for prompt in PROMPTS:
        ar = SpeculativeEngine(target=bt, policy=Autoregressive()).generate(prompt, max_new_tokens=n).tokens
        for policy in _policies():
            got = SpeculativeEngine(target=bt, policy=policy, drafter=bd).generate(prompt, max_new_tokens=n).tokens
            if got == ar:
                same += 1
                continue
            i = next(k for k, (x, y) in enumerate(zip(got, ar)) if x != y)
            with torch.inference_mode():
                logits = bf(torch.tensor([prompt + ar[:i]], device=device)).logits[0, -1].float()
            top = logits.topk(2)
            ties.append(f"{policy.name} at token {i} (top-2 margin {float(top.values[0] - top.values[1]):.3g})")
    total = len(PROMPTS) * len(_policies())
    rows.append(f"| bf16 T=0: 3 policies x {len(PROMPTS)} prompts vs bf16 autoregressive | {same}/{total} identical"
                + (f"; differ: {'; '.join(ties)}" if ties else "") + " |")
    return rows


def check_ogspo_method(device: torch.device, n: int = 30) -> list[str]:
    """Rows for the `ogspo` method: an exported ONNX stop policy inside the decoding loop on `device`."""
    import tempfile

    import onnxruntime as ort

    target_model = tiny_llama(0, dtype=torch.float32, device=device)
    eagle = EagleDrafter(random_head(target_model, 48), max_len=256)
    target = LlamaTreeLM(target_model, max_len=256, feature_layers=eagle.feature_layers)
    early = LMDrafter(LlamaTreeLM(tiny_llama(1, dtype=torch.float32, device=device), max_len=256))
    torch.manual_seed(5)
    head = torch.nn.Sequential(torch.nn.Linear(len(FEATURE_NAMES), 16), torch.nn.Tanh(), torch.nn.Linear(16, 1),
                               torch.nn.Flatten(0))  # features [B, F] -> advantage [B]
    S = Structure([[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 0, 0, 0]])
    checked, calls, stops, seconds = 0, 0, 0, []
    with tempfile.TemporaryDirectory() as tmp:
        write_policy_folder(head=head, structure=S, lam=0.5, out_dir=Path(tmp), info={"source": "gpu_check"})
        policy = make_ogspo(policy_path=tmp, device=str(device))

        def timed_hook(tree, level, ctx) -> bool:  # the policy's own hook, timed call by call
            t0 = time.perf_counter()
            stop = policy.hook(tree, level, ctx)
            seconds.append(time.perf_counter() - t0)
            return stop

        for prompt in PROMPTS:
            ref = hf_greedy(target_model, prompt, n)
            for drafter in (early, eagle):
                engine = SpeculativeEngine(target=target, policy=policy, drafter=drafter, stop_hook=timed_hook)
                got = engine.generate(prompt, max_new_tokens=n).tokens
                if got != ref:
                    raise AssertionError(f"fp32 ogspo + {drafter.name} differs from greedy on {device}: {got} vs {ref}")
                checked += 1
        calls, stops = policy.hook.calls, policy.hook.stops
    measured = ", ".join(f"{p} {s * 1e6:.0f} us" for p, s in policy.hook.provider_seconds.items()) or "the only one"
    return [f"| fp32 T=0: ogspo (ONNX stop policy, {calls} calls, {stops} stops) x 2 drafters x {len(PROMPTS)} prompts "
            f"vs transformers greedy | {checked}/{checked} identical |",
            f"| onnxruntime {ort.__version__}: providers available | {', '.join(ort.get_available_providers())} |",
            f"| ogspo policy: provider chosen (timed per single-state call) | {policy.hook.providers[0]} ({measured}) |",
            f"| ogspo policy: one stop decision in the loop (features + ONNX call), median | {np.median(seconds) * 1e6:.0f} us |"]


class Timer:
    """Seconds of a region on `device` (CUDA events there, perf_counter on the CPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def __call__(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(self.device)
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def time_engine(device: torch.device, *, dtype, tokens: int, reps: int, sizes: list[int], context: int) -> list[str]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).to(device=device, dtype=dtype).eval()
    timer = Timer(device)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, SMOLLM2["vocab_size"], 64)]
    drafter = EagleDrafter(random_head(model, 8192), max_len=context + max(sizes) + tokens + 128)
    target = build_tree_lm(model, max_len=context + max(sizes) + tokens + 128, feature_layers=drafter.feature_layers)
    engine = SpeculativeEngine(target=target, policy=Autoregressive())
    ids = torch.tensor([prompt], device=device)
    ours, theirs = [], []
    for r in range(reps + 1):  # the first round warms up
        a = timer(lambda: engine.generate(prompt, max_new_tokens=tokens))
        b = timer(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                         min_new_tokens=tokens, do_sample=False, pad_token_id=0))
        if r:
            ours.append(tokens / a)
            theirs.append(tokens / b)
    rows = [f"| AR decoding, engine ({dtype}) | {np.median(ours):.1f} tok/s |",
            f"| AR decoding, transformers generate ({dtype}) | {np.median(theirs):.1f} tok/s |",
            f"| engine / transformers | {np.median(ours) / np.median(theirs):.2f}x |"]
    # verify(n): a binary tree of n nodes (heap order: node i's parent is (i - 1) // 2) after `context` committed rows
    engine.generate(prompt + prompt * (context // len(prompt)), max_new_tokens=1)
    cache = target.cache
    filled = cache.length
    times = {}
    for n in sizes:
        parents = (np.arange(n) - 1) // 2  # [n], root -1
        depths = np.floor(np.log2(np.arange(n) + 1)).astype(np.int64)  # [n]
        toks = torch.as_tensor(np.arange(n) % 1000, device=device)
        pos = torch.as_tensor(filled + depths, device=device)
        att = None if n == 1 else torch.as_tensor(ancestor_matrix(parents, depths), device=device)
        samples = []
        for r in range(reps + 2):
            cache.length, cache.pending = filled, 0
            dt = timer(lambda: target.forward(toks, pos, att))
            cache.commit(None)
            if r >= 2:
                samples.append(dt)
        times[n] = float(np.median(samples))
    rows.append(f"| verify(1) at context {context} | {times[1] * 1e3:.2f} ms |")
    rows += [f"| verify({n}) / verify(1) | {times[n] / times[1]:.2f} |" for n in sizes if n > 1]
    # one draft-head level over w frontier nodes
    pre = target.prefill(prompt)
    for w in (1, 4, 16):
        samples = []
        for r in range(reps + 2):
            drafter.begin(prompt, pre)
            tree = DraftTree.from_root(int(prompt[-1]))
            exp = drafter.expand(tree, np.zeros(1, dtype=np.int64), w)
            kids = tree.add_children(parents=np.zeros(w, dtype=np.int64), tokens=exp.tokens[0], ranks=np.arange(w),
                                     logq=exp.logq[0], entropy=np.repeat(exp.entropy, w))
            synchronize(device)
            dt = timer(lambda: drafter.expand(tree, kids, 4))
            if r >= 2:
                samples.append(dt)
        rows.append(f"| one head level, w={w} frontier nodes | {np.median(samples) * 1e3:.2f} ms |")
    # whole cycles with the random head (acceptance ~0: each cycle commits ~1 token, so the figures are
    # the cost of one cycle, not a speed-up)
    ar = engine.generate(prompt, max_new_tokens=tokens)
    step = float(np.median([c.cycle_seconds for c in ar.cycles]))
    rows.append(f"| AR step (engine, whole cycle) | {step * 1e3:.2f} ms |")
    for policy in (DynamicTree(total_tokens=60, depth=5, top_k=10), DynamicTree(total_tokens=8, depth=3, top_k=2), chain(4)):
        spec = SpeculativeEngine(target=target, policy=policy, drafter=drafter)
        cycles = []
        for r in range(reps + 1):
            res = spec.generate(prompt, max_new_tokens=tokens // 2)
            if r:
                cycles += res.cycles
        cyc, dr, ve, rest = (float(np.median(x)) * 1e3 for x in zip(*[(c.cycle_seconds, sum(c.draft_seconds), c.verify_seconds,
                                                                          c.other_seconds) for c in cycles]))
        rows.append(f"| cycle {policy.name}: whole / draft / verify / rest (medians) | {cyc:.2f} / {dr:.2f} / {ve:.2f} / "
                    f"{rest:.2f} ms ({cyc / (step * 1e3):.2f} AR steps) |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run, e.g. on a CPU)")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    lines = [f"## GPU check (benchmarks/gpu_check.sh) on {name}", "",
             f"torch {torch.__version__}; {time.strftime('%Y-%m-%d')}", "", "| check | result |", "|---|---|"]
    sizes = [1, 2, 4, 8] if args.quick else [1, 2, 4, 8, 16, 32, 64, 128]
    sections = [("lossless", lambda: check_lossless(device)), ("ogspo method", lambda: check_ogspo_method(device))]
    for dtype in ([torch.float32] if args.quick else [torch.bfloat16, torch.float32]):
        sections.append((f"timing {dtype}", lambda dtype=dtype: time_engine(
            device, dtype=dtype, tokens=8 if args.quick else 128, reps=1 if args.quick else 5, sizes=sizes,
            context=64 if args.quick else 512)))
    failed = []
    for title, section in sections:  # a failing section is a row of the table; the others still run
        try:
            rows = section()
        except Exception as exc:  # noqa: BLE001 - reported, and the exit status says so
            traceback.print_exc()
            rows = [f"| {title} | FAILED: {exc.__class__.__name__}: {exc} |"]
            failed.append(title)
        print("\n".join(rows), flush=True)
        lines += rows
    lines += ["", f"({time.perf_counter() - t0:.0f} s)"]
    text = "\n".join(lines)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.md").write_text(text + "\n")
    if failed:
        print(f"gpu_check: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
