"""The EAGLE-3 draft head.

One decoder layer as EAGLE-3 defines it (SafeAILab/EAGLE `cnets.py`, SGLang `llama_eagle3.py`), sized
like the target's layers (any family the engine runs):
- `fc` (3D -> D) reads the target's hidden states at a low, a mid and a high layer; one step deeper into
  a draft, the head's own layer output at the parent node takes its place. That D-wide vector `h` is
  the layer's residual stream.
- q/k/v read `cat(input_layernorm(embedding of the next token), hidden_norm(h))` (2D wide); the
  attention output is added to `h`, then `post_attention_layernorm` and the MLP, as in Llama.
- a final RMSNorm and a reduced LM head: the frozen target LM-head rows of the `draft_vocab` most
  frequent tokens (or those rows trained further, `drafter.train_lm_head`), with `d2t` mapping draft
  ids back to target ids. The embedding is the target's, frozen and shared.
- Two variants published heads declare (vLLM and speculators read them from config.json):
  `norm_before_fc` (one RMSNorm, `input_norm`, on the concatenated features before `fc`) and
  `norm_before_residual` (the residual stream is hidden_norm(h) instead of h). ogspo's own heads use neither.

Input at position t is (feature of position t, token t+1); the output predicts token t+2.
At decode time (`use_kernels`) the head's matmuls run on the target's measured kernel table in the
target's weight dtype (`HeadKernels`), not through torch's per-module linears; where that table runs
the target's layer ops natively at the step's row count, so does the head (its norms, rotary embedding
+ cache write + tree attention and SwiGLU in a few C calls instead of ~60 torch ops: a draft level
was ~0.9 ms of dispatch beside ~1.5 ms of weights on the 2-core Zen 3).
Training-time test (TTT): step j > 1 feeds the head its own step-(j-1) output at t-1 as the feature,
attending the way a depth-j draft node does (committed rows up to t-j+1, then its own ancestors).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ogspo.engine.kernels import KernelTable, Matmul
from ogspo.engine.layer_ops import TORCH, NativeLayerOps, Step, make_layer_ops
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
    norm_before_residual: bool = False  # the residual is hidden_norm(h), not h (published heads' flag)
    norm_before_fc: bool = False  # one RMSNorm (`input_norm`, 3D wide) on the concatenated features before fc

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


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Attention of training-time-test step j = len(keys) (EAGLE-3's TTT): the depth-j node drafted at
    position t sees the step-1 rows up to its root t-j+1 (the target's features, causal) and one row
    of each deeper step i = 2..j, its ancestor at t-j+i (the last one itself).
    q [B, H, T, hd]; keys/values: per step i [B, KV, T, hd]. Returns [B, H, T, hd].

    The ancestors are one row each, so their scores are row-wise dot products beside a causal
    [T, T] block, rather than a dense [T, jT] mask that is almost all zeros (flash attention's
    backward over it was a quarter of a training step)."""
    B, H, T, hd = q.shape
    j, rep = len(keys), H // keys[0].shape[1]

    def heads(x):  # [B, KV, T, hd] -> [B, H, T, hd] (grouped-query attention)
        return x.repeat_interleave(rep, dim=1) if rep > 1 else x

    def shifted(x, by):  # row t holds x's row t - by (zeros before the start)
        return F.pad(x[:, :, : T - by], (0, 0, by, 0)) if by else x

    scale = hd ** -0.5
    t = torch.arange(T, device=q.device)
    k1, v1 = heads(keys[0]), heads(values[0])
    scores = [(q @ k1.transpose(-1, -2) * scale).masked_fill(t[None, :] > t[:, None] - j + 1, float("-inf"))]  # [B, H, T, T]
    anc_v = []
    for i in range(2, j + 1):  # the ancestor at t-j+i, absent before the start
        ki, vi = shifted(heads(keys[i - 1]), j - i), shifted(heads(values[i - 1]), j - i)
        s = (q.float() * ki.float()).sum(-1, keepdim=True) * scale  # [B, H, T, 1], summed in fp32 under autocast
        scores.append(s.to(scores[0].dtype).masked_fill((t < j - i)[:, None], float("-inf")))
        anc_v.append(vi)
    if j == 1:  # plain causal attention (the row itself is in the block)
        p = torch.softmax(scores[0].float(), -1).to(q.dtype)
        return p @ v1
    p = torch.softmax(torch.cat(scores, -1).float(), -1).to(q.dtype)  # [B, H, T, T + j - 1]
    out = p[..., :T] @ v1  # [B, H, T, hd]
    anc_p = p[..., T:]  # [B, H, T, j - 1] (a slice, not an index at T + i: torch.compile keeps T symbolic)
    for i, vi in enumerate(anc_v):
        out = out + anc_p[..., i : i + 1] * vi
    return out


