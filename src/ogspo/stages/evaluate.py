"""Stage `evaluate`: every decoding method side by side on held-out prompts.

`evaluate_methods` runs, per temperature, workload, eval prompt and repeat, every configured method
on the same weights, every method generating the same number of tokens (EOS does not stop a request
here: equal work per pair). By default the methods of a request slot advance side by side, cycle by
cycle, each on its own fork of the target's and drafter's caches (`run_interleaved`: the machine's
drift over seconds slows them alike); `interleave: requests` runs them one after another instead, in
mirrored seeded orders per pair of slots (`slot_order`: drift linear in the position cancels). Per
request: complete-request throughput (prefill included), tau, the time split (prefill / draft / policy / verify / other; the stop
hook's time, timed by a wrapper, is taken out of "other", where the engine books it; the routing
baseline's pre-drafting decision stays in "other") and the latency model's prediction for the very
cycles that ran. At T=0 every method's tokens must equal the autoregressive output: a real mismatch
raises `LosslessError` naming method, workload and prompt; a float near-tie (`compare_greedy`) is
reported, not failed.

The `eagle-tuned` method and the best baseline of each cell come from stage `tune_eagle`
(`stages.tune_eagle`), on calib prompts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
import torch

from ogspo.analysis.summary import summarize_requests
from ogspo.artifacts.io import atomic_write, write_json
from ogspo.artifacts.oracle import read_oracle
from ogspo.artifacts.records import temperature_tag
from ogspo.drafter.budget import WRITE, DataBudget
from ogspo.engine.decode import GenerationResult
from ogspo.engine.kernels import cpu_model
from ogspo.engine.lossless import compare_greedy
from ogspo.engine.policies import DynamicTree
from ogspo.methods.harness import (
    MethodEngine,
    SpeedProbe,
    engine_handles,
    make_method_engine,
    pair_seed,
    run_slot,
    slot_order,
    slot_seed,
)
from ogspo.methods.ogspo import OgspoTree, same_tree
from ogspo.methods.registry import METHOD_RECORDS, REFERENCE, TUNED, MethodSpec, build_policy


class LosslessError(ValueError):
    """A method's T=0 output differs from autoregressive decoding (not a float near-tie)."""


AUTO = "auto"  # evaluate.minutes: what the stages before it left of the run's hour


def evaluate_minutes(evaluate: Mapping, run: Mapping, *, elapsed: float | None) -> float | None:
    """The evaluation's budget in minutes: `evaluate.minutes` where it is a number or None (every prompt);
    for `auto`, what is left of `run.minutes` after the `elapsed` minutes of the run so far (None: not
    known, a stage run on its own) less `run.tail_minutes`, and never less than `evaluate.min_minutes`:
    the last stage that decodes fills the hour, so a faster machine measures on more requests and a
    slower one keeps the rounds it had."""
    if evaluate["minutes"] != AUTO:
        return evaluate["minutes"]
    if elapsed is None:
        return evaluate["min_minutes"]
    return max(evaluate["min_minutes"], run["minutes"] - elapsed - run["tail_minutes"])


# ---------------------------------------------------------------- method artifacts


def read_calib_best(path: Path) -> tuple[dict[str, str], dict[str, float]]:
    """(workload -> the best baseline on the calib prompts: ar, eagle-tuned or sequoia; workload -> the
    share of bootstrap resamples of the tuning prompts that keep the EAGLE-3 winner) of a tune_eagle JSON."""
    data = json.loads(Path(path).read_text()) if Path(path).is_file() else None
    best = data.get("best_baseline") if isinstance(data, dict) else None
    if not isinstance(best, dict):
        raise ValueError(f"{path}: not a tune_eagle output with 'best_baseline' (rerun rule tune_eagle)")
    return {str(w): str(b) for w, b in best.items()}, dict(data.get("winner_stability") or {})


# ---------------------------------------------------------------- one request


