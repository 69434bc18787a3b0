"""EAGLE-3-style head: training-time-test attention equals what drafting does, the drafter is
lossless in the engine, and a head for another target is refused."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine_helpers import hf_greedy, make_head, tiny_model
from ogspo.drafter.runtime import META, WEIGHTS, EagleDrafter, load_head
from ogspo.engine.decode import SpeculativeEngine
from ogspo.engine.policies import DynamicTree, StaticTree, chain
from ogspo.engine.target import ForwardOut, build_tree_lm
from ogspo.engine.tree import DraftTree, Structure


def test_ttt_steps_match_drafting():
    """Step 1 of training at position t = the root's expansion; step 2 at t+1 = its child's expansion."""
    target = tiny_model(0).float()
    head = make_head(target)
    D = head.cfg.hidden
    g = torch.Generator().manual_seed(0)
    n, t = 12, 7
    tokens = torch.randint(0, 64, (n,), generator=g)
    feats3 = torch.randn(n, 3 * D, generator=g)
    with torch.no_grad():
        train_logits = head.forward_train(feats3[None, : n - 1], tokens[None, 1:], steps=2)
    drafter = EagleDrafter(head, max_len=64)
    drafter.begin(tokens[: t + 1].tolist(), ForwardOut(logits=torch.zeros(1), features=feats3[: t + 1]))
    tree = DraftTree.from_root(int(tokens[t + 1]))
    exp = drafter.expand(tree, np.array([0]), 5)
    ref1 = torch.log_softmax(train_logits[0][0, t], -1).topk(5)
    np.testing.assert_allclose(exp.logq[0], ref1.values.double().numpy(), atol=1e-4)
    assert exp.tokens[0].tolist() == head.d2t[ref1.indices].tolist()
    tree.add_children(parents=np.array([0]), tokens=np.array([int(tokens[t + 2])]), ranks=np.array([0]),
                      logq=np.zeros(1), entropy=np.zeros(1))
    exp2 = drafter.expand(tree, np.array([1]), 5)
    ref2 = torch.log_softmax(train_logits[1][0, t + 1], -1).topk(5)
    np.testing.assert_allclose(exp2.logq[0], ref2.values.double().numpy(), atol=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_eagle_drafter_is_lossless_and_replayable(temperature):
    target_model = tiny_model(0)
    head = make_head(target_model.float(), draft_vocab=64)
    target_model = target_model.double()
    prompt = [5, 9, 13, 2, 7, 3, 3, 40]
    runs = []
    for policy in [chain(3), DynamicTree(total_tokens=10, depth=4, top_k=3), StaticTree(Structure.full([2, 2, 1]))]:
        drafter = EagleDrafter(head, max_len=256)
        engine = SpeculativeEngine(target=build_tree_lm(target_model, max_len=256, feature_layers=drafter.feature_layers),
                                   policy=policy, drafter=drafter, temperature=temperature)
        res = engine.generate(prompt, max_new_tokens=30, seed=5)
        if temperature == 0:
            assert res.tokens == hf_greedy(target_model, prompt, 30), policy.name
        again = engine.generate(prompt, max_new_tokens=30, seed=5)
        assert again.tokens == res.tokens
        runs.append(res.tokens)


def test_head_for_another_target_is_refused(tmp_path):
    target = tiny_model(0).float()
    head = make_head(target)
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(tmp_path / WEIGHTS))
    (tmp_path / META).write_text(json.dumps({"target_checksum": "abc123", "head": head.cfg.to_dict()}))
    load_head(tmp_path, target_model=target, target_checksum="abc123")
    with pytest.raises(ValueError, match="was trained for target"):
        load_head(tmp_path, target_model=target, target_checksum="ffff0000")
    with pytest.raises(ValueError, match="expects a target with vocab"):
        load_head(tmp_path, target_model=tiny_model(0, vocab=80).float(), target_checksum=None)


def test_a_retrained_head_in_the_same_folder_is_another_drafter(tmp_path):
    """The head's id hashes its weights: records, latency tables and policies of the old head are not reused."""
    target = tiny_model(0).float()
    ids = []
    for seed in (0, 1):
        head = make_head(target, seed=seed)
        save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(tmp_path / WEIGHTS))
        (tmp_path / META).write_text(json.dumps({"target_checksum": "abc123", "head": head.cfg.to_dict()}))
        ids.append(load_head(tmp_path, target_model=target)[1]["id"])
    assert ids[0] != ids[1] and all(i.startswith(tmp_path.name + "-") for i in ids)


