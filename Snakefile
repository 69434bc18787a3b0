# ogspo workflow. Stages live in rules/<stage>.smk; outputs go to results/{device}/.
#   .venv/bin/snakemake --profile profiles/default     (or: make run)
# The config is validated (rules/common.smk) before any rule is defined.


configfile: "config/default.yaml"


include: "rules/common.smk"
include: "rules/prepare.smk"


rule all:
    input:
        f"{RESULTS}/model",
        expand(f"{RESULTS}/workloads/{{workload}}.parquet", workload=WORKLOADS),
    default_target: True