@dataclass
class RequestRow:
    workload: str
    temperature: float
    method: str
    prompt_id: str
    repeat: int
    order: int  # position of the method in this request slot's order (`slot_order`)
    seed: int
    prompt_tokens: int
    new_tokens: int
    cycles: int
    tau: float
    mean_tree_size: float  # verified drafted nodes per cycle (root excluded)
    wall_seconds: float
    throughput: float  # complete-request tokens / s, prefill included
    prefill_seconds: float
    draft_seconds: float
    policy_seconds: float
    verify_seconds: float
    other_seconds: float
    predicted_seconds: float  # measured prefill + the latency model's time of the cycles that ran, in the request's state
    speed_factor: float  # `SpeedProbe`: the request's machine state (one-token forward over the model's, probes around it)
    predicted_throughput: float
    lossless: str  # identical | near-tie | n/a (T>0, or the reference itself)
    first_mismatch: int  # -1 when identical / n/a
    tie_margin: float  # reference top-2 logit margin at a near-tie (nan otherwise)
    tokens: list[int] = field(default_factory=list)


# ---------------------------------------------------------------- evaluate


@dataclass
class NearTie:
    method: str
    workload: str
    prompt_id: str
    repeat: int
    token: int
    margin: float


@dataclass
class EvaluateResult:
    rows: list[RequestRow]
    summary: list[dict]
    checked: int  # T=0 requests compared with the autoregressive output
    near_ties: list[NearTie]
    oracle: dict[str, float]  # temperature tag -> oracle throughput (surrogate), where given
    tuned: dict[str, dict[str, list[int]]]  # temperature tag -> workload -> eagle-tuned tree
    calib_best: dict[str, dict[str, str]]  # temperature tag -> workload -> best baseline on the calib prompts
    settings: dict
    seconds: float

    def frame(self) -> pl.DataFrame:
        return requests_frame(self.rows)


def requests_frame(rows: list[RequestRow]) -> pl.DataFrame:
    data = [asdict(r) for r in rows]
    schema = {"tokens": pl.List(pl.Int64), "temperature": pl.Float64, "tie_margin": pl.Float64,
              "predicted_seconds": pl.Float64, "predicted_throughput": pl.Float64, "speed_factor": pl.Float64}
    if not data:
        return pl.DataFrame(schema=schema)
    return pl.DataFrame(data, schema_overrides=schema)


def _cell_engines(methods: list[MethodSpec], *, temp: float, workload: str, artifacts: Mapping[str, str], policy_device: str,
                  handles: list[tuple], providers: dict, tuned: dict, skipped: list[str]) -> list[MethodEngine]:
    """One engine per method for one (temperature, workload) cell, method i on `handles[i]` (its
    target and drafter), but for a method that would draft the same fixed tree as its record's
    `same_as` there (named in `skipped`); records which onnxruntime provider each OGSPO head runs on
    (`providers`) and the tuned EAGLE-3 tree of the cell (`tuned`)."""
    engines = []
    built = [build_policy(spec, temperature=temp, workload=workload, artifacts=artifacts, policy_device=policy_device)
             for spec in methods]
    by_name = {spec.name: pol for spec, pol in zip(methods, built)}
    for spec, pol, (target, drafter) in zip(methods, built, handles):
        twin = METHOD_RECORDS[spec.kind].same_as
        if twin in by_name and same_tree(pol, by_name[twin]):  # it would time `twin`'s tree again: not run here
            skipped.append(f"{spec.name} (the same tree as {twin})")
            continue
        if isinstance(pol, OgspoTree):  # which onnxruntime provider its head runs on, and why
            providers[f"{spec.name}/{temperature_tag(temp)}/{workload}"] = {"provider": pol.hook.providers[0],
                                                                            "seconds_per_call": pol.hook.provider_seconds}
        if spec.kind == TUNED:
            tuned[workload] = [pol.total_tokens, pol.max_depth, pol.top_k] if isinstance(pol, DynamicTree) else [0, 0, 0]
        engines.append(make_method_engine(spec, pol, target=target, drafter=drafter, temperature=temp))
    return engines


def request_figures(res: GenerationResult) -> dict:
    """The RequestRow fields one generation fills (before the lossless check)."""
    return dict(new_tokens=len(res.tokens), cycles=len(res.cycles), tau=res.tau,
                mean_tree_size=float(np.mean([c.tree_size for c in res.cycles])) if res.cycles else 0.0,
                wall_seconds=res.wall_seconds, throughput=res.throughput, lossless="n/a", first_mismatch=-1,
                tie_margin=float("nan"), tokens=list(res.tokens))


