"""Target models with a preallocated KV cache and tree attention.

Two backends share one interface (`TreeLM`):

- `LlamaTreeLM`: a small gpt-fast-style forward for the architectures whose decoder layer is
  Llama's math (`fast_path_refusal` says which: Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3 with its
  QK-norm, Phi-3 with its fused weights), reading the transformers weights in place. Fused QKV and
  gate/up matmuls, a preallocated cache, boolean tree masks straight into SDPA; every matmul goes
  through the device's measured kernel table (`engine.kernels`), torch's `F.linear` without one.
  Weights may be fp32 or bf16; the activations (residual stream, norms, rotary, attention, KV cache,
  logits) are fp32 either way (fp64 for fp64 test models), so a bf16 target rounds only what enters a matmul.
- `HFTreeLM`: any transformers causal LM whose attention accepts a custom 4-D mask and explicit
  position ids (Gemma 2/3 with their soft-capping and scaled norms, and the rest), through
  transformers' own forward with a preallocated cache layer.

Sliding-window attention composes with the tree mask: a new row at position p sees a cache row
(committed, or one of its pending ancestors) only if that row's position is above p - window. While
every position is below the window this is the plain tree mask, so the window costs nothing until
the context crosses it. Models that interleave local and global layers get one mask per kind.

The cache has a *committed* part (rows 0..length) and a *pending* part (rows written by forwards
since the last commit). A forward over m new tokens attends to every committed row and to the
pending rows its `attend` mask allows (its own ancestors in the tree). `commit(rows)` keeps the
chosen pending rows (the accepted path) and drops the rest, without re-running the model.

`fork()` gives another handle on the same weights, kernels and packed matrices with a cache of its
own: the requests of several methods can then advance cycle by cycle side by side
(`methods.harness.run_interleaved`) without copying a weight.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kernels import LAYER_OPS, KernelTable, Matmul, check_usable, layer_ops_shape
from .layer_ops import TORCH, NativeLayerOps, Step, TorchLayerOps, make_layer_ops

LLAMA_LIKE = {"llama", "mistral", "qwen2", "qwen3", "phi3"}  # decoder layers of Llama's math (see fast_path_refusal)
FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' names of the attention kinds
STATIC_ROPE = {"default", "linear", "llama3", "yarn"}  # rotary tables that do not change with the sequence length


def attention_layout(cfg) -> tuple[list[str], int | None]:
    """Each layer's attention kind (FULL or SLIDING) and the sliding window (None: no sliding layer).

    transformers spells it `layer_types` (Qwen2/3, Gemma 2/3); Mistral and Phi-3 have one
    `sliding_window` for every layer. Other kinds (chunked, linear, state-space) raise one line."""
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    types = list(types)[:n] if types is not None else [SLIDING if window else FULL] * n
    other = sorted(set(types) - {FULL, SLIDING})
    if other:
        raise ValueError(f"architecture '{cfg.model_type}' has {', '.join(other)} layers; tree attention runs "
                         f"{FULL} and {SLIDING} layers only")
    if SLIDING not in types:
        return types, None
    if not window or window < 1:
        raise ValueError(f"architecture '{cfg.model_type}' has sliding-window layers but no sliding_window size")
    return types, int(window)


def _rope_type(cfg) -> str:
    rp = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    return str(rp.get("rope_type", rp.get("type", "default")))


def fast_path_refusal(cfg) -> str | None:
    """Why `LlamaTreeLM` cannot run this architecture (None: it can): its decoder layer must be
    Llama's (RMSNorm, SiLU-gated MLP, rotary attention over every head dimension, optional QKV biases
    and QK-norm) with a rotary table that does not depend on the sequence length."""
    if cfg.model_type not in LLAMA_LIKE:
        return f"'{cfg.model_type}' is not one of {', '.join(sorted(LLAMA_LIKE))}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation '{cfg.hidden_act}' is not silu"
    rope = _rope_type(cfg)
    if rope not in STATIC_ROPE:
        return f"rotary scaling '{rope}' changes with the sequence length"
    rp = getattr(cfg, "rope_parameters", None) or {}
    if float(rp.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        return "partial rotary embeddings"
    return None


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work: every timed region that feeds the latency model, records or
    evaluation ends with this (CUDA runs asynchronously; on the CPU it is a no-op)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class ForwardOut:
    logits: torch.Tensor  # [m, vocab]
    features: torch.Tensor | None  # [m, n_feature_layers * dim] hidden states of the chosen layers, or None


class KVCache:
    """Preallocated per-layer keys/values: [1, kv_heads, max_len, head_dim], and the position of
    each row (what a sliding window compares)."""

    def __init__(self, *, n_layers: int, kv_heads: int, head_dim: int, max_len: int, dtype, device):
        shape = (1, kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.row_positions = torch.zeros(max_len, dtype=torch.long, device=device)  # [max_len]
        self.max_len = max_len
        self.length = 0  # committed rows
        self.pending = 0  # rows written since the last commit

    @property
    def end(self) -> int:
        return self.length + self.pending

    def reserve(self, positions: torch.Tensor) -> int:
        """Claim len(positions) new pending rows at these positions [m]; returns their first row."""
        start, m = self.end, positions.shape[0]
        if start + m > self.max_len:
            raise ValueError(f"sequence of {start + m} tokens exceeds the cache of {self.max_len}")
        self.row_positions[start : start + m] = positions
        self.pending += m
        return start

    def commit(self, rows: torch.Tensor | None) -> None:
        """Keep pending rows `rows` (absolute, ascending) as the next committed rows; drop the rest."""
        if rows is not None and len(rows) > 0:
            k = len(rows)
            first = self.length
            contiguous = int(rows[0]) == first and int(rows[-1]) == first + k - 1
            if not contiguous:
                for kk, vv in zip(self.keys, self.values):
                    kk[:, :, first : first + k] = kk[:, :, rows]  # [1, kvh, k, hd]
                    vv[:, :, first : first + k] = vv[:, :, rows]
                self.row_positions[first : first + k] = self.row_positions[rows]
            self.length += k
        self.pending = 0

    def commit_prefix(self, m: int) -> None:
        """Make the first m pending rows committed (they are already in place)."""
        self.length += m
        self.pending -= m

    def reset(self) -> None:
        self.length = 0
        self.pending = 0


@dataclass
class BatchKVCache:
    """Keys/values of B sequences side by side: [B, kv_heads, max_len, head_dim] per layer; rows
    0..length are filled (padding rows included, masked by the caller's `valid`)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    row_positions: torch.Tensor  # [B, max_len] position of each row (padding rows: anything, never seen)
    length: int = 0


class TreeLM:
    """Interface of a model that runs tree forwards over a committed KV cache."""

    config = None
    vocab_size: int
    cache: KVCache
    device: torch.device = torch.device("cpu")  # where the weights and the cache live
    dtype: torch.dtype = torch.float32  # of the weights
    kernels: KernelTable | None = None  # the device's kernel table its matmuls run on (None: the reference kernel)
    window: int | None = None  # sliding window of the model's sliding layers (None: none)

    def new_cache(self, max_len: int) -> KVCache:
        raise NotImplementedError

    def fork(self) -> TreeLM:
        """This model with a KV cache of its own (empty, as long as this one's); every weight, kernel
        plan and lazily packed matrix stays shared, so a fork costs one cache."""
        twin = copy.copy(self)  # shallow: the weight tensors and the kernel and ops tables are the same objects
        twin.cache = twin.new_cache(self.cache.max_len)
        return twin

    def forward(
        self,
        tokens: torch.Tensor,  # [m] int64
        positions: torch.Tensor,  # [m] int64
        attend: torch.Tensor | None,  # [m, pending + m] bool over pending rows and the new rows; None = causal
        *,
        logits_rows: torch.Tensor | None = None,
    ) -> ForwardOut:
        raise NotImplementedError

    def prefill(self, prompt: list[int]) -> ForwardOut:
        """Reset the cache and commit `prompt` as its first rows: logits of the last position, features
        of every position."""
        self.cache.reset()
        L, dev = len(prompt), self.device
        out = self.forward(torch.tensor(prompt, device=dev), torch.arange(L, device=dev), None,
                           logits_rows=torch.tensor([L - 1], device=dev))
        self.cache.commit_prefix(L)
        return out

    def full_mask(self, attend: torch.Tensor | None, m: int) -> torch.Tensor | None:
        """Boolean mask [m, committed + pending + m]: committed rows always visible."""
        c = self.cache
        if attend is None:
            if m == 1:
                return None
            attend = torch.ones(m, c.pending + m, dtype=torch.bool, device=self.device).tril_(c.pending)
        head = torch.ones(m, c.length, dtype=torch.bool, device=self.device)
        return torch.cat([head, attend], dim=1)

    def window_mask(self, mask: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor | None:
        """The sliding layers' mask [m, end] for new rows at `positions` [m] (rows already reserved):
        `mask` (None: causal) and, once a position reaches the window, rows within it only. None
        when it equals `mask` (no window, or every position below it)."""
        w = self.window
        if w is None or int(positions.max()) < w:
            return None
        end = self.cache.end
        if mask is None:
            mask = torch.ones(positions.shape[0], end, dtype=torch.bool, device=self.device)
        return mask & (positions[:, None] - self.cache.row_positions[None, :end] < w)  # [m, end]


def _fuse(linears) -> torch.Tensor:
    """The weights of `linears` stacked by rows into one matrix, which the transformers modules then
    read through row views: one copy of the weights, not two (the model may be on a GPU)."""
    w = torch.cat([lin.weight for lin in linears], 0)  # [sum out, in]
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = w[start : start + rows]
        start += rows
    return w


def decoder_layer_weights(layer, model_type: str) -> dict:
    """The weights of a Llama-math decoder layer in the fused layout `LlamaTreeLM` runs: qkv
    [(H + 2KV) * hd, dim], o, gate_up [2 * inter, dim], down, the two norms, the QKV bias (or None)
    and the QK-norm weights (q [hd], k [hd], or None). Separate projections (Llama, Qwen) are fused
    into one matrix that the transformers modules then read through views; Phi-3's are fused already."""
    a, m = layer.self_attn, layer.mlp
    if model_type == "phi3":
        qkv, bqkv, gate_up = a.qkv_proj.weight, a.qkv_proj.bias, m.gate_up_proj.weight
    else:
        qkv = _fuse([a.q_proj, a.k_proj, a.v_proj])
        bqkv = None if a.q_proj.bias is None else torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias], 0)
        gate_up = _fuse([m.gate_proj, m.up_proj])
    qk_norm = (a.q_norm.weight, a.k_norm.weight) if model_type == "qwen3" else None
    return dict(qkv=qkv, bqkv=bqkv, o=a.o_proj.weight, gate_up=gate_up, down=m.down_proj.weight,
                ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight, qk_norm=qk_norm)


