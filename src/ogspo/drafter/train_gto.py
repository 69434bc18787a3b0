"""GTO fine-tuning of a trained draft head on the trees it is decoded with (stage: `stages.train_gto`).

Every step draws `groups` groups of `group` adjacent positions r of the training sequences. At each
position the current head M and the frozen reference M_ref (the `train_drafter` head) draft an
EAGLE-3 dynamic tree from the root x_{r+1}, exactly as decoding drafts it (`EagleDrafter` behind
`DynamicTree`, from the stored target features of the `context` positions before the root). One
target forward scores a whole group: the group's real tokens x_{s+1..s+m} form a chain (the *spine*)
over the committed prefix x_0..x_s, and each position's two trees hang off their root on the spine,
so every node sees exactly its own context under tree attention. From that forward, each node's
target probability (T = 1) gives the Draft Tree Reward of both trees, and greedy acceptance gives S,
the longest root path of M's tree the target accepts. `gto.group_advantages` and
`gto.clipped_surrogate` turn them into L_GTO; the log-probabilities of S under M (with gradient) and
M_ref come from the training-time-test forward over the root's context followed by S's tokens (the
rows a depth-j node attends to are the same as in decoding). The step minimises
L_token + omega * L_GTO, with L_token the head's usual TTT loss on a batch of training windows.

With omega = 0 the same steps, batches and learning rate train on L_token alone (the control run),
and no trees are drafted.
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ogspo.artifacts.settings import settings
from ogspo.engine.policies import CycleContext, DynamicTree
from ogspo.engine.target import ForwardOut, TreeLM, build_tree_lm
from ogspo.engine.tree import DraftTree, ancestor_matrix

from .budget import DataBudget
from .data import Sequence
from .gto import clipped_surrogate, group_advantages, tree_reward
from .head import EagleHead
from .runtime import EagleDrafter, load_head
from .train import (
    batch_at,
    build_data,
    make_batch,
    split_windows,
    target_to_draft,
    token_batches,
    ttt_loss,
    window_lengths,
    write_head,
)


@dataclass
class ScoredTree:
    """A drafted tree with the target's verdict on it."""

    tree: DraftTree  # the verified tree (root first)
    p: np.ndarray  # [n] target probability (T = 1) of each node's token after its root path (root: 1)
    path: np.ndarray  # [l] tokens of the longest root path the target accepts greedily (root excluded)
    reward: float  # its Draft Tree Reward


@dataclass
class GTOResult:
    steps: int
    seconds: float
    reward_before: float  # held-out Draft Tree Reward of the reference head
    reward_after: float
    accepted_before: float  # held-out mean greedy-accepted path length (tokens per tree)
    accepted_after: float
    history: list[dict] = field(default_factory=list)


def group_starts(seqs: list[Sequence], windows: np.ndarray, seq_len: int, m: int) -> np.ndarray:
    """(sequence, s) of every group of m roots s..s+m-1 inside a window whose positions all carry a
    target distribution and whose spine x_{s+1..s+m} exists: [G, 2] int64."""
    out = []
    for i, a in windows:
        s_ = seqs[i]
        n = len(s_.tokens)
        has = (s_.top_p.float().sum(-1) > 0).numpy()  # [n] position t carries the target's distribution of t+1
        end = min(a + seq_len, n - 1 - m)  # spine x_{s+m} and its successor exist
        for s in range(max(a, 1), end - m + 1, m):
            if has[s + 1 : s + m + 1].all():
                out.append((i, s))
    return np.array(out, dtype=np.int64).reshape(-1, 2)


def draft_at(drafter: EagleDrafter, policy: DynamicTree, seq: Sequence, r: int, context: int) -> DraftTree:
    """The verified tree the drafter drafts from root x_{r+1} after the `context` positions up to r."""
    w0 = max(0, r - context)
    prompt = seq.tokens[w0 : r + 1].tolist()
    dev = drafter.device
    target = ForwardOut(logits=torch.empty(0, device=dev), features=seq.feats[w0 : r + 1].to(dev))
    drafter.begin(prompt, target)
    ctx = CycleContext(context_length=len(prompt), request_seed=0, index=1, prompt_length=len(prompt))
    draft = policy.draft(drafter, int(seq.tokens[r + 1]), ctx)
    tree, _ = draft.drafted.subset(draft.verified)
    return tree


