# Stage: OGSPO policy update (DESIGN §5): with the oracle's structure S fixed, learn the stop policy
# head from all workloads' records at one temperature (backward induction on net gains), evaluate the
# surrogate throughput against fixed depths and the oracle, and export it to ONNX.
# Records are complete when their folder's complete.flag exists (rules/records.smk).


rule train_policy:
    input:
        records=expand(f"{RESULTS}/records/{{workload}}/T{{{{temperature}}}}/complete.flag", workload=WORKLOADS),
        latency=f"{RESULTS}/latency/latency.json",
        oracle=f"{RESULTS}/solve/oracle_T{{temperature}}.json",
    output:
        directory(f"{RESULTS}/policy/T{{temperature}}"),
    wildcard_constraints:
        temperature=r"[0-9.]+",
    params:
        config=config_json(config, "policy", "seed"),
        records=lambda wildcards, input: [os.path.dirname(f) for f in input.records],
    log:
        f"{RESULTS}/logs/train_policy/T{{temperature}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/train_policy_T{{temperature}}.tsv"
    threads: 1
    resources:
        mem_mb=4000,
        runtime=30,
    conda:
        "../envs/torch.yaml"
    shell:
        "OMP_NUM_THREADS={threads} ogspo train-policy --config-json {params.config:q} --records {params.records}"
        " --latency {input.latency} --oracle {input.oracle} --out {output} > {log} 2>&1"
