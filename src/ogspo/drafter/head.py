"""The EAGLE-3-style draft head.

One Llama decoder layer, sized like the target's layers (any family the engine runs), over a fusion of
- the target's hidden states at a low, a mid and a high layer (`fc`: 3D -> D), or, one step deeper
  into a draft, the head's own output at the parent node, and
- the (frozen, shared) target embedding of the next token,
then a final RMSNorm and a reduced LM head: the frozen target LM-head rows of the `draft_vocab`
most frequent tokens, with `d2t` mapping draft ids back to target ids.

Input at position t is (feature of position t, token t+1); the output predicts token t+2.
Training-time test (TTT): step j > 1 feeds the head its own step-(j-1) output at t-1 as the feature,
attending the way a depth-j draft node does (committed rows up to t-j+1, then its own ancestors).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ogspo.engine.target import layer_projections


@dataclass
class HeadConfig:
    hidden: int
    n_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    vocab: int
    draft_vocab: int
    feature_layers: tuple[int, ...]
    rope_theta_inv_freq: list[float]
    rope_scaling: float = 1.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["feature_layers"] = list(self.feature_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "HeadConfig":
        d = dict(d)
        d["feature_layers"] = tuple(d["feature_layers"])
        return cls(**d)

    @classmethod
    def for_target(cls, hf_model, *, draft_vocab: int) -> "HeadConfig":
        """The head for `hf_model`: its layer sizes, its rotary table, and the feature layers chosen
        from its depth (a low, a middle and a high layer, as EAGLE-3 reads them)."""
        cfg = hf_model.config
        n = cfg.num_hidden_layers
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        inv_freq, scaling = target_rope(hf_model, hd)
        return cls(
            hidden=cfg.hidden_size,
            n_heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads,
            head_dim=hd,
            intermediate=cfg.intermediate_size,
            eps=cfg.rms_norm_eps,
            vocab=cfg.vocab_size,
            draft_vocab=min(draft_vocab, cfg.vocab_size),
            feature_layers=feature_layers_for_depth(n),
            rope_theta_inv_freq=inv_freq,
            rope_scaling=scaling,
        )


def feature_layers_for_depth(n: int) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high feature layers of an n-layer target (0-based): layers 1, n/2 - 1
    and n - 4 of a deep model, 0, (n - 1)/2 and n - 2 of a shallow one. Never the last layer, whose
    output transformers reports after the final norm (the engine's features are the residual stream)."""
    if n < 2:
        raise ValueError(f"the draft head reads features below the last layer: a target needs at least 2 layers, got {n}")
    if n <= 6:
        return (0, (n - 1) // 2, n - 2)
    return (1, n // 2 - 1, n - 4)


def target_rope(hf_model, head_dim: int) -> tuple[list[float], float]:
    """The target's (full-attention) rotary frequencies and scaling, for the head's own rotary table:
    transformers keeps them as `inv_freq` (Llama, Qwen, Phi-3, Mistral) or per attention kind
    (`full_attention_inv_freq`, Gemma 3). A table of another shape gets the standard one."""
    rot = hf_model.model.rotary_emb
    for prefix in ("", "full_attention_"):
        inv = getattr(rot, f"{prefix}inv_freq", None)
        if isinstance(inv, torch.Tensor) and inv.numel() == head_dim // 2:
            return inv.float().tolist(), float(getattr(rot, f"{prefix}attention_scaling", 1.0))
    return (1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, device="cpu").float() / head_dim)).tolist(), 1.0


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


