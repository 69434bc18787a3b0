"""A non-editable install carries what the commands read (the config schema, the default settings,
the native kernels' sources): the package is built as a wheel, installed into a fresh venv and run
outside the repository. The dependencies come from this interpreter's site-packages through a .pth
file (a wheel's own dependencies would be downloaded otherwise; torch alone is gigabytes)."""

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(*cmd, cwd=None):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing but the install decides what imports
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_installed_wheel_prepares_workloads_outside_the_repository(tmp_path, smollm2_dir):
    source = tmp_path / "source"  # built from a copy: setuptools writes build/ beside the sources
    shutil.copytree(REPO / "src", source / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "wheel", source)
    (wheel,) = (tmp_path / "wheel").glob("ogspo-*.whl")
    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    (site / "project-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run(python, "-m", "pip", "install", "-q", "--no-deps", wheel)
    work = tmp_path / "elsewhere"
    work.mkdir()
    where = _run(python, "-c", "import ogspo.artifacts.settings as s; print(s.__file__); print(s.DEFAULTS_FILE)", cwd=work).split()
    assert all(p.startswith(str(site)) for p in where), where  # the wheel's copy, not the repository's
    out = _run(env / "bin" / "ogspo", "prepare-workloads", "--config", where[1], "--model", smollm2_dir, "--out", work / "wl", cwd=work)
    assert "mtbench:" in out and sorted(p.name for p in (work / "wl").glob("*.parquet")) == [
        "fortunes.parquet", "humaneval.parquet", "mtbench.parquet"]
