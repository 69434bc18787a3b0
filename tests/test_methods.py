"""One record per decoding method (`ogspo.methods.registry.METHOD_RECORDS`): make_policy, evaluate's
method table, the rule inputs of evaluate and the config schema are derived from it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ogspo.engine.policies import StaticTree
from ogspo.engine.tree import Structure
from ogspo.methods import registry
from ogspo.methods.registry import METHOD_RECORDS, Artifact, Method, build_policy, make_policy, method_specs
from ogspo.stages.config import ConfigError, load_config, load_schema

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def throwaway(monkeypatch):
    """A method added through its record only: a chain of 2 read from an artifact of rule build_sequoia."""
    record = Method("throwaway", "a throwaway chain", lambda a: StaticTree(Structure.chain(2), name=a.name or "throwaway"),
                    artifact=Artifact("build_sequoia", "sequoia/{T}", "sequoia/{T}/structure.json"))
    monkeypatch.setitem(METHOD_RECORDS, record.name, record)
    return record


def _methods_schema() -> dict:
    schema = load_schema()
    evaluate = schema["properties"]["evaluate"]
    if "$ref" in evaluate:
        evaluate = schema["$defs"][evaluate["$ref"].rsplit("/", 1)[-1]]
    return evaluate["properties"]["methods"]


def test_a_method_added_through_its_record_is_everywhere(throwaway):
    assert make_policy("throwaway").structure.paths == Structure.chain(2).paths
    specs = method_specs(["ar", "throwaway"], {})
    assert [s.kind for s in specs] == ["ar", "throwaway"]
    policy = build_policy(specs[1], temperature=0.0, workload="w", artifacts={"throwaway": "x/{T}"})
    assert policy.name == "throwaway"
    assert "throwaway" in _methods_schema()["items"]["enum"]
    cfg = load_config(ROOT / "config" / "default.yaml")
    cfg["evaluate"]["methods"], cfg["evaluate"]["light_methods"] = ["ar", "throwaway"], []
    assert load_config(cfg, check_paths=False)["evaluate"]["methods"] == ["ar", "throwaway"]
    assert registry.artifact_inputs(["ar", "throwaway"], "results/cpu") == {
        "throwaway": ("results/cpu/sequoia/{T}", "results/cpu/sequoia/{T}/structure.json")}


def test_an_unknown_method_is_refused_everywhere_in_one_line():
    with pytest.raises(ValueError, match="unknown method 'beam'; allowed: ar, ar-aa, chain"):
        make_policy("beam")
    with pytest.raises(ValueError, match="evaluate.methods: unknown method 'beam'"):
        method_specs(["ar", "beam"], {})
    cfg = load_config(ROOT / "config" / "default.yaml")
    cfg["evaluate"]["methods"] = ["ar", "beam"]
    with pytest.raises(ConfigError, match="evaluate.methods.*'beam' is not allowed; allowed values: ar, ar-aa"):
        load_config(cfg, check_paths=False)


def test_every_artifact_is_an_output_of_the_rule_named_for_it():
    rules = {}
    for path in (ROOT / "rules").glob("*.smk"):
        parts = re.split(r"^rule (\w+):\n", path.read_text(), flags=re.M)
        rules.update(dict(zip(parts[1::2], parts[2::2])))
    for m in METHOD_RECORDS.values():
        if m.artifact is None:
            continue
        assert m.artifact.rule in rules, f"{m.name}: no rule {m.artifact.rule}"
        output = rules[m.artifact.rule].split("output:", 1)[1].split("log:", 1)[0]
        pattern = m.artifact.output.replace("{T}", "T{{temperature}}")
        assert pattern in output, f"{m.name}: rule {m.artifact.rule} does not write {m.artifact.output}"
        assert m.artifact.reads.startswith(m.artifact.output)


def test_every_method_names_its_config_key():
    cfg = load_config(ROOT / "config" / "default.yaml")
    for m in METHOD_RECORDS.values():
        node = cfg
        for part in (m.config or "").split(".") if m.config else []:
            assert part in node, f"{m.name}: config key {m.config} does not exist"
            node = node[part]
