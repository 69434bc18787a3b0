"""Training data for the draft head: the target's own continuations of prompts (the `train` split of
the workloads, ShareGPT user turns, requests it writes itself, corpora), and text read as it stands
(ShareGPT conversations through the chat template, Python standard-library source); per position
the target's features (low/mid/high hidden states) and top-K next-token distribution, from the
generation passes or from teacher-forced passes over the text. Eval and calib prompts are never used."""

from __future__ import annotations

import ast
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
import torch
from tqdm.auto import tqdm

from ogspo.artifacts.prompts import (
    adds_bos,
    fortune_entries,
    has_chat_template,
    read_fortunes,
    render_chat,
    render_conversation,
    render_raw,
)
from ogspo.artifacts.sharegpt import Conversation
from ogspo.engine.kernels import KernelTable
from ogspo.engine.target import TreeLM, build_tree_lm, fast_path_refusal

from .corpus import NearDuplicateIndex, TrainText, clean_request, user_turn_prefix

CHAT_VARIANTS = {
    "humaneval": "Complete the following Python function and explain it briefly:\n\n{text}",
    "fortunes": "Continue this thought in a few sentences: {text}",
}
# Chat requests around corpus text (extra prompts), used in turn.
FORTUNE_QUESTIONS = (
    "Continue this thought in a few sentences: {text}",
    "What does this saying mean, and do you agree with it? \"{text}\"",
    "Write a short story that begins with: {text}",
)
FUNCTION_QUESTIONS = (
    "Explain what the following Python function does:\n\n{text}",
    "Write a Python function `{name}` that does the following: {doc}",
)


def store_features(x: torch.Tensor) -> torch.Tensor:
    """Target features as stored, on the CPU: float16 where they fit its range, else bfloat16 (float32's
    range at the same size): Gemma's residual stream reaches 1e5, past float16's 65504, where float16
    made them inf and the head's loss NaN."""
    half = x.to(torch.float16)
    return (half if bool(torch.isfinite(half).all()) else x.to(torch.bfloat16)).cpu()