class HeadKernels:
    """The head's inference matmuls on the target's kernel table (`engine.kernels`), its weights in
    the target's dtype: q/k/v fused as the target's `qkv` class, the gate/up pair as `gate_up`, `o`
    and `down` as theirs, `fc` (D x 3D) as `down`, the draft LM head (V' x D) as `lm_head`; each
    matmul takes the kernel (and padding) the table measured for its class at that row count.
    A snapshot of the weights: rebuild it after training."""

    def __init__(self, head: "EagleHead", table: KernelTable | None, dtype: torch.dtype):
        c = head.cfg
        w = lambda t: t.detach().to(dtype).contiguous()  # noqa: E731
        self.split = [c.n_heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim]
        self.mm = {
            "qkv": Matmul("qkv", [w(torch.cat([head.q.weight, head.k.weight, head.v.weight]))], table),  # [(H + 2KV) hd, 2D]
            "o": Matmul("o", [w(head.o.weight)], table),
            "gate_up": Matmul("gate_up", [w(torch.cat([head.gate.weight, head.up.weight]))], table),  # [2I, D]
            "down": Matmul("down", [w(head.down.weight)], table),
            "fc": Matmul("down", [w(head.fc.weight)], table),
            "lm": Matmul("lm_head", [w(head.lm_rows)], table),
        }
        self.table, self.device = table, head.lm_rows.device
        self.n_heads, self.kv_heads, self.head_dim, self.eps = c.n_heads, c.kv_heads, c.head_dim, c.eps
        self._ops: dict[str, NativeLayerOps | None] = {}
        self._ops_by_rows: dict[int, NativeLayerOps | None] = {}
        self._rope = head.rope
        self._cos = self._sin = torch.zeros(0, c.head_dim)

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return self.mm[name](0, x)

    def layer_ops(self, m: int) -> NativeLayerOps | None:
        """The native layer ops the table runs the target's single-sequence forwards of m rows on, or None
        (no table, a GPU head, or torch's ops there: the head's step then runs its torch ops)."""
        if m not in self._ops_by_rows:
            name = TORCH if self.table is None or self.device.type != "cpu" else self.table.layer_ops(m)
            if name != TORCH and name not in self._ops:
                try:
                    self._ops[name] = make_layer_ops(name, n_heads=self.n_heads, kv_heads=self.kv_heads, head_dim=self.head_dim,
                                                     eps=self.eps)
                except RuntimeError:  # no native build, or a head dimension the native attention does not take
                    self._ops[name] = None
            self._ops_by_rows[m] = None if name == TORCH else self._ops[name]
        return self._ops_by_rows[m]

    def rope_tables(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [rows, hd] of positions 0..rows-1 (rows >= `positions`, grown by doubling), the values
        `EagleHead.rope` computes for each position."""
        if self._cos.shape[0] < positions:
            rows = max(positions, 2 * self._cos.shape[0], 256)
            cos, sin = self._rope(torch.arange(rows, device=self.device), torch.float32)  # [rows, hd] each
            self._cos, self._sin = cos.contiguous(), sin.contiguous()
        return self._cos, self._sin


class EagleHead(nn.Module):
    def __init__(self, cfg: HeadConfig, *, embed: torch.Tensor, lm_rows: torch.Tensor, d2t: torch.Tensor,
                 train_lm_head: bool = False):
        """`lm_rows` [V', D]: the LM head's rows (the target's, at a fresh start); `train_lm_head` makes them a
        trained parameter instead of a frozen buffer (the state dict names them `lm_rows` either way)."""
        super().__init__()
        self.cfg = cfg
        D, H, KV, hd = cfg.hidden, cfg.n_heads, cfg.kv_heads, cfg.head_dim
        dev = embed.device  # the head lives where the target's embeddings live
        self.register_buffer("embed", embed.detach().clone().float(), persistent=False)  # [V, D] frozen target rows
        rows = lm_rows.detach().float().to(dev, copy=True)  # [V', D]
        if train_lm_head:
            self.lm_rows = nn.Parameter(rows)
        else:
            self.register_buffer("lm_rows", rows)
        self.register_buffer("d2t", d2t.long().to(dev))  # [V'] draft id -> target id
        self.fc = nn.Linear(3 * D, D, bias=False, device=dev)
        self.input_layernorm = nn.Parameter(torch.ones(D, device=dev))  # on the token embedding
        self.hidden_norm = nn.Parameter(torch.ones(D, device=dev))  # on the feature h
        self.q = nn.Linear(2 * D, H * hd, bias=False, device=dev)
        self.k = nn.Linear(2 * D, KV * hd, bias=False, device=dev)
        self.v = nn.Linear(2 * D, KV * hd, bias=False, device=dev)
        self.o = nn.Linear(H * hd, D, bias=False, device=dev)
        self.post_attention_layernorm = nn.Parameter(torch.ones(D, device=dev))
        self.gate = nn.Linear(D, cfg.intermediate, bias=False, device=dev)
        self.up = nn.Linear(D, cfg.intermediate, bias=False, device=dev)
        self.down = nn.Linear(cfg.intermediate, D, bias=False, device=dev)
        self.norm = nn.Parameter(torch.ones(D, device=dev))
        if cfg.norm_before_fc:
            self.input_norm = nn.Parameter(torch.ones(3 * D, device=dev))  # on cat(features) [3D]
        self.register_buffer("inv_freq", torch.tensor(cfg.rope_theta_inv_freq, dtype=torch.float32, device=dev), persistent=False)
        self.kernels: HeadKernels | None = None  # decode-time matmuls (`use_kernels`); None: the modules

    def use_kernels(self, table: KernelTable | None, dtype: torch.dtype) -> None:
        """Run `step` and `project` on `table`'s kernels with weights in `dtype` (the target's)."""
        self.kernels = HeadKernels(self, table, dtype)

    # ------------------------------------------------------------------ building blocks

    def init_from_target(self, hf_model) -> None:
        """Warm start: `fc` passes the high-layer feature through; where the target's last layer is
        Llama's math (`layer_projections`), the feature half of q/k/v, `hidden_norm` (the target's
        input norm), o, the MLP and the final norm are copied from it, and the embedding half of
        q/k/v starts small; another family's layer (Gemma's) keeps its random start."""
        D = self.cfg.hidden
        with torch.no_grad():
            w = layer_projections(hf_model, -1)
            if w is not None:
                for mine, name in [(self.q, "q"), (self.k, "k"), (self.v, "v")]:
                    mine.weight[:, :D].normal_(0, 0.02)
                    mine.weight[:, D:] = w[name].float()
                for mine, name in [(self.o, "o"), (self.gate, "gate"), (self.up, "up"), (self.down, "down")]:
                    mine.weight.copy_(w[name].float())
                self.hidden_norm.copy_(w["ln1"].float())
                self.post_attention_layernorm.copy_(w["ln2"].float())
                self.norm.copy_(hf_model.model.norm.weight.float())
            self.fc.weight.zero_()
            self.fc.weight[:, 2 * D :] = torch.eye(D, device=self.fc.weight.device)

    def rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq  # [..., T, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [..., T, hd]
        return (emb.cos() * self.cfg.rope_scaling).to(dtype), (emb.sin() * self.cfg.rope_scaling).to(dtype)

    def fc_input(self, features: torch.Tensor) -> torch.Tensor:
        """What `fc` reads: the target's features [..., 3D], RMS-normed first where `norm_before_fc`."""
        return rms_norm(features, self.input_norm, self.cfg.eps) if self.cfg.norm_before_fc else features

    def residual(self, feat: torch.Tensor) -> torch.Tensor:
        """The layer's residual stream from its feature h [..., D]: h, or hidden_norm(h) where `norm_before_residual`."""
        return rms_norm(feat, self.hidden_norm, self.cfg.eps) if self.cfg.norm_before_residual else feat

    def layer_input(self, tokens: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        """What q/k/v read: cat(input_layernorm(embedding of tokens [..., T]), hidden_norm(feat [..., T, D])) [..., T, 2D]."""
        c = self.cfg
        e = rms_norm(F.embedding(tokens, self.embed), self.input_layernorm, c.eps)  # [..., T, D]
        return torch.cat([e, rms_norm(feat, self.hidden_norm, c.eps)], dim=-1)  # [..., T, 2D]

    def qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernels: HeadKernels | None = None):
        """h [B, T, 2D] (`layer_input`) -> q [B, H, T, hd], k, v [B, KV, T, hd] (rotary applied)."""
        B, T, _ = h.shape
        c = self.cfg
        q, k, v = kernels("qkv", h).split(kernels.split, -1) if kernels is not None else (self.q(h), self.k(h), self.v(h))
        q = q.view(B, T, c.n_heads, c.head_dim).transpose(1, 2)
        k = k.view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)
        v = v.view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, hd]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def finish(self, x: torch.Tensor, attn: torch.Tensor, kernels: HeadKernels | None = None) -> torch.Tensor:
        """The residual stream x [B, T, D] (the feature) + attention output attn [B, H, T, hd], then the MLP.
        Returns the layer output [B, T, D]."""
        B, _, T, _ = attn.shape
        a = attn.transpose(1, 2).reshape(B, T, -1)  # [B, T, H hd]
        if kernels is None:
            x = x + self.o(a)
            h = rms_norm(x, self.post_attention_layernorm, self.cfg.eps)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))
        x = x + kernels("o", a)
        g, u = kernels("gate_up", rms_norm(x, self.post_attention_layernorm, self.cfg.eps)).chunk(2, -1)  # [B, T, I] each
        return x + kernels("down", F.silu(g) * u)

    def logits(self, out: torch.Tensor, kernels: HeadKernels | None = None) -> torch.Tensor:
        """Draft-vocabulary logits [..., V'] from layer outputs [..., D]."""
        h = rms_norm(out, self.norm, self.cfg.eps)
        return h @ self.lm_rows.T if kernels is None else kernels("lm", h)

    @torch.inference_mode()
    def project(self, features: torch.Tensor) -> torch.Tensor:
        """`fc` at decode time: the target's features [r, 3D] -> the head's h [r, D]."""
        x = self.fc_input(features)  # [r, 3D]
        return self.fc(x) if self.kernels is None else self.kernels("fc", x)

    # ------------------------------------------------------------------ training (TTT)

    def forward_train(self, feats3: torch.Tensor, next_tokens: torch.Tensor, steps: int, *,
                      logits: bool = True) -> list[torch.Tensor]:
        """feats3 [B, T, 3D] target features at t, next_tokens [B, T] token t+1.
        Returns per TTT step the draft logits [B, T, V'] predicting token t+2 (with `logits=False`
        the layer outputs [B, T, D], for a caller that needs `self.logits` of a few rows only)."""
        B, T, _ = feats3.shape
        pos = torch.arange(T, device=feats3.device).expand(B, T)
        cos, sin = self.rope(pos, feats3.dtype)
        feat = self.fc(self.fc_input(feats3))  # [B, T, D]
        keys, values, outs = [], [], []
        for j in range(1, steps + 1):
            if j > 1:  # the parent's output at t-1 is the feature of a depth-j node at t
                feat = F.pad(outs[-1][:, :-1], (0, 0, 1, 0))
            q, k, v = self.qkv(self.layer_input(next_tokens, feat), cos, sin)
            keys.append(k)
            values.append(v)
            outs.append(self.finish(self.residual(feat), ttt_attention(q, keys, values)))
        return [self.logits(o) for o in outs] if logits else outs

    # ------------------------------------------------------------------ inference

    @torch.inference_mode()
    def step(self, tokens, feat, positions, keys, values, start: int, committed: int, attend, *, with_logits: bool = True):
        """One forward over m new rows (written at cache rows start..start+m).
        tokens [m], feat [m, D], positions [m]; keys/values [1, KV, max_len, hd]. Every new row sees the
        committed rows 0..committed; of the pending rows committed..start+m, those `attend` [m, start -
        committed + m] (bool) marks, or with attend None the causal ones (row i up to start + i).
        Returns (layer outputs [m, D], draft logits [m, V'] or None without `with_logits`)."""
        m = tokens.shape[0]
        kern = self.kernels
        ops = None if kern is None else kern.layer_ops(m)
        if ops is not None:
            return self._native_step(ops, tokens, feat, positions, keys, values, start, committed, attend, with_logits)
        x = self.residual(feat)[None]  # [1, m, D] the residual stream
        cos, sin = self.rope(positions[None], x.dtype)
        q, k, v = self.qkv(self.layer_input(tokens, feat)[None], cos, sin, kern)
        keys[:, :, start : start + m] = k
        values[:, :, start : start + m] = v
        if attend is None:
            mask = None if m == 1 else torch.ones(m, start + m, dtype=torch.bool, device=feat.device).tril_(start)  # causal
        else:
            mask = torch.ones(m, start + m, dtype=torch.bool, device=feat.device)  # [m, start + m]
            mask[:, committed:] = attend
        attn = F.scaled_dot_product_attention(
            q, keys[:, :, : start + m], values[:, :, : start + m],
            attn_mask=None if mask is None else mask[None, None], enable_gqa=q.shape[1] != k.shape[1],
        )  # [1, H, m, hd]
        out = self.finish(x, attn, kern)[0]  # [m, D]
        return out, self.logits(out, kern) if with_logits else None

    def _native_step(self, ops: NativeLayerOps, tokens, feat, positions, keys, values, start, committed, attend, with_logits):
        """`step` on the native layer ops: the same operations (RMSNorms, rotary embedding, the cache write,
        attention over the visible rows, SwiGLU, the residual adds) in C, summed in their own order."""
        kern, c = self.kernels, self.cfg
        feat = feat.float().contiguous()[None]  # [1, m, D]
        _, hf = ops.add_rmsnorm(feat, None, self.hidden_norm)  # hidden_norm(h) [1, m, D]; feat itself is unchanged
        x = (hf if c.norm_before_residual else feat).clone()  # [1, m, D] the residual stream, updated in place
        _, e = ops.add_rmsnorm(F.embedding(tokens, self.embed)[None].contiguous(), None, self.input_layernorm)  # [1, m, D]
        cos, sin = kern.rope_tables(int(positions.max()) + 1)
        where = Step(positions=positions[None], start=start, committed=committed, attend=attend, mask=None, cos_table=cos,
                     sin_table=sin)
        attn = ops.rope_attention(kern("qkv", torch.cat([e, hf], -1)), None, where, keys, values)  # [1, m, H hd]
        x, h = ops.add_rmsnorm(x, kern("o", attn), self.post_attention_layernorm)
        x, h = ops.add_rmsnorm(x, kern("down", ops.silu_mul(kern("gate_up", h))), self.norm)  # h: the final norm's output
        return x[0], kern("lm", h)[0] if with_logits else None
