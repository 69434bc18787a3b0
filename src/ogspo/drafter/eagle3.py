"""Draft heads in EAGLE-3's published format: the folder SGLang (`LlamaForCausalLMEagle3`), vLLM
(`llama_eagle3.py`) and llama.cpp's `convert_hf_to_gguf.py` read, and the format every head ogspo
trains is written in (with ogspo's own `drafter.json` beside it: target checksum, recipe, metrics).

- `model.safetensors`: `fc.weight` [D, 3D]; `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`;
  `midlayer.self_attn.{q,k,v,o}_proj.weight` (q/k/v read 2D: the normed embedding, then the normed
  feature); `midlayer.mlp.{gate,up,down}_proj.weight`; `norm.weight`; `lm_head.weight` [V', D];
  optionally `embed_tokens.weight` (absent: the target's embedding, as the engines do); `d2t` [V']
  int64 offsets, target id = draft id + d2t[draft id]; `t2d` [V] bool, the target ids drafted.
- `config.json`: a Llama config with `architectures: ["LlamaForCausalLMEagle3"]`, `num_hidden_layers: 1`,
  `vocab_size` (the target's), `draft_vocab_size`, `target_hidden_size`, the target's rotary settings
  (`rope_theta`, `rope_scaling`), and `eagle_aux_hidden_state_layer_ids` in vLLM's numbering: id j is
  the hidden state entering target layer j (the output of layer j - 1, 0 the embedding), so ogspo's
  feature layers (outputs of 0-based layers) are those ids minus one; llama.cpp's converter reads the
  same field. SGLang reads only `eagle_config.eagle_aux_hidden_state_layer_ids` and captures the input
  of layer id + 1, so that copy holds the ids minus one. Absent in both places, vLLM's default (2, N/2,
  N-3) for an N-layer target. `norm_before_residual` and `norm_before_fc` (false for ogspo's heads)
  are written out and read (`head.HeadConfig`).
- The weights load from `model.safetensors`, or `pytorch_model.bin` where a head ships that.

Torch and transformers only: no engine imports beyond the head itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .head import EagleHead, HeadConfig

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TORCH_WEIGHTS = "pytorch_model.bin"  # the other form published heads ship (EAGLE's own loader reads it)
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # SGLang's name, vLLM's alias

# ogspo's parameter names -> EAGLE-3's keys (vectors are nn.Parameters of the head, matrices its Linear weights)
KEYS = {
    "fc.weight": "fc.weight",
    "input_layernorm": "midlayer.input_layernorm.weight",
    "hidden_norm": "midlayer.hidden_norm.weight",
    "post_attention_layernorm": "midlayer.post_attention_layernorm.weight",
    "q.weight": "midlayer.self_attn.q_proj.weight",
    "k.weight": "midlayer.self_attn.k_proj.weight",
    "v.weight": "midlayer.self_attn.v_proj.weight",
    "o.weight": "midlayer.self_attn.o_proj.weight",
    "gate.weight": "midlayer.mlp.gate_proj.weight",
    "up.weight": "midlayer.mlp.up_proj.weight",
    "down.weight": "midlayer.mlp.down_proj.weight",
    "norm": "norm.weight",
    "lm_rows": "lm_head.weight",
}


def keys_of(cfg: HeadConfig) -> dict[str, str]:
    """`KEYS`, with `input_norm.weight` for a head that norms its features before fc."""
    return KEYS | ({"input_norm": "input_norm.weight"} if cfg.norm_before_fc else {})


def eagle3_state(head: EagleHead) -> dict[str, torch.Tensor]:
    """The head's tensors under EAGLE-3's keys, on the CPU, with `d2t` as offsets and `t2d` as a mask."""
    own = head.state_dict()
    state = {key: own[name].detach().cpu().contiguous() for name, key in keys_of(head.cfg).items()}
    d2t = head.d2t.cpu()
    state["d2t"] = d2t - torch.arange(len(d2t))  # [V'] offsets: target = draft + d2t[draft]
    t2d = torch.zeros(head.cfg.vocab, dtype=torch.bool)
    t2d[d2t] = True
    state["t2d"] = t2d  # [V]
    return state


def target_rope_settings(target_config) -> tuple[float, dict | None, int]:
    """(rope_theta, rope_scaling or None, max_position_embeddings) of the target's full-attention
    layers, as a Llama config spells them (transformers 5 keeps them as `rope_parameters`, per
    attention kind for Gemma 3)."""
    params = getattr(target_config, "rope_parameters", None) or {}
    if "full_attention" in params:
        params = params["full_attention"]
    theta = params.get("rope_theta", getattr(target_config, "rope_theta", 10000.0))
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    return float(theta), scaling, int(getattr(target_config, "max_position_embeddings", 4096))


def eagle3_config(cfg: HeadConfig, target_config) -> dict:
    """The head's `config.json` for a target with `target_config` (a transformers config)."""
    theta, scaling, max_pos = target_rope_settings(target_config)
    return {
        "architectures": [ARCHITECTURES[0]],
        "model_type": "llama",
        "hidden_size": cfg.hidden,
        "target_hidden_size": cfg.hidden,
        "intermediate_size": cfg.intermediate,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.eps,
        "vocab_size": cfg.vocab,
        "draft_vocab_size": cfg.draft_vocab,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": max_pos,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.feature_layers],
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        # SGLang's copy: it captures the input of layer id + 1
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.feature_layers), "use_aux_hidden_state": True},
    }


