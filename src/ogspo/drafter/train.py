"""Train the EAGLE-3-style head with training-time test, on data built from the target's own answers
(stage: `stages.train_drafter`).

Deterministic given the seed (data order, initialisation, sampling of batches). Checkpoints every
`checkpoint_every` steps into `work_dir`, and an interrupted run resumes from the last one; the
annotated data is cached by content hash in the user's cache (`data_cache_dir`), so a rerun on the
same machine does not regenerate it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ogspo.artifacts.io import atomic_write
from ogspo.artifacts.prompts import has_chat_template, render_chat
from ogspo.artifacts.settings import settings
from ogspo.artifacts.sharegpt import read_sharegpt
from ogspo.engine.kernels import KernelTable
from ogspo.engine.native import cache_root
from ogspo.engine.target import LlamaTreeLM, TreeLM, build_tree_lm, fast_path_refusal

from .budget import READ, WRITE, DataBudget, budget_steps
from .corpus import NearDuplicateIndex, TrainText, decontaminate, held_out_texts
from .data import (
    BulkPlan,
    Sequence,
    annotate_text,
    corpus_prompts,
    draft_vocabulary,
    fortune_sequences,
    generate_annotated,
    generate_batched,
    plan_bulk,
    self_instructions,
    sharegpt_texts,
    stdlib_sequences,
    train_prompts,
)
from .eagle3 import save_eagle3
from .head import EagleHead, HeadConfig
from .runtime import META


@dataclass
class TrainResult:
    path: Path
    steps: int
    train_tokens: int
    data_seconds: float
    train_seconds: float
    val_top1: list[float]  # held-out top-1 agreement with the target per TTT step
    val_loss: float
    history: list[dict] = field(default_factory=list)


TEXT_BLOCK = 100  # texts annotated and cached together: ShareGPT samples of different sizes share their first blocks


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _atomic_torch_save(obj, path: Path) -> None:
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def data_cache_dir(cfg: dict) -> Path:
    """Where the generated training data is kept between runs: `drafter.cache_dir`, else `drafter-data`
    in ogspo's one user cache ($OGSPO_CACHE, else $XDG_CACHE_HOME/ogspo or ~/.cache/ogspo); a file there
    is named by the hash of everything it was built from (target checksum, recipe, token ids)."""
    return Path(cfg["cache_dir"]) if cfg.get("cache_dir") else cache_root() / "drafter-data"


@dataclass
class DataStats:
    """How the training data was built: prompts and texts by source, what decontamination dropped,
    and this device's rates (0 where the cache had it): tokens the target wrote per second
    (generation) and tokens it read per second (annotation of text, `annotate_rows` rows a forward),
    on the kernels `plan_bulk` measured cheaper for each."""
    prompts: dict[str, int]
    near_held_out: int  # prompts dropped as near-duplicates of an eval or calib prompt
    repeats: int  # prompts dropped as near-duplicates of an earlier training prompt
    self_instructions: int  # requests the target wrote itself (before decontamination)
    generated_tokens: int  # continuation tokens the target wrote
    annotated_tokens: int  # tokens of text read as it stands (ShareGPT conversations, standard library)
    tokens: int  # all training tokens (prompts, continuations, annotated text)
    generation_seconds: float
    generation_tokens_per_second: float
    annotation_seconds: float
    annotation_tokens_per_second: float
    annotate_rows: int  # 0 where nothing was read here (all cached)
    bulk: dict  # the kernels that wrote and read the data, and their timings (`BulkPlan.describe`; empty where cached)
    sharegpt: dict  # what the ShareGPT file held and what was picked or dropped
    skipped: list[str]  # parts of the recipe this target cannot run, and why
    cached: bool
    budget: dict  # the blocks of the recipe taken within the data's budget (`DataBudget.describe`)


def _cached(path: Path, build):
    """`torch.load(path)` if it exists, else `build()` saved there atomically (so an interrupted run
    leaves nothing half-written)."""
    if path.is_file():
        return torch.load(path, weights_only=False), True
    value = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_torch_save(value, path)
    return value, False


def recipe_for_target(cfg: dict, model_config) -> tuple[dict, list[str]]:
    """The head-data recipe this target can run, and what was left out and why: sampled continuations
    and self-written requests need the Llama backend's batched forward; a family on the transformers
    backend (Gemma 3) gets greedy continuations and text only."""
    if fast_path_refusal(model_config) is None or not (cfg["sampled"] or cfg["self_instruct"]):
        return cfg, []
    why = (f"sampled continuations and self-instruction: '{model_config.model_type}' runs on the transformers backend, "
           "which has no batched forward (greedy continuations and text only)")
    return cfg | {"sampled": 0, "self_instruct": 0}, [why]


def build_data(*, model, tokenizer, target_checksum: str, workloads_dir: Path, fortunes_dir: Path | None, cfg: dict,
               head_cfg: HeadConfig, seed: int, kernels: KernelTable | None = None,
               budget: DataBudget | None = None) -> tuple[list[Sequence], DataStats]:
    """The head's training sequences, annotated with the target's features and next-token
    distributions: the target's greedy (and `sampled` T=1) continuations of every training prompt
    (workload train splits, ShareGPT user turns, corpora, its own requests), then text read as it
    stands (ShareGPT conversations, standard-library source). Every prompt and text near an eval or
    calib prompt of any workload is dropped first. The prompts are written in blocks of `gen_batch` of
    similar length, in an order shuffled by the seed, the text read in blocks of `TEXT_BLOCK`: `budget`
    (a `DataBudget`) takes a prefix of each (None: all of them). Each block is built once per content hash in
    `data_cache_dir(cfg)`, with the seconds it took; the target runs on the engine, with the device's
    kernel table (`kernels`) or torch's reference kernels, whichever `plan_bulk` measures cheaper for
    writing and for reading."""
    cache = data_cache_dir(cfg)
    budget = budget or DataBudget(seconds=None)
    lms: dict[int, TreeLM] = {}  # by id of the kernel table it runs (None: the reference kernels)
    cfg, skipped = recipe_for_target(cfg, model.config)
    bulk: BulkPlan | None = None

    def target_lm(rows: int, writes: bool):
        """The target on the kernels `plan_bulk` measured cheaper for writing (generation) or reading text."""
        nonlocal bulk
        if bulk is None:
            bulk = plan_bulk(model, kernels, feature_layers=head_cfg.feature_layers, write_rows=cfg["gen_batch"],
                             read_rows=cfg["annotate_rows"])
        table = bulk.write if writes else bulk.read
        lm = lms.get(id(table))
        if lm is None or lm.cache.max_len < rows:
            lm = lms[id(table)] = build_tree_lm(model, max_len=rows, feature_layers=head_cfg.feature_layers, kernels=table)
        return lm

    texts = train_prompts(workloads_dir=workloads_dir, tokenizer=tokenizer, chat_variants=cfg["chat_variants"],
                          max_per_workload=cfg["prompts_per_workload"] or None)
    texts += corpus_prompts(workloads_dir=workloads_dir, fortunes_dir=fortunes_dir, tokenizer=tokenizer,
                            fortunes=cfg["extra_fortunes"], functions=cfg["extra_functions"], seed=seed)
    held_out = held_out_texts(workloads_dir)
    sg, sg_texts, sg_info = cfg["sharegpt"], [], {}
    if sg["texts"] or sg["answered"]:
        if not has_chat_template(tokenizer):
            skipped.append("ShareGPT: the target has no chat template to render conversations with")
        else:
            read = read_sharegpt(sg["path"])
            sg_texts, sg_requests, sg_dropped = sharegpt_texts(
                read.conversations, tokenizer, n_text=sg["texts"], n_answer=sg["answered"],
                max_prompt_tokens=sg["max_prompt_tokens"], held_out=held_out, seed=seed)
            texts += sg_requests
            sg_info = {"records": read.records, "conversations": len(read.conversations), "truncated": read.truncated,
                       "texts": len(sg_texts), "requests": len(sg_requests), "dropped": sg_dropped}
    requests: list[str] = []
    if cfg["self_instruct"]:
        key = _hash({"v": 2, "target": target_checksum, "n": cfg["self_instruct"], "max": cfg["instruct_max_tokens"],
                     "seed": seed})

        def instruct():
            lm = target_lm(512, writes=True)
            t = time.perf_counter()
            written = self_instructions(lm, tokenizer, n=cfg["self_instruct"], max_tokens=cfg["instruct_max_tokens"],
                                        batch=cfg["gen_batch"], seed=seed + 1000)
            return {"requests": written, "seconds": time.perf_counter() - t}

        made, _ = _cached(cache / f"requests-{key}.pt", instruct)
        requests = made["requests"]
        budget.charge(made["seconds"])  # the budget's time, not the answers' rate
        texts += [TrainText("self-instruct", r, render_chat(tokenizer, r)) for r in requests]
    texts, near_held, repeats = decontaminate(texts, held_out)
    prompts = [tokenizer(t.prompt, add_special_tokens=False).input_ids for t in texts]

    recipe = {k: cfg[k] for k in ("max_new_tokens", "top_k", "sampled")} | {"v": 7, "target": target_checksum,
                                                                            "layers": head_cfg.feature_layers}

    def generate(block: list[list[int]]) -> dict:
        """The target's continuations of one block of prompts (greedy, then `sampled` T=1 passes)."""
        lm = target_lm(max(cfg["gen_rows"], max(len(p) for p in block) + cfg["max_new_tokens"]), writes=True)
        t = time.perf_counter()
        kw = dict(max_new_tokens=cfg["max_new_tokens"], top_k=cfg["top_k"], eos_token_id=tokenizer.eos_token_id)
        if not isinstance(lm, LlamaTreeLM):
            seqs = generate_annotated(lm, block, pack=cfg["gen_batch"], **kw)
        else:
            seqs = generate_batched(lm, block, batch=cfg["gen_batch"], **kw)
            for k in range(cfg["sampled"]):
                seqs += generate_batched(lm, block, batch=cfg["gen_batch"], temperature=1.0, seed=seed + 1 + k, **kw)
        return {"seqs": seqs, "seconds": time.perf_counter() - t}

    # blocks of gen_batch prompts of similar length (little padding), taken in an order shuffled by the seed
    by_length = np.argsort([len(p) for p in prompts], kind="stable").tolist()
    blocks = [by_length[a : a + cfg["gen_batch"]] for a in range(0, len(prompts), cfg["gen_batch"])]
    data, generated, gen_new, gen_s, by_source = [], 0, 0, 0.0, {}
    for b in np.random.default_rng(seed).permutation(len(blocks)).tolist():
        block = blocks[b]
        if not budget.admit("generated", WRITE, len(block)):
            continue
        ids = [prompts[i] for i in block]
        part, was_cached = _cached(cache / f"generated-{_hash(recipe | {'prompts': _hash(ids)})}.pt", lambda: generate(ids))
        budget.spend(WRITE, len(block), part["seconds"])
        written = 0
        for k, s in enumerate(part["seqs"]):  # generate_batched keeps the prompts' order, once per sampled pass
            i = block[k % len(block)]
            s.source = "answered" if texts[i].source == "sharegpt/answer" else "generated"
            written += len(s.tokens) - len(prompts[i])
        for i in block:
            by_source[texts[i].source] = by_source.get(texts[i].source, 0) + 1
        generated += written
        gen_new += 0 if was_cached else written
        gen_s += 0.0 if was_cached else part["seconds"]
        data += part["seqs"]

    # text read as it stands, by source: ShareGPT conversations (cut to sharegpt.max_tokens), standard-library
    # chunks, whole fortunes; each source in blocks of TEXT_BLOCK texts, so a larger sample reuses a smaller one's blocks
    held_index = NearDuplicateIndex(held_out)
    if cfg["fortune_tokens"] and fortunes_dir is None:
        raise ValueError("drafter.fortune_tokens needs workloads.fortunes.dir (the fortunes folder)")
    text_sources = {
        "sharegpt": [tokenizer(t.prompt, add_special_tokens=False).input_ids[: sg["max_tokens"]] for t in sg_texts],
        "stdlib": stdlib_sequences(tokenizer=tokenizer, max_tokens=cfg["stdlib_tokens"], seq_len=cfg["seq_len"] + 1, seed=seed,
                                   held_out=held_index),
        "fortunes": fortune_sequences(fortunes_dir=fortunes_dir, workloads_dir=workloads_dir, tokenizer=tokenizer,
                                      max_tokens=cfg["fortune_tokens"], seq_len=cfg["seq_len"] + 1, seed=seed,
                                      held_out=held_index) if cfg["fortune_tokens"] else [],
    }

    def read_text(block: list[list[int]]) -> dict:
        lm = target_lm(max(len(s) for s in block), writes=False)  # plans the bulk forwards first
        t = time.perf_counter()
        seqs = annotate_text(lm, block, top_k=cfg["top_k"], rows=bulk.read_rows)
        return {"seqs": seqs, "seconds": time.perf_counter() - t}

    if bulk is not None and bulk.read_seconds_per_token is not None:  # the first text block's predicted seconds
        budget.expect(READ, bulk.read_seconds_per_token)
    annotated, ann_built, ann_s = [], 0, 0.0
    for source, ids in text_sources.items():
        for a in range(0, len(ids), TEXT_BLOCK):
            block = ids[a : a + TEXT_BLOCK]
            units = sum(len(s) for s in block)
            if not budget.admit(source, READ, units):
                continue
            key = _hash({"v": 4, "target": target_checksum, "layers": head_cfg.feature_layers, "top_k": cfg["top_k"],
                         "ids": _hash(block)})
            part, was_cached = _cached(cache / f"text-{key}.pt", lambda: read_text(block))
            budget.spend(READ, units, part["seconds"])
            for s in part["seqs"]:
                s.source = source
            annotated += part["seqs"]
            ann_built += 0 if was_cached else units
            ann_s += 0.0 if was_cached else part["seconds"]

    seqs = data + annotated
    if sg_texts:
        by_source["sharegpt/text"] = sum(s.source == "sharegpt" for s in annotated)  # conversations read
    ann_tokens = int(sum(len(s.tokens) for s in annotated))
    stats = DataStats(prompts=by_source, near_held_out=near_held, repeats=repeats, self_instructions=len(requests),
                      generated_tokens=generated, annotated_tokens=ann_tokens, tokens=int(sum(len(s.tokens) for s in seqs)),
                      generation_seconds=gen_s, generation_tokens_per_second=gen_new / gen_s if gen_s else 0.0,
                      annotation_seconds=ann_s if ann_built else 0.0,
                      annotation_tokens_per_second=ann_built / ann_s if ann_built else 0.0,
                      annotate_rows=bulk.read_rows if bulk else 0, bulk=bulk.describe() if bulk else {}, sharegpt=sg_info,
                      skipped=skipped, cached=not gen_s and not ann_built, budget=budget.describe())
    return seqs, stats