def evaluate_methods(
    *,
    target,
    drafter,
    prompts: Mapping[str, list[tuple[str, list[int]]]],
    methods: list[MethodSpec],
    temperatures: list[float],
    max_new_tokens: int,
    repeats: int,
    seed: int,
    artifacts: Mapping[str, str] | None = None,
    latency=None,
    oracle: Mapping[str, float] | None = None,
    reference_model=None,
    policy_device: str = "cpu",
    tie_margin: float = 1e-4,
    light_methods: tuple[str, ...] = (),
    light_prompts: int = 0,
    progress: Callable[[str], None] | None = None,
    minutes: float | None = None,
    interleave: str = "cycles",
) -> EvaluateResult:
    """Every method on every prompt (workload -> [(prompt_id, tokens)]) at every temperature, slot by
    slot. `interleave` "cycles": the methods of a slot advance side by side (`run_interleaved`), each
    on its own fork of `target` and `drafter`; "requests": one after another on the shared ones. Either
    way in mirrored seeded orders per pair of request slots (`slot_order`: the order of the prefills and
    of ties, or of the requests). Every method of a slot generates exactly `max_new_tokens` tokens (EOS
    does not stop it: equal work per pair).
    Methods whose kind is in `light_methods` run on the first `light_prompts` prompts of each workload
    only (they keep their place in the slot's order). Before a slot's methods run, the prompt is
    prefilled once untimed, so the slot's first method does not pay for the new prompt's shapes.
    `reference_model` (an HF causal LM, default `target.hf_model`) tells near-ties from real
    mismatches at T=0; a real mismatch raises `LosslessError` at once. The calib-picked best baseline
    per cell is read from the `eagle-tuned` artifact (`tune_eagle`). One loop on purpose (~85 lines):
    a slot's order, untimed prefill, timed requests, lossless check and rows stay together, so every
    method of a slot runs under the same conditions.

    **Rounds within `minutes`** (None: every prompt). The slots run in rounds of one mirrored pair
    (slots 2k and 2k+1) of every cell, so every cell has the same prompts whenever the work stops. A
    round is started while the seconds spent plus the mean seconds of the rounds without light methods
    so far (`DataBudget`) fit; the rounds with light methods and the first one without always run."""
    if repeats < 1 or max_new_tokens < 1:
        raise ValueError(f"repeats and max_new_tokens must be >= 1, got {repeats} and {max_new_tokens}")
    if REFERENCE not in {m.kind for m in methods}:
        raise ValueError("the evaluated methods must include 'ar' (the reference)")
    if REFERENCE in light_methods:
        raise ValueError("evaluate.light_methods cannot hold 'ar' (the reference runs on every prompt)")
    artifacts = dict(artifacts or {})
    ref_model = reference_model if reference_model is not None else getattr(target, "hf_model", None)
    t_start = time.perf_counter()
    rows: list[RequestRow] = []
    near: list[NearTie] = []
    checked = 0
    tuned: dict[str, dict[str, list[int]]] = {}  # tag -> workload -> the tuned tree
    calib_best: dict[str, dict[str, str]] = {}
    stability: dict[str, dict[str, float]] = {}
    ref_name = next(m.name for m in methods if m.kind == REFERENCE)
    providers: dict[str, dict] = {}
    skipped: dict[str, list[str]] = {}  # cell -> methods not run there (the same tree as another)
    speed = SpeedProbe() if latency is not None else None
    cells = [(temp, workload) for temp in temperatures for workload in prompts]
    handles = engine_handles(target, drafter, len(methods), interleave=interleave)  # method i's, in every cell
    engines: dict[tuple[float, str], list[MethodEngine]] = {}
    for temp, workload in cells:
        tag = temperature_tag(temp)
        if TUNED in {m.kind for m in methods} and TUNED in artifacts and tag not in calib_best:
            calib_best[tag], stability[tag] = read_calib_best(Path(artifacts[TUNED].format(T=tag)))
        engines[temp, workload] = _cell_engines(methods, temp=temp, workload=workload, artifacts=artifacts,
                                                policy_device=policy_device, handles=handles,
                                                providers=providers, tuned=tuned.setdefault(tag, {}),
                                                skipped=skipped.setdefault(f"{tag}/{workload}", []))
    budget = DataBudget(seconds=None if minutes is None else minutes * 60)
    budget.charge(time.perf_counter() - t_start)
    if progress:
        progress("budget: every prompt" if minutes is None else f"budget: {minutes:.1f} minutes")
    n_slots = max(len(v) for v in prompts.values())
    taken = 0  # slots run per cell in the first repeat
    for repeat in range(repeats):
        for first in range(0, n_slots, 2):  # a round: the mirrored pair of slots first, first + 1 of every cell
            light = first < light_prompts
            if not light and not budget.admit("rounds", WRITE, 1):
                break
            t_round = time.perf_counter()
            for index in range(first, min(first + 2, n_slots)):
                for temp, workload in cells:
                    if index >= len(prompts[workload]):
                        continue
                    prompt_id, prompt = prompts[workload][index]
                    cell = engines[temp, workload]
                    rseed = slot_seed(seed, workload, prompt_id, repeat)
                    order = slot_order(len(cell), pair_seed(seed, temp, workload, index, repeat), index)
                    here = [cell[j] for j in order if cell[j].spec.kind not in light_methods or index < light_prompts]
                    target.prefill(prompt)  # untimed (every method's engine shares it): the slot's first method meets warm shapes
                    out: dict[str, RequestRow] = {}
                    timed = run_slot(here, prompt, interleave=interleave, max_new_tokens=max_new_tokens, seed=rseed,
                                     latency=latency, speed=speed)
                    for pos, (me, (res, fig)) in enumerate(zip(here, timed)):
                        if len(res.tokens) != max_new_tokens:  # pragma: no cover - the engine stops at max_new_tokens
                            raise RuntimeError(f"method '{me.spec.name}' generated {len(res.tokens)} tokens, "
                                               f"not {max_new_tokens}")
                        out[me.spec.name] = RequestRow(
                            workload=workload, temperature=float(temp), method=me.spec.name, prompt_id=str(prompt_id),
                            repeat=repeat, order=pos, seed=rseed, prompt_tokens=len(prompt), **request_figures(res), **fig)
                    if float(temp) == 0.0:
                        checked += _check_lossless(out, ref_name, prompt, workload=workload, prompt_id=str(prompt_id),
                                                   repeat=repeat, ref_model=ref_model, tie_margin=tie_margin, near=near)
                    rows.extend(out[me.spec.name] for me in here)
                    if progress:
                        progress(f"{temperature_tag(temp)} {workload} {prompt_id} r{repeat}: " + ", ".join(
                            f"{me.spec.name} {out[me.spec.name].throughput:.1f}" for me in here))
            if repeat == 0:
                taken = min(first + 2, n_slots)
            if light:
                budget.charge(time.perf_counter() - t_round)
            else:
                budget.spend(WRITE, 1, time.perf_counter() - t_round)
    frame = requests_frame(rows)
    oracle = {k: float(v) for k, v in (oracle or {}).items()}
    return EvaluateResult(
        rows=rows, summary=summarize_requests(frame, oracle=oracle, calib_best=calib_best), checked=checked,
        near_ties=near, oracle=oracle, tuned={k: v for k, v in tuned.items() if v}, calib_best=calib_best,
        seconds=time.perf_counter() - t_start,
        settings={"methods": [asdict(m) for m in methods], "temperatures": [float(t) for t in temperatures],
                  "max_new_tokens": max_new_tokens, "repeats": repeats, "seed": seed, "policy_providers": providers,
                  "light_methods": list(light_methods), "light_prompts": light_prompts, "eos_stops": False,
                  "interleave": interleave, "skipped": {c: v for c, v in skipped.items() if v},
                  "tune_winner_stability": stability, "target": target_description(target),
                  "prompts": {w: [p for p, _ in v][:taken] for w, v in prompts.items()},
                  "prompts_asked": n_slots, "budget": budget.describe()},
    )