def test_packed_generation_equals_greedy_and_teacher_forcing():
    """Packed continuations (several prompts in one cache, a forest mask) equal transformers' greedy
    decoding, and their features / distributions equal a teacher-forced pass over the result."""
    from ogspo.drafter.data import annotate, generate_annotated, pack_prompts

    model = tiny_model(3, vocab=64, layers=3)  # features of layers 0 and 1 (HF's last hidden state is normed)
    prompts = [[1, 2, 3], [5, 9, 9, 4, 2, 7], [8], [3, 3, 3, 3]]
    lm = build_tree_lm(model, max_len=40, feature_layers=(0, 1))
    packed = generate_annotated(lm, prompts, max_new_tokens=7, pack=3, top_k=4, eos_token_id=None)
    assert len(pack_prompts([len(p) for p in prompts], max_new_tokens=7, pack=3, max_rows=40)) == 2
    forced = annotate(model, [s.tokens.tolist() for s in packed], feature_layers=(0, 1), top_k=4, batch_tokens=64)
    for p, s, f in zip(prompts, packed, forced):
        ref = hf_greedy(model, p, 7)  # 7 new tokens: the last one is never fed back
        assert s.tokens.tolist() == p + ref[:6]
        assert int(s.top_ids[-1, 0]) == ref[6]
        torch.testing.assert_close(s.feats.float(), f.feats.float(), atol=1e-2, rtol=0)
        torch.testing.assert_close(s.top_p.float(), f.top_p.float(), atol=1e-3, rtol=0)


def test_batched_generation_equals_greedy_and_teacher_forcing():
    """Batched continuations (left-padded rows, one forward per step) equal transformers' greedy
    decoding and a teacher-forced pass; an EOS ends a row before it; sampling is seeded."""
    from ogspo.drafter.data import annotate, generate_batched

    model = tiny_model(3, vocab=64, layers=3)
    prompts = [[1, 2, 3], [5, 9, 9, 4, 2, 7], [8], [3, 3, 3, 3], [6, 1]]
    lm = build_tree_lm(model, max_len=40, feature_layers=(0, 1))
    out = generate_batched(lm, prompts, max_new_tokens=7, batch=3, top_k=4, eos_token_id=None)
    forced = annotate(model, [s.tokens.tolist() for s in out], feature_layers=(0, 1), top_k=4, batch_tokens=64)
    for p, s, f in zip(prompts, out, forced):
        ref = hf_greedy(model, p, 7)
        assert s.tokens.tolist() == p + ref[:6]
        assert int(s.top_ids[-1, 0]) == ref[6]
        torch.testing.assert_close(s.feats.float(), f.feats.float(), atol=1e-2, rtol=0)
        torch.testing.assert_close(s.top_p.float(), f.top_p.float(), atol=1e-3, rtol=0)
    eos = hf_greedy(model, prompts[1], 7)[2]  # the third token of prompt 1's continuation
    cut = generate_batched(lm, prompts, max_new_tokens=7, batch=5, top_k=4, eos_token_id=eos)
    assert cut[1].tokens.tolist() == prompts[1] + hf_greedy(model, prompts[1], 2)
    assert all(eos not in s.tokens[len(p):].tolist() for p, s in zip(prompts, cut))
    a = generate_batched(lm, prompts, max_new_tokens=7, batch=2, top_k=4, eos_token_id=None, temperature=1.0, seed=5)
    b = generate_batched(lm, prompts, max_new_tokens=7, batch=2, top_k=4, eos_token_id=None, temperature=1.0, seed=5)
    assert [s.tokens.tolist() for s in a] == [s.tokens.tolist() for s in b]
    assert [s.tokens.tolist() for s in a] != [s.tokens.tolist() for s in out]


class _CharTokenizer:
    """Bytes as token ids; a chat template that wraps the request in markers."""

    chat_template = "<user>{content}<assistant>"
    bos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return type("Enc", (), {"input_ids": list(text.encode())})()

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return f"<user>{messages[0]['content']}<assistant>"


def test_corpus_prompts_skip_workload_prompts(tmp_path):
    """Extra fortunes never repeat a workload prompt; each corpus text gives a plain and a chat prompt."""
    import polars as pl

    from ogspo.drafter.data import corpus_prompts, stdlib_functions

    fdir = tmp_path / "fortunes"
    fdir.mkdir()
    entries = [f"Fortune number {i} says that patience is a virtue. And then it goes on for a while longer." for i in range(5)]
    (fdir / "wisdom").write_text("\n%\n".join(entries) + "\n")
    wl = tmp_path / "workloads"
    wl.mkdir()
    pl.DataFrame({"prompt_id": ["fortunes/wisdom/0", "fortunes/wisdom/3"]}).write_parquet(wl / "fortunes.parquet")
    tok = _CharTokenizer()
    out = corpus_prompts(workloads_dir=wl, fortunes_dir=fdir, tokenizer=tok, fortunes=10, functions=0, seed=0)
    texts = [bytes(p).decode() for p in out]
    assert len(texts) == 6  # 3 unused fortunes, each plain and as a chat request
    assert not any("number 0" in t or "number 3" in t for t in texts)
    assert sum(t.startswith("<user>") for t in texts) == 3
    funcs = stdlib_functions(max_functions=5, seed=0)
    assert len(funcs) == 5 and all(src.startswith("def ") and doc for _, doc, src in funcs)
    code = corpus_prompts(workloads_dir=wl, fortunes_dir=None, tokenizer=tok, fortunes=0, functions=5, seed=0)
    assert len(code) == 10
    with pytest.raises(ValueError, match="extra_fortunes needs"):
        corpus_prompts(workloads_dir=wl, fortunes_dir=None, tokenizer=tok, fortunes=1, functions=0, seed=0)
