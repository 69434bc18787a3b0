"""EAGLE-3-style head: training-time-test attention equals what drafting does, the drafter is
lossless in the engine, and a head for another target is refused."""


import json
import shutil

import numpy as np
import pytest
import torch
from engine_helpers import hf_annotate, hf_greedy, make_head, tiny_model

from ogspo.drafter.head import EagleHead, ttt_attention
from ogspo.drafter.runtime import EagleDrafter, load_head
from ogspo.drafter.train import write_head
from ogspo.engine import kernels as K
from ogspo.engine import native
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


@pytest.mark.skipif(native.load() is None, reason=f"native kernels not built here: {native.unavailable_reason()}")
def test_the_heads_native_step_drafts_what_its_torch_step_does():
    """With a kernel table that runs the layer ops natively, a draft level's norms, rotary embedding, cache
    write, tree attention and SwiGLU run in C: the same tokens and log-probs (to 1e-4) as the head's torch
    ops, from the prompt's prefill through the root and two deeper levels of a branching tree."""
    target = tiny_model(0, hidden=64, heads=4, kv_heads=2).float()  # head dim 16: a multiple of every vector width
    rows = [1, 2, 4, 8, 16, 32]
    classes = (*K.CLASSES, K.LAYER_OPS)
    table = K.KernelTable(key=K.device_key("cpu", torch.float32), shapes={}, rows=rows,
                          choice={c: ["native1"] * len(rows) for c in classes}, pad_to={c: list(rows) for c in classes})
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 64, (11,), generator=g).tolist()
    feats = ForwardOut(logits=torch.zeros(1), features=torch.randn(len(prompt), 3 * 64, generator=g))
    drafts = []
    for native_ops in (False, True):
        head = make_head(target)
        head.use_kernels(table if native_ops else None, torch.float32)
        assert (head.kernels.layer_ops(4) is not None) == native_ops
        drafter = EagleDrafter(head, max_len=64)
        drafter.begin(prompt, feats)
        tree = DraftTree.from_root(int(prompt[-1]))
        levels = [drafter.expand(tree, np.array([0]), 3)]
        kids = tree.add_children(parents=np.zeros(3, dtype=np.int64), tokens=levels[0].tokens[0], ranks=np.arange(3),
                                 logq=np.zeros(3), entropy=np.zeros(3))
        levels.append(drafter.expand(tree, kids, 2))
        grand = tree.add_children(parents=np.repeat(kids[:2], 2), tokens=levels[1].tokens[:2].ravel(),
                                  ranks=np.tile(np.arange(2), 2), logq=np.zeros(4), entropy=np.zeros(4))
        levels.append(drafter.expand(tree, grand, 2))
        drafts.append(levels)
    for ref, got in zip(*drafts):
        assert got.tokens.tolist() == ref.tokens.tolist()
        np.testing.assert_allclose(got.logq, ref.logq, atol=1e-4)
        np.testing.assert_allclose(got.entropy, ref.entropy, atol=1e-4)


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_ttt_attention_equals_the_dense_tree_mask(depth):
    """Step j's attention (causal block up to the root, one ancestor row per deeper step) equals
    attention over all steps' rows with EAGLE-3's dense [T, jT] mask."""
    g = torch.Generator().manual_seed(depth)
    B, H, KV, T, hd = 2, 4, 2, 9, 8
    q = torch.randn(B, H, T, hd, generator=g)
    keys = [torch.randn(B, KV, T, hd, generator=g) for _ in range(depth)]
    values = [torch.randn(B, KV, T, hd, generator=g) for _ in range(depth)]
    t = torch.arange(T)
    blocks = [t[None, :] <= t[:, None] - depth + 1] + [t[None, :] == t[:, None] - depth + i for i in range(2, depth + 1)]
    mask = torch.cat(blocks, dim=1)  # [T, depth*T]
    ref = torch.nn.functional.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask,
                                                           enable_gqa=True)
    torch.testing.assert_close(ttt_attention(q, keys, values), ref, atol=1e-5, rtol=1e-5)


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
    write_head(head, {"target_checksum": "abc123"}, tmp_path / "head", target_config=target.config)
    load_head(tmp_path / "head", target_model=target, target_checksum="abc123")
    with pytest.raises(ValueError, match="was trained for target"):
        load_head(tmp_path / "head", target_model=target, target_checksum="ffff0000")
    with pytest.raises(ValueError, match="head for a vocabulary of 64 tokens, the target has 80"):
        load_head(tmp_path / "head", target_model=tiny_model(0, vocab=80).float(), target_checksum=None)


def test_a_retrained_head_in_the_same_folder_is_another_drafter(tmp_path):
    """The head's id hashes its weights: records, latency tables and policies of the old head are not reused."""
    target = tiny_model(0).float()
    ids = []
    for seed in (0, 1):
        head = make_head(target, seed=seed)
        write_head(head, {"target_checksum": "abc123"}, tmp_path / "head", target_config=target.config)
        ids.append(load_head(tmp_path / "head", target_model=target)[1]["id"])
    assert ids[0] != ids[1] and all(i.startswith("head-") for i in ids)