def target_description(target) -> dict:
    """What the evaluated target is: its weights' dtype, the machine, threads, and where its matmul
    kernels come from (the kernel table's dtype and machine key, or the reference kernel)."""
    table, dev = target.kernels, target.device
    return {"dtype": str(target.dtype).removeprefix("torch."), "machine": cpu_model() if dev.type == "cpu" else str(dev),
            "threads": torch.get_num_threads(),
            "kernels": "reference" if table is None else f"{table.key.get('dtype')} table, {table.key.get('model')}"}


def _check_lossless(out: dict[str, RequestRow], ref_name: str, prompt: list[int], *, workload: str, prompt_id: str,
                    repeat: int, ref_model, tie_margin: float, near: list[NearTie]) -> int:
    """T=0: every method's tokens against the autoregressive ones; returns the number compared."""
    ref = out[ref_name].tokens
    n = 0
    for name, row in out.items():
        if name == ref_name:
            continue
        n += 1
        if row.tokens == ref:
            row.lossless = "identical"
            continue
        if ref_model is None:
            raise LosslessError(f"lossless check failed: method '{name}' differs from autoregressive decoding on "
                                f"{workload} prompt {prompt_id} (repeat {repeat}) and no reference model is given")
        rep = compare_greedy(ref_model, prompt, ref, row.tokens, tie_margin=tie_margin)
        if rep.equal:  # cannot happen (tokens differ); kept explicit
            row.lossless = "identical"
        elif rep.near_tie:
            row.lossless, row.first_mismatch, row.tie_margin = "near-tie", int(rep.first_mismatch), float(rep.margin)
            near.append(NearTie(method=name, workload=workload, prompt_id=prompt_id, repeat=repeat,
                                token=int(rep.first_mismatch), margin=float(rep.margin)))
        else:
            raise LosslessError(
                f"lossless check failed: method '{name}' on {workload} prompt {prompt_id} (T=0, repeat {repeat}): "
                f"{rep.describe()} against autoregressive decoding"
            )
    out[ref_name].lossless = "n/a"
    return n


