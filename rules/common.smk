# Shared by all stages: config validation and paths. Included first by the Snakefile.
# Rules pass their stage exactly the config sections it reads: params: config=config_json(config, ...)
import sys

from ogspo.stages.config import ConfigError, config_json, load_config

# Validate before any rule exists: a bad config stops here with one line naming the key.
try:
    _validated = load_config(config)
except ConfigError as _err:
    sys.exit(str(_err))
config.clear()
config.update(_validated)

RESULTS = f"results/{config['device']}"
WORKLOADS = list(config["workloads"])

# Every stage that decodes or times the target runs it with the device's kernel table (rule calibrate_kernels).
KERNELS = f"{RESULTS}/kernels/kernels.json"
# Input function of the latency and records stages: the trained drafter folder (rule train_drafter).
drafter_input = lambda wildcards: f"{RESULTS}/drafter"
# Records folder per temperature: 0 -> T0, 1.0 -> T1, 0.7 -> T0.7.
RECORD_TEMPERATURES = [f"T{float(t):g}" for t in config["records"]["temperatures"]]
