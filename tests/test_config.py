import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ogspo.stages.config import ConfigError, config_json, deep_merge, load_config, read_config_files

REPO = Path(__file__).resolve().parents[1]
DEFAULT = REPO / "config" / "default.yaml"


@pytest.fixture
def base():
    return yaml.safe_load(DEFAULT.read_text())


def error_of(cfg) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(cfg)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("config error at '")
    return msg


def test_default_and_quick_configs_are_valid():
    assert load_config(DEFAULT)["device"] == "cpu"
    quick = load_config([DEFAULT, REPO / "config" / "quick.yaml"])
    assert quick["workloads"]["mtbench"]["max_prompts"] == 8
    h200 = load_config([DEFAULT, REPO / "config" / "devices" / "h200.yaml"])
    assert (h200["device"], h200["torch_device"], h200["dtype"]) == ("h200", "cuda", "bfloat16")


def test_misspelt_key(base):
    base["modle"] = base.pop("model")
    msg = error_of(base)
    assert msg.startswith("config error at 'modle': unknown key")
    assert "did you mean 'model'" in msg
    assert ("allowed keys: baselines, device, device_profile, drafter, dtype, evaluate, kernels, latency, measure_drafter, "
            "model, on_device, policy, records, resolve, rounds, run, seed, solve, torch_device, workloads") in msg


def test_misspelt_nested_key(base):
    base["workloads"]["mtbench"]["max_promts"] = 3
    msg = error_of(base)
    assert msg.startswith("config error at 'workloads.mtbench.max_promts': unknown key")
    assert "max_prompts" in msg


def test_wrong_type(base):
    base["seed"] = "zero"
    assert error_of(base) == "config error at 'seed': 'zero' is not of type 'integer'"


def test_wrong_value(base):
    base["workloads"]["mtbench"]["eval_fraction"] = 1.5
    assert error_of(base) == "config error at 'workloads.mtbench.eval_fraction': 1.5 is greater than the maximum of 1"
    base["workloads"]["mtbench"]["eval_fraction"] = 0.25
    base["dtype"] = "float8"
    assert error_of(base) == "config error at 'dtype': 'float8' is not allowed; allowed values: auto, float32, bfloat16, float16"


def test_evaluate_minutes_is_a_number_null_or_auto(base):
    base["evaluate"]["minutes"] = "soon"
    assert error_of(base) == ("config error at 'evaluate.minutes': evaluate.minutes must be a number of minutes > 0, "
                              "null (every prompt) or auto (what is left of run.minutes)")
    for ok in (5, None, "auto"):
        base["evaluate"]["minutes"] = ok
        assert load_config(base)["evaluate"]["minutes"] == ok


def test_missing_key(base):
    del base["workloads"]["humaneval"]["max_prompt_tokens"]
    assert error_of(base) == "config error at 'workloads.humaneval.max_prompt_tokens': required key is missing"


def test_nonexistent_model_path(base):
    base["model"] = {"path": "/x/y"}
    assert error_of(base) == "config error at 'model.path': /x/y does not exist"


def test_model_source_must_be_exactly_one(base):
    merged = deep_merge(base, {"model": {"path": "/x/y"}})
    msg = error_of(merged)
    assert msg.startswith("config error at 'model': give exactly one model source")
    assert "got keys: gguf_file, gguf_package, path" in msg
    # nulling the other sources in an override switches the source
    merged = deep_merge(base, {"model": {"gguf_package": None, "gguf_file": None, "path": str(REPO)}})
    assert load_config(merged)["model"] == {"path": str(REPO)}


def test_missing_gguf_file(base):
    base["model"]["gguf_file"] = "nope.gguf"
    msg = error_of(base)
    assert msg.startswith("config error at 'model.gguf_file': nope.gguf is not in ")
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in msg


def test_bad_yaml_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("a: [\n")
    with pytest.raises(ConfigError, match=r"^config error at '<file>': .* is not valid YAML") as info:
        read_config_files([f])
    assert "\n" not in str(info.value)


