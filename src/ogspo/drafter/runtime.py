"""`EagleDrafter`: the draft head behind the engine's `TreeDrafter` interface.

The head keeps its own one-layer KV cache. Committed rows were computed from the target's real
features; rows of drafted nodes (computed from the head's own outputs) stay pending and are
dropped after verification, and the accepted tokens are re-encoded from the target features that
verification already computed (no extra target pass).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from ogspo.engine.drafters import Expansion, Observation, TreeDrafter, accepted_path
from ogspo.engine.target import ForwardOut, KVCache
from ogspo.engine.tree import DraftTree

from .eagle3 import CONFIG, WEIGHTS, is_eagle3_folder, load_eagle3, weights_file
from .head import EagleHead

META = "drafter.json"  # ogspo's provenance beside the EAGLE-3 files: target checksum, recipe, metrics


def head_id(path: Path) -> str:
    """The head's identity: folder name and the first 12 hex digits of its weights' sha256. Records,
    latency tables and policies name the drafter by it, so a retrained head in the same folder is a
    different drafter (its records are recollected, not reused)."""
    digest = hashlib.sha256()
    with open(weights_file(path), "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return f"{Path(path).name}-{digest.hexdigest()[:12]}"


def load_head(path: Path, *, target_model, target_checksum: str | None = None) -> tuple[EagleHead, dict]:
    """Load a draft head folder in EAGLE-3's format (`drafter.eagle3`): one ogspo trained (its
    `drafter.json` names the target, and a head trained for another target is refused) or a published
    one (no `drafter.json`: vocabulary, sizes and feature layers are checked against the target).
    `meta["id"]` is `head_id(path)`."""
    path = Path(path)
    if not is_eagle3_folder(path):
        raise FileNotFoundError(f"drafter folder {path} lacks {CONFIG} or {WEIGHTS} (or pytorch_model.bin) of an EAGLE-3 head "
                                "(run the train_drafter stage, or give a published EAGLE-3 head's folder)")
    meta = json.loads((path / META).read_text()) if (path / META).is_file() else {"kind": "eagle3-head", "published": True}
    trained_for = meta.get("target_checksum")
    if target_checksum is not None and trained_for is not None and trained_for != target_checksum:
        raise ValueError(
            f"drafter {path} was trained for target {str(trained_for)[:12]}..., not this target {target_checksum[:12]}..."
        )
    head = load_eagle3(path, target_model=target_model)
    head.eval()
    return head, {**meta, "head": head.cfg.to_dict(), "id": head_id(path)}


class EagleDrafter(TreeDrafter):
    name = "eagle"

    def __init__(self, head: EagleHead, *, max_len: int = 4096, drafter_id: str = "eagle"):
        self.head = head
        self.drafter_id = drafter_id
        c = head.cfg
        self.feature_layers = c.feature_layers
        self.device = head.lm_rows.device
        self.cache = KVCache(n_layers=1, kv_heads=c.kv_heads, head_dim=c.head_dim, max_len=max_len,
                             dtype=torch.float32, device=self.device)
        self.back_feats: list[torch.Tensor] = []  # fused features [*, D] waiting for their next token
        self.back_tokens: list[int] = []
        self.node_row = np.zeros(0, dtype=np.int64)
        self.node_out: dict[int, torch.Tensor] = {}

    def fork(self) -> EagleDrafter:
        return EagleDrafter(self.head, max_len=self.cache.max_len, drafter_id=self.drafter_id)

    def _features(self, out: ForwardOut | None, rows) -> torch.Tensor:
        if out is None or out.features is None:
            raise ValueError("the eagle drafter needs target features: build the target with the drafter's feature_layers")
        with torch.inference_mode():
            return self.head.project(out.features[rows].float())  # [r, D]

    def begin(self, prompt: list[int], target: ForwardOut | None) -> None:
        """The drafter's own prefill: encode the pairs (f_t, x_{t+1}) of the prompt now, so that the
        first cycle (and a same-trace re-run of any recorded cycle) costs what any cycle costs; the
        last pair waits for its token, the root of the first cycle."""
        c = self.cache
        c.reset()
        feats = self._features(target, slice(0, len(prompt)))  # [L, D]
        n = len(prompt) - 1
        if n > 0:
            dev = self.device
            start = c.reserve(torch.arange(c.end, c.end + n, device=dev))
            with torch.inference_mode():  # causal over the prompt
                self.head.step(torch.tensor(prompt[1:], device=dev), feats[:n], torch.arange(start, start + n, device=dev),
                               c.keys[0], c.values[0], start, start, None, with_logits=False)
            c.commit_prefix(n)
        self.back_feats = [feats[n:]]
        self.back_tokens = []
        self.node_row = np.zeros(0, dtype=np.int64)
        self.node_out = {}

    def _expansion(self, logits: torch.Tensor, k: int) -> Expansion:
        logp = torch.log_softmax(logits.float(), dim=-1)  # [w, V']
        top = logp.topk(k, dim=-1)
        ent = -(logp.exp() * logp).sum(-1)
        return Expansion(
            tokens=self.head.d2t[top.indices].cpu().numpy().astype(np.int64),
            logq=top.values.double().cpu().numpy(),
            entropy=ent.double().cpu().numpy(),
        )

    def expand(self, tree: DraftTree, frontier: np.ndarray, k: int) -> Expansion:
        c, dev = self.cache, self.device
        if len(self.node_row) < len(tree):
            self.node_row = np.concatenate([self.node_row, np.full(len(tree) - len(self.node_row), -1)])
        k = min(k, self.head.cfg.draft_vocab)
        if len(frontier) == 1 and frontier[0] == 0 and c.pending == 0:
            feats = torch.cat(self.back_feats)  # [b, D]
            toks = torch.tensor(self.back_tokens + [int(tree.tokens[0])], device=dev)
            b = toks.shape[0]
            positions = torch.arange(c.end, c.end + b, device=dev)  # [b]
            start = c.reserve(positions)
            out, logits = self.head.step(toks, feats, positions, c.keys[0], c.values[0], start, start, None)  # causal
            c.commit_prefix(b - 1)
            self.back_feats, self.back_tokens = [], []
            self.node_row[0] = c.length
            self.node_out = {0: out[-1]}
            return self._expansion(logits[-1:], k)
        w = len(frontier)
        pos = torch.as_tensor(c.length + tree.depths[frontier], device=dev)  # [w]
        start = c.reserve(pos)
        base = c.length  # every node sees the committed rows; of the pending ones, its ancestors' and its own
        attend = np.zeros((w, start - base + w), dtype=bool)  # built on the host, sent once
        for i, f in enumerate(frontier):
            a = tree.parents[f]
            while a >= 0:
                attend[i, self.node_row[a] - base] = True
                a = tree.parents[a]
            attend[i, start - base + i] = True
        feat = torch.stack([self.node_out[int(tree.parents[f])] for f in frontier])  # [w, D]
        out, logits = self.head.step(torch.as_tensor(tree.tokens[frontier], device=dev), feat, pos, c.keys[0], c.values[0], start,
                                     base, torch.as_tensor(attend, device=dev))
        self.node_row[frontier] = start + np.arange(w)
        for i, f in enumerate(frontier):
            self.node_out[int(f)] = out[i]
        return self._expansion(logits, k)

    def observe(self, obs: Observation) -> None:
        path = accepted_path(obs)
        row_of = np.full(len(obs.tree), -1, dtype=np.int64)
        row_of[obs.verified] = np.arange(len(obs.verified))
        feats = self._features(obs.target, torch.as_tensor(row_of[path], device=self.device))  # [k+1, D]
        forwarded = len(self.node_row) > 0 and self.node_row[0] >= 0
        if forwarded:  # keep the root row (built from real features), re-encode the accepted tokens
            self.cache.commit(torch.tensor([int(self.node_row[0])], device=self.device))
            self.back_feats, self.back_tokens = [feats], []
        else:  # nothing drafted this cycle: the root completes the waiting pair
            self.cache.commit(None)
            self.back_tokens.append(int(obs.tree.tokens[0]))
            self.back_feats.append(feats)
        self.back_tokens.extend(int(t) for t in obs.tree.tokens[path[1:]])
        self.node_row = np.zeros(0, dtype=np.int64)
        self.node_out = {}
