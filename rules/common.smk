# Shared by all stages: config validation and paths. Included first by the Snakefile.
# Rules pass their stage exactly the config sections it reads: params: config=config_json(config, ...)
import os
import sys

from ogspo.stages.config import ConfigError, config_json, load_config

# The device profile (`device_profile: h200`, set by profiles/h200 and profiles/cluster or in your
# own config file): config/devices/<name>.yaml is merged over config/default.yaml and under every
# --configfile / --config (Snakemake re-applies those after each configfile), so it survives them.
if config.get("device_profile"):
    _device_file = f"config/devices/{config['device_profile']}.yaml"
    if not os.path.isfile(_device_file):
        _known = sorted(f[: -len(".yaml")] for f in os.listdir("config/devices") if f.endswith(".yaml"))
        sys.exit(f"config error at 'device_profile': no {_device_file}; allowed: {', '.join(_known)}")

    configfile: _device_file


# Validate before any rule exists: a bad config stops here with one line naming the key.
try:
    _validated = load_config(config)
except ConfigError as _err:
    sys.exit(str(_err))
config.clear()
config.update(_validated)

RESULTS = f"results/{config['device']}"
WORKLOADS = list(config["workloads"])

# Rules that run the target model (on `torch_device`): on CUDA each asks for one GPU, the resource
# the SLURM executor plugin turns into --gpus (profiles/cluster adds the model and partition) and
# profiles/h200 caps at 1. Rules that time the device also claim every local core, so no other job
# runs beside them on this machine.
GPU = 1 if str(config["torch_device"]).startswith("cuda") else 0
TIMING_THREADS = workflow.cores if isinstance(workflow.cores, int) and workflow.cores > 0 else 2
# The default model's prepared weights (SmolLM2-135M, fp32), until the model folder exists.
DEFAULT_WEIGHTS_MB = 540


def model_mem_mb(extra_mb):
    """Resource function of a model rule: `extra_mb` plus four copies of the prepared weights (the
    transformers model, the engine's layouts and headroom), so memory scales with the model."""

    def mem_mb(wildcards, input):
        weights = os.path.join(input.model, "model.safetensors")
        size = os.path.getsize(weights) / 2**20 if os.path.isfile(weights) else DEFAULT_WEIGHTS_MB
        return int(extra_mb + 4 * size)

    return mem_mb


# Every stage that decodes or times the target runs it with the device's kernel table (rule calibrate_kernels).
KERNELS = f"{RESULTS}/kernels/kernels.json"
# Input function of the latency and records stages: the trained drafter folder (rule train_drafter).
drafter_input = lambda wildcards: f"{RESULTS}/drafter"
# Records folder per temperature: 0 -> T0, 1.0 -> T1, 0.7 -> T0.7.
RECORD_TEMPERATURES = [f"T{float(t):g}" for t in config["records"]["temperatures"]]