def test_packed_generation_equals_greedy_and_teacher_forcing():
    """Packed continuations (several prompts in one cache, a forest mask) equal transformers' greedy
    decoding, and their features / distributions equal a teacher-forced pass over the result."""
    from ogspo.drafter.data import generate_annotated, pack_prompts

    model = tiny_model(3, vocab=64, layers=3)  # features of layers 0 and 1 (HF's last hidden state is normed)
    prompts = [[1, 2, 3], [5, 9, 9, 4, 2, 7], [8], [3, 3, 3, 3]]
    lm = build_tree_lm(model, max_len=40, feature_layers=(0, 1))
    packed = generate_annotated(lm, prompts, max_new_tokens=7, pack=3, top_k=4, eos_token_id=None)
    assert len(pack_prompts([len(p) for p in prompts], max_new_tokens=7, pack=3, max_rows=40)) == 2
    forced = hf_annotate(model, [s.tokens.tolist() for s in packed], (0, 1), top_k=4)
    for p, s, f in zip(prompts, packed, forced):
        ref = hf_greedy(model, p, 7)  # 7 new tokens: the last one is never fed back
        assert s.tokens.tolist() == p + ref[:6]
        assert int(s.top_ids[-1, 0]) == ref[6]
        torch.testing.assert_close(s.feats.float(), f.feats.float(), atol=1e-2, rtol=0)
        torch.testing.assert_close(s.top_p.float(), f.top_p.float(), atol=1e-3, rtol=0)


def test_batched_generation_equals_greedy_and_teacher_forcing():
    """Batched continuations (left-padded rows, one forward per step) equal transformers' greedy
    decoding and a teacher-forced pass; an EOS ends a row before it; sampling is seeded."""
    from ogspo.drafter.data import generate_batched

    model = tiny_model(3, vocab=64, layers=3)
    prompts = [[1, 2, 3], [5, 9, 9, 4, 2, 7], [8], [3, 3, 3, 3], [6, 1]]
    lm = build_tree_lm(model, max_len=40, feature_layers=(0, 1))
    out = generate_batched(lm, prompts, max_new_tokens=7, batch=3, top_k=4, eos_token_id=None)
    forced = hf_annotate(model, [s.tokens.tolist() for s in out], (0, 1), top_k=4)
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
    texts = [t.prompt for t in out]
    assert len(texts) == 6  # 3 unused fortunes, each plain and as a chat request
    assert not any("number 0" in t or "number 3" in t for t in texts)
    assert sum(t.startswith("<user>") for t in texts) == 3
    funcs = stdlib_functions(max_functions=5, seed=0)
    assert len(funcs) == 5 and all(src.startswith("def ") and doc for _, doc, src in funcs)
    code = corpus_prompts(workloads_dir=wl, fortunes_dir=None, tokenizer=tok, fortunes=0, functions=5, seed=0)
    assert len(code) == 10
    with pytest.raises(ValueError, match="extra_fortunes needs"):
        corpus_prompts(workloads_dir=wl, fortunes_dir=None, tokenizer=tok, fortunes=1, functions=0, seed=0)


def test_fortunes_read_as_text_skip_workload_and_near_held_out_fortunes(tmp_path):
    """Whole fortunes for the target to read: none a workload selected, none near an eval or calib prompt,
    each whole on one line, packed with a blank line between them into chunks of at most seq_len tokens."""
    import polars as pl

    from ogspo.drafter.corpus import NearDuplicateIndex
    from ogspo.drafter.data import fortune_sequences

    fdir = tmp_path / "fortunes"
    fdir.mkdir()
    animals = ["cat", "dog", "owl", "fox", "eel", "yak"]
    sayings = ["sleeps all day long", "barks at the mailman", "hoots before dawn", "steals the hens at night",
               "hides under wet rocks", "climbs steep mountain paths"]
    entries = [f"The {a} {b}.\nWho would have {a}ly guessed it." for a, b in zip(animals, sayings)]
    (fdir / "wisdom").write_text("\n%\n".join(entries) + "\n")
    wl = tmp_path / "workloads"
    wl.mkdir()
    pl.DataFrame({"prompt_id": ["fortunes/wisdom/0", "fortunes/wisdom/3"]}).write_parquet(wl / "fortunes.parquet")
    held = NearDuplicateIndex(["The eel hides under wet rocks."])  # an eval prompt cut from fortune 4
    tok = _CharTokenizer()
    one = max(len(e) for e in entries)
    seqs = fortune_sequences(fortunes_dir=fdir, workloads_dir=wl, tokenizer=tok, max_tokens=10**6, seq_len=2 * one + 2,
                             seed=0, held_out=held)
    text = "\n\n".join(bytes(s).decode() for s in seqs)
    assert sorted(a for a in animals if f"The {a} " in text) == ["dog", "owl", "yak"]
    assert all(len(s) <= 2 * one + 2 for s in seqs) and len(seqs) == 2  # two fortunes fit a chunk, the third starts one
    # one line each: spacing flattened like the workload's prompts
    assert "night. Who would" in text or "paths. Who would" in text
    assert fortune_sequences(fortunes_dir=fdir, workloads_dir=wl, tokenizer=tok, max_tokens=0, seq_len=64, seed=0,
                             held_out=held) == []


