# Stage: baselines built from the same records (docs/DESIGN.md §7), all workloads at one temperature.
# - build_sequoia: Sequoia-style static tree (DP over positional acceptance, size by the latency model);
#   structure.json (empty list = autoregressive) + sequoia.json with the figures.
# - train_routing: pre-drafting routing classifier over a few templates; router.json + train.json.
# Records are complete when their folder's complete.flag exists (rules/records.smk).


rule build_sequoia:
    input:
        records=expand(f"{RESULTS}/records/{{workload}}/T{{{{temperature}}}}/complete.flag", workload=WORKLOADS),
        latency=f"{RESULTS}/latency/latency.json",
    output:
        directory(f"{RESULTS}/sequoia/T{{temperature}}"),
    wildcard_constraints:
        temperature=r"[0-9.]+",
    params:
        config=stage_config(config, "build_sequoia"),
        records=lambda wildcards, input: [os.path.dirname(f) for f in input.records],
    log:
        f"{RESULTS}/logs/build_sequoia/T{{temperature}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/build_sequoia_T{{temperature}}.tsv"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    conda:
        "../envs/torch.yaml"
    shell:
        "ogspo build-sequoia --config-json {params.config:q} --records {params.records}"
        " --latency {input.latency} --out {output} > {log} 2>&1"


rule train_routing:
    input:
        records=expand(f"{RESULTS}/records/{{workload}}/T{{{{temperature}}}}/complete.flag", workload=WORKLOADS),
        latency=f"{RESULTS}/latency/latency.json",
    output:
        directory(f"{RESULTS}/routing/T{{temperature}}"),
    wildcard_constraints:
        temperature=r"[0-9.]+",
    params:
        config=stage_config(config, "train_routing"),
        records=lambda wildcards, input: [os.path.dirname(f) for f in input.records],
    log:
        f"{RESULTS}/logs/train_routing/T{{temperature}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/train_routing_T{{temperature}}.tsv"
    threads: 1
    resources:
        mem_mb=4000,
        runtime=20,
    conda:
        "../envs/torch.yaml"
    shell:
        "OMP_NUM_THREADS={threads} ogspo train-routing --config-json {params.config:q} --records {params.records}"
        " --latency {input.latency} --out {output} > {log} 2>&1"