def layer_projections(hf_model, index: int) -> dict[str, torch.Tensor] | None:
    """q, k, v, o, gate, up, down weights and the two norms of decoder layer `index` when the model's
    layers are Llama's math (`fast_path_refusal`; Phi-3's fused matrices split by views), without
    changing the module; None for another family (Gemma's scaled norms and GELU)."""
    cfg = hf_model.config
    if fast_path_refusal(cfg) is not None:
        return None
    layer = hf_model.model.layers[index]
    a, m = layer.self_attn, layer.mlp
    if cfg.model_type == "phi3":
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv = cfg.num_key_value_heads * hd
        q, k, v = a.qkv_proj.weight.split([cfg.num_attention_heads * hd, kv, kv])
        gate, up = m.gate_up_proj.weight.chunk(2)
    else:
        q, k, v = a.q_proj.weight, a.k_proj.weight, a.v_proj.weight
        gate, up = m.gate_proj.weight, m.up_proj.weight
    return dict(q=q, k=k, v=v, o=a.o_proj.weight, gate=gate, up=up, down=m.down_proj.weight,
                ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight)


def _rope_tables(inv_freq: torch.Tensor, scaling: float, max_len: int, dtype):
    pos = torch.arange(max_len, dtype=torch.float32, device=inv_freq.device)
    freqs = pos[:, None] * inv_freq.float()[None, :]  # [max_len, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [max_len, hd]
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


