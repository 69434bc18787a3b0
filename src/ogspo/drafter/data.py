"""Training data for the draft head: token sequences from the `train` split of the workloads (and
chat variants of them), the target's own greedy continuations, and Python standard-library
source; then, per sequence, the target's features (low/mid/high hidden states) and top-K
next-token distributions from teacher-forced prefill passes. Eval prompts are never used."""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import torch
from tqdm.auto import tqdm

CHAT_VARIANTS = {
    "humaneval": "Complete the following Python function and explain it briefly:\n\n{text}",
    "fortunes": "Continue this thought in a few sentences: {text}",
}


@dataclass
class Sequence:
    tokens: torch.Tensor  # [n] int32
    feats: torch.Tensor | None = None  # [n, 3D] float16 target hidden states at the feature layers
    top_ids: torch.Tensor | None = None  # [n, K] int32 target top-K ids of the next token
    top_p: torch.Tensor | None = None  # [n, K] float16 their probabilities


def chat_ids(tokenizer, text: str) -> list[int]:
    s = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tokenizer(s, add_special_tokens=False).input_ids


def train_prompts(*, workloads_dir: Path, tokenizer, chat_variants: bool, max_per_workload: int | None) -> list[list[int]]:
    """Token ids of the `train` prompts of every workload (plus chat variants), in a fixed order."""
    out: list[list[int]] = []
    for path in sorted(Path(workloads_dir).glob("*.parquet")):
        df = pl.read_parquet(path).filter(pl.col("split") == "train").sort("prompt_id")
        if max_per_workload:
            df = df.head(max_per_workload)
        name = path.stem
        for row in df.iter_rows(named=True):
            out.append(tokenizer(row["prompt"], add_special_tokens=False).input_ids)
            if chat_variants and name in CHAT_VARIANTS:
                out.append(chat_ids(tokenizer, CHAT_VARIANTS[name].format(text=row["text"])))
    if not out:
        raise ValueError(f"no train prompts found under {workloads_dir} (run prepare_workloads first)")
    return out


def stdlib_sequences(*, tokenizer, max_tokens: int, seq_len: int, seed: int) -> list[list[int]]:
    """Chunks of Python standard-library source, a seeded sample of files, up to max_tokens."""
    if max_tokens <= 0:
        return []
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size < 200_000)
    rng = np.random.default_rng(seed)
    out, total = [], 0
    for i in rng.permutation(len(files)):
        ids = tokenizer(files[i].read_text(errors="replace"), add_special_tokens=False).input_ids
        for s in range(0, len(ids) - 32, seq_len):
            out.append(ids[s : s + seq_len])
            total += len(out[-1])
            if total >= max_tokens:
                return out
    return out


