"""Engine correctness on tiny float64 models: tree forwards, lossless greedy decoding, replay."""

import pytest
import torch
from engine_helpers import check_tree_forward, hf_greedy, make_head, tiny_model

from ogspo.drafter.runtime import EagleDrafter
from ogspo.engine.decode import SpeculativeEngine
from ogspo.engine.drafters import LMDrafter, PromptLookupDrafter
from ogspo.engine.policies import Autoregressive, DynamicTree, StaticTree, chain
from ogspo.engine.target import build_tree_lm
from ogspo.engine.tree import Structure

PROMPTS = [[5, 9, 13, 2, 7], [3, 3, 3, 3, 3, 3, 40, 41], [17, 22, 60, 1, 8, 33, 12, 5, 9, 13]]


def policies():
    return [
        Autoregressive(),
        chain(3),
        StaticTree(Structure([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)])),
        DynamicTree(total_tokens=12, depth=4, top_k=3),
        DynamicTree(total_tokens=60, depth=5, top_k=10),
    ]


@pytest.mark.parametrize("backend", ["llama", "hf"])
def test_tree_forward_matches_sequential_logits(backend):
    model = tiny_model(0)
    check_tree_forward(build_tree_lm(model, backend=backend, max_len=64), model, torch.tensor([5, 9, 13, 2]))


@pytest.mark.parametrize("drafter_kind", ["lm", "lookup"])
def test_every_policy_is_lossless_at_temperature_zero(drafter_kind):
    target_model = tiny_model(0)
    draft_model = tiny_model(1)  # a different (weak) drafter sharing the vocabulary
    target = build_tree_lm(target_model, max_len=256)
    for prompt in PROMPTS:
        ref = hf_greedy(target_model, prompt, 40)
        for policy in policies():
            drafter = LMDrafter(build_tree_lm(draft_model, max_len=256)) if drafter_kind == "lm" else PromptLookupDrafter()
            engine = SpeculativeEngine(target=target, policy=policy, drafter=drafter)
            res = engine.generate(prompt, max_new_tokens=40)
            assert res.tokens == ref, f"{policy.name} with {drafter_kind} diverged on {prompt}"
            assert sum(c.accepted for c in res.cycles) + 1 == 40 or len(res.tokens) == 40


def test_self_drafting_accepts_everything():
    """Drafting with the target itself at T=0 must accept every drafted top-1 chain token."""
    model = tiny_model(0)
    engine = SpeculativeEngine(
        target=build_tree_lm(model, max_len=256), policy=chain(4), drafter=LMDrafter(build_tree_lm(model, max_len=256))
    )
    res = engine.generate(PROMPTS[0], max_new_tokens=41)
    assert all(c.accepted == 5 for c in res.cycles)
    assert res.tau == 5.0


def test_stop_hook_truncates_drafting():
    model = tiny_model(0)
    calls = []

    def stop_after_two(tree, level, ctx):
        calls.append(level)
        return level >= 2

    engine = SpeculativeEngine(
        target=build_tree_lm(model, max_len=256),
        policy=chain(6),
        drafter=LMDrafter(build_tree_lm(model, max_len=256)),
        stop_hook=stop_after_two,
    )
    res = engine.generate(PROMPTS[0], max_new_tokens=20)
    assert all(c.depth <= 2 for c in res.cycles) and 2 in calls
    assert res.tokens == hf_greedy(model, PROMPTS[0], 20)


def test_replay_same_seed_same_output_at_temperature_one():
    target_model, draft_model = tiny_model(0), tiny_model(1)
    target = build_tree_lm(target_model, max_len=256)
    runs = []
    for _ in range(2):
        engine = SpeculativeEngine(
            target=target,
            policy=DynamicTree(total_tokens=10, depth=3, top_k=3),
            drafter=LMDrafter(build_tree_lm(draft_model, max_len=256)),
            temperature=1.0,
        )
        res = engine.generate(PROMPTS[1], max_new_tokens=30, seed=123)
        runs.append((res.tokens, [c.accepted for c in res.cycles]))
    assert runs[0] == runs[1]
    other = engine.generate(PROMPTS[1], max_new_tokens=30, seed=124)
    assert other.tokens != runs[0][0]


