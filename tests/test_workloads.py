from pathlib import Path

import polars as pl
import pytest

from ogspo.artifacts.prompts import (
    RawPrompt,
    fortune_prefix,
    parse_fortunes,
    read_fortunes,
    read_humaneval,
    read_jsonl_prompts,
    read_mtbench,
)
from ogspo.stages.prepare_workloads import prepare_workloads, select_prompts, split_ids


def test_split_is_deterministic_disjoint_and_sized():
    ids = [f"p{i}" for i in range(40)]
    a = split_ids(ids, eval_fraction=0.25, seed=0, name="w")
    b = split_ids(list(reversed(ids)), eval_fraction=0.25, seed=0, name="w")
    assert a == b  # depends on the set of ids only
    assert set(a) == set(ids)
    assert sum(v == "eval" for v in a.values()) == 10
    assert split_ids(ids, eval_fraction=0.25, seed=1, name="w") != a
    assert split_ids(ids, eval_fraction=0.25, seed=0, name="v") != a


def test_split_edge_sizes():
    assert list(split_ids(["a", "b"], eval_fraction=0.01, seed=0, name="w").values()).count("eval") == 1
    assert list(split_ids(["a", "b"], eval_fraction=0.99, seed=0, name="w").values()).count("train") == 1
    assert set(split_ids(["a", "b"], eval_fraction=1.0, seed=0, name="w").values()) == {"eval"}
    ids = [f"p{i}" for i in range(20)]
    with_calib = split_ids(ids, eval_fraction=0.25, seed=0, name="w", calib_prompts=6)
    assert list(with_calib.values()).count("calib") == 6 and list(with_calib.values()).count("train") == 9
    plain = split_ids(ids, eval_fraction=0.25, seed=0, name="w")
    assert {i for i in ids if with_calib[i] == "eval"} == {i for i in ids if plain[i] == "eval"}
    # at least one train prompt is left for the head
    assert list(split_ids(ids[:4], eval_fraction=0.25, seed=0, name="w", calib_prompts=9).values()).count("train") == 1
    with pytest.raises(ValueError, match="duplicate"):
        split_ids(["a", "a"], eval_fraction=0.5, seed=0, name="w")


def test_select_prompts_seeded():
    ps = [RawPrompt(str(i), "c", "t", False) for i in range(100)]
    a = select_prompts(ps, max_prompts=10, seed=0, name="w")
    assert a == select_prompts(ps, max_prompts=10, seed=0, name="w")
    assert len(a) == 10 and [int(p.prompt_id) for p in a] == sorted(int(p.prompt_id) for p in a)
    assert select_prompts(ps, max_prompts=200, seed=0, name="w") == ps


def test_sources():
    mt = read_mtbench()
    assert len(mt) == 80 and all(p.chat for p in mt)
    assert {"writing", "coding", "math"} <= {p.category for p in mt}
    he = read_humaneval()
    assert len(he) == 164 and he[0].prompt_id == "HumanEval/0" and he[0].text.startswith("from typing")
    fo = read_fortunes("/usr/share/games/fortunes")
    assert len(fo) > 1000 and all(20 <= len(p.text) <= 600 for p in fo)


def test_fortune_parsing():
    text = ("First one.\n%\nA longer fortune here. It keeps going for a while so that there is a rest to continue."
            "\n\t-- Someone\n%\n")
    entries = parse_fortunes(text)
    assert entries[0] == "First one." and len(entries) == 2
    assert fortune_prefix(entries[0]) is None  # too short
    assert fortune_prefix(entries[1]) == "A longer fortune here."


def test_missing_fortunes_dir_is_one_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist") as info:
        read_fortunes(tmp_path / "nope")
    assert "\n" not in str(info.value)


