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

from ogspo.engine.target import TreeLM

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


def pack_prompts(lengths: list[int], *, max_new_tokens: int, pack: int, max_rows: int) -> list[np.ndarray]:
    """Prompts (shortest first) grouped into packs of at most `pack` prompts whose prompts and
    continuations fit `max_rows` cache rows."""
    order = np.argsort(lengths, kind="stable")
    out, cur, rows = [], [], 0
    for i in order:
        need = lengths[i] + max_new_tokens
        if cur and (len(cur) == pack or rows + need > max_rows):
            out.append(np.array(cur))
            cur, rows = [], 0
        cur.append(i)
        rows += need
    if cur:
        out.append(np.array(cur))
    return out


@torch.inference_mode()
def generate_annotated(
    lm: TreeLM, prompts: list[list[int]], *, max_new_tokens: int, pack: int, top_k: int, eos_token_id: int | None,
) -> list[Sequence]:
    """The target's greedy continuation of each prompt, with its features and top-K next-token
    distribution at every position, all from the generation passes themselves.

    Up to `pack` prompts decode together in one KV cache: every step feeds each unfinished
    sequence's last token as one row of a single forward whose mask lets a row see only its own
    sequence's rows (the tree-attention machinery of the engine, with a forest of chains). On a
    compute-bound CPU this runs ~2.5x faster than transformers' batched `generate` (no padding).
    The last emitted token of a sequence (EOS or the token at `max_new_tokens`) is never fed back:
    the sequence ends before it, and its distribution is the target at the last position.
    `lm` needs the feature layers of the head and a cache of at least
    max(len(prompt) + max_new_tokens) rows per prompt of a pack."""
    lengths = [len(p) for p in prompts]
    out: list[Sequence | None] = [None] * len(prompts)
    packs = pack_prompts(lengths, max_new_tokens=max_new_tokens, pack=pack, max_rows=lm.cache.max_len)
    bar = tqdm(total=len(prompts), desc="target continuations", unit="prompt")
    for idx in packs:
        cache = lm.cache
        cache.reset()
        owner: list[int] = []  # sequence of every pending cache row
        feats: list[list[torch.Tensor]] = [[] for _ in idx]
        tops: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in idx]
        toks: list[list[int]] = [list(prompts[i]) for i in idx]
        last = []
        for j, i in enumerate(idx):  # prefill each prompt: causal over its own rows only
            n = lengths[i]
            own = torch.zeros(n, len(owner), dtype=torch.bool)
            attend = torch.cat([own, torch.ones(n, n, dtype=torch.bool).tril_()], dim=1)  # [n, pending + n]
            fwd = lm.forward(torch.tensor(prompts[i]), torch.arange(n), attend)
            owner += [j] * n
            feats[j].append(fwd.features.to(torch.float16))
            top = torch.softmax(fwd.logits.float(), -1).topk(top_k, dim=-1)  # [n, K]
            tops[j].append((top.indices.to(torch.int32), top.values.to(torch.float16)))
            last.append(int(fwd.logits[-1].argmax()))
        active = [j for j in range(len(idx)) if max_new_tokens > 1 and last[j] != eos_token_id]
        for _ in range(max_new_tokens - 1):
            if not active:
                break
            own = torch.tensor(owner)[None, :] == torch.tensor(active)[:, None]  # [m, pending]
            attend = torch.cat([own, torch.eye(len(active), dtype=torch.bool)], dim=1)  # [m, pending + m]
            positions = torch.tensor([len(toks[j]) for j in active])
            fwd = lm.forward(torch.tensor([last[j] for j in active]), positions, attend)
            top = torch.softmax(fwd.logits.float(), -1).topk(top_k, dim=-1)  # [m, K]
            for r, j in enumerate(active):
                toks[j].append(last[j])
                owner.append(j)
                feats[j].append(fwd.features[r : r + 1].to(torch.float16))
                tops[j].append((top.indices[r : r + 1].to(torch.int32), top.values[r : r + 1].to(torch.float16)))
                last[j] = int(fwd.logits[r].argmax())
            active = [j for j in active if last[j] != eos_token_id]
        for j, i in enumerate(idx):
            out[i] = Sequence(
                tokens=torch.tensor(toks[j], dtype=torch.int32),
                feats=torch.cat(feats[j]),
                top_ids=torch.cat([t[0] for t in tops[j]]),
                top_p=torch.cat([t[1] for t in tops[j]]),
            )
        bar.update(len(idx))
    bar.close()
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
