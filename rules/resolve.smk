# Stage: re-solve the OGSPO structure and stop policy for another device (docs/DESIGN.md §5: records are
# device-independent, only times are not) from this run's records and a latency.json calibrated there.
# config `resolve: {name: path/to/latency.json}`; outputs results/{device}/resolve/{name}/T*/ with
# oracle.json, policy/ (the folder the `ogspo` method reads) and resolve.json.


rule resolve_device:
    input:
        records=expand(f"{RESULTS}/records/{{workload}}/T{{{{temperature}}}}/complete.flag", workload=WORKLOADS),
        latency=lambda wildcards: config["resolve"][wildcards.name],
    output:
        directory(f"{RESULTS}/resolve/{{name}}/T{{temperature}}"),
    wildcard_constraints:
        temperature=r"[0-9.]+",
    params:
        config=stage_config(config, "resolve_device"),
        records=lambda wildcards, input: [os.path.dirname(f) for f in input.records],
    log:
        f"{RESULTS}/logs/resolve_device/{{name}}_T{{temperature}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/resolve_device_{{name}}_T{{temperature}}.tsv"
    threads: 1
    resources:
        mem_mb=4000,
        runtime=60,
    conda:
        "../envs/torch.yaml"
    shell:
        "OMP_NUM_THREADS={threads} ogspo resolve-device --config-json {params.config:q} --records {params.records}"
        " --latency {input.latency} --out {output} > {log} 2>&1"