# ---------------------------------------------------------------- inputs and outputs


def load_prompts(workload_files: list[Path], tokenizer, *, split: str, n: int) -> dict[str, list[tuple[str, list[int]]]]:
    """The first `n` prompts (by prompt_id) of `split` of each workload file, tokenised as the
    records and drafter stages do; the workload name is the file's `workload` column."""
    if n < 1:
        raise ValueError(f"prompts per workload must be >= 1, got {n}")
    out: dict[str, list[tuple[str, list[int]]]] = {}
    for path in workload_files:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"workload file {path} does not exist")
        df = pl.read_parquet(path)
        if not {"workload", "prompt_id", "split", "prompt"} <= set(df.columns):
            raise ValueError(f"{path} is not a workload table (needs workload, prompt_id, split, prompt columns)")
        df = df.filter(pl.col("split") == split).sort("prompt_id").head(n)
        if df.height == 0:
            raise ValueError(f"{path} has no '{split}' prompts")
        name = df["workload"][0]
        out[name] = [(str(pid), tokenizer(p, add_special_tokens=False).input_ids)
                     for pid, p in zip(df["prompt_id"].to_list(), df["prompt"].to_list())]
    if not out:
        raise ValueError("no workload files given")
    return out


def oracle_throughputs(paths: Mapping[str, Path]) -> dict[str, float]:
    """Temperature tag -> the oracle's throughput (results/{device}/solve/oracle_T*.json)."""
    out = {}
    for tag, path in paths.items():
        _, throughput = read_oracle(path)
        if throughput is None:
            raise ValueError(f"{path}: not an oracle JSON (no 'throughput')")
        out[tag] = throughput
    return out


def write_evaluation(result: EvaluateResult, *, requests_path: Path, summary_path: Path) -> None:
    """requests.parquet (one row per request) and summary.json. Evaluation stops at the first real
    lossless mismatch, so a written evaluation has none; its near-ties are listed."""
    frame = result.frame()
    atomic_write(requests_path, frame.write_parquet)
    write_json(summary_path, {
        "rows": result.summary,
        "lossless": {"checked": result.checked, "mismatches": 0,
                     "near_ties": [asdict(t) for t in result.near_ties]},
        "oracle": result.oracle, "eagle_tuned": result.tuned, "best_baseline_calib": result.calib_best,
        "settings": result.settings, "seconds": result.seconds,
    })