def test_near_duplicates_of_held_out_prompts_are_dropped():
    """A copy of an eval prompt, one with a few words changed, and one quoted inside a longer request are
    dropped; a repeat of an earlier training text is dropped once; unrelated texts are kept."""
    from ogspo.drafter.corpus import TrainText, decontaminate

    held = ["Write a persuasive essay to convince your friend to try a new hobby that involves the outdoors.",
            "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\""]
    items = [TrainText("a", held[0], ""),
             TrainText("b", "write a PERSUASIVE essay to convince your friend to try a new hobby that involves cooking.", ""),
             TrainText("c", f"Summarise this in one line: \"{held[0]}\" Then explain why.", ""),
             TrainText("d", "Explain how photosynthesis turns light into sugar in green plants.", ""),
             TrainText("e", "Explain how photosynthesis turns light into sugar in green plants!", ""),
             TrainText("f", "def add(a, b):\n    return a + b  # sum", ""),
             TrainText("g", "Name three rivers of Europe.", "")]
    kept, near_held, repeats = decontaminate(items, held)
    assert [t.source for t in kept] == ["d", "f", "g"]
    assert (near_held, repeats) == (3, 1)


def test_training_prompts_hold_no_eval_or_calib_prompt(tmp_path):
    """The training prompts `build_data` generates from (workload train splits, extra fortunes, the
    target's own requests) hold no eval or calib prompt of any workload, nor a near-duplicate: a fortune
    that repeats an eval prompt under another id is dropped."""
    import polars as pl

    from ogspo.artifacts.prompts import read_fortunes
    from ogspo.drafter.corpus import NearDuplicateIndex, decontaminate, held_out_texts
    from ogspo.drafter.data import corpus_prompts, train_prompts

    fdir = tmp_path / "fortunes"
    fdir.mkdir()
    entries = ["A watched pot never boils, said the cook, and went off to read the paper instead of waiting.",
               "Fortune seven: the early bird gets the worm, but the second mouse gets the cheese in the trap.",
               "A watched pot never boils, said the cook, and went off to read the paper instead of waiting!",
               "Nothing is so permanent as a temporary arrangement made by a committee on a Friday afternoon."]
    (fdir / "wisdom").write_text("\n%\n".join(entries) + "\n")
    first = [p.text for p in read_fortunes(fdir)]  # a fortune's prompt is its first part, as the workload has it
    wl = tmp_path / "workloads"
    wl.mkdir()
    pl.DataFrame({"prompt_id": ["fortunes/wisdom/0", "fortunes/wisdom/1", "fortunes/x/9"],
                  "split": ["eval", "train", "calib"],
                  "text": [first[0], first[1], "An unrelated calib prompt about the weather in spring and autumn."],
                  "prompt": [first[0], first[1], "An unrelated calib prompt"]}).write_parquet(wl / "fortunes.parquet")
    tok = _CharTokenizer()
    texts = train_prompts(workloads_dir=wl, tokenizer=tok, chat_variants=True, max_per_workload=None)
    texts += corpus_prompts(workloads_dir=wl, fortunes_dir=fdir, tokenizer=tok, fortunes=10, functions=3, seed=0)
    held = held_out_texts(wl)
    assert len(held) == 2
    kept, near_held, _ = decontaminate(texts, held)
    assert near_held >= 2  # fortune 2 (a copy of eval fortune 0), plain and as a chat request
    index = NearDuplicateIndex(held)
    assert not any(index.near(t.text) for t in kept)
    assert any(t.text == first[3] for t in kept) and any(t.text == first[1] for t in kept)


def test_self_written_requests_and_the_data_cache(tmp_path, smollm2_dir):
    """SmolLM2 writes its own requests (seeded, no template markers); `build_data` answers them beside
    the train prompts, greedy and sampled, and a second build with the same recipe reads the cache."""
    import polars as pl

    from ogspo.artifacts.settings import settings
    from ogspo.drafter.data import self_instructions
    from ogspo.drafter.head import HeadConfig
    from ogspo.drafter.train import build_data
    from ogspo.engine.model import load_target

    model, tok = load_target(smollm2_dir)
    lm = build_tree_lm(model, max_len=128, feature_layers=(1, 14, 26))
    reqs = self_instructions(lm, tok, n=4, max_tokens=24, batch=4, seed=0)
    assert len(reqs) >= 2 and all("<|" not in r and len(r.split()) >= 4 for r in reqs)
    assert reqs == self_instructions(lm, tok, n=4, max_tokens=24, batch=2, seed=0)  # batching does not change them
    wl = tmp_path / "workloads"
    wl.mkdir()
    texts = ["The capital of France is", "Once upon a time, in a quiet village by the sea,"]
    pl.DataFrame({"prompt_id": ["t/0", "t/1"], "split": ["train", "eval"], "text": texts, "prompt": texts}
                 ).write_parquet(wl / "text.parquet")
    cfg = settings("drafter", {"self_instruct": 3, "instruct_max_tokens": 16, "max_new_tokens": 5, "sampled": 1,
                               "extra_fortunes": 0, "extra_functions": 0, "stdlib_tokens": 40, "seq_len": 32,
                               "gen_batch": 4, "gen_rows": 64, "cache_dir": str(tmp_path / "cache"),
                               "sharegpt": {"texts": 0, "answered": 0}})
    cfg.pop("gto")
    head_cfg = HeadConfig.for_target(model, draft_vocab=512)
    kw = dict(model=model, tokenizer=tok, target_checksum="abc", workloads_dir=wl, fortunes_dir=None, cfg=cfg,
              head_cfg=head_cfg, seed=0)
    seqs, stats = build_data(**kw)
    n = stats.prompts["text/train"] + stats.prompts.get("self-instruct", 0)
    assert stats.prompts["text/train"] == 1 and stats.self_instructions == 3 and not stats.cached
    assert stats.generated_tokens == 2 * n * 4  # greedy and sampled, 5 new tokens each, the last never fed back
    assert stats.generation_tokens_per_second > 0 and stats.annotation_tokens_per_second > 0
    assert sum(s.feats is not None for s in seqs) == len(seqs)
    again, stats2 = build_data(**kw)
    assert stats2.cached and [s.tokens.tolist() for s in again] == [s.tokens.tolist() for s in seqs]


