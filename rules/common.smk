# Shared by all stages: config validation and paths. Included by the Snakefile after rules/device.smk.
# Rules pass their stage exactly the config sections it reads (declared once in ogspo.stages.registry):
#   params: config=stage_config(config, "<rule name>")
import os
import sys
import time

from ogspo.stages.config import RUN_STARTED, ConfigError, load_config
from ogspo.stages.registry import stage_config
from ogspo.engine.model import model_memory_mb

# Validate before any rule exists: a bad config stops here with one line naming the key.
try:
    _validated = load_config(config)
except ConfigError as _err:
    sys.exit(str(_err))
config.clear()
config.update(_validated)

# The run's clock (`run.minutes`): from `make run` when it set one, else from now; the jobs inherit it.
os.environ.setdefault(RUN_STARTED, f"{time.time():.0f}")

RESULTS = f"results/{config['device']}"
WORKLOADS = list(config["workloads"])
# The user's own prompt files (workloads with `jsonl:`): inputs of prepare_workloads, so an edit rebuilds them.
prompt_files = lambda wildcards: [w["jsonl"] for w in config["workloads"].values() if "jsonl" in w]

# Rules that run the target model (on `torch_device`): on CUDA each asks for one GPU, the resource
# the SLURM executor plugin turns into --gpus (profiles/cluster adds the model and partition) and
# profiles/h200 caps at 1. Rules that time the device also claim every local core, so no other job
# runs beside them on this machine.
GPU = 1 if str(config["torch_device"]).startswith("cuda") else 0
TIMING_THREADS = workflow.cores if isinstance(workflow.cores, int) and workflow.cores > 0 else 2
# Memory of a model rule scales with the prepared weights: lambda wildcards, input: model_memory_mb(input.model, extra).
# Every stage that decodes or times the target runs it with the device's kernel table (rule calibrate_kernels).
KERNELS = f"{RESULTS}/kernels/kernels.json"
# The draft heads by label: the train_drafter head (or the EAGLE-3 head at drafter.path, and then
# train_drafter does not run), and its GTO fine-tune (rule train_gto) when drafter.gto.enabled.
# Every stage that drafts uses the GTO head when there is one.
HEADS = {"base": os.path.expanduser(config["drafter"]["path"]) if config["drafter"]["path"] else f"{RESULTS}/drafter"}
if config["drafter"]["gto"]["enabled"]:
    HEADS["gto"] = f"{RESULTS}/drafter_gto"
drafter_input = lambda wildcards: HEADS.get("gto", HEADS["base"])
# Records folder per temperature: 0 -> T0, 1.0 -> T1, 0.7 -> T0.7.
RECORD_TEMPERATURES = [f"T{float(t):g}" for t in config["records"]["temperatures"]]