def score_group(lm: TreeLM, seq: Sequence, s: int, trees: list[list[DraftTree]], *, eta: float) -> list[list[ScoredTree]]:
    """Score trees[i][h] (head h's tree at root position s+i) with one target forward; the target's
    cache must hold x_0..x_s committed. Afterwards it also holds the spine x_{s+1..s+m}, ready for
    the next group at s+m."""
    m = len(trees)
    tokens = [seq.tokens[s + 1 : s + 1 + m].long().numpy()]
    parents = [np.arange(-1, m - 1)]
    depths = [np.arange(m)]
    spans = []  # (root position i, first row of its drafted nodes, tree) of each tree
    n = m
    for i, per_head in enumerate(trees):
        for t in per_head:
            k = len(t) - 1
            par = np.where(t.parents[1:] == 0, i, n + t.parents[1:] - 1)
            tokens.append(t.tokens[1:])
            parents.append(par)
            depths.append(i + t.depths[1:])
            spans.append((i, n, t))
            n += k
    tok = np.concatenate(tokens)
    par = np.concatenate(parents)
    dep = np.concatenate(depths)
    dev = lm.device
    attend = torch.as_tensor(ancestor_matrix(par, dep), device=dev)  # [n, n] tree attention
    start = lm.cache.length
    out = lm.forward(torch.as_tensor(tok, device=dev), torch.as_tensor(start + dep, device=dev), attend)
    logits = out.logits.float()  # [n, vocab]
    probs = torch.softmax(logits, -1)  # [n, vocab]
    best = logits.argmax(-1).cpu().numpy()  # [n]
    lm.cache.commit(torch.arange(start, start + m, device=dev))  # keep the spine
    scored: list[list[ScoredTree]] = [[] for _ in range(m)]
    for i, first, t in spans:
        rows = np.concatenate([[i], first + np.arange(len(t) - 1)])  # row of every node of t, root = spine i
        prow = rows[t.parents[1:]]  # row of each drafted node's parent
        p = np.ones(len(t))
        p[1:] = probs[torch.as_tensor(prow, device=dev), torch.as_tensor(t.tokens[1:], device=dev)].double().cpu().numpy()
        ok = np.ones(len(t), dtype=bool)
        for v in range(1, len(t)):  # parents come first
            ok[v] = ok[t.parents[v]] and best[prow[v - 1]] == t.tokens[v]
        deepest = int(np.argmax(np.where(ok, t.depths, -1)))
        path = []
        while deepest > 0:
            path.append(int(t.tokens[deepest]))
            deepest = int(t.parents[deepest])
        scored[i].append(ScoredTree(tree=t, p=p, path=np.array(path[::-1], dtype=np.int64),
                                    reward=tree_reward(t.parents, p, eta=eta)))
    return scored


def path_logprobs(heads: list[EagleHead], seqs: list[Sequence], items: list[tuple[int, int, np.ndarray]], context: int,
                  t2d: torch.Tensor) -> list[torch.Tensor]:
    """log M(S) for each item (sequence, root position r, path tokens S) under each head: [N] per head,
    with gradient for heads in training mode. The TTT forward runs over the root's context rows
    (target features) and then S's tokens; step j at row r + j - 1 is S's depth-j node."""
    depth = max(1, max(len(p) for _, _, p in items))
    N = len(items)
    rows = min(context, max(r for _, r, _ in items)) + 1 + depth
    dev = heads[0].d2t.device
    D3 = seqs[0].feats.shape[1]
    feats = torch.zeros(N, rows, D3, device="cpu")
    nxt = torch.zeros(N, rows, dtype=torch.long, device="cpu")
    root_row = np.zeros(N, dtype=np.int64)
    for b, (i, r, path) in enumerate(items):
        w0 = max(0, r - context)
        P = r - w0 + 1  # context rows, the root's pair last
        feats[b, :P] = seqs[i].feats[w0 : r + 1].float()
        nxt[b, :P] = seqs[i].tokens[w0 + 1 : r + 2].long()
        nxt[b, P : P + len(path) - 1] = torch.as_tensor(path[:-1], device="cpu")  # S's tokens feed its deeper nodes
        root_row[b] = P - 1
    feats, nxt = feats.to(dev), nxt.to(dev)
    lengths = torch.tensor([len(p) for _, _, p in items], device=dev)
    js = torch.arange(1, depth + 1, device=dev)  # [depth]
    row = torch.as_tensor(root_row, device=dev)[:, None] + js - 1  # [N, depth] row of the depth-j node
    tgt = torch.zeros(N, depth, dtype=torch.long, device=dev)
    for b, (_, _, path) in enumerate(items):
        tgt[b, : len(path)] = t2d[torch.as_tensor(path, device="cpu")].to(dev)
    on_path = js[None] <= lengths[:, None]  # [N, depth]
    out = []
    for head in heads:
        with torch.set_grad_enabled(head.training), torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            outs = head.forward_train(feats, nxt, depth, logits=False)  # depth x [N, rows, D]
            b = torch.arange(N, device=dev)
            logits = torch.stack([head.logits(o[b, row[:, j]]) for j, o in enumerate(outs)], 1)  # [N, depth, V'] at S's rows
        lp = F.log_softmax(logits.float(), -1).gather(-1, tgt[..., None])[..., 0]  # [N, depth]
        out.append((lp * on_path).sum(1))
    return out