def test_more_text_reuses_the_blocks_read_before(tmp_path, smollm2_dir, monkeypatch):
    """Text is read and cached in blocks: a larger sample reads only the blocks a smaller one lacked."""
    import polars as pl

    from ogspo.artifacts.settings import settings
    from ogspo.drafter import train
    from ogspo.drafter.head import HeadConfig
    from ogspo.engine.model import load_target

    monkeypatch.setattr(train, "TEXT_BLOCK", 1)
    model, tok = load_target(smollm2_dir)
    wl = tmp_path / "workloads"
    wl.mkdir()
    pl.DataFrame({"prompt_id": ["t/0"], "split": ["train"], "text": ["The sea"],
                  "prompt": ["The sea"]}).write_parquet(wl / "t.parquet")
    cache = tmp_path / "cache"
    kw = dict(model=model, tokenizer=tok, target_checksum="abc", workloads_dir=wl, fortunes_dir=None,
              head_cfg=HeadConfig.for_target(model, draft_vocab=512), seed=0)
    seqs = {}
    for n in (40, 100):
        cfg = settings("drafter", {"self_instruct": 0, "max_new_tokens": 3, "gen_batch": 1, "gen_rows": 64, "extra_fortunes": 0,
                                   "extra_functions": 0, "stdlib_tokens": n, "seq_len": 32, "cache_dir": str(cache),
                                   "sharegpt": {"texts": 0, "answered": 0}})
        cfg.pop("gto")
        seqs[n], _ = train.build_data(cfg=cfg, **kw)
        seqs[n] = [s.tokens.tolist() for s in seqs[n]]
    assert seqs[100][: len(seqs[40])] == seqs[40] and len(seqs[100]) > len(seqs[40])
    assert len(list(cache.glob("text-*.pt"))) == len(seqs[100]) - 1  # one file per text block (the rest: the answer)


def test_the_head_layer_is_eagle3s_midlayer():
    """The head's layer computes EAGLE-3's decoder layer (SafeAILab/EAGLE cnets.py): q/k/v over
    cat(input_layernorm(embedding), hidden_norm(h)) with h = fc(features) as the residual stream, then
    post_attention_layernorm and the MLP; written out here op by op from the weights."""
    import torch.nn.functional as F

    from ogspo.drafter.head import rms_norm, rotate_half

    model = tiny_model(5, vocab=64, layers=4).float()
    head = make_head(model).float()
    c = head.cfg
    D, T = c.hidden, 7
    assert head.q.weight.shape == (c.n_heads * c.head_dim, 2 * D) and head.k.weight.shape == (c.kv_heads * c.head_dim, 2 * D)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1, T, 3 * D, generator=g)
    tokens = torch.randint(0, 64, (1, T), generator=g)
    out = head.forward_train(feats, tokens, 1, logits=False)[0][0]  # [T, D]

    h = feats[0] @ head.fc.weight.T  # [T, D]
    x = torch.cat([rms_norm(model.model.embed_tokens.weight[tokens[0]], head.input_layernorm, c.eps),
                   rms_norm(h, head.hidden_norm, c.eps)], -1)  # [T, 2D]
    cos, sin = head.rope(torch.arange(T), torch.float32)  # [T, hd]
    split = lambda y, n: y.view(T, n, c.head_dim).transpose(0, 1)  # [n, T, hd]
    q = split(x @ head.q.weight.T, c.n_heads)
    k, v = split(x @ head.k.weight.T, c.kv_heads), split(x @ head.v.weight.T, c.kv_heads)
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    rep = c.n_heads // c.kv_heads
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    scores = (q @ k.transpose(1, 2)) / c.head_dim ** 0.5 + torch.full((T, T), float("-inf")).triu(1)  # causal
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, -1)  # [T, H * hd]
    h = h + attn @ head.o.weight.T
    y = rms_norm(h, head.post_attention_layernorm, c.eps)
    ref = h + (F.silu(y @ head.gate.weight.T) * (y @ head.up.weight.T)) @ head.down.weight.T
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_the_lm_head_rows_train_only_when_asked():
    model = tiny_model(5, vocab=64, layers=4).float()
    head = make_head(model)
    frozen = EagleHead(head.cfg, embed=head.embed, lm_rows=head.lm_rows, d2t=head.d2t)
    trained = EagleHead(head.cfg, embed=head.embed, lm_rows=head.lm_rows, d2t=head.d2t, train_lm_head=True)
    assert "lm_rows" not in dict(frozen.named_parameters()) and "lm_rows" in dict(trained.named_parameters())
    assert frozen.state_dict().keys() == trained.state_dict().keys()  # one folder format for both
    frozen.load_state_dict(trained.state_dict(), strict=True)