class EagleHead(nn.Module):
    def __init__(self, cfg: HeadConfig, *, embed: torch.Tensor, lm_rows: torch.Tensor, d2t: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        D, H, KV, hd = cfg.hidden, cfg.n_heads, cfg.kv_heads, cfg.head_dim
        dev = embed.device  # the head lives where the target's embeddings live
        self.register_buffer("embed", embed.detach().clone().float(), persistent=False)  # [V, D] frozen target rows
        self.register_buffer("lm_rows", lm_rows.detach().float().to(dev, copy=True))  # [V', D] frozen target LM-head rows
        self.register_buffer("d2t", d2t.long().to(dev))  # [V'] draft id -> target id
        self.fc = nn.Linear(3 * D, D, bias=False, device=dev)
        self.fuse = nn.Linear(2 * D, D, bias=False, device=dev)
        self.emb_norm = nn.Parameter(torch.ones(D, device=dev))
        self.ln1 = nn.Parameter(torch.ones(D, device=dev))
        self.q = nn.Linear(D, H * hd, bias=False, device=dev)
        self.k = nn.Linear(D, KV * hd, bias=False, device=dev)
        self.v = nn.Linear(D, KV * hd, bias=False, device=dev)
        self.o = nn.Linear(H * hd, D, bias=False, device=dev)
        self.ln2 = nn.Parameter(torch.ones(D, device=dev))
        self.gate = nn.Linear(D, cfg.intermediate, bias=False, device=dev)
        self.up = nn.Linear(D, cfg.intermediate, bias=False, device=dev)
        self.down = nn.Linear(cfg.intermediate, D, bias=False, device=dev)
        self.norm = nn.Parameter(torch.ones(D, device=dev))
        self.register_buffer("inv_freq", torch.tensor(cfg.rope_theta_inv_freq, dtype=torch.float32, device=dev), persistent=False)

    # ------------------------------------------------------------------ building blocks

    def init_from_target(self, hf_model) -> None:
        """Warm start: `fc` reads the high-layer feature, `fuse` passes the feature through (the
        embedding path starts small) and, where the target's last layer is Llama's math
        (`layer_projections`), the decoder layer and final norm are copied from it; another
        family's layer (Gemma's) keeps its random start."""
        D = self.cfg.hidden
        with torch.no_grad():
            w = layer_projections(hf_model, -1)
            if w is not None:
                for mine, name in [(self.q, "q"), (self.k, "k"), (self.v, "v"), (self.o, "o"), (self.gate, "gate"),
                                   (self.up, "up"), (self.down, "down")]:
                    mine.weight.copy_(w[name].float())
                self.ln1.copy_(w["ln1"].float())
                self.ln2.copy_(w["ln2"].float())
                self.norm.copy_(hf_model.model.norm.weight.float())
            self.fc.weight.zero_()
            self.fc.weight[:, 2 * D :] = torch.eye(D, device=self.fc.weight.device)
            self.fuse.weight.normal_(0, 0.02)
            self.fuse.weight[:, D:] += torch.eye(D, device=self.fuse.weight.device)

    def rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq  # [..., T, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [..., T, hd]
        return (emb.cos() * self.cfg.rope_scaling).to(dtype), (emb.sin() * self.cfg.rope_scaling).to(dtype)

    def fused_input(self, tokens: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        e = rms_norm(F.embedding(tokens, self.embed), self.emb_norm, self.cfg.eps)  # [..., T, D]
        return self.fuse(torch.cat([e, feat], dim=-1))  # [..., T, D]

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, D] -> q [B, H, T, hd], k, v [B, KV, T, hd] (rotary applied)."""
        B, T, _ = x.shape
        c = self.cfg
        h = rms_norm(x, self.ln1, c.eps)
        q = self.q(h).view(B, T, c.n_heads, c.head_dim).transpose(1, 2)
        k = self.k(h).view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)
        v = self.v(h).view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, hd]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual + attention output attn [B, H, T, hd], then the MLP. Returns the layer output [B, T, D]."""
        B, _, T, _ = attn.shape
        x = x + self.o(attn.transpose(1, 2).reshape(B, T, -1))
        h = rms_norm(x, self.ln2, self.cfg.eps)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., V'] from layer outputs [..., D]."""
        return rms_norm(out, self.norm, self.cfg.eps) @ self.lm_rows.T

    # ------------------------------------------------------------------ training (TTT)

    def forward_train(self, feats3: torch.Tensor, next_tokens: torch.Tensor, steps: int, *,
                      logits: bool = True) -> list[torch.Tensor]:
        """feats3 [B, T, 3D] target features at t, next_tokens [B, T] token t+1.
        Returns per TTT step the draft logits [B, T, V'] predicting token t+2 (with `logits=False`
        the layer outputs [B, T, D], for a caller that needs `self.logits` of a few rows only)."""
        B, T, _ = feats3.shape
        pos = torch.arange(T, device=feats3.device).expand(B, T)
        cos, sin = self.rope(pos, feats3.dtype)
        feat = self.fc(feats3)  # [B, T, D]
        keys, values, outs = [], [], []
        t = torch.arange(T, device=feats3.device)
        for j in range(1, steps + 1):
            if j > 1:  # the parent's output at t-1 is the feature of a depth-j node at t
                feat = F.pad(outs[-1][:, :-1], (0, 0, 1, 0))
            x = self.fused_input(next_tokens, feat)
            q, k, v = self.qkv(x, cos, sin)
            keys.append(k)
            values.append(v)
            blocks = [t[None, :] <= (t[:, None] - j + 1)]  # step-1 rows up to the root at t-j+1
            for i in range(2, j + 1):  # then the ancestor at depth i-1: step-i row at t-j+i
                blocks.append(t[None, :] == (t[:, None] - j + i))
            mask = torch.cat(blocks, dim=1)  # [T, j*T]
            mask[:, (j - 1) * T :] |= torch.eye(T, dtype=torch.bool, device=mask.device)  # always see itself
            attn = F.scaled_dot_product_attention(
                q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
            )  # [B, H, T, hd]
            outs.append(self.finish(x, attn))
        return [self.logits(o) for o in outs] if logits else outs

    # ------------------------------------------------------------------ inference

    @torch.inference_mode()
    def step(self, tokens, feat, positions, keys, values, start: int, mask, *, with_logits: bool = True):
        """One forward over m new rows (written at cache rows start..start+m).
        tokens [m], feat [m, D], positions [m]; keys/values [1, KV, max_len, hd]; mask [m, start+m] bool or None.
        Returns (layer outputs [m, D], draft logits [m, V'] or None without `with_logits`)."""
        m = tokens.shape[0]
        x = self.fused_input(tokens, feat)[None]  # [1, m, D]
        cos, sin = self.rope(positions[None], x.dtype)
        q, k, v = self.qkv(x, cos, sin)
        keys[:, :, start : start + m] = k
        values[:, :, start : start + m] = v
        attn = F.scaled_dot_product_attention(
            q, keys[:, :, : start + m], values[:, :, : start + m],
            attn_mask=None if mask is None else mask[None, None], enable_gqa=q.shape[1] != k.shape[1],
        )  # [1, H, m, hd]
        out = self.finish(x, attn)[0]  # [m, D]
        return out, self.logits(out) if with_logits else None
