"""Every architecture family, both backends, every tree policy: lossless at T=0 against transformers'
own `generate`, with a drafter good enough (a perturbed copy of the target) that a broken tree or
window mask could not hide behind rejected drafts."""

import numpy as np
import pytest
import torch

from engine_helpers import hf_greedy
from family_models import FAMILIES, WINDOW, family_model, perturbed
from ogspo.engine.decode import SpeculativeEngine
from ogspo.engine.drafters import LMDrafter
from ogspo.engine.policies import Autoregressive, DynamicTree, StaticTree, chain
from ogspo.engine.target import HFTreeLM, LlamaTreeLM, attention_layout, build_tree_lm, fast_path_refusal
from ogspo.engine.tree import Structure, ancestor_matrix

PROMPTS = [[5, 9, 13, 2, 7], [17, 22, 60, 1, 8, 33, 12, 5, 9, 13, 40]]  # the second starts past the window
N_NEW = 40


def policies():
    return [
        Autoregressive(),
        chain(4),
        StaticTree(Structure([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)])),
        DynamicTree(total_tokens=12, depth=4, top_k=3),
    ]


FAST = [f for f in FAMILIES if fast_path_refusal(family_model(f).config) is None]


def test_fast_path_covers_the_llama_math_families_only():
    assert set(FAST) == {"llama", "mistral-sliding", "qwen2-interleaved", "qwen3-qknorm", "phi3-fused"}
    with pytest.raises(ValueError, match="cannot run this model: 'gemma2' is not one of"):
        LlamaTreeLM(family_model("gemma2-softcap"))


@pytest.mark.parametrize("family,backend", [(f, "hf") for f in FAMILIES] + [(f, "llama") for f in FAST])
def test_every_tree_policy_is_lossless_against_transformers(family, backend):
    model = family_model(family)
    draft_model = perturbed(model)
    target = build_tree_lm(model, backend=backend, max_len=256)
    assert isinstance(target, LlamaTreeLM if backend == "llama" else HFTreeLM)
    accepted = []
    for prompt in PROMPTS:
        ref = hf_greedy(model, prompt, N_NEW)
        for policy in policies():
            drafter = LMDrafter(build_tree_lm(draft_model, backend=backend, max_len=256))
            res = SpeculativeEngine(target=target, policy=policy, drafter=drafter).generate(prompt, max_new_tokens=N_NEW)
            assert res.tokens == ref, f"{family}/{backend}/{policy.name} diverged on {prompt}"
            if policy.max_nodes > 1:
                accepted += [c.accepted for c in res.cycles]
    assert np.mean(accepted) > 1.5, f"{family}: mean accepted length {np.mean(accepted):.2f}: the drafter tests too little"


@pytest.mark.parametrize("family,backend", [("mistral-sliding", "llama"), ("mistral-sliding", "hf"),
                                            ("qwen2-interleaved", "llama"), ("gemma3-interleaved", "hf")])
def test_tree_forward_past_the_window_matches_sequential_logits(family, backend):
    """Every node of a tree drafted after a context longer than the window gets the logits of its own
    root path run as one plain sequence (transformers' own sliding-window masking; without the
    window the logits differ by ~1, not 1e-5)."""
    model = family_model(family)
    lm = build_tree_lm(model, backend=backend, max_len=64)
    assert attention_layout(model.config)[1] == WINDOW
    ctx = torch.arange(3, 3 + 2 * WINDOW)  # a context twice the window
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
        seq = torch.cat([ctx, tokens[path[::-1]]])
        with torch.no_grad():
            ref = model(seq[None]).logits[0, -1]
        torch.testing.assert_close(out.logits[node], ref, atol=1e-5, rtol=1e-5)
    # keep the path 0 -> 1 -> 3 (rows moved into place, their positions with them) and go on
    lm.cache.commit(torch.tensor([L, L + 1, L + 3]))
    nxt = lm.forward(torch.tensor([50]), torch.tensor([L + 3]), None)
    with torch.no_grad():
        ref = model(torch.cat([ctx, torch.tensor([7, 11, 20, 50])])[None]).logits[0, -1]
    torch.testing.assert_close(nxt.logits[0], ref, atol=1e-5, rtol=1e-5)


def test_unsupported_attention_kinds_are_refused_in_one_line():
    model = family_model("llama")
    model.config.layer_types = ["full_attention", "chunked_attention", "full_attention"]
    with pytest.raises(ValueError, match="has chunked_attention layers; tree attention runs full_attention and sliding_attention layers only"):
        build_tree_lm(model, backend="hf")