@pytest.mark.parametrize("backend", ["llama", "hf"])
@pytest.mark.parametrize("drafter_kind", ["lm", "lookup", "eagle"])
def test_forked_requests_stepped_in_turn_decode_as_alone(backend, drafter_kind):
    """Engines on forks of one target and one drafter (`TreeLM.fork`, `TreeDrafter.fork`), their
    requests started and stepped in turn, cycle by cycle, give every request the tokens and cycles
    it gets alone (T=0 and T=1), and the forks' caches are their own (the weights are not copied)."""
    target_model = tiny_model(0)
    head = make_head(target_model) if drafter_kind == "eagle" else None
    drafter = {"lm": lambda: LMDrafter(build_tree_lm(tiny_model(1), max_len=128)), "lookup": PromptLookupDrafter,
               "eagle": lambda: EagleDrafter(head, max_len=128)}[drafter_kind]()
    target = build_tree_lm(target_model, backend=backend, max_len=128, feature_layers=drafter.feature_layers)
    pols = [Autoregressive, lambda: chain(3), lambda: DynamicTree(total_tokens=12, depth=4, top_k=3)]
    for temperature in (0.0, 1.0):
        alone = [SpeculativeEngine(target=target, policy=p(), drafter=drafter, temperature=temperature).generate(
            PROMPTS[2], max_new_tokens=24, seed=5) for p in pols]
        forks = [(target.fork(), drafter.fork()) for _ in pols]
        assert forks[0][0].cache is not forks[1][0].cache and forks[0][1] is not forks[1][1]
        engines = [SpeculativeEngine(target=t, policy=p(), drafter=d, temperature=temperature) for p, (t, d) in zip(pols, forks)]
        gens = [e.start(PROMPTS[2], max_new_tokens=24, seed=5) for e in engines]
        while not all(g.done for g in gens):
            for e, g in zip(engines, gens):
                if not g.done:
                    e.step(g)
        for a, g in zip(alone, gens):
            assert g.tokens == a.tokens and [c.accepted for c in g.cycles] == [c.accepted for c in a.cycles]
        if temperature == 0:
            assert gens[0].tokens == hf_greedy(target_model, PROMPTS[2], 24)
    if backend == "llama":
        assert forks[0][0].mm is target.mm  # the matmuls (weights, packed copies) are shared
    with pytest.raises(ValueError, match="the request is done"):
        engines[0].step(gens[0])


@pytest.mark.parametrize("backend", ["llama", "hf"])
@pytest.mark.parametrize("drafter_kind", ["lm", "lookup", "eagle"])
def test_path_verification_decodes_as_a_tree_pass(backend, drafter_kind):
    """`verify="path"` (the accepted path forwarded one row at a time) commits exactly what one forward
    over the tree commits, cycle by cycle, at T=0 (= greedy decoding) and T=1 (same seeds), and hands
    the drafter the path's rows: the next cycles' drafts are the same too."""
    target_model = tiny_model(0)
    head = make_head(target_model) if drafter_kind == "eagle" else None
    drafter = {"lm": lambda: LMDrafter(build_tree_lm(tiny_model(1), max_len=128)), "lookup": PromptLookupDrafter,
               "eagle": lambda: EagleDrafter(head, max_len=128)}[drafter_kind]()
    target = build_tree_lm(target_model, backend=backend, max_len=128, feature_layers=drafter.feature_layers)
    for temperature in (0.0, 1.0):
        for policy in (chain(3), StaticTree(Structure.full([3, 2, 1])), DynamicTree(total_tokens=12, depth=4, top_k=3)):
            runs = {mode: SpeculativeEngine(target=target, policy=policy, drafter=drafter, temperature=temperature,
                                            verify=mode).generate(PROMPTS[2], max_new_tokens=24, seed=5)
                    for mode in ("tree", "path")}
            assert runs["path"].tokens == runs["tree"].tokens, f"{policy.name} at T={temperature}"
            assert [c.accepted for c in runs["path"].cycles] == [c.accepted for c in runs["tree"].cycles]
            assert [c.tree_size for c in runs["path"].cycles] == [c.tree_size for c in runs["tree"].cycles]
            if temperature == 0:
                assert runs["path"].tokens == hf_greedy(target_model, PROMPTS[2], 24)
    with pytest.raises(ValueError, match="verify must be one of tree, path, got 'rows'"):
        SpeculativeEngine(target=target, policy=chain(2), drafter=drafter, verify="rows")