def join_features(chunks: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """Stored feature chunks joined along `dim`, in bfloat16 if any chunk needed it."""
    common = torch.bfloat16 if any(c.dtype == torch.bfloat16 for c in chunks) else chunks[0].dtype
    return torch.cat([c.to(common) for c in chunks], dim)


@dataclass
class Sequence:
    tokens: torch.Tensor  # [n] int32
    feats: torch.Tensor | None = None  # [n, 3D] target hidden states (`store_features`) at the feature layers
    top_ids: torch.Tensor | None = None  # [n, K] int32 target top-K ids of the next token
    top_p: torch.Tensor | None = None  # [n, K] float16 their probabilities
    source: str | None = None  # "generated" / "answered" (the target's own answer to a train prompt / a ShareGPT
    # user turn), "sharegpt", "stdlib" or "fortunes" (text read as it stands)


BULK_ROWS = (64, 128, 256, 512)  # rows of the causal forwards timed for reading text (the generation batch is added)
BULK_MARGIN = 0.10  # the table's kernels are kept unless the reference kernels are this much cheaper per token


@dataclass
class BulkPlan:
    """How the target runs while it builds the head's data, measured on the device (`plan_bulk`).

    Decoding needs the kernel table's batch-invariant kernels (a row's bits must not depend on the
    tree size); the head's data does not: it is read and written in forwards of 64-512 rows, where
    torch's reference kernels (oneDNN, AMX where the CPU has it) can be several times faster than
    the native ones the table picks for trees (Intel Xeon with AMX, bf16: 1,050-1,400 against
    380-440 tokens/s of reading text). Either gives the target's features and distributions to
    bf16 rounding, so the faster one builds the data; the data's bits then depend on that choice,
    and the cache keeps the first build's."""
    read: KernelTable | None  # kernels of the passes over text (None: torch's reference kernels)
    read_rows: int  # rows per forward over text
    write: KernelTable | None  # kernels of the batched generation
    us_per_token: dict[str, float] = field(default_factory=dict)  # "table@64", "reference@512", ...: median causal forward

    @property
    def read_seconds_per_token(self) -> float | None:
        """Seconds a token of text costs at the rows and kernels chosen for reading, as timed (None: not timed)."""
        us = self.us_per_token.get(f"{'reference' if self.read is None else 'table'}@{self.read_rows}")
        return None if us is None else us / 1e6

    def describe(self) -> dict:
        name = lambda t: "reference" if t is None else "table"  # noqa: E731
        return {"read": name(self.read), "read_rows": self.read_rows, "write": name(self.write),
                "us_per_token": {k: round(v, 1) for k, v in self.us_per_token.items()}}


def plan_bulk(model, kernels: KernelTable | None, *, feature_layers, write_rows: int, read_rows: int | None = None,
              reps: int = 3, margin: float = BULK_MARGIN) -> BulkPlan:
    """Time causal forwards of `BULK_ROWS` rows (and `write_rows`, the generation batch) through the
    target with the device's kernel table and with torch's reference kernels, interleaved, after one
    warm-up round; read text at the (kernels, rows) cheapest per token (`read_rows` if given) and
    generate with the kernels cheaper at `write_rows` rows. The table wins within `margin`. A target
    without the Llama backend (or without a table) has one way to run: nothing is timed."""
    if kernels is None or fast_path_refusal(model.config) is not None:
        fixed_rows = read_rows or (kernels.cheapest_rows(64) if kernels is not None else max(BULK_ROWS))
        return BulkPlan(read=kernels, read_rows=fixed_rows, write=kernels)
    rows = sorted({*(BULK_ROWS if read_rows is None else (read_rows,)), write_rows})
    lms = {name: build_tree_lm(model, max_len=max(rows), feature_layers=feature_layers, kernels=table)
           for name, table in (("table", kernels), ("reference", None))}
    g = torch.Generator(device="cpu").manual_seed(0)
    vocab = model.config.vocab_size
    times: dict[tuple[str, int], list[float]] = {(n, m): [] for n in lms for m in rows}
    cells = list(times)
    with torch.inference_mode():
        for r in range(reps + 1):
            for i in torch.randperm(len(cells), generator=g).tolist():
                name, m = cells[i]
                lm = lms[name]
                tokens = torch.randint(vocab, (m,), generator=g).to(lm.device)
                lm.cache.reset()
                t0 = time.perf_counter()
                lm.forward(tokens, torch.arange(m, device=lm.device), None)
                if r:
                    times[cells[i]].append((time.perf_counter() - t0) * 1e6 / m)
                lm.cache.reset()
    us = {f"{n}@{m}": float(np.median(v)) for (n, m), v in times.items()}
    return choose_bulk(us, kernels, write_rows=write_rows, read_rows=read_rows, margin=margin)


def choose_bulk(us_per_token: dict[str, float], kernels: KernelTable, *, write_rows: int, read_rows: int | None,
                margin: float = BULK_MARGIN) -> BulkPlan:
    """The plan from timings {"table@64": us per token, "reference@64": ..., ...}: text is read at
    the (kernels, rows) cheapest per token (rows `read_rows` if given), generation runs on the kernels
    cheaper at `write_rows`; the table's kernels are kept unless the reference is cheaper by more than
    `margin` (they give decoding's exact numbers)."""
    t = {(name, int(m)): v for k, v in us_per_token.items() for name, m in [k.split("@")]}
    cells = list(t)

    def best(candidates: list[tuple[str, int]]) -> tuple[str, int]:
        fastest = min(candidates, key=t.get)
        table = min((c for c in candidates if c[0] == "table"), key=t.get)
        return table if t[table] <= (1 + margin) * t[fastest] else fastest

    read_name, read_at = best([c for c in cells if read_rows is None or c[1] == read_rows])
    write_name, _ = best([c for c in cells if c[1] == write_rows])
    table_of = {"table": kernels, "reference": None}
    return BulkPlan(read=table_of[read_name], read_rows=read_at, write=table_of[write_name], us_per_token=dict(us_per_token))


def train_prompts(*, workloads_dir: Path, tokenizer, chat_variants: bool, max_per_workload: int | None) -> list[TrainText]:
    """The `train` prompts of every workload (plus chat variants), in a fixed order."""
    out: list[TrainText] = []
    for path in sorted(Path(workloads_dir).glob("*.parquet")):
        df = pl.read_parquet(path).filter(pl.col("split") == "train").sort("prompt_id")
        if max_per_workload:
            df = df.head(max_per_workload)
        name = path.stem
        for row in df.iter_rows(named=True):
            out.append(TrainText(f"{name}/train", row["text"], row["prompt"]))
            if chat_variants and name in CHAT_VARIANTS:
                request = CHAT_VARIANTS[name].format(text=row["text"])
                out.append(TrainText(f"{name}/chat", request, render_chat(tokenizer, request)))
    if not out:
        raise ValueError(f"no train prompts found under {workloads_dir} (run prepare_workloads first)")
    return out


def stdlib_sequences(*, tokenizer, max_tokens: int, seq_len: int, seed: int, held_out: NearDuplicateIndex | None = None
                     ) -> list[list[int]]:
    """Chunks of Python standard-library source, a seeded sample of files, up to max_tokens; a chunk
    near a held-out prompt (`held_out`) is left out."""
    if max_tokens <= 0:
        return []
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size < 200_000)
    rng = np.random.default_rng(seed)
    bos = [tokenizer.bos_token_id] if adds_bos(tokenizer) else []  # each chunk starts as the model expects a text to
    out, total = [], 0
    for i in rng.permutation(len(files)):
        ids = tokenizer(files[i].read_text(errors="replace"), add_special_tokens=False).input_ids
        for s in range(0, len(ids) - 32, seq_len - len(bos)):
            chunk = ids[s : s + seq_len - len(bos)]
            if held_out is not None and held_out.near(tokenizer.decode(chunk)):
                continue
            out.append(bos + chunk)
            total += len(out[-1])
            if total >= max_tokens:
                return out
    return out