class GroupScorer:
    """Drafts and scores groups for a head and the reference head, reusing one target prefill per group."""

    def __init__(self, lm: TreeLM, policy: DynamicTree, context: int, eta: float):
        self.lm, self.policy, self.context, self.eta = lm, policy, context, eta

    def score(self, drafters: list[EagleDrafter], seq: Sequence, s: int, m: int) -> list[list[ScoredTree]]:
        self.lm.prefill(seq.tokens[: s + 1].tolist())
        trees = [[draft_at(d, self.policy, seq, s + i, self.context) for d in drafters] for i in range(m)]
        return score_group(self.lm, seq, s, trees, eta=self.eta)


def held_out_reward(scorer: GroupScorer, drafter: EagleDrafter, seqs: list[Sequence], groups: np.ndarray,
                    m: int) -> tuple[float, float]:
    """(mean Draft Tree Reward, mean greedy-accepted path length) of the drafter's trees over `groups`."""
    rewards, accepted = [], []
    for i, s in groups:
        for (st,) in scorer.score([drafter], seqs[i], int(s), m):
            rewards.append(st.reward)
            accepted.append(len(st.path))
    return float(np.mean(rewards)), float(np.mean(accepted))


def gto_loss(head: EagleHead, reference: EagleHead, drafters: tuple[EagleDrafter, EagleDrafter], scorer: GroupScorer,
             seqs: list[Sequence], groups: np.ndarray, t2d: torch.Tensor, cfg: dict) -> tuple[torch.Tensor, dict]:
    """L_GTO over `groups` [G, 2] (sequence, first root), and its figures; `drafters` draft with
    (head, reference)."""
    m = cfg["group"]
    rewards = np.zeros((len(groups), m))
    ref_rewards = np.zeros((len(groups), m))
    items = []
    for g, (i, s) in enumerate(groups):
        for k, (cur, ref) in enumerate(scorer.score(list(drafters), seqs[i], int(s), m)):
            rewards[g, k], ref_rewards[g, k] = cur.reward, ref.reward
            items.append((int(i), int(s) + k, cur.path))
    dev = head.d2t.device
    adv = group_advantages(torch.as_tensor(rewards, device=dev), torch.as_tensor(ref_rewards, device=dev), delta=cfg["delta"])
    logp, logp_ref = path_logprobs([head, reference], seqs, items, scorer.context, t2d)
    lengths = torch.tensor([len(p) for _, _, p in items], device=dev, dtype=torch.float32)
    G = len(groups)
    loss = clipped_surrogate(logp.view(G, m), logp_ref.detach().view(G, m), lengths.view(G, m), adv.float(), eps=cfg["eps"])
    return loss, dict(gto_loss=float(loss.detach()), reward=float(rewards.mean()), reference_reward=float(ref_rewards.mean()),
                      accepted=float(lengths.mean()))


def gto_step(head: EagleHead, reference: EagleHead, drafters: tuple[EagleDrafter, EagleDrafter], scorer: GroupScorer,
             seqs: list[Sequence], groups: np.ndarray, token_batch, t2d: torch.Tensor, cfg: dict, train_cfg: dict):
    """One optimisation step's loss L_token + omega * L_GTO and its figures (omega = 0: L_token alone,
    no trees drafted)."""
    token_loss, _, _ = ttt_loss(head, token_batch, train_cfg["ttt_steps"], train_cfg["ttt_decay"])
    stats = dict(token_loss=float(token_loss.detach()))
    if cfg["omega"] == 0:
        return token_loss, stats | dict(gto_loss=0.0, reward=float("nan"), reference_reward=float("nan"), accepted=float("nan"))
    loss, more = gto_loss(head, reference, drafters, scorer, seqs, groups, t2d, cfg)
    return token_loss + cfg["omega"] * loss, stats | more


