"""The Python API (`ogspo.load`), local folders used in place, chat templates (from GGUF metadata,
and the one-line refusal without one), on a tiny random Qwen3 (QK-norm: off the Llama mold) that
shares SmolLM2's tokenizer."""

import json

import pytest
import torch
import transformers as tf
from engine_helpers import hf_greedy
from family_models import COMMON

import ogspo
from ogspo.artifacts.prompts import render_chat, render_raw
from ogspo.engine.model import MANIFEST, complete_tokenizer, gguf_tokenizer_metadata, weights_checksum
from ogspo.stages.prepare_model import prepare_model


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory, smollm2_dir):
    """A local Hugging Face folder: a tiny random Qwen3 with SmolLM2's tokenizer (and chat template)."""
    folder = tmp_path_factory.mktemp("qwen3")
    tokenizer = tf.AutoTokenizer.from_pretrained(str(smollm2_dir))
    torch.manual_seed(0)
    config = tf.Qwen3Config(**{**COMMON, "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id}, head_dim=8)
    tf.Qwen3ForCausalLM(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_local_folder_is_used_in_place(qwen3_folder, tmp_path):
    prepared = prepare_model(source={"path": str(qwen3_folder)}, out_dir=tmp_path / "model")
    weights = prepared.path / "model.safetensors"
    assert weights.is_symlink() and weights.resolve() == (qwen3_folder / "model.safetensors").resolve()
    manifest = json.loads((prepared.path / MANIFEST).read_text())
    assert manifest["checksum_sha256"] == weights_checksum(qwen3_folder) == prepared.checksum
    assert manifest["linked_from"] == str(qwen3_folder.resolve())


def test_load_generates_streams_and_stays_lossless(qwen3_folder):
    dec = ogspo.load(model=qwen3_folder, drafter="lookup", policy="eagle", total_tokens=8, depth=3, top_k=2)
    prompt = "the the the the cat sat on the mat, the cat sat on the"
    out = dec.generate(prompt, max_new_tokens=24)
    ids = dec.tokenizer(prompt).input_ids
    assert out.tokens == hf_greedy(dec.model, ids, 24) and out.method == "eagle8-3-2"
    assert "".join(dec.stream(prompt, max_new_tokens=24)) == out.text
    hot = [dec.generate(prompt, max_new_tokens=24, temperature=1.0, seed=7).tokens for _ in range(2)]
    assert hot[0] == hot[1] and hot[0] != out.tokens  # seeded sampling: the same draws each time
    ar = ogspo.load(model=qwen3_folder)
    assert ar.method == "ar" and ar.generate(prompt, max_new_tokens=24).tokens == out.tokens
    assert ar.generate("hello", max_new_tokens=4, chat=True).tokens == hf_greedy(
        ar.model, ar.tokenizer(render_chat(ar.tokenizer, "hello"), add_special_tokens=False).input_ids, 4)


def test_load_refuses_bad_arguments_in_one_line(qwen3_folder):
    with pytest.raises(ValueError, match="unknown method 'no-such'; allowed: ar, ar-aa, chain, .*, or an exported policy folder"):
        ogspo.load(model=qwen3_folder, policy="no-such")
    with pytest.raises(ValueError, match="drafts a tree and needs a drafter"):
        ogspo.load(model=qwen3_folder, policy="eagle")
    with pytest.raises(ValueError, match="drafter 'early-exit' runs on the fast path only"):
        _early_exit_gemma()
    with pytest.raises(ValueError, match="empty prompt"):
        ogspo.load(model=qwen3_folder).generate("   ")


def _early_exit_gemma():
    from family_models import family_model

    from ogspo.methods.registry import make_drafter

    make_drafter("early-exit", target_model=family_model("gemma2-softcap"), max_len=32)


def test_a_model_without_a_chat_template_refuses_chat_in_one_line(qwen3_folder):
    tokenizer = tf.AutoTokenizer.from_pretrained(str(qwen3_folder))
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="has no chat template .*give raw prompts"):
        render_chat(tokenizer, "hello")


def test_gguf_metadata_fills_the_chat_template_and_special_tokens(tmp_path, qwen3_folder):
    import gguf

    path = tmp_path / "meta.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_chat_template("{% for m in messages %}<u>{{ m['content'] }}</u>{% endfor %}<a>")
    writer.add_eos_token_id(2)
    writer.add_bos_token_id(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    meta = gguf_tokenizer_metadata(path)
    assert meta["eos_token"] == 2 and meta["bos_token"] == 1 and meta["chat_template"].startswith("{% for m")
    tokenizer = tf.AutoTokenizer.from_pretrained(str(qwen3_folder))
    tokenizer.chat_template = None
    tokenizer.bos_token = None
    assert complete_tokenizer(tokenizer, meta) == ["chat_template", "bos_token"]
    assert render_chat(tokenizer, "hi") == "<u>hi</u><a>"
    assert tokenizer.bos_token == tokenizer.convert_ids_to_tokens(1)


class _BosTokenizer:
    """Adds BOS (id 1) in front of every encoding unless told not to, as Gemma's tokenizer does."""

    bos_token, bos_token_id = "<s>", 1

    def __call__(self, text, add_special_tokens=True):
        ids = [1] * text.startswith("<s>") + [ord(c) for c in text.removeprefix("<s>")]
        return type("Enc", (), {"input_ids": ([1] if add_special_tokens else []) + ids})()


def test_raw_prompts_get_the_bos_token_where_the_tokenizer_adds_one(qwen3_folder):
    from ogspo.api import encode_prompt

    tok = _BosTokenizer()
    assert render_raw(tok, "ab") == "<s>ab" and encode_prompt(tok, "ab", chat=False) == [1, 97, 98]
    smol = tf.AutoTokenizer.from_pretrained(str(qwen3_folder))  # SmolLM2's adds none
    assert render_raw(smol, "ab") == "ab" and encode_prompt(smol, "ab", chat=False) == smol("ab").input_ids