def workload_prompt_ids(workloads_dir: Path) -> set[str]:
    """The prompt id of every prompt the workloads selected, in any split."""
    used: set[str] = set()
    for path in Path(workloads_dir).glob("*.parquet"):
        used |= set(pl.read_parquet(path, columns=["prompt_id"])["prompt_id"].to_list())
    return used


def fortune_sequences(*, fortunes_dir: Path, workloads_dir: Path, tokenizer, max_tokens: int, seq_len: int, seed: int,
                      held_out: NearDuplicateIndex) -> list[list[int]]:
    """Whole fortunes the workloads did not select, as text for the target to read: a seeded sample, each
    fortune on one line (spacing flattened, as the workload's prompts), packed behind one another with a
    blank line between them into chunks of up to `seq_len` tokens, up to `max_tokens`. A fortune near a
    held-out prompt (`held_out`) is left out. What the fortunes workload decodes at T=1 is text of this kind,
    and reading it costs a prefill, not the generation a continuation prompt costs."""
    if max_tokens <= 0:
        return []
    used = workload_prompt_ids(workloads_dir)
    pool = [" ".join(entry.split()) for pid, entry in fortune_entries(Path(fortunes_dir)) if pid not in used]
    bos = [tokenizer.bos_token_id] if adds_bos(tokenizer) else []
    sep = tokenizer("\n\n", add_special_tokens=False).input_ids
    out, cur, total = [], list(bos), 0
    for i in np.random.default_rng(seed).permutation(len(pool)):
        if held_out.near(pool[i]):
            continue
        ids = tokenizer(pool[i], add_special_tokens=False).input_ids
        piece = (sep if len(cur) > len(bos) else []) + ids
        if len(cur) + len(piece) > seq_len and len(cur) > len(bos):
            out.append(cur)
            total += len(cur)
            if total >= max_tokens:
                return out
            cur, piece = list(bos), ids
        cur += piece[: seq_len - len(cur)]
    if len(cur) > len(bos):
        out.append(cur)
    return out


def stdlib_functions(*, max_functions: int, seed: int, max_chars: int = 1200) -> list[tuple[str, str, str]]:
    """(name, first docstring paragraph, source through the docstring) of documented top-level functions
    of the Python standard library: HumanEval-shaped code prompts. A seeded sample, in file order."""
    if max_functions <= 0:
        return []
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(p for p in root.glob("*.py") if p.stat().st_size < 200_000):
        src = path.read_text(errors="replace")
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        lines = src.splitlines()
        for node in tree.body:
            doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
            if not doc or node.name.startswith("_") or len(doc) < 20:
                continue
            text = "\n".join(lines[node.lineno - 1 : node.body[0].end_lineno]) + "\n"
            if len(text) <= max_chars:
                out.append((node.name, " ".join(doc.strip().split("\n\n")[0].split()), text))
    rng = np.random.default_rng(seed)
    keep = sorted(rng.permutation(len(out))[:max_functions].tolist())
    return [out[i] for i in keep]


