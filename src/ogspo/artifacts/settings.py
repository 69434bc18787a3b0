"""The default settings: the packaged `default.yaml` (the repository's `config/default.yaml` links to
it) is the one place a default value lives. Library functions called with part of a config section
fill the rest from here; the workflow passes whole, schema-validated sections."""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from pathlib import Path

import yaml

DEFAULTS_FILE = Path(__file__).with_name("default.yaml")


@functools.cache
def _defaults() -> dict:
    with DEFAULTS_FILE.open() as fh:
        return yaml.safe_load(fh)


def default_settings(section: str) -> dict:
    """A copy of one section of the defaults, by dotted path (`solve`, `baselines.sequoia`)."""
    node = _defaults()
    for part in section.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise KeyError(f"the default config has no section '{section}'")
        node = node[part]
    return copy.deepcopy(dict(node))


def settings(section: str, given: Mapping | None) -> dict:
    """The settings of `section`: `given` (the section itself, or a config holding it under the
    section's last name) over the defaults. An unknown key raises one line naming the allowed ones."""
    given = given or {}
    inner = given.get(section.rsplit(".", 1)[-1])
    part = inner if isinstance(inner, Mapping) else given
    cfg = default_settings(section)
    unknown = sorted(set(part) - set(cfg))
    if unknown:
        raise ValueError(f"unknown {section} settings {unknown}; allowed: {', '.join(sorted(cfg))}")
    for k, v in part.items():  # a nested section (drafter.sharegpt) given in part keeps its other defaults
        cfg[k] = {**cfg[k], **v} if isinstance(cfg[k], dict) and isinstance(v, Mapping) else v
    return cfg
