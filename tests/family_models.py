"""Tiny random models of every architecture family the engine runs, built in-test (no weights are
fetched): float64 with a wide initialisation so greedy argmaxes have clear margins. Each family
exercises what sets it apart: sliding windows (all layers, or interleaved with global ones), QKV
biases, QK-norm, Phi-3's fused projections, Gemma's scaled norms and attention/final soft-capping."""

from __future__ import annotations

import copy

import torch
import transformers as tf

WINDOW = 8  # small enough that a 5-token prompt plus 40 new tokens and depth-4 trees cross it

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, bos_token_id=0,
              eos_token_id=None, pad_token_id=None)

# family -> (model class, config); the configs are what transformers' own tests use for these, made tiny
FAMILIES = {
    "llama": (tf.LlamaForCausalLM, lambda: tf.LlamaConfig(**COMMON, tie_word_embeddings=False)),
    "mistral-sliding": (tf.MistralForCausalLM, lambda: tf.MistralConfig(**COMMON, sliding_window=WINDOW)),
    "qwen2-interleaved": (tf.Qwen2ForCausalLM, lambda: tf.Qwen2Config(
        **COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, tie_word_embeddings=True)),
    "qwen3-qknorm": (tf.Qwen3ForCausalLM, lambda: tf.Qwen3Config(**COMMON, head_dim=8, attention_bias=True)),
    "phi3-fused": (tf.Phi3ForCausalLM, lambda: tf.Phi3Config(**COMMON, sliding_window=WINDOW)),
    "gemma2-softcap": (tf.Gemma2ForCausalLM, lambda: tf.Gemma2Config(
        **COMMON, head_dim=8, sliding_window=WINDOW, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
        query_pre_attn_scalar=8, attn_implementation="eager")),
    "gemma3-interleaved": (tf.Gemma3ForCausalLM, lambda: tf.Gemma3TextConfig(
        **COMMON, head_dim=8, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=8, attn_implementation="eager")),
}


def family_model(family: str, seed: int = 0):
    cls, make_config = FAMILIES[family]
    torch.manual_seed(seed)
    return cls(make_config()).to(torch.float64).eval()


def perturbed(model, scale: float = 0.05, seed: int = 1):
    """A copy of `model` with every weight moved by `scale` times its own spread: a drafter that
    agrees with the target most of the time, not always (so rejections and masks both get used)."""
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale * (p.std() if p.numel() > 1 else 1.0))
    return out
