"""Stage `measure_drafter`: acceptance of the trained heads on held-out `eval` prompts.

Per workload and temperature, for every head (the train_drafter head and its GTO fine-tune): a chain
on `prompts_per_workload` prompts (acceptance per depth, with the cycles behind each figure), and on
the first `speed_prompts_per_workload` of them, side by side and interleaved prompt by prompt, the
autoregressive target and EAGLE-3 dynamic trees of several sizes (tau, bonus included, and
complete-request throughput). And two ceilings on acceptance: how much of the target's next-token mass
each head's draft vocabulary holds on the greedy continuations of those prompts, and, at T > 0, the
target's largest next-token probability at each chain cycle's root: drafted tokens are point-mass
proposals (`engine.verify`), so a first drafted token is accepted with at most that probability, whatever
the head (at T = 0 the ceiling is 1).

**Within `minutes`.** Prompts run in rounds: round i decodes eval prompt i of every workload at every
temperature, so a budget cut leaves every cell the same prompts. A round is started while the seconds
spent plus the chain rounds' mean seconds so far (`DataBudget`; the speed rounds, which run more
methods, predict nothing for the chain-only ones after them) fit the budget less what the
teacher-forced ceilings after the rounds take (`FINISH_SHARE`); the speed rounds and the first chain
round always run. What was taken is recorded (`rounds`), and `prompts_per_workload` set to it with
`minutes: null` replays it."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
import torch
from tqdm.auto import tqdm

from ogspo.artifacts.io import write_text
from ogspo.drafter.budget import WRITE, DataBudget
from ogspo.drafter.recall import continuation_recall
from ogspo.engine.decode import CycleTrace, SpeculativeEngine
from ogspo.engine.model import load_target, model_checksum
from ogspo.engine.policies import Autoregressive, DynamicTree, chain
from ogspo.engine.target import synchronize
from ogspo.engine.tree import DraftTree
from ogspo.engine.verify import target_probs
from ogspo.methods.registry import make_drafter, make_target


@dataclass
class MethodFigures:
    workload: str
    temperature: float
    method: str
    head: str  # which head drafted ("" for the autoregressive target)
    tau: float  # mean committed tokens per cycle, bonus included
    throughput: float  # median complete-request tokens/s over prompts
    speedup: float  # median per-prompt throughput ratio to the autoregressive target
    tokens: int
    accept_by_depth: list[float] = field(default_factory=list)  # chains: P(depth d accepted | d-1 accepted)
    depth_trials: list[int] = field(default_factory=list)  # chains: cycles that reached depth d - 1 (each figure's count)
    prompts: int = 0  # requests behind the figures
    # chains: mean over cycles of the target's largest next-token probability at the root, at this temperature;
    # the first drafted token (a point mass) is accepted with at most that probability (1 at T = 0)
    first_token_ceiling: float = float("nan")


FINISH_SHARE = 0.1  # of the budget kept for what follows the rounds (ceilings, recall, expand timing)


@dataclass
class MeasureResult:
    figures: list[MethodFigures]
    expand_ms: dict[int, float]  # median ms of one head level over w frontier nodes
    seconds: float
    prompts_per_workload: int = 0  # prompts per workload the chains ran on (the rounds taken)
    prompts_asked: int = 0  # the setting's prompts_per_workload
    budget: dict = field(default_factory=dict)  # DataBudget.describe() of the rounds (seconds None: no budget)
    max_new_tokens: int = 0
    speed_prompts_per_workload: int = 0
    # head -> workload -> {"mass": mean target probability inside the draft vocabulary, "top1": share of the
    # target's greedy tokens inside it, "positions": positions behind both}, on the T=0 continuations
    vocab_coverage: dict[str, dict[str, dict]] = field(default_factory=dict)
    # head -> workload -> top-k recall by depth on the T=0 continuations (`drafter.recall.continuation_recall`):
    # {"ks", "recall" [depth][k], "positions" [depth]}
    recall: dict[str, dict[str, dict]] = field(default_factory=dict)


@torch.inference_mode()
def vocab_coverage(target, d2t: torch.Tensor, texts: list[tuple[list[int], list[int]]]) -> dict:
    """The target's next-token mass inside the draft vocabulary `d2t` at every continuation position of
    `texts` [(prompt, continuation)], and the share of its top-1 tokens there: one teacher-forced pass each."""
    mass, top1, n = 0.0, 0, 0
    dev = target.device
    inside = torch.zeros(target.vocab_size, dtype=torch.bool, device=dev)
    inside[d2t.to(dev)] = True
    for prompt, cont in texts:
        ids = prompt + cont[:-1]  # the positions that predict each continuation token
        target.cache.reset()
        out = target.forward(torch.tensor(ids, device=dev), torch.arange(len(ids), device=dev), None)  # causal
        target.cache.reset()
        probs = torch.softmax(out.logits[len(prompt) - 1 :].float(), -1)  # [len(cont), vocab]
        mass += float(probs[:, inside].sum())
        top1 += int(inside[probs.argmax(-1)].sum())
        n += probs.shape[0]
    return {"mass": mass / max(n, 1), "top1": top1 / max(n, 1), "positions": n}


def eval_prompts(workloads_dir: Path, tokenizer, n: int) -> dict[str, list[list[int]]]:
    out = {}
    for path in sorted(Path(workloads_dir).glob("*.parquet")):
        df = pl.read_parquet(path).filter(pl.col("split") == "eval").sort("prompt_id").head(n)
        out[path.stem] = [tokenizer(p, add_special_tokens=False).input_ids for p in df["prompt"]]
    if not out:
        raise ValueError(f"no workloads under {workloads_dir}")
    return out


def time_expand(drafter, prompt: list[int], target, widths=(1, 2, 4, 8), reps: int = 20) -> dict[int, float]:
    """Median ms of one drafter level over w frontier nodes, from a real drafting state."""
    dev = target.device
    pre = target.prefill(prompt)
    out: dict[int, list[float]] = {w: [] for w in widths}
    for r in range(reps + 2):
        drafter.begin(prompt, pre)
        tree = DraftTree.from_root(int(pre.logits[-1].argmax()))
        exp = drafter.expand(tree, np.array([0]), max(widths))
        kids = tree.add_children(parents=np.zeros(max(widths), dtype=np.int64), tokens=exp.tokens[0],
                                 ranks=np.arange(max(widths)),
                                 logq=exp.logq[0], entropy=np.repeat(exp.entropy, max(widths)))
        for w in widths:  # each width expands a fresh set of depth-1 nodes: discard pending rows between
            drafter.begin(prompt, pre)
            drafter.expand(DraftTree.from_root(int(tree.tokens[0])), np.array([0]), 1)
            synchronize(dev)
            t0 = time.perf_counter()
            drafter.expand(tree, kids[:w], 4)
            synchronize(dev)
            if r >= 2:
                out[w].append((time.perf_counter() - t0) * 1e3)
    return {w: float(np.median(v)) for w, v in out.items()}


def measure_drafter(
    *,
    model_dir: Path,
    drafter_dirs: dict[str, Path],
    workloads_dir: Path,
    prompts_per_workload: int = 8,
    max_new_tokens: int = 96,
    temperatures: tuple[float, ...] = (0.0, 1.0),
    trees: tuple[tuple[int, int, int], ...] = ((60, 5, 10), (16, 4, 4), (24, 5, 4), (32, 6, 6)),
    chain_depth: int = 6,
    speed_prompts_per_workload: int | None = None,
    seed: int = 0,
    kernels=None,
    device: str = "cpu",
    minutes: float | None = None,
) -> MeasureResult:
    """Acceptance and speed of each trained head (label -> drafter folder) on held-out prompts, on
    `device`: every head runs the same policies on the same prompts, interleaved prompt by prompt.
    Chains run on every prompt; the autoregressive target and the trees on the first
    `speed_prompts_per_workload` (None: all), where the chains' speedup is taken too. Within `minutes`
    (None: every prompt), in rounds of one prompt per workload and temperature (module docstring)."""
    t_start = time.perf_counter()
    model, tok = load_target(model_dir, device=device)
    checksum = model_checksum(model_dir)
    drafters = {label: make_drafter("eagle", target_model=model, max_len=2048, path=path, target_checksum=checksum,
                                    kernels=kernels)
                for label, path in drafter_dirs.items()}
    first_drafter = next(iter(drafters.values()))
    target = make_target(model, max_len=2048, drafter=first_drafter, kernels=kernels)
    prompts = eval_prompts(workloads_dir, tok, prompts_per_workload)
    n_speed = prompts_per_workload if speed_prompts_per_workload is None else min(speed_prompts_per_workload,
                                                                                  prompts_per_workload)
    tree_policies = [DynamicTree(total_tokens=a, depth=b, top_k=c) for a, b, c in trees]
    # (head, policy, drafter, runs on every prompt): chains first, then the timed-only methods
    runs = [(label, chain(chain_depth), d, True) for label, d in drafters.items()]
    if n_speed:  # (0: acceptance only)
        runs += [("", Autoregressive(), None, False)] + [(label, p, d, False) for label,
                                                         d in drafters.items() for p in tree_policies]
    n_rounds = max(len(v) for v in prompts.values())
    greedy: dict[str, list[tuple[list[int], list[int]]]] = {w: [] for w in prompts}  # T=0 continuations of the first chain
    # no EOS: every method generates max_new_tokens, so its speedup compares the same work (at T > 0 an AR
    # request stopping at an early EOS was timed mostly on its prefill: "2.05x" on humaneval T=1)
    cells = [(temp, w) for temp in temperatures for w in prompts]
    root_pmax = {c: [[] for _ in runs] for c in cells}  # chains: the target's largest probability at each cycle's root
    acc = {c: [{"tps": [], "cycles": [], "tokens": 0, "prompts": 0} for _ in runs] for c in cells}

    def observer(into: list[float], temp: float):
        def observe(trace: CycleTrace) -> None:
            into.append(1.0 if temp == 0 else float(target_probs(trace.logits[:1].cpu(), temperature=temp).max()))
        return observe

    engines = {c: [SpeculativeEngine(target=target, policy=p, drafter=d, temperature=c[0], eos_token_id=None,
                                     cycle_observer=observer(pm, c[0]) if every else None)
                   for (_, p, d, every), pm in zip(runs, root_pmax[c])] for c in cells}
    budget = DataBudget(seconds=None if minutes is None else minutes * 60 * (1 - FINISH_SHARE))
    budget.charge(time.perf_counter() - t_start)  # loading
    bar = tqdm(total=n_rounds * len(cells), desc="measure drafter", unit="prompt")
    taken = 0  # rounds run
    for i in range(n_rounds):
        # a speed round runs more methods than the chain rounds: it is always taken and predicts none of them
        if i >= n_speed and not budget.admit("rounds", WRITE, 1):
            break
        t0, taken = time.perf_counter(), i + 1
        for temp, workload in cells:
            plist = prompts[workload]
            if i >= len(plist):
                continue
            for (_, _, _, every), a, eng in zip(runs, acc[temp, workload], engines[temp, workload]):
                if not every and i >= n_speed:
                    continue
                res = eng.generate(plist[i], max_new_tokens=max_new_tokens, seed=seed + i)
                if temp == 0 and eng is engines[temp, workload][0]:
                    greedy[workload].append((list(plist[i]), list(res.tokens)))
                a["tps"].append(res.throughput)
                a["cycles"].extend(c.accepted for c in res.cycles)
                a["tokens"] += len(res.tokens)
                a["prompts"] += 1
            bar.update(1)
        if i >= n_speed:
            budget.spend(WRITE, 1, time.perf_counter() - t0)
        else:
            budget.charge(time.perf_counter() - t0)
    figures = []
    for temp, workload in cells:
        base = np.array(acc[temp, workload][len(drafters)]["tps"] if n_speed else [])
        for (label, p, _, _), a, pm in zip(runs, acc[temp, workload], root_pmax[temp, workload]):
            cyc = np.array(a["cycles"]) - 1  # drafted tokens accepted per cycle
            by_depth, trials = [], []
            if p.name.startswith("chain") and len(cyc):
                for d in range(1, chain_depth + 1):
                    reach = int((cyc >= d - 1).sum())
                    by_depth.append(float((cyc >= d).sum() / reach) if reach else 0.0)
                    trials.append(reach)
            tps = np.array(a["tps"])
            figures.append(MethodFigures(
                workload=workload, temperature=temp, method=p.name, head=label,
                tau=float(np.mean(a["cycles"])) if a["cycles"] else 1.0,
                throughput=float(np.median(tps[:n_speed])) if n_speed else float("nan"),
                speedup=float(np.median(tps[: len(base)] / base)) if len(base) else float("nan"),
                tokens=int(a["tokens"]), accept_by_depth=by_depth, depth_trials=trials, prompts=a["prompts"],
                first_token_ceiling=float(np.mean(pm)) if pm else float("nan"),
            ))
    bar.close()
    coverage = {label: {w: vocab_coverage(target, d.head.d2t, texts) for w, texts in greedy.items() if texts}
                for label, d in drafters.items()}
    recall = {label: {w: continuation_recall(d.head, target, texts, chain_depth) for w, texts in greedy.items() if texts}
              for label, d in drafters.items()}
    first = next(iter(prompts.values()))[0]
    expand_ms = time_expand(first_drafter, first, target) if n_speed else {}
    return MeasureResult(figures=figures, expand_ms=expand_ms, seconds=time.perf_counter() - t_start,
                         prompts_per_workload=taken, prompts_asked=prompts_per_workload,
                         max_new_tokens=max_new_tokens, speed_prompts_per_workload=n_speed, vocab_coverage=coverage,
                         recall=recall, budget=budget.describe())


def write_measure(result: MeasureResult, out_json: Path, out_md: Path) -> None:
    data = {"figures": [asdict(f) for f in result.figures], "expand_ms": result.expand_ms, "seconds": result.seconds,
            "prompts_per_workload": result.prompts_per_workload, "prompts_asked": result.prompts_asked,
            "budget": result.budget, "max_new_tokens": result.max_new_tokens,
            "speed_prompts_per_workload": result.speed_prompts_per_workload, "vocab_coverage": result.vocab_coverage,
            "recall": result.recall}
    write_text(out_json, json.dumps(data, indent=1))
    write_text(out_md, render_markdown(result))


def render_markdown(result: MeasureResult) -> str:
    cut = ("" if result.prompts_per_workload >= result.prompts_asked else
           f" (of the {result.prompts_asked} asked: what `measure_drafter.minutes` held on this machine)")
    lines = [f"Chains on {result.prompts_per_workload} eval prompts per workload{cut}, the others (and every speedup) on the "
             "first "
             f"{result.speed_prompts_per_workload}; {result.max_new_tokens} new tokens per request. Acceptance by depth d is "
             "P(depth d accepted | depth d-1 reached), over the cycles that reached d-1 (in brackets). The first-token "
             "ceiling is the target's mean largest probability at the chains' roots: a drafted token is a point mass, "
             "accepted at T > 0 with at most that probability.", "",
             "| workload | T | method | head | prompts | tokens | tau | tokens/s | speedup vs ar | acceptance by depth [cycles] "
             "| first-token ceiling |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for f in result.figures:
        depth = ", ".join(f"{a:.2f} [{n}]" for a, n in zip(f.accept_by_depth, f.depth_trials))
        ceiling = "-" if np.isnan(f.first_token_ceiling) else f"{f.first_token_ceiling:.3f}"
        lines.append(f"| {f.workload} | {f.temperature:g} | {f.method} | {f.head or '-'} | {f.prompts} | {f.tokens} | "
                     f"{f.tau:.2f} "
                     f"| {f.throughput:.1f} | {f.speedup:.2f}x | {depth} | {ceiling} |")
    lines += ["", "One head level over w frontier nodes (median ms): "
              + ", ".join(f"w={w}: {ms:.1f}" for w, ms in result.expand_ms.items()), ""]
    for head, by_w in result.vocab_coverage.items():
        lines.append(f"Draft vocabulary of head {head} on the T=0 continuations: " + "; ".join(
            f"{w} {c['mass']:.3f} of the target's next-token mass, {c['top1']:.3f} of its greedy tokens ({c['positions']} "
            "positions)"
            for w, c in by_w.items()))
    for head, by_w in result.recall.items():
        for w, r in by_w.items():
            lines.append(f"Top-k recall by depth of head {head} on {w}'s T=0 continuations (k = "
                         + "/".join(map(str, r["ks"])) + "): " + "; ".join(
                             f"depth {d + 1} " + "/".join(f"{x:.2f}" for x in row) + f" [{n}]"
                             for d, (row, n) in enumerate(zip(r["recall"], r["positions"]))))
    return "\n".join(lines)
