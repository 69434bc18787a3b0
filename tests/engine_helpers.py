"""Tiny models for engine tests: float64 and a wide initialisation, so greedy argmaxes have clear
margins and token-for-token comparisons test the engine, not float rounding."""

from __future__ import annotations

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ogspo.drafter.head import EagleHead, HeadConfig
from ogspo.engine.decode import SpeculativeEngine
from ogspo.engine.drafters import LMDrafter
from ogspo.engine.policies import DynamicTree, StaticTree, chain
from ogspo.engine.target import LlamaTreeLM
from ogspo.engine.tree import Structure, ancestor_matrix


def tiny_model(seed: int = 0, *, vocab: int = 64, layers: int = 2, hidden: int = 32, heads: int = 4,
               kv_heads: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        initializer_range=0.3,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).to(torch.float64).eval()


def make_head(target, seed=0, draft_vocab=48) -> EagleHead:
    """An EAGLE-3-style head for `target` with random weights and a non-trivial draft vocabulary."""
    torch.manual_seed(seed)
    cfg = HeadConfig.for_target(target, draft_vocab=draft_vocab)
    d2t = torch.arange(draft_vocab) + (target.config.vocab_size - draft_vocab)  # a non-trivial map
    head = EagleHead(cfg, embed=target.model.embed_tokens.weight, lm_rows=target.lm_head.weight[d2t], d2t=d2t)
    for p in head.parameters():
        p.data.normal_(0, 0.3)
    return head.eval()


def check_tree_forward(lm, model, ctx: torch.Tensor) -> None:
    """After committing `ctx`, one tree forward gives every node the logits of its own root path run
    as a plain sequence by `model`; keeping the path 0 -> 1 -> 3 (compaction) and forwarding one more
    token gives the sequential logits again."""
    L = len(ctx)
    lm.forward(ctx, torch.arange(L), None)
    lm.cache.commit_prefix(L)
    parents = np.array([-1, 0, 0, 1, 1, 2, 3])
    depths = np.array([0, 1, 1, 2, 2, 2, 3])
    tokens = torch.tensor([7, 11, 12, 20, 21, 30, 40])
    out = lm.forward(tokens, torch.from_numpy(L + depths), torch.from_numpy(ancestor_matrix(parents, depths)))
    for node in range(7):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(int(parents[path[-1]]))
        with torch.no_grad():
            ref = model(torch.cat([ctx, tokens[path[::-1]]])[None]).logits[0, -1]
        torch.testing.assert_close(out.logits[node], ref, atol=1e-5, rtol=1e-5)
    lm.cache.commit(torch.tensor([L, L + 1, L + 3]))  # rows moved into place, their positions with them
    assert lm.cache.length == L + 3 and lm.cache.pending == 0
    nxt = lm.forward(torch.tensor([50]), torch.tensor([L + 3]), None)
    with torch.no_grad():
        ref = model(torch.cat([ctx, torch.tensor([7, 11, 20, 50])])[None]).logits[0, -1]
    torch.testing.assert_close(nxt.logits[0], ref, atol=1e-5, rtol=1e-5)


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def assert_tree_policies_equal_greedy(target, target_model, draft_model) -> None:
    """A chain, a static tree and an EAGLE-3 dynamic tree over `target` (drafted by `draft_model`)
    each equal transformers' greedy decoding of `target_model` on two prompts, token for token."""
    policies = [chain(4), StaticTree(Structure([[0], [1], [0, 0], [1, 0], [0, 0, 0]])),
                DynamicTree(total_tokens=12, depth=4, top_k=3)]
    for prompt in ([3, 7, 11], [9, 1, 4, 4, 20]):
        ref = hf_greedy(target_model, prompt, 30)
        for policy in policies:
            engine = SpeculativeEngine(target=target, policy=policy, drafter=LMDrafter(LlamaTreeLM(draft_model, max_len=256)))
            assert engine.generate(prompt, max_new_tokens=30).tokens == ref, policy.name


@torch.inference_mode()
def hf_annotate(model, seqs: list[list[int]], feature_layers: tuple[int, ...], top_k: int):
    """The reference teacher-forced pass, through transformers' own forward (not the engine's): per
    position the hidden states after `feature_layers` and the top-k next-token probabilities, as
    `drafter.data.Sequence`s."""
    from ogspo.drafter.data import Sequence, store_features

    out = []
    for s in seqs:
        res = model(input_ids=torch.tensor([s]), output_hidden_states=True)
        feats = torch.cat([res.hidden_states[layer + 1][0] for layer in feature_layers], -1)  # [n, F]
        top = torch.softmax(res.logits[0].float(), -1).topk(top_k, dim=-1)  # [n, K]
        out.append(Sequence(tokens=torch.tensor(s, dtype=torch.int32), feats=store_features(feats),
                            top_ids=top.indices.to(torch.int32), top_p=top.values.to(torch.float16)))
    return out
