# The device profile, merged before the config is validated (rules/common.smk). Included first.
import os
import sys

# The device profile (`device_profile: h200`, set by profiles/h200 and profiles/cluster or in your
# own config file): config/devices/<name>.yaml is merged over config/default.yaml and under every
# --configfile / --config (Snakemake re-applies those after each configfile), so it survives them.
if config.get("device_profile"):
    _device_file = f"config/devices/{config['device_profile']}.yaml"
    if not os.path.isfile(_device_file):
        _known = sorted(f[: -len(".yaml")] for f in os.listdir("config/devices") if f.endswith(".yaml"))
        sys.exit(f"config error at 'device_profile': no {_device_file}; allowed: {', '.join(_known)}")

    configfile: _device_file
