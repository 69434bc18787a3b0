# Stage: OGSPO oracle (docs/DESIGN.md §5 step 0): posterior-optimal structure S ⊆ T and per-cycle stop depths
# over all workloads' records at one temperature, by Dinkelbach iterations with SCIP.


rule solve_oracle:
    input:
        records=expand(f"{RESULTS}/records/{{workload}}/T{{{{temperature}}}}/complete.flag", workload=WORKLOADS),
        latency=f"{RESULTS}/latency/latency.json",
    output:
        f"{RESULTS}/solve/oracle_T{{temperature}}.json",
    wildcard_constraints:
        temperature=r"[0-9.]+",
    params:
        config=stage_config(config, "solve_oracle"),
        records=lambda wildcards, input: [os.path.dirname(f) for f in input.records],
    log:
        f"{RESULTS}/logs/solve_oracle/T{{temperature}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/solve_oracle_T{{temperature}}.tsv"
    threads: 1
    resources:
        mem_mb=4000,
        runtime=60,
    conda:
        "../envs/torch.yaml"
    shell:
        "ogspo solve-oracle --config-json {params.config:q} --records {params.records}"
        " --latency {input.latency} --out {output} > {log} 2>&1"