def test_input_not_mutated(base):
    before = copy.deepcopy(base)
    load_config(base)
    assert base == before


def _snakemake(*args, cwd=REPO):
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(
        [str(Path(sys.executable).parent / "snakemake"), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
    )


def test_snakemake_rejects_bad_config_with_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("workloads:\n  mtbench:\n    eval_fraction: 1.5\n")
    proc = _snakemake("-n", "--configfile", str(bad))
    assert proc.returncode != 0
    expected = "config error at 'workloads.mtbench.eval_fraction': 1.5 is greater than the maximum of 1"
    assert expected in proc.stderr.splitlines(), proc.stderr
    assert "Traceback" not in proc.stderr


def test_snakemake_dry_runs(tmp_path):
    # a device name with no results yet: the whole DAG is planned
    proc = _snakemake("-n", "--configfile", str(REPO / "config" / "quick.yaml"), "--config", f"device=dry-{tmp_path.name}")
    assert proc.returncode == 0, proc.stderr
    for rule in ("prepare_workloads", "train_drafter", "ogspo_rounds", "evaluate", "report"):
        assert f"rule {rule}:" in proc.stdout, proc.stdout


def test_snakemake_cluster_profile_dry_runs():
    # as documented in the README: `snakemake --profile cluster` from the repo root
    proc = _snakemake("--profile", "cluster", "-n")
    assert proc.returncode == 0, proc.stderr
    assert "results/h200/model" in proc.stdout + proc.stderr


# Rules that run the target model: on CUDA each needs the GPU; every other rule runs on CPUs only
# (data preparation, the SCIP solver, the small policy and router heads, the report).
MODEL_RULES = {"calibrate_kernels", "train_drafter", "train_gto", "measure_drafter", "calibrate_latency", "collect_records",
               "ogspo_rounds", "tune_eagle", "choose_on_device", "evaluate"}


def _dry_run_resources(stdout: str) -> dict[str, list[dict[str, str]]]:
    """rule -> the `resources:` of each of its planned jobs, read from a dry run's job listing."""
    jobs: dict[str, list[dict[str, str]]] = {}
    rule = None
    for line in stdout.splitlines():
        if line.startswith(("rule ", "localrule ")) and line.endswith(":"):
            rule = line.split()[1][:-1]
        elif rule is not None and line.strip().startswith("resources:"):
            pairs = [p.split("=", 1) for p in line.split(":", 1)[1].split(", ")]
            jobs.setdefault(rule, []).append({k.strip(): v.strip() for k, v in pairs})
            rule = None
    return jobs


def test_cluster_profile_asks_a_gpu_for_every_model_rule_and_none_for_the_others(tmp_path):
    fresh = tmp_path / "fresh.yaml"
    # no results yet: every rule is planned (train_gto too, with the GTO head on)
    fresh.write_text(f"device: dry-{tmp_path.name}\ndrafter: {{gto: {{enabled: true}}}}\n")
    proc = _snakemake("--profile", "cluster", "-n", "--configfile", str(fresh))
    assert proc.returncode == 0, proc.stderr
    jobs = _dry_run_resources(proc.stdout)
    assert MODEL_RULES < set(jobs) and {"solve_oracle", "train_policy_only", "train_routing", "report"} < set(jobs)
    for rule, per_job in jobs.items():
        for res in per_job:
            if rule in MODEL_RULES:
                assert (res.get("gpu"), res.get("gpu_model"), res.get("slurm_partition")) == ("1", "h200", "gpu"), (rule, res)
            else:
                assert not {"gpu", "gpu_model", "gres", "cpus_per_gpu"} & set(res), (rule, res)
                assert res["slurm_partition"] == "cpu", (rule, res)


@pytest.mark.parametrize("profile, torch_device, dtype",
                         [("profiles/h200", "cuda", "bfloat16"), ("profiles/cpu", "cpu", "float32")])
def test_device_profile_survives_a_user_configfile(tmp_path, profile, torch_device, dtype):
    mine = tmp_path / "mine.yaml"
    mine.write_text(f"device: dry-{tmp_path.name}\nevaluate:\n  max_new_tokens: 20\n")
    proc = _snakemake("--profile", profile, "-n", "-p", "--configfile", str(mine))
    assert proc.returncode == 0, proc.stderr
    assert f'"torch_device": "{torch_device}"' in proc.stdout and f'"dtype": "{dtype}"' in proc.stdout
    assert '"max_new_tokens": 20' in proc.stdout and f"results/dry-{tmp_path.name}/" in proc.stdout
    assert ("gpu=1" in proc.stdout) == (torch_device == "cuda")


def test_unknown_device_profile_is_one_line():
    proc = _snakemake("-n", "--config", "device_profile=nope")
    assert proc.returncode != 0
    assert "config error at 'device_profile': no config/devices/nope.yaml; allowed: cpu, h200" in proc.stderr.splitlines()


def test_missing_fortunes_is_one_line_with_the_ways_out(base, tmp_path):
    base["workloads"]["fortunes"]["dir"] = str(tmp_path / "no-fortunes-here")
    msg = error_of(base)
    assert msg.startswith("config error at 'workloads.fortunes.dir':") and "apt-get install fortunes" in msg
    assert "workloads: {fortunes: null}" in msg


def test_a_machine_without_fortunes_runs_the_other_workloads(base, tmp_path):
    without = deep_merge(base, {"workloads": {"fortunes": None}, "drafter": {"extra_fortunes": 5}})
    assert error_of(without).startswith("config error at 'drafter.extra_fortunes':")
    without["drafter"]["extra_fortunes"] = 0
    assert list(load_config(without)["workloads"]) == ["mtbench", "humaneval"]
    mine = tmp_path / "mine.yaml"
    mine.write_text(f"device: dry-{tmp_path.name}\nworkloads:\n  fortunes: null\ndrafter:\n  extra_fortunes: 0\n")
    proc = _snakemake("-n", "--configfile", str(mine))
    assert proc.returncode == 0, proc.stderr
    assert "workloads/mtbench.parquet" in proc.stdout and "workloads/fortunes.parquet" not in proc.stdout


def test_train_drafter_params_leave_out_gto_so_gto_settings_do_not_retrain_the_head(base):
    a = json.loads(config_json(base, "drafter", "seed", omit=("drafter.gto",)))
    changed = copy.deepcopy(base)
    changed["drafter"]["gto"]["omega"] = 0.0
    assert json.loads(config_json(changed, "drafter", "seed", omit=("drafter.gto",))) == a and "gto" not in a["drafter"]
    assert base["drafter"]["gto"]["omega"] != 0.0  # the caller's config is left alone
    assert json.loads(config_json(changed, "drafter"))["drafter"]["gto"]["omega"] == 0.0
    # the sliced section still validates: train_gto fills the GTO settings from the defaults
    assert "gto" not in load_config(a, sections=("drafter", "seed"))["drafter"]


def test_the_workflow_and_the_package_read_the_same_defaults():
    """The Snakefile's configfile and the packaged defaults (`settings()`, the Python API) are one
    file: a copy that drifts in any key or value fails here."""
    import re

    from ogspo.artifacts.settings import DEFAULTS_FILE

    configfile = re.search(r'^configfile:\s*"([^"]+)"', (REPO / "Snakefile").read_text(), re.M).group(1)
    workflow = yaml.safe_load((REPO / configfile).read_text())
    package = yaml.safe_load(DEFAULTS_FILE.read_text())

    def diff(a, b, path=""):
        if isinstance(a, dict) and isinstance(b, dict):
            return [d for k in sorted(set(a) | set(b)) for d in diff(a.get(k, "<missing>"), b.get(k, "<missing>"), f"{path}.{k}")]
        return [] if a == b else [f"{path}: workflow {a!r}, package {b!r}"]

    assert not diff(workflow, package), ("config/default.yaml and the packaged default.yaml differ: "
                                         + "; ".join(diff(workflow, package)))