def save_eagle3(head: EagleHead, out_dir: Path, *, target_config) -> None:
    """Write `config.json` and `model.safetensors` of `head` into `out_dir` (which must exist)."""
    out_dir = Path(out_dir)
    save_file(eagle3_state(head), str(out_dir / WEIGHTS))
    (out_dir / CONFIG).write_text(json.dumps(eagle3_config(head.cfg, target_config), indent=1))


def weights_file(path: Path) -> Path | None:
    """The head folder's weights: model.safetensors, else pytorch_model.bin; None without either."""
    return next((Path(path) / f for f in (WEIGHTS, TORCH_WEIGHTS) if (Path(path) / f).is_file()), None)


def is_eagle3_folder(path: Path) -> bool:
    return (Path(path) / CONFIG).is_file() and weights_file(path) is not None


def aux_layer_ids(conf: dict, n_layers: int, *, where: str) -> list[int]:
    """The feature layer ids in vLLM's numbering from either place a head writes them (the top level, or
    SGLang's `eagle_config` ids plus one); both present, they must agree."""
    top = conf.get("eagle_aux_hidden_state_layer_ids")
    nested = (conf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    from_sglang = None if nested is None else [int(i) + 1 for i in nested]
    if top is not None and from_sglang is not None and [int(i) for i in top] != from_sglang:
        raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids {list(top)} and eagle_config's {list(nested)} "
                         "(SGLang's numbering, the input of layer id + 1) name different layers")
    return [int(i) for i in top] if top is not None else from_sglang or [2, n_layers // 2, n_layers - 3]


def head_config(conf: dict, target_config, *, where: str) -> HeadConfig:
    """The `HeadConfig` of an EAGLE-3 `config.json` for a target with `target_config`, or a ValueError
    of one line naming what does not fit (`where` names the folder)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    arch = conf.get("architectures") or []
    if not set(arch) & set(ARCHITECTURES):
        raise ValueError(f"{where}: config.json architectures {arch} is not an EAGLE-3 head (one of {list(ARCHITECTURES)})")
    if conf.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{where}: EAGLE-3 heads of {conf['num_hidden_layers']} layers are not supported (1 layer)")
    n_layers, t_hidden, t_vocab = target_config.num_hidden_layers, target_config.hidden_size, target_config.vocab_size
    hidden = conf["hidden_size"]
    fed = conf.get("target_hidden_size") or hidden
    if hidden != t_hidden or fed != t_hidden:
        raise ValueError(f"{where}: head of hidden size {hidden} (target features {fed}), the target's is {t_hidden}")
    if conf["vocab_size"] != t_vocab:
        raise ValueError(f"{where}: head for a vocabulary of {conf['vocab_size']} tokens, the target has {t_vocab}")
    ids = aux_layer_ids(conf, n_layers, where=where)
    if len(ids) != 3 or not all(1 <= int(i) <= n_layers - 1 for i in ids):
        raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids {ids} must be 3 layer ids in 1..{n_layers - 1} "
                         f"(hidden states entering layers of this {n_layers}-layer target)")
    heads = conf["num_attention_heads"]
    head_dim = conf.get("head_dim") or hidden // heads
    rope = LlamaRotaryEmbedding(LlamaConfig(**{k: v for k, v in conf.items() if k not in ("architectures", "model_type")}))
    return HeadConfig(
        hidden=hidden, n_heads=heads, kv_heads=conf.get("num_key_value_heads", heads), head_dim=head_dim,
        intermediate=conf["intermediate_size"], eps=float(conf.get("rms_norm_eps", 1e-6)), vocab=t_vocab,
        draft_vocab=int(conf.get("draft_vocab_size") or t_vocab), feature_layers=tuple(int(i) - 1 for i in ids),
        rope_theta_inv_freq=rope.inv_freq.float().tolist(), rope_scaling=float(rope.attention_scaling),
        norm_before_residual=bool(conf.get("norm_before_residual", False)),
        norm_before_fc=bool((conf.get("eagle_config") or {}).get("norm_before_fc", conf.get("norm_before_fc", False))),
    )


def load_eagle3(path: Path, *, target_model) -> EagleHead:
    """An EAGLE-3 head folder as an `EagleHead` for `target_model` (its embedding unless the folder
    has its own), on the target's device; one-line errors for a head of another target's shape."""
    path = Path(path)
    where = f"draft head {path}"
    conf = json.loads((path / CONFIG).read_text())
    cfg = head_config(conf, target_model.config, where=where)
    weights = weights_file(path)
    state = load_file(str(weights)) if weights.name == WEIGHTS else torch.load(weights, map_location="cpu", weights_only=True)
    keys = keys_of(cfg)
    missing = [k for k in keys.values() if k not in state]
    if missing:
        raise ValueError(f"{where}: {weights.name} lacks {missing[:3]}{' ...' if len(missing) > 3 else ''} "
                         "(an EAGLE-3 head has fc, midlayer.*, norm and lm_head weights)")
    lm = state["lm_head.weight"]
    if tuple(lm.shape) != (cfg.draft_vocab, cfg.hidden):
        raise ValueError(f"{where}: lm_head.weight is {tuple(lm.shape)}, config.json says ({cfg.draft_vocab}, {cfg.hidden})")
    offsets = state.get("d2t", torch.zeros(cfg.draft_vocab, dtype=torch.long)).long()
    d2t = torch.arange(cfg.draft_vocab) + offsets  # [V'] target ids
    if len(d2t) != cfg.draft_vocab or int(d2t.min()) < 0 or int(d2t.max()) >= cfg.vocab:
        raise ValueError(f"{where}: d2t maps draft ids outside the target's {cfg.vocab} tokens")
    if "t2d" in state and not torch.equal(state["t2d"].bool().nonzero().flatten().sort().values, d2t.sort().values):
        raise ValueError(f"{where}: t2d does not mark the target ids d2t maps to")
    embed = state.get("embed_tokens.weight", target_model.get_input_embeddings().weight)
    head = EagleHead(cfg, embed=embed.to(target_model.get_input_embeddings().weight.device), lm_rows=lm, d2t=d2t)
    own = {name: state[key] for name, key in keys.items()} | {"d2t": d2t}
    head.load_state_dict({k: v.to(head.lm_rows.dtype) if v.is_floating_point() else v for k, v in own.items()}, strict=True)
    return head