def corpus_prompts(*, workloads_dir: Path, fortunes_dir: Path | None, tokenizer, fortunes: int, functions: int,
                   seed: int) -> list[TrainText]:
    """Extra training prompts from corpora on every machine, never a workload prompt: fortunes the
    workloads did not select (as continuation prompts and as chat requests) and documented functions of
    the standard library (as code prompts and as chat requests), `fortunes` and `functions` of each.
    A model without a chat template gets the continuation and code prompts only."""
    chat = has_chat_template(tokenizer)

    out: list[TrainText] = []
    if fortunes > 0:
        if fortunes_dir is None:
            raise ValueError("extra_fortunes needs workloads.fortunes.dir (the fortunes folder)")
        used = workload_prompt_ids(workloads_dir)
        pool = [p for p in read_fortunes(Path(fortunes_dir)) if p.prompt_id not in used]
        rng = np.random.default_rng(seed)
        for j, i in enumerate(sorted(rng.permutation(len(pool))[:fortunes].tolist())):
            text = pool[i].text
            out.append(TrainText("fortunes/extra", text, render_raw(tokenizer, text)))
            if chat:
                request = FORTUNE_QUESTIONS[j % len(FORTUNE_QUESTIONS)].format(text=text)
                out.append(TrainText("fortunes/chat", request, render_chat(tokenizer, request)))
    for j, (name, doc, text) in enumerate(stdlib_functions(max_functions=functions, seed=seed)):
        out.append(TrainText("stdlib/function", text, render_raw(tokenizer, text)))
        if chat:
            request = FUNCTION_QUESTIONS[j % len(FUNCTION_QUESTIONS)].format(text=text, name=name, doc=doc)
            out.append(TrainText("stdlib/chat", request, render_chat(tokenizer, request)))
    return out


@torch.inference_mode()
def self_instructions(lm, tokenizer, *, n: int, max_tokens: int, batch: int, seed: int) -> list[str]:
    """`n` requests the target writes itself (Magpie): the chat template up to the user's words, then
    the target's own sampled (T=1) user turn, up to its end-of-turn token or `max_tokens`. Requests
    too short to be one are dropped, so fewer than `n` may come back; duplicates are left to
    `corpus.decontaminate`."""
    prefix = tokenizer(user_turn_prefix(tokenizer), add_special_tokens=False).input_ids
    turns = generate_batched(lm, [prefix] * n, max_new_tokens=max_tokens, batch=batch, top_k=1,
                             eos_token_id=tokenizer.eos_token_id, temperature=1.0, seed=seed, annotate=False)
    out = []
    for s in turns:
        request = clean_request(tokenizer.decode(s.tokens[len(prefix):].tolist(), skip_special_tokens=False))
        if request is not None:
            out.append(request)
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
    dev = lm.device  # the target's device; the returned sequences live on the CPU
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
            own = torch.zeros(n, len(owner), dtype=torch.bool, device=dev)
            attend = torch.cat([own, torch.ones(n, n, dtype=torch.bool, device=dev).tril_()], dim=1)  # [n, pending + n]
            fwd = lm.forward(torch.tensor(prompts[i], device=dev), torch.arange(n, device=dev), attend)
            owner += [j] * n
            feats[j].append(store_features(fwd.features))
            tops[j].append(_top(fwd.logits, top_k))  # [n, K]
            last.append(int(fwd.logits[-1].argmax()))
        active = [j for j in range(len(idx)) if max_new_tokens > 1 and last[j] != eos_token_id]
        for _ in range(max_new_tokens - 1):
            if not active:
                break
            own = torch.tensor(owner, device=dev)[None, :] == torch.tensor(active, device=dev)[:, None]  # [m, pending]
            attend = torch.cat([own, torch.eye(len(active), dtype=torch.bool, device=dev)], dim=1)  # [m, pending + m]
            positions = torch.tensor([len(toks[j]) for j in active], device=dev)
            fwd = lm.forward(torch.tensor([last[j] for j in active], device=dev), positions, attend)
            ids, probs = _top(fwd.logits, top_k)  # [m, K]
            stored = store_features(fwd.features)  # [m, F]
            nxt = fwd.logits.argmax(-1).tolist()
            for r, j in enumerate(active):
                toks[j].append(last[j])
                owner.append(j)
                feats[j].append(stored[r : r + 1])
                tops[j].append((ids[r : r + 1], probs[r : r + 1]))
                last[j] = int(nxt[r])
            active = [j for j in active if last[j] != eos_token_id]
        for j, i in enumerate(idx):
            out[i] = Sequence(
                tokens=torch.tensor(toks[j], dtype=torch.int32, device="cpu"),
                feats=join_features(feats[j]),
                top_ids=torch.cat([t[0] for t in tops[j]]),
                top_p=torch.cat([t[1] for t in tops[j]]),
            )
        bar.update(len(idx))
    bar.close()
    return out  # type: ignore[return-value]


