"""Records once, any device: structure and stop policy re-solved from records and another device's latency table."""

import json

import pytest
from solve_helpers import synthetic_latency
from test_records import _collect

from ogspo.artifacts.oracle import read_oracle
from ogspo.engine.tree import Structure
from ogspo.methods.ogspo import load_policy_dir
from ogspo.stages.resolve_device import resolve_device, template_edges

POLICY = {"hidden": 8, "sweeps": 0, "steps_per_sweep": 30, "lr": 0.003, "weight_decay": 0.0, "rounds": 1,
          "holdout_fraction": 0.25}
SOLVE = {"time_limit": 10, "mip_gap": 1e-6, "dinkelbach_tol": 1e-7, "max_iterations": 10, "min_depth": 1,
         "max_depth": None, "context_buckets": 1}
META = {"model_checksum": "m" * 64, "drafter": "ee1"}


def _device(tmp_path, name, **shape) -> tuple:
    m = synthetic_latency(**shape)
    m.meta = {**META, "device": name}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(m.to_json()))
    return m, path


def test_resolve_for_another_device_finds_that_devices_optimum(tmp_path):
    """The same records re-solved for a CPU-like and a GPU-like latency table: each writes its oracle,
    policy folder and resolve.json, and the flat (GPU-like) verification makes a larger tree pay."""
    _collect(tmp_path / "r", temperature=0.0, shard_size=3)
    cfg = {"solve": SOLVE, "policy": POLICY}
    # a CPU-like device (verification cost rising with tree size) and a GPU-like one (flat, cheap drafting)
    cpu, cpu_path = _device(tmp_path, "cpu")
    gpu, gpu_path = _device(tmp_path, "gpu", verify_base=0.02, draft=0.0005, fixed=0.0005)
    gpu.verify_intercept = [0.02] * len(gpu.sizes)
    gpu.verify_table = [[0.02 + b * L for L in gpu.contexts] for b in gpu.verify_slope]
    gpu_path.write_text(json.dumps(gpu.to_json()))
    sizes = {}
    for name, model, path in (("cpu", cpu, cpu_path), ("gpu", gpu, gpu_path)):
        res = resolve_device(records_dirs=[tmp_path / "r"], latency_path=path, out_dir=tmp_path / name, config=cfg, seed=0)
        S, J = read_oracle(tmp_path / name / "oracle.json")
        assert J > 0 and S.to_list() == Structure(res.oracle.structure).to_list()
        doc = json.loads((tmp_path / name / "resolve.json").read_text())
        assert doc["device"] == name and doc["structure"] == S.to_list()
        if len(S):
            pS, pol, _ = load_policy_dir(tmp_path / name / "policy")
            assert pS.paths == S.paths and pol is not None
        sizes[name] = len(S)
        assert res.template_edges == doc["template_edges"]
    assert sizes["gpu"] > sizes["cpu"]  # flat verification makes a larger tree worth it: a different optimum


def test_resolve_refuses_a_latency_table_of_another_model(tmp_path):
    _collect(tmp_path / "r", temperature=0.0, shard_size=3)
    m = synthetic_latency()
    m.meta = {"model_checksum": "x" * 64, "drafter": "ee1"}
    path = tmp_path / "other.json"
    path.write_text(json.dumps(m.to_json()))
    with pytest.raises(ValueError, match="calibrated for model x+, the records .* are for m+") as info:
        resolve_device(records_dirs=[tmp_path / "r"], latency_path=path, out_dir=tmp_path / "out",
                       config={"solve": SOLVE, "policy": POLICY}, seed=0)
    assert "\n" not in str(info.value) and not (tmp_path / "out").exists()


def test_template_edges_name_the_limits_a_structure_reaches():
    """A structure at the template's depth, or using a parent's last drafted child, is at an edge of
    the template (a larger template might have paid); one inside it is at none."""
    template = Structure([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])  # widths 3, 2, 1; depth 3
    assert template_edges(Structure([(0,), (0, 0)]), template) == []
    assert template_edges(Structure([(0,), (0, 0), (0, 0, 0)]), template) == ["depth 3", "all 1 children of [0, 0]"]
    assert template_edges(Structure([(0,), (1,), (2,)]), template) == ["all 3 children of []"]
    assert template_edges(Structure([(0,), (1,), (0, 0), (0, 1), (1, 0)]), template) == \
        ["all 2 children of [0]", "all 1 children of [1]"]
    assert template_edges(Structure([]), template) == []
