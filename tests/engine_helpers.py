"""Tiny models for engine tests: float64 and a wide initialisation, so greedy argmaxes have clear
margins and token-for-token comparisons test the engine, not float rounding."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_model(seed: int = 0, *, vocab: int = 64, layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).to(torch.float64).eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()