def _top(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids (int32) and probabilities (float16) of the softmax over the last dim, on the CPU."""
    top = torch.softmax(logits.float(), -1).topk(k, dim=-1)
    return top.indices.to(torch.int32).cpu(), top.values.to(torch.float16).cpu()


@torch.inference_mode()
def generate_batched(
    lm, prompts: list[list[int]], *, max_new_tokens: int, batch: int, top_k: int, eos_token_id: int | None,
    temperature: float = 0.0, seed: int = 0, annotate: bool = True,
) -> list[Sequence]:
    """The target's continuation of each prompt (greedy, or sampled at `temperature`), with its
    features and top-K next-token distribution at every position, from the generation passes
    (tokens only with `annotate=False`).

    Prompts, shortest first, decode `batch` at a time with a batch dimension (`lm.forward_batch`,
    the Llama backend): left-padded to a common length, each row attending to its own rows only.
    The last emitted token (EOS or the token at `max_new_tokens`) is never fed back: the sequence
    ends before it, and its distribution is the target's at the last position."""
    # sampling draws on the CPU from one generator per prompt: the same data on every device and batch size
    gens = ([torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + i) for i in range(len(prompts))]
            if temperature > 0 else [])
    dev = lm.device
    order = np.argsort([len(p) for p in prompts], kind="stable")
    out: list[Sequence | None] = [None] * len(prompts)
    bar = tqdm(total=len(prompts), desc="target continuations", unit="prompt")
    for s in range(0, len(order), batch):
        idx = order[s : s + batch]
        B, P = len(idx), max(len(prompts[i]) for i in idx)
        tokens = torch.zeros(B, P, dtype=torch.long, device=dev)
        positions = torch.zeros(B, P, dtype=torch.long, device=dev)
        valid = torch.ones(B, P + max_new_tokens, dtype=torch.bool, device=dev)
        for r, i in enumerate(idx):
            n = len(prompts[i])
            tokens[r, P - n :] = torch.tensor(prompts[i], device=dev)
            positions[r, P - n :] = torch.arange(n, device=dev)
            valid[r, : P - n] = False
        cache = lm.new_batch_cache(B, P + max_new_tokens)
        fwd = lm.forward_batch(tokens, positions, cache, valid)
        feats, tops = [], []
        if annotate:
            feats.append(store_features(fwd.features))  # [B, P, F]
            tops.append(_top(fwd.logits, top_k))  # [B, P, K]
        fed = torch.zeros(B, dtype=torch.long, device=dev)  # continuation tokens fed back per row
        alive = torch.ones(B, dtype=torch.bool, device=dev)
        last = positions[:, -1]
        for _ in range(max_new_tokens - 1):
            logits = fwd.logits[:, -1]  # [B, vocab]
            if temperature > 0:
                probs = torch.softmax(logits.float() / temperature, -1).cpu()  # [B, vocab]
                nxt = torch.cat([torch.multinomial(probs[r], 1, generator=gens[i]) for r, i in enumerate(idx)]).to(dev)
            else:
                nxt = logits.argmax(-1)
            if eos_token_id is not None:
                alive &= nxt != eos_token_id
            if not alive.any():
                break
            fed += alive
            last = last + 1
            fwd = lm.forward_batch(nxt[:, None], last[:, None], cache, valid)
            tokens = torch.cat([tokens, nxt[:, None]], 1)  # [B, P + steps]
            if annotate:
                feats.append(store_features(fwd.features))
                tops.append(_top(fwd.logits, top_k))
        tokens, fed = tokens.cpu(), fed.cpu()
        if not annotate:
            for r, i in enumerate(idx):
                out[i] = Sequence(tokens=tokens[r, P - len(prompts[i]) : P + int(fed[r])].to(torch.int32))
            bar.update(B)
            continue
        feats_all = join_features(feats, 1)  # [B, P + steps, F]
        ids_all, p_all = torch.cat([t[0] for t in tops], 1), torch.cat([t[1] for t in tops], 1)
        for r, i in enumerate(idx):
            a, b = P - len(prompts[i]), P + int(fed[r])
            out[i] = Sequence(tokens=tokens[r, a:b].to(torch.int32), feats=feats_all[r, a:b].clone(),
                              top_ids=ids_all[r, a:b].clone(), top_p=p_all[r, a:b].clone())
        bar.update(B)
    bar.close()
    return out  # type: ignore[return-value]


