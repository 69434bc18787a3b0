import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_prepared_model_greedy_paris(smollm2_dir):
    import torch

    from ogspo.engine.model import load_target, weights_checksum

    manifest = json.loads((smollm2_dir / "ogspo_model.json").read_text())
    assert manifest["checksum_sha256"] == weights_checksum(smollm2_dir)
    model, tok = load_target(smollm2_dir)
    assert not model.training
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in text, text


def test_load_target_errors_are_one_line(tmp_path):
    from ogspo.engine.model import load_target

    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_target(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match=r"is not a model folder \(no config.json\)"):
        load_target(tmp_path)


def test_cli_error_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("modle: {}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "ogspo.cli", "prepare-model", "--config", str(bad), "--out", str(tmp_path / "m")],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ogspo: error: config error at 'modle': unknown key"), proc.stderr
    assert not (tmp_path / "m").exists()