def test_prepare_workloads_with_real_tokenizer(smollm2_dir, tmp_path):
    from ogspo.engine.model import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    config = {
        "seed": 0,
        "workloads": {
            "mtbench": {"max_prompts": 8, "eval_fraction": 0.25, "calib_prompts": 2, "max_prompt_tokens": 512},
            "humaneval": {"max_prompts": 8, "eval_fraction": 0.25, "calib_prompts": 2, "max_prompt_tokens": 512},
            "fortunes": {"max_prompts": 8, "eval_fraction": 0.25, "calib_prompts": 2, "max_prompt_tokens": 256,
                         "dir": "/usr/share/games/fortunes"},
        },
    }
    result = prepare_workloads(config=config, tokenizer=tok, out_dir=tmp_path / "a")
    again = prepare_workloads(config=config, tokenizer=tok, out_dir=tmp_path / "b")
    for t, u in zip(result.tables, again.tables):
        df = pl.read_parquet(t.path)
        assert df.equals(pl.read_parquet(u.path))  # deterministic
        assert df.columns == ["workload", "prompt_id", "split", "category", "chat", "text", "prompt", "n_tokens"]
        assert df.height == 8 and (t.n_train, t.n_calib, t.n_eval) == (4, 2, 2)
        assert df["prompt_id"].n_unique() == 8
        for row in df.iter_rows(named=True):
            assert row["n_tokens"] == len(tok(row["prompt"], add_special_tokens=False)["input_ids"])
    mt = pl.read_parquet(result.tables[0].path)
    assert mt["prompt"][0].startswith("<|im_start|>") and mt["prompt"][0].endswith("<|im_start|>assistant\n")
    he = pl.read_parquet(result.tables[1].path)
    assert (he["prompt"] == he["text"]).all()
    assert not list(tmp_path.glob("*/.*tmp*"))  # no temp files left behind


def test_jsonl_workload_reads_ids_and_chat(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "def add(a, b):", "id": "add"}\n\n{"prompt": "Name three colours.", "chat": true}\n'
                    '{"prompt": "Once upon a time", "id": 7}\n')
    got = read_jsonl_prompts(path, "mine")
    assert [p.prompt_id for p in got] == ["mine/add", "mine/3", "mine/7"]
    assert [p.chat for p in got] == [False, True, False] and got[0].text == "def add(a, b):"


@pytest.mark.parametrize("line, message", [
    ('{"prompt": ""}', "line 2: 'prompt' is missing or not non-empty text"),
    ('{"text": "hi"}', "line 2: unknown key 'text'"),
    ('{"prompt": "hi", "chat": "yes"}', "line 2: 'chat' must be true or false"),
    ('{"prompt": "hi", "id": "a"}', "line 2: id 'a' repeats line 1"),
    ('["hi"]', "line 2: a JSON list, not an object"),
    ('{"prompt": "hi"', "line 2: not JSON"),
])
def test_jsonl_workload_with_a_bad_line_is_one_clear_error(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine", "id": "a"}\n' + line + "\n")
    with pytest.raises(ValueError, match=message) as info:
        read_jsonl_prompts(path, "bad")
    assert "\n" not in str(info.value) and "'prompt' (non-empty text)" in str(info.value)


def test_jsonl_workload_in_the_config(tmp_path):
    import yaml

    from ogspo.stages.config import ConfigError, load_config

    default = Path(__file__).resolve().parents[1] / "config" / "default.yaml"
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "hello"}\n')
    entry = {"jsonl": str(path), "max_prompts": 10, "eval_fraction": 0.25, "calib_prompts": 1, "max_prompt_tokens": 64}

    def load(workload):
        override = tmp_path / "override.yaml"
        override.write_text(yaml.safe_dump({"workloads": {"mine": workload, "fortunes": None}, "drafter": {"extra_fortunes": 0}}))
        return load_config([default, override])

    cfg = load(entry)
    assert cfg["workloads"]["mine"]["jsonl"] == str(path) and "mtbench" in cfg["workloads"]
    with pytest.raises(ConfigError, match="'workloads.mine.jsonl': .* does not exist") as info:
        load({**entry, "jsonl": str(tmp_path / "nope.jsonl")})
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="workloads.mine"):
        load({"max_prompts": 10})