class LlamaTreeLM(TreeLM):
    """Tree forward for Llama-like transformers models, weights shared with the HF module."""

    def __init__(
        self,
        hf_model,
        *,
        max_len: int = 2048,
        feature_layers: tuple[int, ...] = (),
        n_layers: int | None = None,
        kernels: KernelTable | None = None,
    ):
        """`n_layers` keeps only the first layers (then the final norm and LM head): an early-exit
        self-drafter that shares the target's weights and tokenizer. `kernels`: the device's kernel
        table (`ogspo calibrate-kernels`); None runs every matmul with `F.linear`."""
        cfg = hf_model.config
        refusal = fast_path_refusal(cfg)
        if refusal is not None:
            raise ValueError(f"LlamaTreeLM cannot run this model: {refusal}; use backend 'hf'")
        self.hf_model = hf_model
        self.config = cfg
        inner = hf_model.model
        p = next(hf_model.parameters())
        self.device, self.dtype = p.device, p.dtype  # dtype: the weights' (the kernel table's key)
        self.act_dtype = torch.float32 if p.dtype in (torch.bfloat16, torch.float16) else p.dtype  # activations, cache, logits
        self.n_heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.vocab_size = cfg.vocab_size
        self.eps = cfg.rms_norm_eps
        self.feature_layers = tuple(feature_layers)
        layer_types, self.window = attention_layout(cfg)
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight.to(self.act_dtype)
        self.lm_head = hf_model.lm_head.weight
        self.layers = []
        fused = {c: [] for c in ("qkv", "o", "gate_up", "down")}
        with torch.no_grad():
            for i, layer in enumerate(inner.layers[: n_layers or len(inner.layers)]):
                w = decoder_layer_weights(layer, cfg.model_type)
                fused["qkv"].append(w["qkv"])  # [(H + 2KV) * hd, dim]
                fused["o"].append(w["o"])  # [dim, H * hd]
                fused["gate_up"].append(w["gate_up"])  # [2 * inter, dim]
                fused["down"].append(w["down"])  # [dim, inter]
                act = lambda t: None if t is None else t.to(self.act_dtype)  # noqa: E731 (no copy when the dtypes agree)
                self.layers.append(dict(ln1=act(w["ln1"]), bqkv=act(w["bqkv"]), ln2=act(w["ln2"]),
                                        qk_norm=None if w["qk_norm"] is None else tuple(map(act, w["qk_norm"])),
                                        sliding=layer_types[i] == SLIDING))
        # QK-norm and windows are torch ops only: the native ops do neither
        self.torch_ops_only = any(L["qk_norm"] is not None for L in self.layers)
        shapes = {c: list(ws[0].shape) for c, ws in fused.items()} | {"lm_head": list(self.lm_head.shape)}
        self.layer_ops_shape = layer_ops_shape(n_heads=self.n_heads, kv_heads=self.kv_heads, head_dim=self.head_dim,
                                               dim=self.embed.shape[1], inter=fused["gate_up"][0].shape[0] // 2)
        shapes[LAYER_OPS] = self.layer_ops_shape
        if kernels is not None:
            check_usable(kernels, str(self.device), self.dtype)
            kernels.check_shapes(shapes)
        self.kernels = kernels
        self.mm = {c: Matmul(c, ws, kernels) for c, ws in fused.items()}  # the matmul classes
        self.mm["lm_head"] = Matmul("lm_head", [self.lm_head], kernels)
        rot = inner.rotary_emb
        self.max_len = max_len
        self.cos, self.sin = _rope_tables(rot.inv_freq, float(rot.attention_scaling), max_len, self.act_dtype)
        self._ops_torch = TorchLayerOps(n_heads=self.n_heads, kv_heads=self.kv_heads, head_dim=self.head_dim, eps=self.eps)
        self._ops = {TORCH: self._ops_torch}  # implementation name -> instance
        self._ops_by_rows: dict[int, object] = {}  # row count -> instance
        self._fused: dict[int, tuple[int, ...] | None] = {}  # row count -> matmul threads of the one-call layer, or None
        # per layer: the packed qkv, o, gate_up, down (built on the first one-call forward)
        self._packed: list[tuple] | None = None
        self.cache = self.new_cache(max_len)

    def new_cache(self, max_len: int) -> KVCache:
        return KVCache(
            n_layers=len(self.layers),
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            max_len=max_len,
            dtype=self.act_dtype,
            device=self.device,
        )

    def layer_ops(self, m: int):
        """The layer-ops implementation the kernel table picked for single-sequence forwards of m rows
        (looked up once per row count, like `Matmul.plan`)."""
        ops = self._ops_by_rows.get(m)
        if ops is None:
            native_ok = self.kernels is not None and self.device.type == "cpu" and not self.torch_ops_only
            name = self.kernels.layer_ops(m) if native_ok else TORCH
            ops = self._ops.get(name)
            if ops is None:
                ops = self._ops[name] = make_layer_ops(name, n_heads=self.n_heads, kv_heads=self.kv_heads, head_dim=self.head_dim,
                                                       eps=self.eps)
            self._ops_by_rows[m] = ops
        return ops

    def fused_threads(self, m: int, ops) -> tuple[int, ...] | None:
        """Thread counts of the qkv, o, gate_up and down matmuls when a forward of m rows can run each
        layer as one native call (`NativeLayerOps.decoder_layer`): the native layer ops and a native
        kernel for all four classes at m rows (the table's padding is not applied there: a native
        kernel gives a row the same bits at any row count). None otherwise."""
        if not isinstance(ops, NativeLayerOps):
            return None
        if m not in self._fused:
            threads = tuple(self.mm[c].native_threads(m) for c in ("qkv", "o", "gate_up", "down"))
            self._fused[m] = None if None in threads else threads
        return self._fused[m]

    def _layers_fused(self, x, step: Step, keys, values, ops, threads):
        """`_layers` with each decoder layer as one native call; x [1, m, dim] contiguous, updated in place."""
        feats: dict[int, torch.Tensor] = {}
        if self._packed is None:
            self._packed = [tuple(self.mm[c].weights[i].packed for c in ("qkv", "o", "gate_up",
                                                                         "down")) for i in range(len(self.layers))]
        for i, L in enumerate(self.layers):
            ops.decoder_layer(x, ln1=L["ln1"], ln2=L["ln2"], bias=L["bqkv"], threads=threads, step=step, keys=keys[i],
                              values=values[i],
                              weights=self._packed[i])
            if i in self.feature_layers:
                feats[i] = x.clone()  # the output of layer i
        x, h = ops.add_rmsnorm(x, None, self.norm)
        features = torch.cat([feats[i] for i in self.feature_layers], -1) if feats else None  # [1, m, n_feat * dim]
        return h, features

    def _layers(self, x, step: Step, keys, values, ops):
        """The decoder layers and the final norm over B sequences of m new tokens: x [B, m, dim] the
        embeddings; keys/values: per-layer caches [B, KV, max_len, hd] whose rows step.start..+m
        are written here. Returns the normed final hidden state [B, m, dim] and the chosen feature
        layers' outputs [B, m, n_feat * dim] (or None)."""
        mm = self.mm
        feats: dict[int, torch.Tensor] = {}
        r = None  # the residual branch not yet added to x
        for i, L in enumerate(self.layers):
            x, h = ops.add_rmsnorm(x, r, L["ln1"])  # x: the output of layer i - 1
            if i - 1 in self.feature_layers:
                feats[i - 1] = x.clone()  # the native ops update x in place
            o = ops.rope_attention(mm["qkv"](i, h), L["bqkv"], step, keys[i], values[i],
                                   sliding=L["sliding"], qk_norm=L["qk_norm"])  # [B, m, H * hd]
            x, h = ops.add_rmsnorm(x, mm["o"](i, o), L["ln2"])
            r = mm["down"](i, ops.silu_mul(mm["gate_up"](i, h)))  # [B, m, dim]
        x, h = ops.add_rmsnorm(x, r, self.norm)
        if len(self.layers) - 1 in self.feature_layers:
            feats[len(self.layers) - 1] = x
        features = torch.cat([feats[i] for i in self.feature_layers], -1) if feats else None  # [B, m, n_feat * dim]
        return h, features

    @torch.inference_mode()
    def forward(self, tokens, positions, attend, *, logits_rows=None) -> ForwardOut:
        c = self.cache
        m = tokens.shape[0]
        mask = self.full_mask(attend, m)  # [m, end+m] bool or None
        committed = c.length
        start = c.reserve(positions)
        window = self.window_mask(mask, positions)  # [m, end+m] or None
        step = Step(positions=positions[None], start=start, committed=committed, attend=attend,
                    mask=None if mask is None else mask[None, None], cos_table=self.cos, sin_table=self.sin,
                    window_mask=None if window is None else window[None, None])
        x = F.embedding(tokens, self.embed).to(self.act_dtype)[None]  # [1, m, dim]
        ops = self._ops_torch if window is not None else self.layer_ops(m)
        threads = self.fused_threads(m, ops)
        if threads is not None:
            h, features = self._layers_fused(x, step, c.keys, c.values, ops, threads)
        else:
            h, features = self._layers(x, step, c.keys, c.values, ops)
        h = h[0]  # [m, dim]
        if logits_rows is not None:
            h = h[logits_rows]
        return ForwardOut(logits=self.mm["lm_head"](0, h), features=None if features is None else features[0])

    def new_batch_cache(self, batch: int, max_len: int) -> BatchKVCache:
        if max_len > self.max_len:
            raise ValueError(f"sequence of {max_len} tokens exceeds the rope table of {self.max_len}")
        shape = (batch, self.kv_heads, max_len, self.head_dim)
        z = lambda: torch.zeros(shape, dtype=self.act_dtype, device=self.device)  # noqa: E731
        return BatchKVCache(keys=[z() for _ in self.layers], values=[z() for _ in self.layers],
                            row_positions=torch.zeros(batch, max_len, dtype=torch.long, device=self.device))

    @torch.inference_mode()
    def forward_batch(self, tokens, positions, cache: BatchKVCache, valid) -> ForwardOut:
        """Causal forward of B sequences side by side (no tree, no shared rows): tokens and positions
        [B, m] fill rows cache.length..+m of every sequence; `valid` [B, >= length + m] bool marks
        real rows (False = left padding, never attended to). Logits [B, m, vocab], features
        [B, m, n_feat * dim]. A padding row attends to itself only, so every row stays finite."""
        B, m = tokens.shape
        start = cache.length
        new = torch.ones(m, m, dtype=torch.bool, device=self.device).tril_() & valid[:, None, start : start + m]  # [B, m, m]
        new |= torch.eye(m, dtype=torch.bool, device=self.device)
        mask = torch.cat([valid[:, None, :start].expand(B, m, start), new], -1)[:, None]  # [B, 1, m, end]
        cache.row_positions[:, start : start + m] = positions
        window = None
        if self.window is not None and int(positions.max()) >= self.window:
            near = positions[:, :, None] - cache.row_positions[:, None, : start + m] < self.window  # [B, m, end]
            window = mask & near[:, None]  # a padding row (position 0) still sees itself
        step = Step(positions=positions, start=start, committed=0, attend=None, mask=mask, cos_table=self.cos, sin_table=self.sin,
                    window_mask=window)
        x = F.embedding(tokens, self.embed).to(self.act_dtype)  # [B, m, dim]
        h, features = self._layers(x, step, cache.keys, cache.values, self._ops_torch)
        cache.length = start + m
        return ForwardOut(logits=self.mm["lm_head"](0, h), features=features)


class _PreallocatedLayer:
    """A transformers cache layer that writes into our preallocated KVCache rows."""

    is_sliding = False
    is_compileable = False
    is_initialized = True

    def __init__(self, cache: KVCache, idx: int):
        self.cache, self.idx = cache, idx

    def update(self, key_states, value_states, *args, **kwargs):
        c = self.cache
        m = key_states.shape[-2]
        start = c.end - m  # rows already reserved by HFTreeLM.forward
        c.keys[self.idx][:, :, start : c.end] = key_states
        c.values[self.idx][:, :, start : c.end] = value_states
        return c.keys[self.idx][:, :, : c.end], c.values[self.idx][:, :, : c.end]

    def get_seq_length(self) -> int:
        return self.cache.end

    def get_mask_sizes(self, query_length: int):
        return self.cache.end + query_length, 0

    def get_max_length(self) -> int:
        return -1


class HFTreeLM(TreeLM):
    """Tree forward through transformers' own modules: any causal LM that takes a custom 4-D mask
    and explicit position ids (every one here does), logits through its own head (Gemma's final
    soft-capping included)."""

    def __init__(self, hf_model, *, max_len: int = 2048, feature_layers: tuple[int, ...] = ()):
        from transformers.cache_utils import Cache

        self.hf_model = hf_model
        self.config = cfg = hf_model.config
        self.layer_types, self.window = attention_layout(cfg)
        p = next(hf_model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.vocab_size = cfg.vocab_size
        self.feature_layers = tuple(feature_layers)
        self.n_layers = cfg.num_hidden_layers
        self.kv_heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self._Cache = Cache
        self.max_len = max_len
        self.cache = self.new_cache(max_len)

    def new_cache(self, max_len: int) -> KVCache:
        kv = KVCache(
            n_layers=self.n_layers,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            max_len=max_len,
            dtype=self.dtype,
            device=self.device,
        )
        self._hf_cache = self._Cache(layers=[_PreallocatedLayer(kv, i) for i in range(self.n_layers)])
        return kv

    def _bias(self, mask: torch.Tensor) -> torch.Tensor:
        """Boolean mask [m, end] -> the additive float mask [1, 1, m, end] transformers takes."""
        return torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill_(~mask,
                                                                                          torch.finfo(self.dtype).min)[None, None]

    @torch.inference_mode()
    def forward(self, tokens, positions, attend, *, logits_rows=None) -> ForwardOut:
        c = self.cache
        m = tokens.shape[0]
        mask = self.full_mask(attend, m)
        if mask is None:
            mask = torch.ones(1, c.end + 1, dtype=torch.bool, device=self.device)
        c.reserve(positions)
        window = self.window_mask(mask, positions)
        attention_mask = self._bias(mask)  # [1, 1, m, end]
        if window is not None:
            # one mask per attention kind: models with layer_types read the dict; the others (Mistral,
            # Phi-3: every layer sliding) take the one tensor
            sliding = self._bias(window)
            attention_mask = sliding if SLIDING in self.layer_types and FULL not in self.layer_types else {
                FULL: attention_mask, SLIDING: sliding}
        out = self.hf_model(
            input_ids=tokens[None],
            attention_mask=attention_mask,
            position_ids=positions[None],
            cache=self._hf_cache,
            use_cache=True,
            output_hidden_states=bool(self.feature_layers),
            logits_to_keep=0 if logits_rows is None else logits_rows,  # 0: every row
        )
        feats = None
        if self.feature_layers:
            feats = torch.cat([out.hidden_states[i + 1][0] for i in self.feature_layers], -1)  # [m, n_feat * dim]
        return ForwardOut(logits=out.logits[0], features=feats)


def build_tree_lm(
    hf_model, *, backend: str = "auto", max_len: int = 2048, feature_layers=(), kernels: KernelTable | None = None
) -> TreeLM:
    """Wrap a transformers causal LM for tree forwards. backend: 'auto', 'llama' or 'hf'; `kernels`
    (the device's kernel table) applies to the 'llama' backend."""
    if backend not in ("auto", "llama", "hf"):
        raise ValueError(f"unknown backend '{backend}'; allowed: auto, llama, hf")
    if backend == "llama" or (backend == "auto" and fast_path_refusal(hf_model.config) is None):
        return LlamaTreeLM(hf_model, max_len=max_len, feature_layers=feature_layers, kernels=kernels)
    return HFTreeLM(hf_model, max_len=max_len, feature_layers=feature_layers)