def fine_tune_gto(head: EagleHead, *, model, seqs: list[Sequence], train: np.ndarray, val: np.ndarray,
                  t2d: torch.Tensor, cfg: dict, train_cfg: dict, seed: int) -> GTOResult:
    """GTO fine-tuning of `head` in place for cfg["steps"] steps (cfg: the `drafter.gto` settings,
    train_cfg: the `drafter` settings the head was trained with; train/val: its windows; model: the
    transformers target, on the head's device)."""
    t0 = time.perf_counter()
    reference = copy.deepcopy(head).eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    total, depth, top_k = cfg["tree"]
    policy = DynamicTree(total_tokens=total, depth=depth, top_k=top_k)
    m = cfg["group"]
    # the target's cache: a sequence, then one group's spine and 2m trees; the head's: context, root, levels
    lm = build_tree_lm(model, max_len=max(len(s.tokens) for s in seqs) + m * (2 * total + 1) + 1)
    scorer = GroupScorer(lm, policy, cfg["context"], cfg["eta"])
    rows = cfg["context"] + 2 + depth * top_k
    drafters = (EagleDrafter(head, max_len=rows, drafter_id="gto"), EagleDrafter(reference, max_len=rows, drafter_id="reference"))
    train_groups = group_starts(seqs, train, train_cfg["seq_len"], m)
    val_groups = group_starts(seqs, val, train_cfg["seq_len"], m)
    if len(train_groups) == 0 or len(val_groups) == 0:
        raise ValueError(f"no groups of {m} positions with target distributions in the training data (lower drafter.gto.group)")
    val_groups = val_groups[np.random.default_rng([seed, 1]).permutation(len(val_groups))[: cfg["held_out_groups"]]]
    reward_before, acc_before = held_out_reward(scorer, drafters[1], seqs, val_groups, m)

    batches = token_batches(window_lengths(seqs, train, train_cfg["seq_len"]), cfg["batch_size"] * train_cfg["seq_len"])
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    history = []
    head.train()
    bar = tqdm(range(cfg["steps"]), desc="GTO" if cfg["omega"] else "GTO control (omega 0)", unit="step")
    for step in bar:
        rng = np.random.default_rng([seed, 2, step])  # per step, so a control run sees the same batches
        groups = train_groups[rng.choice(len(train_groups), size=cfg["groups"], replace=False)]
        batch = make_batch(seqs, train[batch_at(batches, step, seed + 1)], t2d, train_cfg["seq_len"], head.d2t.device)
        loss, stats = gto_step(head, reference, drafters, scorer, seqs, groups, batch, t2d, cfg, train_cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg["grad_clip"])
        opt.step()
        history.append({"step": step} | stats)
        bar.set_postfix(token=f"{stats['token_loss']:.3f}", reward=f"{stats['reward']:.2f}")
    head.eval()
    reward_after, acc_after = held_out_reward(scorer, drafters[0], seqs, val_groups, m)
    return GTOResult(steps=cfg["steps"], seconds=time.perf_counter() - t0, reward_before=reward_before, reward_after=reward_after,
                     accepted_before=acc_before, accepted_after=acc_after, history=history)


def train_gto(*, model, tokenizer, base_dir: Path, target_checksum: str, workloads_dir: Path, out_dir: Path,
              fortunes_dir: Path | None = None, config: dict | None = None, seed: int = 0) -> GTOResult:
    """GTO fine-tuning of the head in `base_dir` (from `train_drafter` with the same `drafter` settings)
    into the drafter folder `out_dir`. The training data comes from `train_drafter`'s data cache
    (`train.data_cache_dir`; rebuilt there if it is gone), the blocks the head's budget took; its held-out
    windows give the reward figures."""
    cfg = settings("drafter", config)
    gcfg = settings("drafter.gto", cfg.pop("gto", None))
    torch.manual_seed(seed)
    head, meta = load_head(base_dir, target_model=model, target_checksum=target_checksum)
    # the blocks the head was trained on (a head from before the budget recorded none: the whole recipe)
    budget = DataBudget.replay(meta["metrics"].get("sizes"))
    seqs, _ = build_data(model=model, tokenizer=tokenizer, target_checksum=target_checksum, workloads_dir=workloads_dir,
                         fortunes_dir=fortunes_dir, cfg=cfg, head_cfg=head.cfg, seed=seed, budget=budget)
    val, train = split_windows(seqs, cfg, np.random.default_rng(seed))
    t2d = target_to_draft(head.d2t, head.cfg.vocab)
    result = fine_tune_gto(head, model=model, seqs=seqs, train=train, val=val, t2d=t2d, cfg=gcfg, train_cfg=cfg, seed=seed)
    meta = {k: v for k, v in meta.items() if k not in ("head", "id")} | {"base_id": meta["id"]}  # the head's own: config.json
    meta["gto"] = gcfg | {"seed": seed}
    meta["gto_metrics"] = {k: v for k, v in asdict(result).items() if k != "history"} | {"history": result.history[::10]}
    write_head(head, meta, Path(out_dir), target_config=model.config)
    return result