def chunk_index(seqs: list[Sequence], seq_len: int) -> np.ndarray:
    """(sequence, start) of every training window of up to seq_len head positions."""
    out = []
    for i, s in enumerate(seqs):
        n = len(s.tokens) - 1  # head positions: t = 0..n-1 take (f_t, x_{t+1})
        for a in range(0, max(n, 1), seq_len):
            if n - a >= 8:
                out.append((i, a))
    return np.array(out, dtype=np.int64)


def split_windows(seqs: list[Sequence], cfg: dict, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(held-out, training) windows: a seeded `val_fraction` of all windows is held out (the same split
    for `train_drafter` and `train_gto`, given the same generator)."""
    windows = chunk_index(seqs, cfg["seq_len"])
    perm = rng.permutation(len(windows))
    n_val = max(1, int(len(windows) * cfg["val_fraction"]))
    return windows[perm[:n_val]], windows[perm[n_val:]]


def target_to_draft(d2t: torch.Tensor, vocab: int) -> torch.Tensor:
    """[vocab] draft id of every target id, -1 outside the draft vocabulary (on the CPU, where the data lives)."""
    t2d = torch.full((vocab,), -1, dtype=torch.long, device="cpu")
    t2d[d2t.cpu()] = torch.arange(len(d2t), device="cpu")
    return t2d


def window_lengths(seqs: list[Sequence], windows: np.ndarray, seq_len: int) -> np.ndarray:
    return np.array([min(seq_len, len(seqs[i].tokens) - 1 - a) for i, a in windows], dtype=np.int64)


def token_batches(lengths: np.ndarray, batch_tokens: int) -> list[np.ndarray]:
    """Windows grouped by length into batches of at most `batch_tokens` padded positions (few pad rows)."""
    order = np.argsort(lengths, kind="stable")
    out, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[i] > batch_tokens:
            out.append(np.array(cur))
            cur = []
        cur.append(i)
    if cur:
        out.append(np.array(cur))
    return out


def batch_at(batches: list[np.ndarray], step: int, seed: int) -> np.ndarray:
    """Batch of training step `step`: every epoch visits all batches in its own seeded order, so a
    resumed run continues exactly where it stopped."""
    epoch, k = divmod(step, len(batches))
    order = np.random.default_rng([seed, epoch]).permutation(len(batches))
    return batches[order[k]]


def make_batch(seqs, windows, t2d: torch.Tensor, seq_len: int, device: torch.device):
    """A training batch of `windows`, built on the CPU (where the data lives) and sent to `device`:
    (features [B, T, 3D], next tokens [B, T], draft ids [B, T, K], target probs [B, T, K], valid [B, T],
    target top-1 [B, T])."""
    B = len(windows)
    seq_len = max(min(seq_len, len(seqs[i].tokens) - 1 - a) for i, a in windows)  # trim padding
    D3 = seqs[0].feats.shape[1]
    K = seqs[0].top_ids.shape[1]
    cpu = torch.device("cpu")
    feats = torch.zeros(B, seq_len, D3, device=cpu)
    nxt = torch.zeros(B, seq_len, dtype=torch.long, device=cpu)
    tid = torch.zeros(B, seq_len, K, dtype=torch.long, device=cpu)
    tp = torch.zeros(B, seq_len, K, device=cpu)
    valid = torch.zeros(B, seq_len, dtype=torch.bool, device=cpu)
    for b, (i, a) in enumerate(windows):
        s = seqs[i]
        n = min(seq_len, len(s.tokens) - 1 - a)
        feats[b, :n] = s.feats[a : a + n].float()
        nxt[b, :n] = s.tokens[a + 1 : a + 1 + n].long()
        tid[b, :n] = s.top_ids[a + 1 : a + 1 + n].long()  # target's distribution of token t+2
        tp[b, :n] = s.top_p[a + 1 : a + 1 + n].float()
        valid[b, :n] = True
    valid &= tp.sum(-1) > 0  # prompt positions carry no target distribution
    did = t2d[tid]  # [B, T, K] draft ids, -1 outside the draft vocabulary
    tp = tp * (did >= 0)
    return tuple(t.to(device) for t in (feats, nxt, did.clamp(min=0), tp, valid, tid[..., 0]))


def step_mask(valid: torch.Tensor, j: int) -> torch.Tensor:
    """The positions TTT step j is scored on: valid ones with a root (t - j + 1 >= 0). [B, T] bool"""
    m = valid.clone()
    m[:, : j - 1] = False
    return m


def ttt_objective(head: EagleHead, batch, steps: int, decay: float, dtype: torch.dtype | None = None):
    """The TTT loss (decayed sum over steps), the per-step losses [steps] and the per-step draft logits:
    tensors only, no host synchronisation, so `torch.compile` takes the whole of it (`compile_objective`).
    Matmuls under autocast in `dtype` (None: bf16 on CUDA, fp32 elsewhere); weights and the softmax stay fp32.
    The cross-entropy against the target's top-K probabilities is sum_k p_k (logsumexp(logits) - logit_k)."""
    feats, nxt, did, tp, valid, _ = batch
    if dtype is None:
        dtype = torch.bfloat16 if feats.device.type == "cuda" else torch.float32
    with torch.autocast(feats.device.type, dtype=dtype, enabled=dtype != torch.float32):
        outs = head.forward_train(feats, nxt, steps)
    total, losses = 0.0, []
    for j, logits in enumerate(outs, start=1):
        m = step_mask(valid, j)
        lf = logits.float()  # [B, T, V']
        ce = (tp * (torch.logsumexp(lf, -1, keepdim=True) - lf.gather(-1, did))).sum(-1)  # [B, T]
        loss = (ce * m).sum() / m.sum().clamp(min=1)
        total = total + (decay ** (j - 1)) * loss
        losses.append(loss)
    return total, torch.stack(losses).detach(), outs


def ttt_loss(head: EagleHead, batch, steps: int, decay: float, *, dtype: torch.dtype | None = None, accuracy: bool = True):
    """The TTT loss (decayed sum over steps), and per step the loss and the top-1 agreement with the
    target (empty without `accuracy`: an argmax over every logit, wanted only where it is logged)."""
    total, losses, outs = ttt_objective(head, batch, steps, decay, dtype)
    accs = []
    if accuracy:
        valid, top1 = batch[4], batch[5]
        for j, logits in enumerate(outs, start=1):
            m = step_mask(valid, j)
            pred = head.d2t[logits.argmax(-1)]
            accs.append(float(((pred == top1) & m).sum() / m.sum().clamp(min=1)))
    return total, losses.tolist(), accs


def compile_objective(steps: int, decay: float, dtype: torch.dtype):
    """`ttt_objective` through `torch.compile`, for batches of any shape: the batch's rows and positions are
    marked dynamic, so one compilation serves every batch (about a minute on a 2-core CPU, once per run).
    Returns f(head, batch) -> (loss, per-step losses [steps])."""
    compiled = torch.compile(ttt_objective, dynamic=True)

    def objective(head: EagleHead, batch):
        for t in batch:
            torch._dynamo.mark_dynamic(t, 0)
            torch._dynamo.mark_dynamic(t, 1)
        total, losses, _ = compiled(head, batch, steps, decay, dtype)
        return total, losses

    return objective


TRAIN_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def step_seconds(head: EagleHead, batch, cfg: dict, dtype: torch.dtype) -> float:
    """Seconds of one eager training step (forward and backward) on `batch` in `dtype`."""
    t0 = time.perf_counter()
    loss, _, _ = ttt_loss(head, batch, cfg["ttt_steps"], cfg["ttt_decay"], dtype=dtype, accuracy=False)
    loss.backward()
    return time.perf_counter() - t0


DTYPE_TIMING_MIN_SECONDS = 60  # fp32 training shorter than this is not timed against bf16: the timing would cost more
DTYPE_DROP = 3.0  # a dtype whose step takes this many times the fastest one's is not timed further
PROBE_SHAPE = (1, 32)  # rows and positions of the batch cut the dtypes are first compared on


def probe_batch(batch, rows: int = PROBE_SHAPE[0], positions: int = PROBE_SHAPE[1]):
    """The first `rows` rows and `positions` positions of a training batch (every tensor [B, T, ...])."""
    return tuple(t[:rows, :positions] for t in batch)


def choose_train_dtype(head: EagleHead, batch, cfg: dict, *, steps: int, reps: int = 2) -> tuple[torch.dtype, dict]:
    """The dtype of the head's training matmuls: `cfg["train_dtype"]` if named, else (auto) bf16 on
    CUDA and, on a CPU, the faster of fp32 and bf16 autocast timed on `batch` (forward and backward,
    after one warm-up each, interleaved): bf16 pays where the CPU computes it (AVX512-BF16, AMX) and
    is emulated, several times slower, where it does not. Where `steps` fp32 steps would take under
    `DTYPE_TIMING_MIN_SECONDS` fp32 is kept untimed against bf16. bf16 is first compared with fp32 on
    a cut of the batch (`probe_batch`: a second step each, the first warming up), and not timed on
    the whole batch where it takes `DTYPE_DROP` times fp32 there (on a CPU without bf16 its warm-up
    step on the batch took 52-55 s against 1.6 s in fp32); nor further where its warm-up step does.
    Returns the dtype and the median step seconds of each dtype timed (a dtype dropped after its
    warm-up: that step's seconds; after the cut's comparison: "<dtype> on the cut" and fp32's there)."""
    name = cfg["train_dtype"]
    if name == "auto" and batch[0].device.type != "cpu":
        name = "bfloat16"
    timed = TRAIN_DTYPES if name == "auto" else {name: TRAIN_DTYPES[name]}
    warm: dict[str, float] = {}
    probed: dict[str, float] = {}
    for k, dt in timed.items():  # fp32 first
        if name == "auto" and k != "float32":
            cut = probe_batch(batch)
            on_cut = {j: [step_seconds(head, cut, cfg, TRAIN_DTYPES[j]) for _ in range(2)][-1] for j in ("float32", k)}
            if on_cut[k] > DTYPE_DROP * on_cut["float32"]:
                probed = {f"{j} on the cut": v for j, v in on_cut.items()}
                continue
        warm[k] = step_seconds(head, batch, cfg, dt)
        if name == "auto" and k == "float32" and warm[k] * steps < DTYPE_TIMING_MIN_SECONDS:
            break
    timed = {k: dt for k, dt in timed.items() if k in warm and warm[k] <= DTYPE_DROP * min(warm.values())}
    times: dict[str, list[float]] = {k: [] for k in timed}
    for _ in range(reps):
        for k, dt in timed.items():
            times[k].append(step_seconds(head, batch, cfg, dt))
    head.zero_grad(set_to_none=True)
    medians = warm | {k: float(np.median(v)) for k, v in times.items()}
    return TRAIN_DTYPES[min(medians, key=medians.get)], medians | probed


COMPILE_MIN_SECONDS = 300  # eager training time from which `train_compile: auto` compiles (a compilation: ~1 min, 2-core CPU)


def choose_compile(setting, *, steps: int, step_seconds: float) -> bool:
    """Whether the training steps run through `torch.compile` (`compile_objective`): `drafter.train_compile`
    if true or false; auto: where the eager run would take `COMPILE_MIN_SECONDS` or more, so the one
    compilation pays (measured on the 2-core Intel Xeon: a compiled bf16 step 0.30-0.38 s against 0.45-0.62 s eager)."""
    if setting != "auto":
        return bool(setting)
    return steps * step_seconds >= COMPILE_MIN_SECONDS


REPLAN = (10, 30)  # steps after the start between which the step time is measured again, then the steps re-planned


def _train_steps(head, opt, sched, params, *, seqs, train, batches, t2d, cfg: dict, seed: int, start: int, history: list,
                 checkpoint, dtype: torch.dtype, compiled: bool, replan: tuple[float, int] | None = None) -> str | None:
    """Steps start..cfg["steps"] of training (appending to `history`), saving a resumable checkpoint
    every `checkpoint_every` steps; checkpoint = (path, run key, numpy generator). With `compiled`,
    the unlogged steps run `compile_objective` (logged steps stay eager: they take an argmax over the
    logits). `replan` = (deadline, the recipe's steps): at `REPLAN` the steps are fitted again to the
    deadline (`time.perf_counter` seconds) at the step time measured since the compilation, and
    cfg["steps"] (which the learning-rate schedule reads) set. Returns why compilation fell back to
    eager steps (no C++ compiler, say), or None."""
    ckpt, run_key, rng = checkpoint
    objective = compile_objective(cfg["ttt_steps"], cfg["ttt_decay"], dtype) if compiled else None
    fallback, mark = None, None
    head.train()
    bar = tqdm(desc="train draft head", unit="step", initial=start, total=cfg["steps"])
    step = start - 1
    while step + 1 < cfg["steps"]:
        step += 1
        bar.update(1)
        if replan is not None and step == start + REPLAN[0]:
            mark = time.perf_counter()
        elif replan is not None and step == start + REPLAN[1]:
            per_step = (time.perf_counter() - mark) / (REPLAN[1] - REPLAN[0])
            deadline, full = replan
            cfg["steps"] = step + budget_steps(full - step, seconds_left=deadline - time.perf_counter(), step_seconds=per_step)
            bar.total = cfg["steps"]
        batch = make_batch(seqs, train[batch_at(batches, step, seed)], t2d, cfg["seq_len"], head.d2t.device)
        logged = step % 25 == 0 or step == cfg["steps"] - 1
        opt.zero_grad(set_to_none=True)
        stepped = False
        if objective is not None and not logged:
            try:  # the backward graph compiles at the first backward: it fails there, if anywhere
                loss, _ = objective(head, batch)
                loss.backward()
                stepped = True
            except Exception as e:  # noqa: BLE001 - inductor's failures (a missing compiler, say) leave eager steps
                objective, fallback = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                opt.zero_grad(set_to_none=True)
        if not stepped:
            loss, losses, accs = ttt_loss(head, batch, cfg["ttt_steps"], cfg["ttt_decay"], dtype=dtype, accuracy=logged)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if logged:
            history.append({"step": step, "loss": losses, "top1": accs})
            bar.set_postfix(loss=f"{losses[0]:.3f}", top1=f"{accs[0]:.3f}")
        if (step + 1) % cfg["checkpoint_every"] == 0 and step + 1 < cfg["steps"]:
            _atomic_torch_save(
                {"key": run_key, "head": head.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                 "step": step + 1, "steps": cfg["steps"], "history": history, "rng": rng.bit_generator.state,
                 "torch_rng": torch.get_rng_state()},
                ckpt,
            )
    bar.close()
    return fallback


def _validate(head: EagleHead, seqs: list[Sequence], val: np.ndarray, t2d: torch.Tensor, cfg: dict, batch_tokens: int,
              dtype: torch.dtype | None = None):
    """Summed held-out TTT losses and top-1 agreements per step, and the number of batches."""
    head.eval()
    with torch.no_grad():
        vl, va, nb = np.zeros(cfg["ttt_steps"]), np.zeros(cfg["ttt_steps"]), 0
        for b in token_batches(window_lengths(seqs, val, cfg["seq_len"]), batch_tokens):
            batch = make_batch(seqs, val[b], t2d, cfg["seq_len"], head.d2t.device)
            _, losses, accs = ttt_loss(head, batch, cfg["ttt_steps"], cfg["ttt_decay"], dtype=dtype)
            vl += losses
            va += accs
            nb += 1
    return vl, va, nb


def write_head(head: EagleHead, meta: dict, out_dir: Path, *, target_config) -> None:
    """The drafter folder: the head in EAGLE-3's format (`drafter.eagle3`) and ogspo's `drafter.json`,
    built beside `out_dir` and renamed over it."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    save_eagle3(head, tmp, target_config=target_config)
    (tmp / META).write_text(json.dumps(meta, indent=1))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)


def train_drafter(
    *,
    model,
    tokenizer,
    target_checksum: str,
    workloads_dir: Path,
    out_dir: Path,
    work_dir: Path,
    fortunes_dir: Path | None = None,
    config: dict | None = None,
    seed: int = 0,
    kernels: KernelTable | None = None,
) -> TrainResult:
    """Build (or read from the cache) the training data, then train the head into `out_dir`, all within
    `drafter.minutes` (`budget.py`: the data's blocks within its `data_share`, then the steps
    within the rest), or exactly the blocks and steps of `drafter.sizes`."""
    cfg = settings("drafter", config)
    cfg.pop("gto")  # stage train_gto's settings
    head_cfg = HeadConfig.for_target(model, draft_vocab=cfg["draft_vocab"])
    t0 = time.perf_counter()
    fixed = cfg["sizes"]
    timed = cfg["minutes"] is not None and fixed is None
    budget = DataBudget(seconds=cfg["minutes"] * 60 * cfg["data_share"]) if timed else DataBudget.replay(fixed)
    seqs, stats = build_data(model=model, tokenizer=tokenizer, target_checksum=target_checksum, workloads_dir=workloads_dir,
                             fortunes_dir=fortunes_dir, cfg=cfg, head_cfg=head_cfg, seed=seed, kernels=kernels, budget=budget)
    return train_head(model=model, tokenizer=tokenizer, target_checksum=target_checksum, seqs=seqs, cfg=cfg, seed=seed,
                      out_dir=out_dir, work_dir=work_dir, data_seconds=time.perf_counter() - t0, data_stats=asdict(stats),
                      deadline=t0 + cfg["minutes"] * 60 if timed else None,
                      fixed_steps=None if fixed is None else fixed["steps"])


def train_head(*, model, tokenizer, target_checksum: str, seqs: list[Sequence], cfg: dict, seed: int, out_dir: Path,
               work_dir: Path, data_seconds: float = 0.0, data_stats: dict | None = None, deadline: float | None = None,
               fixed_steps: int | None = None) -> TrainResult:
    """Train a head on `seqs` for `cfg["epochs"]` passes (cfg: the full `drafter` settings without `gto`),
    or fewer steps where they would end after `deadline` (`time.perf_counter` seconds; `budget_steps`
    at the measured step time), or exactly `fixed_steps`; write its folder to `out_dir`; checkpoints go
    to `work_dir`."""
    cfg = dict(cfg)
    torch.manual_seed(seed)
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    head_cfg = HeadConfig.for_target(model, draft_vocab=cfg["draft_vocab"])
    d2t = draft_vocabulary(seqs, size=head_cfg.draft_vocab, vocab=head_cfg.vocab, always=[tokenizer.eos_token_id])
    t2d = target_to_draft(d2t, head_cfg.vocab)
    head = EagleHead(head_cfg, embed=model.get_input_embeddings().weight, lm_rows=model.lm_head.weight[d2t], d2t=d2t,
                     train_lm_head=cfg["train_lm_head"])
    head.init_from_target(model)

    rng = np.random.default_rng(seed)
    val, train = split_windows(seqs, cfg, rng)
    windows = chunk_index(seqs, cfg["seq_len"])
    batch_tokens = cfg["batch_size"] * cfg["seq_len"]
    lengths = window_lengths(seqs, train, cfg["seq_len"])
    batches = token_batches(lengths, batch_tokens)
    full = max(1, math.ceil(cfg["epochs"] * len(batches)))  # epochs set the steps: the data sets the work
    fullest = max(batches, key=lambda b: len(b) * int(lengths[b].max()))  # the most padded positions: a typical step's shape
    dtype, dtype_timing = choose_train_dtype(head, make_batch(seqs, train[fullest], t2d, cfg["seq_len"], head.d2t.device), cfg,
                                             steps=full)
    step_s = dtype_timing[str(dtype).removeprefix("torch.")]
    reserve = len(token_batches(window_lengths(seqs, val, cfg["seq_len"]), batch_tokens)) * step_s / 2 + 5  # validation, writing
    deadline = None if deadline is None else deadline - reserve
    cfg["steps"] = fixed_steps or budget_steps(full, seconds_left=None if deadline is None else deadline - time.perf_counter(),
                                               step_seconds=step_s)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / cfg["warmup"]) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / cfg["steps"])))
    )
    run_key = _hash({k: v for k, v in cfg.items() if k != "steps"}  # the steps a budget sets are in the checkpoint
                    | {"seed": seed, "n_windows": len(windows), "tokens": sum(len(s.tokens) for s in seqs), "full": full})
    ckpt = work_dir / "checkpoint.pt"
    start, history = 0, []
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        if state["key"] == run_key:
            head.load_state_dict(state["head"])
            opt.load_state_dict(state["opt"])
            sched.load_state_dict(state["sched"])
            start, history, cfg["steps"] = state["step"], state["history"], state["steps"]
            rng.bit_generator.state = state["rng"]
            torch.set_rng_state(state["torch_rng"])
    compiled = choose_compile(cfg["train_compile"], steps=cfg["steps"] - start, step_seconds=step_s)
    t1 = time.perf_counter()
    fallback = _train_steps(head, opt, sched, params, seqs=seqs, train=train, batches=batches, t2d=t2d, cfg=cfg, seed=seed,
                            start=start, history=history, checkpoint=(ckpt, run_key, rng), dtype=dtype, compiled=compiled,
                            replan=None if deadline is None or fixed_steps else (deadline, full))
    train_s = time.perf_counter() - t1

    vl, va, nb = _validate(head, seqs, val, t2d, cfg, batch_tokens, dtype=dtype)
    n_tokens = int(sum(len(s.tokens) for s in seqs))
    meta = {
        "kind": "eagle3-head",
        "target_checksum": target_checksum,
        "train": cfg | {"seed": seed},
        "metrics": {"val_loss_step1": float(vl[0] / nb), "val_top1": (va / nb).tolist(), "train_tokens": n_tokens,
                    "data": data_stats, "data_seconds": data_seconds, "train_seconds": train_s, "steps": cfg["steps"],
                    "recipe_steps": full,  # the data's blocks and the steps taken: drafter.sizes for a rerun
                    "sizes": None if data_stats is None else data_stats["budget"]["taken"] | {"steps": cfg["steps"]},
                    "train_dtype": str(dtype).removeprefix("torch."), "train_dtype_step_seconds": dtype_timing,
                    "train_compiled": compiled and fallback is None, "train_compile_fallback": fallback,
                    "history": history},
    }
    out_dir = Path(out_dir)
    write_head(head, meta, out_dir, target_config=model.config)
    if ckpt.is_file():
        ckpt.unlink()
    return TrainResult(path=out_dir, steps=cfg["steps"], train_tokens=n_tokens, data_seconds=data_seconds, train_seconds=train_s,
                       val_top1=(va / nb).tolist(), val_loss=float(vl[0] / nb), history=history)
