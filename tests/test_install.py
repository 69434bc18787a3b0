"""A non-editable install carries what the commands read (the config schema, the default settings,
the native kernels' sources): the package is built as a wheel, installed into a fresh venv and run
outside the repository: the workloads prepared, the kernels calibrated with the native kernels built
from the installed sources, and a 4-token generation on that kernel table. The dependencies come from
this interpreter's site-packages through a .pth file (a wheel's own dependencies would be downloaded otherwise;
torch alone is gigabytes)."""

import json
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


def test_installed_wheel_runs_the_workload_kernel_and_decode_commands_outside_the_repository(tmp_path, smollm2_dir):
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
    where = _run(python, "-c", "import ogspo.artifacts.settings as s; print(s.__file__); print(s.DEFAULTS_FILE)",
                 cwd=work).split()
    assert all(p.startswith(str(site)) for p in where), where  # the wheel's copy, not the repository's
    out = _run(env / "bin" / "ogspo", "prepare-workloads", "--config", where[1], "--model", smollm2_dir, "--out", work / "wl",
               cwd=work)
    assert "mtbench:" in out and sorted(p.name for p in (work / "wl").glob("*.parquet")) == [
        "fortunes.parquet", "humaneval.parquet", "mtbench.parquet"]
    # the native kernels build from the wheel's own sources, and calibration measures them
    native = _run(python, "-c", "from ogspo.engine import native; print(native.SOURCES[0]); print(native.load() is not None)",
                  cwd=work).split()
    assert native[0].startswith(str(site)) and native[1] == "True", native
    small = work / "kernels.yaml"
    small.write_text("kernels: {rows: [1, 4], reps: 1, max_seconds: 20, cache: false}\n")
    out = _run(env / "bin" / "ogspo", "calibrate-kernels", "--config", where[1], small, "--model", smollm2_dir,
               "--out", work / "kernels.json", cwd=work)
    table = json.loads((work / "kernels.json").read_text())
    assert not [k for k in table["meta"]["unavailable"] if k.startswith("native")], table["meta"]["unavailable"]
    assert any(k.startswith("native") for k in table["meta"]["candidates"]), out
    out = _run(env / "bin" / "ogspo", "generate", "Hello", "--model", smollm2_dir, "--method", "ar", "--max-new-tokens", "4",
               "--kernels", work / "kernels.json", cwd=work)
    assert out.strip(), "no text generated"


def test_package_data_holds_every_native_source():
    """The wheel's package-data patterns cover every source the native builder compiles."""
    import fnmatch
    import tomllib

    from ogspo.engine import native

    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = data["ogspo.engine.native"]
    assert all(any(fnmatch.fnmatch(s.name, p) for p in patterns) for s in native.SOURCES), (patterns, native.SOURCES)