def test_the_head_data_runs_on_the_kernels_measured_cheaper():
    """`choose_bulk` reads text at the (kernels, rows) cheapest per token and writes on the kernels
    cheaper at the generation batch, keeping the table within the margin; `plan_bulk` times both
    ways on a Llama target with a table (every cell), and times nothing without one."""
    from ogspo.drafter.data import BULK_ROWS, choose_bulk, plan_bulk
    from ogspo.engine import kernels as K

    table = K.KernelTable(key=K.device_key("cpu", torch.float32), shapes={}, rows=[1], choice={}, pad_to={})
    us = {"table@64": 2500.0, "table@512": 2800.0, "reference@64": 1550.0, "reference@512": 1000.0}
    plan = choose_bulk(us, table, write_rows=64, read_rows=None)
    assert (plan.read, plan.read_rows, plan.write) == (None, 512, None)
    assert plan.describe()["read"] == "reference" and plan.describe()["us_per_token"] == us
    close = {"table@64": 1050.0, "table@512": 1090.0, "reference@64": 1000.0, "reference@512": 1020.0}
    plan = choose_bulk(close, table, write_rows=64, read_rows=None)  # within 10%: decoding's own kernels
    assert plan.read is table and plan.write is table and plan.read_rows == 64
    plan = choose_bulk(us, table, write_rows=64, read_rows=64)  # annotate_rows set: only that width reads
    assert (plan.read, plan.read_rows) == (None, 64)

    model = tiny_model(2, vocab=64, layers=2).float()
    lm = build_tree_lm(model, max_len=8)
    shapes = {c: list(m.weights[0].w.shape) for c, m in lm.mm.items()}
    table = K.KernelTable(key=K.device_key("cpu", torch.float32), shapes=shapes, rows=[1, 64],
                          choice={c: ["matmul_t", "matmul_t"] for c in K.CLASSES}, pad_to={c: [1, 64] for c in K.CLASSES})
    plan = plan_bulk(model, table, feature_layers=(0,), write_rows=48, reps=1)
    assert set(plan.us_per_token) == {f"{k}@{m}" for k in ("table", "reference") for m in (*BULK_ROWS, 48)}
    assert plan.read_rows in BULK_ROWS and all(v > 0 for v in plan.us_per_token.values())
    none = plan_bulk(model, None, feature_layers=(0,), write_rows=48)
    assert none.read is None and none.write is None and none.us_per_token == {} and none.read_rows == max(BULK_ROWS)


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="torch.compile's CPU backend needs a C++ compiler (training then runs eager)")
def test_the_compiled_training_objective_equals_the_eager_one_at_every_batch_shape():
    """`compile_objective` (torch.compile, the batch's rows and positions dynamic) gives the eager TTT loss and
    gradients on batches of two shapes; `choose_compile` compiles only where the eager run would be long."""
    from ogspo.drafter.train import COMPILE_MIN_SECONDS, choose_compile, compile_objective, ttt_objective
    model = tiny_model(7, vocab=64, layers=4).float()
    head = make_head(model).train()
    c = head.cfg
    gen = torch.Generator().manual_seed(0)
    objective = compile_objective(3, 0.7, torch.float32)
    for B, T in [(2, 24), (3, 17)]:
        tp = torch.rand(B, T, 4, generator=gen)
        batch = (torch.randn(B, T, 3 * c.hidden, generator=gen), torch.randint(0, c.vocab, (B, T), generator=gen),
                 torch.randint(0, c.draft_vocab, (B, T, 4), generator=gen), tp / tp.sum(-1, keepdim=True),
                 torch.rand(B, T, generator=gen) > 0.1, torch.randint(0, c.vocab, (B, T), generator=gen))
        grads = []
        for run in (lambda: ttt_objective(head, batch, 3, 0.7, torch.float32)[:2], lambda: objective(head, batch)):
            head.zero_grad(set_to_none=True)
            loss, losses = run()
            loss.backward()
            grads.append((loss.detach(), losses, [p.grad.clone() for p in head.parameters() if p.requires_grad]))
        (l0, s0, g0), (l1, s1, g1) = grads
        torch.testing.assert_close(l1, l0, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s1, s0, atol=1e-5, rtol=1e-5)
        for a, b in zip(g1, g0):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert choose_compile("auto", steps=1000, step_seconds=COMPILE_MIN_SECONDS / 999)
    assert not choose_compile("auto", steps=10, step_seconds=1.0)
    assert choose_compile(True, steps=1, step_seconds=0.0) and not choose_compile(False, steps=10**6, step_seconds=1.0)


