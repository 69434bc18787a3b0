"""The whole DAG end to end on the quick config (CI runs it through `make test`): every stage from
the prepared SmolLM2 to the report, with the lossless check of `evaluate` inside (two of its three
workloads). ~9 minutes on a 2-core AMD EPYC Zen 3 (fp32 target)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]


def readme_example() -> str:
    """The Python block of the README's "Python API" section."""
    text = (REPO / "README.md").read_text().split("## Python API", 1)[1]
    return text.split("```python\n", 1)[1].split("```", 1)[0]


def test_quick_workflow_ends_with_a_lossless_report(tmp_path, smollm2_dir):
    device = f"ci-{tmp_path.name}"
    # the model prepared once for the tests, not the GGUF again; two of quick's three workloads (a third adds the
    # same jobs again, and 1.5 minutes to the suite on a 2-core CPU)
    override = tmp_path / "ci.yaml"
    override.write_text(f"device: {device}\nmodel: {{gguf_package: null, gguf_file: null, path: {smollm2_dir}}}\n"
                        "workloads: {humaneval: null}\n")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    out = REPO / "results" / device
    try:
        proc = subprocess.run(
            [str(Path(sys.executable).parent / "snakemake"), "--profile", "profiles/default",
             "--configfile", "config/quick.yaml", str(override)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=1200,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        summary = json.loads((out / "report" / "summary.json").read_text())
        assert summary["lossless"]["checked"] > 0 and summary["lossless"]["mismatches"] == 0
        methods = {r["method"] for r in summary["rows"]}
        assert {"ar", "ar-aa", "eagle-default", "eagle-tuned", "sequoia", "routing", "ogspo", "ogspo-structure",
                "ogspo-policy"} <= methods
        assert {r["temperature"] for r in summary["rows"]} == {0.0, 1.0}
        for row in summary["rows"]:
            for key in ("throughput", "tau", "speedup", "vs_eagle_tuned", "predicted_throughput", "time_split"):
                assert row[key] is not None, (row["method"], key)
        assert (out / "report" / "report.md").is_file() and (out / "report" / "throughput.png").is_file()
        # the trees as the serving engines' settings (rule export_tree): every vLLM entry exact or with an exact one beside it
        trees = json.loads((out / "export" / "trees.json").read_text())
        assert set(trees["temperatures"]) == {"T0", "T1"} and trees["vllm_notes"]
        for entry in (e for tag in trees["temperatures"].values() for e in tag.get("ogspo", {}).values()):
            assert entry["vllm"]["exact"] or entry["vllm"]["uniform"]["exact"]
        # intervals against the best baseline, pooled and per cell; the A/A check; the records' bound
        comp = summary["comparisons"]["ogspo"]
        assert comp["vs_best"]["pooled"]["low"] <= comp["vs_best"]["pooled"]["ratio"] <= comp["vs_best"]["pooled"]["high"]
        assert comp["aa_check"]["pooled"]["n"] > 0 and set(summary["records_figures"]) == {"T0", "T1"}
        assert all(row["latency_p90"] >= row["latency_p50"] > 0 for row in summary["rows"])
        # the GTO head decodes every later stage; the report shows it beside the train_drafter head
        gto = json.loads((out / "drafter_gto" / "drafter.json").read_text())
        assert gto["gto_metrics"]["steps"] == 4 and "base" in (out / "logs" / "measure_drafter.log").read_text()
        md = (out / "report" / "report.md").read_text()
        assert "### A/A check" in md and "against the best baseline" in md and "TTFT p50" in md
        assert "## Draft heads" in md and " | base | " in md and " | gto | " in md and "Draft Tree Reward" in md
        # what ogspo ships per workload, decided by decoding its candidates on the device (rule choose_on_device)
        assert "chosen on the device" in md and (out / "ogspo" / "T1" / "device.json").is_file()
        # Snakemake's own HTML report of the run, with the plots the rules mark for it
        html = tmp_path / "report.html"
        rep = subprocess.run(
            [str(Path(sys.executable).parent / "snakemake"), "--profile", "profiles/default",
             "--configfile", "config/quick.yaml", str(override), "--report", str(html)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
        )
        assert rep.returncode == 0 and html.is_file(), rep.stderr[-3000:]
        page = html.read_text(errors="replace")
        assert all(name in page for name in ("throughput.png", "latency.png", "rounds.png")), "plots missing from report.html"
        # the README's Python API example, on this run's results
        example = readme_example().replace("results/cpu/", f"results/{device}/")
        run = subprocess.run([sys.executable, "-c", example], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        assert "tokens, " in run.stdout and " per target pass" in run.stdout, run.stdout[-2000:]
    finally:
        shutil.rmtree(out, ignore_errors=True)
