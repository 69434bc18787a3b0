"""One name per stage: the Snakemake rule, the `ogspo` command and the module `ogspo.stages.<name>`,
with the config sections declared once (`ogspo.stages.registry.STAGES`) and read by both sides."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from ogspo.cli import COMMANDS, build_parser
from ogspo.stages.config import config_json, load_config
from ogspo.stages.registry import STAGES, stage_config

ROOT = Path(__file__).resolve().parents[1]


def _rules() -> dict[str, str]:
    """rule name -> its text, over rules/*.smk."""
    out = {}
    for path in sorted((ROOT / "rules").glob("*.smk")):
        parts = re.split(r"^rule (\w+):\n", path.read_text(), flags=re.M)
        out.update(dict(zip(parts[1::2], parts[2::2])))
    return out


def test_every_rule_is_a_declared_stage_with_its_command_and_module():
    rules = _rules()
    assert set(rules) == set(STAGES), (f"rules without a stage: {set(rules) - set(STAGES)}; "
                                       f"stages without a rule: {set(STAGES) - set(rules)}")
    for name, text in rules.items():
        stage = STAGES[name]
        shell = text[text.index("shell:"):]
        assert re.search(rf"\bogspo {re.escape(stage.command)} ", shell), f"rule {name} does not run `ogspo {stage.command}`"
        passed = re.findall(r'stage_config\(config, "(\w+)"\)', text)
        assert passed == ([name] if stage.sections else []), f"rule {name} passes the config of {passed}"
        assert importlib.util.find_spec(f"ogspo.stages.{name}") is not None, f"no module ogspo.stages.{name}"


def test_config_sections_are_written_once():
    """No rule spells out sections, and every stage command reads its sections from the declaration."""
    for path in (ROOT / "rules").glob("*.smk"):
        assert "config_json(" not in path.read_text(), f"{path.name} passes config sections of its own"
    cli = (ROOT / "src" / "ogspo" / "cli.py").read_text()
    assert not re.search(r"_load_config\(args, ", cli), "a command names its config sections itself"
    stage_commands = {c.stage for c in COMMANDS.values() if c.stage}
    assert stage_commands == set(STAGES)


def test_every_command_parses_under_its_stage_name_and_aliases():
    parser = build_parser()
    for stage in STAGES.values():
        for name in (stage.command, *stage.aliases):
            with pytest.raises(SystemExit) as exc:  # --help of each command, so every parser is built
                parser.parse_args([name, "--help"])
            assert exc.value.code == 0, name


def test_stage_config_is_what_the_command_validates():
    cfg = load_config(ROOT / "config" / "default.yaml")
    for stage in STAGES.values():
        if not stage.sections:
            continue
        passed = json.loads(stage_config(cfg, stage.name))
        assert set(passed) == set(stage.sections)
        assert stage_config(cfg, stage.name) == config_json(cfg, *stage.sections, omit=stage.omit)
        load_config(passed, sections=stage.sections)  # what `ogspo <command> --config-json` accepts