def test_bad_inputs_give_one_clear_line():
    model = tiny_model(0)
    engine = SpeculativeEngine(target=build_tree_lm(model, max_len=64), policy=Autoregressive())
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate([], max_new_tokens=4)
    with pytest.raises(ValueError, match="exceeds"):
        engine.generate(list(range(60)), max_new_tokens=10)
    with pytest.raises(ValueError, match="needs a drafter"):
        SpeculativeEngine(target=build_tree_lm(model, max_len=64), policy=chain(2))
    with pytest.raises(ValueError, match="left-closed"):
        StaticTree(Structure([(0,), (2,)]))


def test_cli_generate_rejects_unknown_method_in_one_line(capsys, tmp_path):
    from ogspo.cli import main

    assert main(["generate", "--model", str(tmp_path), "--method", "beam", "hello"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ogspo: error: unknown method 'beam'; allowed: ar, ar-aa, chain, static, eagle,")
    assert err.endswith(", or an exported policy folder") and "\n" not in err


def test_cli_generate_rejects_open_structure(capsys, tmp_path):
    from ogspo.cli import main

    assert main(["generate", "--model", str(tmp_path), "--method", "static", "--structure", "[[0], [0, 1]]", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert "left-closed" in err and "\n" not in err


def test_fused_weights_are_the_models_own_single_copy():
    """The engine's fused QKV and gate/up matrices are the transformers weights' storage (one copy of
    the model in memory), and the transformers model still decodes the same."""
    model = tiny_model(0)
    before = hf_greedy(model, PROMPTS[0], 12)
    target = build_tree_lm(model, max_len=64)
    layer = model.model.layers[0]
    qkv, gate_up = target.mm["qkv"].weights[0].w, target.mm["gate_up"].weights[0].w
    for lin, fused in ((layer.self_attn.q_proj, qkv), (layer.self_attn.v_proj, qkv), (layer.mlp.up_proj, gate_up)):
        assert lin.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert hf_greedy(model, PROMPTS[0], 12) == before
    engine = SpeculativeEngine(target=target, policy=chain(3), drafter=LMDrafter(build_tree_lm(tiny_model(1), max_len=64)))
    assert engine.generate(PROMPTS[0], max_new_tokens=12).tokens == before


def test_activations_keep_the_weights_dtype_except_half_precision():
    """fp32 and fp64 targets compute in their own dtype (no casts around the matmuls); bf16 weights get fp32
    activations, cache and logits."""
    from ogspo.engine.target import LlamaTreeLM

    for dtype, act in ((torch.float64, torch.float64), (torch.float32, torch.float32), (torch.bfloat16, torch.float32)):
        lm = LlamaTreeLM(tiny_model(0).to(dtype), max_len=16)
        out = lm.prefill([3, 7, 11])
        assert lm.act_dtype == act and lm.cache.keys[0].dtype == act and out.logits.dtype == act, dtype
        assert lm.norm.dtype == act and lm.layers[0]["ln1"].dtype == act