def test_a_compile_failure_at_the_first_backward_leaves_eager_steps_and_says_so(tmp_path, monkeypatch):
    """Inductor compiles the backward graph at the first backward, so a missing C++ compiler shows there:
    training goes on with eager steps from that step, and drafter.json names the failure."""

    from ogspo.drafter import train

    class NoCompiler(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("InvalidCxxCompiler: no working C++ compiler found")

    calls = []

    def failing_objective(steps, decay, dtype):
        def objective(head, batch):
            calls.append(1)
            total, losses, _ = train.ttt_objective(head, batch, steps, decay, dtype)
            return NoCompiler.apply(total), losses
        return objective

    monkeypatch.setattr(train, "compile_objective", failing_objective)
    model, seqs, cfg, tok = tiny_training(train_compile=True)
    r = train.train_head(model=model, tokenizer=tok, target_checksum="x", seqs=seqs, cfg=cfg, seed=0,
                         out_dir=tmp_path / "head", work_dir=tmp_path / "work")
    metrics = json.loads((tmp_path / "head" / "drafter.json").read_text())["metrics"]
    assert r.steps > 26 and len(calls) == 1  # step 1 tried the compiled objective once; the rest ran eager
    assert metrics["train_compiled"] is False and "InvalidCxxCompiler" in metrics["train_compile_fallback"]
    assert all(np.isfinite(h["loss"]).all() for h in r.history)


def test_the_data_budget_takes_a_prefix_of_each_part_at_the_measured_rate():
    """Blocks are taken while the seconds spent plus the next block's predicted seconds fit; a part
    stops at its first refusal; the first block written is always taken; a replay takes exactly the
    recorded blocks; the steps fit what is left at the step time."""
    from ogspo.drafter.budget import READ, WRITE, DataBudget, budget_steps

    b = DataBudget(seconds=10.0)
    taken = []
    for _ in range(5):  # 4 prompts a block at 0.75 s a prompt: 3, 6, 9 fit; 12 does not
        ok = b.admit("generated", WRITE, 4)
        taken.append(ok)
        if ok:
            b.spend(WRITE, 4, 3.0)
    assert taken == [True, True, True, False, False]
    assert not b.admit("generated", WRITE, 0.001)  # a prefix: nothing after a refusal, however small
    assert b.admit("stdlib", READ, 10_000)  # no reading rate yet, 9 s spent of 10: taken
    b.spend(READ, 10_000, 0.5)
    assert not b.admit("stdlib", READ, 20_000)  # 1 s predicted: over
    assert b.sizes == {"generated": 3, "stdlib": 1} and b.describe()["offered"] == {"generated": 6, "stdlib": 2}
    tight = DataBudget(seconds=0.0)
    assert tight.admit("generated", WRITE, 64)  # one block written, always
    tight.spend(WRITE, 64, 1.0)
    assert not tight.admit("generated", WRITE, 64) and not tight.admit("sharegpt", READ, 1)
    charged = DataBudget(seconds=10.0)
    charged.charge(4.0)  # time spent outside any block counts against the budget, not in a rate
    assert charged.admit("generated", WRITE, 4) and charged.predict(WRITE, 4) is None and charged.spent == 4.0
    primed = DataBudget(seconds=10.0)
    assert primed.admit("generated", WRITE, 4)
    primed.spend(WRITE, 4, 9.0)
    primed.expect(READ, 1e-3)  # plan_bulk's forwards: 1 ms a token, so 2000 tokens would end at 11 s
    assert primed.predict(READ, 2000) == pytest.approx(2.0) and not primed.admit("sharegpt", READ, 2000)
    primed.spend(READ, 100, 0.5)  # a measured rate replaces the expected one
    assert primed.predict(READ, 2000) == pytest.approx(10.0)
    again = DataBudget.replay(b.sizes | {"steps": 7})
    assert [again.admit("generated", WRITE, 4) for _ in range(5)] == [True, True, True, False, False]
    assert DataBudget.replay(None).admit("sharegpt", READ, 1e9)
    assert budget_steps(1000, seconds_left=None, step_seconds=1.0) == 1000
    assert budget_steps(1000, seconds_left=50.0, step_seconds=0.5) == 100
    assert budget_steps(1000, seconds_left=5e3, step_seconds=0.5) == 1000
    assert budget_steps(1000, seconds_left=-3.0, step_seconds=0.5) == 1


def test_a_budget_builds_a_prefix_of_the_recipe_and_its_sizes_rebuild_it(tmp_path, smollm2_dir, monkeypatch):
    """On SmolLM2: a budget too small for more than one block writes one block of prompts (shuffled:
    sources mixed) and reads nothing; the whole recipe holds that block; replaying the recorded sizes
    rebuilds the same sequences from the cache."""
    import polars as pl

    from ogspo.artifacts.settings import settings
    from ogspo.drafter import train
    from ogspo.drafter.budget import DataBudget
    from ogspo.drafter.head import HeadConfig
    from ogspo.engine.model import load_target

    monkeypatch.setattr(train, "TEXT_BLOCK", 1)
    model, tok = load_target(smollm2_dir)
    wl = tmp_path / "workloads"
    wl.mkdir()
    texts = ["The sea", "A cat sat", "def add(a, b):", "Rain fell on", "Mountains are", "The year 1900"]
    pl.DataFrame({"prompt_id": [f"t/{i}" for i in range(6)], "split": ["train"] * 6, "text": texts,
                  "prompt": texts}).write_parquet(wl / "t.parquet")
    cfg = settings("drafter", {"self_instruct": 0, "max_new_tokens": 3, "gen_batch": 2, "gen_rows": 64, "extra_fortunes": 0,
                               "extra_functions": 0, "stdlib_tokens": 60, "seq_len": 32, "cache_dir": str(tmp_path / "c"),
                               "sharegpt": {"texts": 0, "answered": 0}})
    cfg.pop("gto")
    kw = dict(model=model, tokenizer=tok, target_checksum="abc", workloads_dir=wl, fortunes_dir=None, cfg=cfg,
              head_cfg=HeadConfig.for_target(model, draft_vocab=512), seed=0)
    cut, stats = train.build_data(**kw, budget=DataBudget(seconds=1e-6))
    assert stats.budget["taken"] == {"generated": 1, "stdlib": 0} and stats.budget["offered"]["generated"] == 3
    assert len(cut) == 2 and stats.annotated_tokens == 0 and sum(stats.prompts.values()) == 2
    whole, whole_stats = train.build_data(**kw)
    assert whole_stats.budget["taken"]["generated"] == 3 and whole_stats.budget["taken"]["stdlib"] >= 2
    tokens = lambda seqs: [s.tokens.tolist() for s in seqs]  # noqa: E731
    assert tokens(whole)[:2] == tokens(cut)
    again, again_stats = train.build_data(**kw, budget=DataBudget.replay(stats.budget["taken"] | {"steps": 1}))
    assert tokens(again) == tokens(cut) and again_stats.cached


def test_training_steps_fit_the_deadline_or_are_fixed(tmp_path):
    """A deadline already past trains one step (the recipe's steps recorded beside); fixed steps train
    exactly those."""
    import time

    from ogspo.drafter import train

    model, seqs, cfg, tok = tiny_training(train_compile=False)
    kw = dict(model=model, tokenizer=tok, target_checksum="x", seqs=seqs, cfg=cfg, seed=0, work_dir=tmp_path / "work")
    late = train.train_head(**kw, out_dir=tmp_path / "late", deadline=time.perf_counter())
    metrics = json.loads((tmp_path / "late" / "drafter.json").read_text())["metrics"]
    assert late.steps == metrics["steps"] == 1 < metrics["recipe_steps"]
    fixed = train.train_head(**kw, out_dir=tmp_path / "fixed", fixed_steps=5)
    assert fixed.steps == 5


@pytest.mark.parametrize("bf16, bf16_cut, steps, calls, chosen, keys", [
    # both timed: bf16 where the CPU computes it (the cut's comparison, a warm-up each, two reps each)
    (0.3, 0.3, 1000, {("float32", 8): 3, ("float32", 1): 2, ("bfloat16", 1): 2, ("bfloat16", 8): 3}, "bfloat16",
     {"float32", "bfloat16"}),
    # bf16 emulated: dropped on the cut, never stepped on the whole batch
    (2.0, 2.0, 1000, {("float32", 8): 3, ("float32", 1): 2, ("bfloat16", 1): 2}, "float32",
     {"float32", "float32 on the cut", "bfloat16 on the cut"}),
    # fast on the cut, slow on the batch: dropped after its warm-up there
    (2.0, 0.3, 1000, {("float32", 8): 3, ("float32", 1): 2, ("bfloat16", 1): 2, ("bfloat16", 8): 1}, "float32",
     {"float32", "bfloat16"}),
    # 5 s of fp32 training: bf16 not worth timing
    (0.3, 0.3, 10, {("float32", 8): 3}, "float32", {"float32"}),
])
def test_the_training_dtype_is_timed_only_where_the_timing_can_pay(monkeypatch, bf16, bf16_cut, steps, calls, chosen, keys):
    from ogspo.drafter import train

    seen: dict[tuple[str, int], int] = {}

    def fake_step(head, batch, cfg, dtype):
        name, rows = str(dtype).removeprefix("torch."), batch[0].shape[0]  # 8 rows: the batch; 1: the cut
        seen[name, rows] = seen.get((name, rows), 0) + 1
        return {"float32": 0.5, "bfloat16": bf16 if rows > 1 else bf16_cut}[name]

    monkeypatch.setattr(train, "step_seconds", fake_step)
    head = torch.nn.Linear(2, 2)
    dtype, timing = train.choose_train_dtype(head, (torch.zeros(8, 64),), {"train_dtype": "auto"}, steps=steps)
    assert seen == calls and str(dtype) == f"torch.{chosen}" and set(timing) == keys


def test_top_k_recall_by_depth_grows_with_k_and_its_top_1_is_the_training_agreement():
    """`ttt_recall`: at k = 1 the top-1 agreement `ttt_loss` logs, never smaller at a larger k, and at k =
    the whole draft vocabulary the share of positions whose target token the vocabulary holds;
    `continuation_recall` scores the continuation's drafted positions only (not the prompt, not the root)."""
    from ogspo.drafter import train
    from ogspo.drafter.recall import continuation_recall, ttt_recall

    model = tiny_model(3, vocab=64, layers=4).float()
    head = make_head(model, seed=1, draft_vocab=48)
    gen = torch.Generator().manual_seed(0)
    seqs = hf_annotate(model, [torch.randint(0, 64, (30,), generator=gen).tolist() for _ in range(3)],
                       head.cfg.feature_layers, top_k=4)
    t2d = train.target_to_draft(head.d2t, head.cfg.vocab)
    batch = train.make_batch(seqs, np.array([[0, 0], [1, 0], [2, 0]]), t2d, 32, torch.device("cpu"))
    hits, n = ttt_recall(head, batch, 3, ks=(1, 2, 4, 48))
    _, _, accs = train.ttt_loss(head, batch, 3, 0.7)
    rec = hits / n[:, None]
    assert np.allclose(rec[:, 0], accs) and (np.diff(rec, axis=1) >= 0).all() and (n == [87, 84, 81]).all()
    inside = torch.isin(batch[5], head.d2t)  # [B, T] the target's token is a draft token
    for j in range(3):
        assert rec[j, 3] == pytest.approx(float((inside & train.step_mask(batch[4], j + 1)).sum()) / n[j])
    lm = build_tree_lm(model, max_len=64, feature_layers=head.cfg.feature_layers)
    prompt, cont = seqs[0].tokens[:12].tolist(), seqs[0].tokens[12:].tolist()
    r = continuation_recall(head, lm, [(prompt, cont)], depth=2, ks=(1, 48))
    assert r["positions"] == [len(cont), len(cont) - 1] and r["ks"] == [1, 48]  # roots: every continuation token
    assert all(0 <= x <= y <= 1 for x, y in r["recall"])


def tiny_training(*, train_compile: bool):
    """A tiny target, 12 annotated random sequences of 40 tokens, and drafter settings that train on them in
    seconds: (model, seqs, cfg, tokenizer) for `train.train_head`."""
    from types import SimpleNamespace

    from ogspo.artifacts.settings import default_settings
    from ogspo.drafter.head import HeadConfig

    model = tiny_model(7, vocab=64, layers=4).float()
    gen = torch.Generator().manual_seed(0)
    seqs = hf_annotate(model, [torch.randint(0, 64, (40,), generator=gen).tolist() for _ in range(12)],
                       HeadConfig.for_target(model, draft_vocab=48).feature_layers, top_k=4)
    cfg = {k: v for k, v in default_settings("drafter").items() if k != "gto"}
    cfg.update(draft_vocab=48, seq_len=16, batch_size=2, epochs=3, warmup=2, train_dtype="float32",
               train_compile=train_compile, val_fraction=0.2)
    return model, seqs, cfg, SimpleNamespace(eos_token_id=2)


def test_measure_drafter_takes_rounds_of_prompts_within_its_budget(tmp_path, smollm2_dir):
    """measure_drafter decodes in rounds (one eval prompt of every workload and temperature): with a budget
    that holds no chain round, it still runs the speed round and the first chain round, records the
    prompts taken against those asked, and every cell has the same prompts."""
    import polars as pl

    from ogspo.drafter.eagle3 import save_eagle3
    from ogspo.drafter.head import HeadConfig
    from ogspo.engine.model import load_target
    from ogspo.stages.measure_drafter import measure_drafter, render_markdown

    model, _ = load_target(smollm2_dir)
    cfg = HeadConfig.for_target(model, draft_vocab=256)
    d2t = torch.arange(cfg.draft_vocab)
    head = EagleHead(cfg, embed=model.get_input_embeddings().weight, lm_rows=model.get_output_embeddings().weight[d2t], d2t=d2t)
    (tmp_path / "head").mkdir()
    save_eagle3(head, tmp_path / "head", target_config=model.config)
    work = tmp_path / "workloads"
    work.mkdir()
    for w in ("chat", "code"):
        pl.DataFrame({"prompt_id": [0, 1, 2], "prompt": [f"{w} one", f"{w} two", f"{w} three"],
                      "split": ["eval"] * 3}).write_parquet(work / f"{w}.parquet")
    cut = measure_drafter(model_dir=smollm2_dir, drafter_dirs={"base": tmp_path / "head"}, workloads_dir=work,
                          prompts_per_workload=3, max_new_tokens=6, temperatures=(0.0, 1.0), trees=((4, 2, 2),), chain_depth=2,
                          speed_prompts_per_workload=1, minutes=1e-4)
    assert cut.prompts_per_workload == 2 and cut.prompts_asked == 3 and cut.budget["taken"] == {"rounds": 1}
    chains = [f for f in cut.figures if f.method.startswith("chain")]
    assert len(chains) == 4 and {f.prompts for f in chains} == {2}
    assert {f.prompts for f in cut.figures if not f.method.startswith("chain")} == {1}
    assert "of the 3 asked" in render_markdown(cut)