@torch.inference_mode()
def generate_annotated(
    model, tokenizer, prompts: list[list[int]], *, max_new_tokens: int, batch_size: int,
    feature_layers: tuple[int, ...], top_k: int,
) -> list[Sequence]:
    """The target's greedy continuation of each prompt (batched, left-padded, stopped at EOS), with
    the target's features at every position and its top-K next-token distribution at every
    generated position, all from the generation pass itself (no second target pass). Prompt
    positions get no distribution (top_p = 0): they serve as context, not as training targets."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    order = np.argsort([len(p) for p in prompts], kind="stable")
    out: list[Sequence | None] = [None] * len(prompts)
    for b in tqdm(range(0, len(order), batch_size), desc="target continuations", unit="batch"):
        idx = order[b : b + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        att = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            att[r, width - len(prompts[i]) :] = 1
        res = model.generate(
            input_ids=ids, attention_mask=att, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
            return_dict_in_generate=True, output_hidden_states=True, output_logits=True,
        )
        gen = res.sequences[:, width:]  # [b, g]
        # features: step 0 holds the prompt positions, step s > 0 the s-th generated token's position
        feats = torch.cat(
            [torch.cat([step[layer + 1] for layer in feature_layers], -1) for step in res.hidden_states], dim=1
        )  # [b, width + g - 1, 3D]
        logits = torch.stack(res.logits, dim=1).float()  # [b, g, V]: distribution of generated token s
        top = torch.softmax(logits, -1).topk(top_k, dim=-1)
        for r, i in enumerate(idx):
            toks = gen[r].tolist()
            g = toks.index(eos) + 1 if eos in toks else len(toks)
            n_p = len(prompts[i])
            n = n_p + g
            seq_feats = feats[r, width - n_p : width - n_p + n]  # positions 0..n-1 (last one may be missing)
            if seq_feats.shape[0] < n:  # the final token was never fed back: drop it
                n -= 1
                g -= 1
                seq_feats = seq_feats[:n]
            top_ids = torch.zeros(n, top_k, dtype=torch.int32)
            top_p = torch.zeros(n, top_k, dtype=torch.float16)
            # position t predicts token t+1; generated token s (0-based) is token n_p + s, predicted at n_p + s - 1
            top_ids[n_p - 1 : n_p - 1 + g] = top.indices[r, :g].to(torch.int32)
            top_p[n_p - 1 : n_p - 1 + g] = top.values[r, :g].to(torch.float16)
            out[i] = Sequence(
                tokens=torch.tensor(prompts[i] + toks[:g], dtype=torch.int32),
                feats=seq_feats.to(torch.float16).clone(),
                top_ids=top_ids,
                top_p=top_p,
            )
    return out  # type: ignore[return-value]


@torch.inference_mode()
def annotate(model, seqs: list[list[int]], *, feature_layers: tuple[int, ...], top_k: int, batch_tokens: int) -> list[Sequence]:
    """Teacher-forced target passes: features and top-K next-token distributions per position."""
    order = np.argsort([len(s) for s in seqs], kind="stable")[::-1]
    out: list[Sequence | None] = [None] * len(seqs)
    i = 0
    bar = tqdm(total=sum(len(s) for s in seqs), desc="target features", unit="tok")
    while i < len(order):
        width = len(seqs[order[i]])
        n = max(1, batch_tokens // width)
        idx = order[i : i + n]
        ids = torch.zeros((len(idx), width), dtype=torch.long)
        att = torch.zeros((len(idx), width), dtype=torch.long)
        for r, j in enumerate(idx):
            ids[r, : len(seqs[j])] = torch.tensor(seqs[j])
            att[r, : len(seqs[j])] = 1
        res = model.model(input_ids=ids, attention_mask=att, output_hidden_states=True)
        feats = torch.cat([res.hidden_states[layer + 1] for layer in feature_layers], -1)  # [b, w, 3D]
        logits = model.lm_head(res.last_hidden_state)  # [b, w, V]
        top_logits, top_ids = logits.topk(top_k, dim=-1)
        top_probs = (top_logits - torch.logsumexp(logits, -1, keepdim=True)).exp()  # [b, w, K]
        for r, j in enumerate(idx):
            n_j = len(seqs[j])
            out[j] = Sequence(
                tokens=torch.tensor(seqs[j], dtype=torch.int32),
                feats=feats[r, :n_j].to(torch.float16).clone(),
                top_ids=top_ids[r, :n_j].to(torch.int32).clone(),
                top_p=top_probs[r, :n_j].to(torch.float16).clone(),
            )
        bar.update(sum(len(seqs[j]) for j in idx))
        i += len(idx)
    bar.close()
    return out  # type: ignore[return-value]


def draft_vocabulary(seqs: list[Sequence], *, size: int, vocab: int, always: list[int]) -> torch.Tensor:
    """The `size` most frequent target tokens (sequence tokens and target top-1 predictions), sorted."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(s.tokens.long(), minlength=vocab)
        counts += torch.bincount(s.top_ids[s.top_p[:, 0] > 0, 0].long(), minlength=vocab)
    for t in always:
        if t is not None:
            counts[t] = counts.max() + 1
    ids = counts.argsort(descending=True, stable=True)[:size]
    return ids.sort().values
