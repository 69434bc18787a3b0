"""The workflow's stages, one declaration each: its name (the Snakemake rule, the module
`ogspo.stages.<name>` and the `ogspo` command with dashes), what it does, and the config sections it
reads. The rule passes exactly those sections (`stage_config`, so a stage reruns when they change)
and the command validates exactly those (`ogspo.cli`); tests/test_stages.py holds rule, command and
module to the one name."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ogspo.stages.config import config_json


@dataclass(frozen=True)
class Stage:
    name: str
    help: str
    sections: tuple[str, ...] = ()  # the config sections it reads
    omit: tuple[str, ...] = ()  # dotted keys inside those sections that belong to a later stage
    aliases: tuple[str, ...] = ()  # earlier command names, still accepted

    @property
    def command(self) -> str:
        return self.name.replace("_", "-")


STAGES: dict[str, Stage] = {s.name: s for s in (
    Stage("prepare_model", "prepare the target model as a safetensors folder", ("model", "dtype", "torch_device")),
    Stage("prepare_workloads", "build the prompt sets", ("workloads", "seed")),
    Stage("calibrate_kernels", "time matmul kernels per weight class and row count on this device", ("kernels", "torch_device")),
    Stage("calibrate_latency", "measure the per-device latency model", ("latency", "seed", "torch_device")),
    Stage("train_drafter", "train the EAGLE-3-style draft head", ("drafter", "seed", "workloads", "torch_device"),
          omit=("drafter.gto",)),
    Stage("train_gto", "fine-tune the draft head with GTO on the trees it is decoded with",
          ("drafter", "seed", "workloads", "torch_device")),
    Stage("measure_drafter", "measure the head's acceptance on eval prompts", ("measure_drafter", "seed", "torch_device")),
    Stage("collect_records", "collect posterior verification records", ("records", "seed", "torch_device")),
    Stage("summarize_records", "summarise posterior verification records"),
    Stage("solve_oracle", "posterior-optimal structure and stop depths (OGSPO step 0)", ("solve",)),
    Stage("ogspo_rounds", "alternating OGSPO rounds with same-trace correction",
          ("rounds", "policy", "solve", "seed", "torch_device")),
    Stage("export_policy", "export the final head of OGSPO rounds as a policy folder"),
    Stage("train_policy_only", "train the OGSPO stop policy for a fixed structure and export it to ONNX",
          ("policy", "seed"), aliases=("train-policy",)),
    Stage("resolve_device", "re-solve structure and stop policy for another device from records and its latency.json",
          ("solve", "policy", "seed")),
    Stage("build_sequoia", "Sequoia-style static tree from records (baseline)", ("baselines",)),
    Stage("train_routing", "pre-drafting routing classifier from records (baseline)", ("baselines", "seed")),
    Stage("tune_eagle", "grid-search EAGLE-3 tree settings (and pick the best baseline) on calib prompts",
          ("evaluate", "records", "seed", "torch_device")),
    Stage("choose_on_device", "choose what ogspo ships per workload by decoding its best-replayed candidates on the device",
          ("on_device", "evaluate", "records", "seed", "torch_device")),
    Stage("evaluate", "all methods side by side on eval prompts, with the lossless check",
          ("evaluate", "run", "records", "seed", "torch_device")),
    Stage("report", "tables and plots from the evaluation"),
    Stage("export_tree", "the shipped tree, Sequoia's and tuned EAGLE-3's as vLLM and SGLang settings"),
)}


def stage_config(config: Mapping, name: str) -> str:
    """The config sections stage `name` reads, as the JSON its rule passes to `--config-json`."""
    stage = STAGES[name]
    return config_json(config, *stage.sections, omit=stage.omit)
