# ogspo workflow. Stages live in rules/<stage>.smk; outputs go to results/{device}/.
#   .venv/bin/snakemake --profile profiles/default     (or: make run)
# The config is validated (rules/common.smk) before any rule is defined. After a run,
#   .venv/bin/snakemake --profile profiles/default --report report.html
# writes Snakemake's HTML report of it (workflow/report/: its text and the plots' captions).
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/default.yaml"


report: "workflow/report/workflow.rst"


include: "rules/device.smk"
include: "rules/common.smk"
include: "rules/prepare.smk"
include: "rules/kernels.smk"
include: "rules/calibrate.smk"
include: "rules/records.smk"
include: "rules/drafter.smk"
include: "rules/solve.smk"
include: "rules/policy.smk"
include: "rules/baselines.smk"
include: "rules/evaluate.smk"
include: "rules/resolve.smk"
include: "rules/export.smk"


rule all:
    input:
        f"{RESULTS}/model",
        expand(f"{RESULTS}/workloads/{{workload}}.parquet", workload=WORKLOADS),
        f"{RESULTS}/kernels/kernels.json",
        f"{RESULTS}/latency/latency.json",
        f"{RESULTS}/records/summary.json",
        f"{RESULTS}/drafter_eval/acceptance.json",
        expand(f"{RESULTS}/solve/oracle_{{tag}}.json", tag=RECORD_TEMPERATURES),
        expand(f"{RESULTS}/policy/{{tag}}", tag=RECORD_TEMPERATURES),
        expand(f"{RESULTS}/ogspo/{{tag}}", tag=RECORD_TEMPERATURES),
        expand(f"{RESULTS}/ablation/policy_only/{{tag}}", tag=RECORD_TEMPERATURES),
        expand(f"{RESULTS}/sequoia/{{tag}}", tag=RECORD_TEMPERATURES),
        expand(f"{RESULTS}/routing/{{tag}}", tag=RECORD_TEMPERATURES),
        f"{RESULTS}/report/summary.json",
        f"{RESULTS}/export/trees.json",
        expand(f"{RESULTS}/resolve/{{name}}/{{tag}}", name=list(config["resolve"]), tag=RECORD_TEMPERATURES),
    default_target: True