@torch.inference_mode()
def annotate_text(lm: TreeLM, seqs: list[list[int]], *, top_k: int, rows: int) -> list[Sequence]:
    """Teacher-forced passes of the engine's target over whole texts (the device's kernels, any family
    the engine runs): features and top-K next-token distributions at every position, the same numbers
    a decode of that text computes. A text runs as causal chunks of `rows` new rows over its own
    committed rows; `lm.cache` must hold the longest text."""
    out: list[Sequence] = []
    dev = lm.device
    bar = tqdm(total=sum(len(s) for s in seqs), desc="target features", unit="tok")
    for seq in seqs:
        lm.cache.reset()
        feats, ids, probs = [], [], []
        for a in range(0, len(seq), rows):
            chunk = seq[a : a + rows]
            m = len(chunk)
            fwd = lm.forward(torch.tensor(chunk, device=dev), torch.arange(a, a + m, device=dev), None)  # causal
            lm.cache.commit_prefix(m)
            feats.append(store_features(fwd.features))  # [m, F]
            i, p = _top(fwd.logits, top_k)  # [m, K]
            ids.append(i)
            probs.append(p)
        out.append(Sequence(tokens=torch.tensor(seq, dtype=torch.int32, device="cpu"), feats=join_features(feats),
                            top_ids=torch.cat(ids), top_p=torch.cat(probs)))
        bar.update(len(seq))
    bar.close()
    lm.cache.reset()
    return out


def sharegpt_texts(conversations: list[Conversation], tokenizer, *, n_text: int, n_answer: int, max_prompt_tokens: int,
                   held_out: list[str], seed: int) -> tuple[list[TrainText], list[TrainText], dict]:
    """A seeded sample of ShareGPT: `n_text` whole conversations through the chat template (user and
    assistant turns, read as text) and the first user turns of `n_answer` other conversations (chat
    requests of at most `max_prompt_tokens` tokens, for the target to answer). No text near an eval or
    calib prompt (`held_out`, word 5-gram containment as `corpus.decontaminate`), nor near an earlier
    pick. Returns (texts, requests, counts of what was dropped)."""
    held, seen = NearDuplicateIndex(held_out), NearDuplicateIndex()
    texts: list[TrainText] = []
    requests: list[TrainText] = []
    dropped = {"near_held_out": 0, "repeats": 0, "long_request": 0}
    for i in np.random.default_rng(seed).permutation(len(conversations)):
        if len(texts) >= n_text and len(requests) >= n_answer:
            break
        conv = conversations[i]
        whole = len(texts) < n_text
        text = "\n\n".join(t for _, t in conv.turns) if whole else conv.turns[0][1]
        if not whole and len(tokenizer(text, add_special_tokens=False).input_ids) > max_prompt_tokens:
            dropped["long_request"] += 1
            continue
        if held.near(text):
            dropped["near_held_out"] += 1
            continue
        if seen.near(text):
            dropped["repeats"] += 1
            continue
        seen.add(text)
        if whole:
            texts.append(TrainText("sharegpt/text", text, render_conversation(tokenizer, conv.turns)))
        else:
            requests.append(TrainText("sharegpt/answer", text, render_chat(tokenizer, text)))
    return texts, requests, dropped


def draft_vocabulary(seqs: list[Sequence], *, size: int, vocab: int, always: list[int]) -> torch.Tensor:
    """The `size` most frequent target tokens (sequence tokens and target top-1 predictions), sorted."""
    counts = torch.zeros(vocab, dtype=torch.long, device="cpu")
    for s in seqs:
        counts += torch.bincount(s.tokens.long(), minlength=vocab)
        counts += torch.bincount(s.top_ids[s.top_p[:, 0] > 0, 0].long(), minlength=vocab)
    for t in always:
        if t is not None:
            counts[t] = counts.max() + 1
    ids = counts.argsort(descending=True, stable=True)[:size]
    return ids.sort().values
