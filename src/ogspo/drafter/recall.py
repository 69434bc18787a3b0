"""Top-k recall by depth of a draft head: what a tree k wide at a level can accept (`ttt_recall`), beside
the top-1 agreement that training logs and a chain's acceptance measures."""

from __future__ import annotations

import numpy as np
import torch

from .data import annotate_text
from .head import EagleHead
from .train import make_batch, step_mask, target_to_draft, ttt_objective

RECALL_KS = (1, 2, 4, 8)  # the tree widths the top-k recall is reported at


@torch.no_grad()
def ttt_recall(head: EagleHead, batch, steps: int, ks: tuple[int, ...] = RECALL_KS,
               root_from: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Top-k recall by depth: at each TTT step j (a draft node at depth j, its path right so far), how
    often the target's top-1 token is among the head's k highest-scoring draft tokens, for each k in
    `ks` (k = 1: the top-1 agreement of `ttt_loss`), over the positions step j is scored on, those whose
    root (position t - j + 1) is `root_from` or later: what a tree `k` wide at that level can accept.
    Returns (hits [steps, len(ks)], positions [steps])."""
    _, _, outs = ttt_objective(head, batch, steps, 1.0)
    valid, top1 = batch[4], batch[5]
    hits, positions = np.zeros((steps, len(ks))), np.zeros(steps)
    for j, logits in enumerate(outs, start=1):
        m = step_mask(valid, j)  # [B, T]
        m[:, : root_from + j - 1] = False
        found = head.d2t[logits.topk(max(ks), dim=-1).indices] == top1[..., None]  # [B, T, max k]
        hits[j - 1] = [float((found[..., :k].any(-1) & m).sum()) for k in ks]
        positions[j - 1] = float(m.sum())
    return hits, positions


def continuation_recall(head: EagleHead, lm, texts: list[tuple[list[int], list[int]]], depth: int,
                        ks: tuple[int, ...] = RECALL_KS) -> dict:
    """`ttt_recall` on the target's continuations `texts` [(prompt, continuation)], read by `lm` (a
    TreeLM computing the head's feature layers) in one teacher-forced pass each: a node at depth j
    under every continuation token as a root (the first is the target's own after the prompt), to
    `depth`, the last one predicting the target's greedy token past the continuation.
    Returns {"ks", "recall" [depth][len(ks)], "positions" [depth]}."""
    seqs = annotate_text(lm, [p + c for p, c in texts], top_k=1, rows=256)
    t2d = target_to_draft(head.d2t, head.cfg.vocab)
    hits, positions = np.zeros((depth, len(ks))), np.zeros(depth)
    for seq, (prompt, _) in zip(seqs, texts):
        batch = make_batch([seq], np.array([[0, 0]]), t2d, len(seq.tokens), head.d2t.device)
        # position t predicts token t + 2; at depth j its root is token t + 2 - j, a continuation token from len(prompt)
        h, n = ttt_recall(head, batch, depth, ks, root_from=len(prompt) - 1)
        hits += h
        positions += n
    return {"ks": list(ks), "recall": (hits / np.maximum(positions, 1)[:, None]).round(4).tolist(),
            "positions": positions.astype(int).tolist()}
