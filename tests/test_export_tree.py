"""`ogspo export-tree`: static trees as vLLM's `speculative_token_tree`, EAGLE-3 dynamic trees as
SGLang's three settings, read from a run's results folder; the exports round-trip into `Structure`."""

import json

import pytest

from ogspo.cli import main
from ogspo.engine.tree import Structure
from ogspo.stages.export_tree import export_trees, parse_vllm_tree, sglang_nearest, sglang_settings, vllm_tree

# vLLM's own spelling (its tests and docs): str() of a level-ordered list of rank-path tuples
VLLM_FIXTURE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"


def test_a_static_tree_is_vllms_token_tree_and_back():
    s = Structure([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    v = vllm_tree(s)
    assert v == {"speculation": True, "num_speculative_tokens": 7, "speculative_token_tree": VLLM_FIXTURE}
    assert parse_vllm_tree(VLLM_FIXTURE).paths == s.paths
    assert vllm_tree(Structure([])) == {"speculation": False}
    with pytest.raises(ValueError, match="not a list of int tuples"):
        parse_vllm_tree("[(0,), [1]]")


def test_eagle_trees_are_sglangs_three_settings():
    assert sglang_settings(60, 5, 10) == {"speculation": True, "speculative_num_steps": 5, "speculative_eagle_topk": 10,
                                          "speculative_num_draft_tokens": 61}  # SGLang counts the root
    near = sglang_nearest(Structure([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]))
    assert (near["speculative_num_steps"], near["speculative_eagle_topk"], near["speculative_num_draft_tokens"]) == (3, 3, 8)
    assert near["exact"] is False and "dynamic" in near["why"]


def test_export_reads_a_results_folder(tmp_path, capsys):
    res = tmp_path / "results"
    (res / "policy" / "T0").mkdir(parents=True)
    (res / "policy" / "T0" / "structure.json").write_text(json.dumps({"structure": [[0], [1], [0, 0]]}))
    (res / "policy" / "T0" / "export.json").write_text(json.dumps({"static": True, "autoregressive": False}))
    (res / "evaluate").mkdir()
    (res / "evaluate" / "tune_T0.json").write_text(json.dumps({"winners": {"mtbench": [8, 3, 2], "fortunes": [0, 0, 0]}}))
    doc = export_trees(res, ["T0"])
    t0 = doc["temperatures"]["T0"]
    assert parse_vllm_tree(t0["ogspo"]["*"]["vllm"]["speculative_token_tree"]).to_list() == [[0], [1], [0, 0]]
    assert t0["eagle_tuned"]["mtbench"]["sglang"]["speculative_num_draft_tokens"] == 9
    assert t0["eagle_tuned"]["fortunes"]["sglang"] == {"speculation": False}
    assert doc["missing"] == [f"{res}/sequoia/T0/structure.json"]
    assert main(["export-tree", "--results", str(res), "--temperatures", "T0", "--out", str(tmp_path / "x.json")]) == 0
    assert json.loads((tmp_path / "x.json").read_text()) == json.loads(capsys.readouterr().out)
