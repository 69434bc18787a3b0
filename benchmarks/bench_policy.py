"""Cost of the OGSPO stop policy at decode time: ONNX (onnxruntime, CPU) and torch head per call, and the
whole stop hook (features from the draft tree + ONNX decision), for a tree of config/default.yaml's
template; set against a SmolLM2-135M cycle on this CPU (~50-150 ms). Writes its section of docs/BENCHMARKS.md.

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 .venv/bin/python benchmarks/bench_policy.py [--calls 3000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchdoc import cpu_model, stats, write_section  # noqa: E402

from ogspo.artifacts.settings import default_settings  # noqa: E402
from ogspo.engine.policies import CycleContext  # noqa: E402
from ogspo.engine.tree import DraftTree, Structure  # noqa: E402
from ogspo.learn.export import export_policy
from ogspo.learn.policy import PolicyHead
from ogspo.methods.features import N_FEATURES, History, state_features
from ogspo.methods.ogspo import OnnxPolicy
from ogspo.stages.config import load_config


def random_tree(S: Structure, rng: np.random.Generator) -> DraftTree:
    """The full tree of structure S (breadth-first), random tokens and drafter log-probs."""
    tree = DraftTree.from_root(1)
    paths = [()]
    for level in range(1, S.max_depth + 1):
        par, rk = [], []
        for i, p in enumerate(paths):
            if len(p) == level - 1:
                for r in range(S.n_children.get(p, 0)):
                    par.append(i), rk.append(r)
        lq = np.log(rng.dirichlet(np.ones(8), len(par))[:, 0])
        tree.add_children(parents=np.array(par), tokens=rng.integers(0, 1000, len(par)), ranks=np.array(rk),
                          logq=lq, entropy=rng.random(len(par)) * 3)
        paths += [paths[p] + (r,) for p, r in zip(par, rk)]
    return tree


def per_call_us(fn, calls: int, repeats: int = 5) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append(1e6 * (time.perf_counter() - t0) / calls)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=3000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(REPO / "config" / "default.yaml")
    tcfg = cfg["records"]["template"]
    S = Structure.full(tcfg["widths"][: tcfg["depth"]])
    rng = np.random.default_rng(0)
    tree = random_tree(S, rng)
    hidden = default_settings("policy")["hidden"]
    head = PolicyHead(N_FEATURES, hidden).eval()
    with tempfile.TemporaryDirectory() as tmp:
        export_policy(head=head, path=Path(tmp) / "policy.onnx", structure=S, lam=1.0)
        pol = OnnxPolicy(Path(tmp) / "policy.onnx")
        ctx = CycleContext(context_length=300, request_seed=0, index=2, prompt_length=200)
        level = S.max_depth // 2
        f = state_features(tree, level, context_length=300, history=History(2.0, 2.0))
        x = torch.from_numpy(f[None])
        rows = {}
        with torch.no_grad():
            rows["torch head (1 state)"] = per_call_us(lambda: head(x), args.calls)
        rows["ONNX head (1 state)"] = per_call_us(lambda: pol.decide(f), args.calls)
        rows[f"features at level {level} ({len(tree) - 1}-node tree)"] = per_call_us(
            lambda: state_features(tree, level, context_length=300, history=History(2.0, 2.0)), args.calls)
        rows["whole hook (features + ONNX)"] = per_call_us(lambda: pol(tree, level, ctx), args.calls)
    hook = stats(rows["whole hook (features + ONNX)"])[0]
    per_cycle = hook * (S.max_depth - 1)  # at most one call per drafted level but the last
    lines = [
        "## Stop policy cost (bench_policy)", "",
        f"CPU: {cpu_model()}, 1 thread; head {N_FEATURES}-{hidden}-{hidden}-1 "
        f"(random weights), template {len(S)} nodes / depth {S.max_depth}; {args.calls} calls x 5 repeats.", "",
        "| per call | median us | min | max |", "|---|---|---|---|",
    ]
    for name, xs in rows.items():
        med, lo, hi = stats(xs)
        lines.append(f"| {name} | {med:.1f} | {lo:.1f} | {hi:.1f} |")
    lines += ["", f"Worst case per cycle ({S.max_depth - 1} decisions): {per_cycle / 1e3:.2f} ms = "
              f"{100 * per_cycle / 50e3:.2f}% of a 50 ms cycle, {100 * per_cycle / 150e3:.2f}% of a 150 ms cycle "
              "(SmolLM2-135M on this CPU)."]
    text = "\n".join(lines)
    print(text)
    write_section("bench_policy", text)


if __name__ == "__main__":
    main()
