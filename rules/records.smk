# Stage: posterior verification records (DESIGN §3): per workload and temperature, draft and
# verify the whole template T every cycle; resumable parquet shards. Then a summary.


rule collect_records:
    input:
        model=f"{RESULTS}/model",
        drafter=drafter_input,
        workload=f"{RESULTS}/workloads/{{workload}}.parquet",
    output:
        directory(f"{RESULTS}/records/{{workload}}/T{{temperature}}"),
    wildcard_constraints:
        temperature=r"[0-9.]+",
    params:
        config=config_json(config, "records", "seed", "torch_device"),
    log:
        f"{RESULTS}/logs/collect_records/{{workload}}-T{{temperature}}.log",
    threads: 2
    resources:
        mem_mb=6000,
        runtime=60,
    conda:
        "../envs/torch.yaml"
    shell:
        "ogspo collect-records --config-json {params.config:q} --model {input.model}"
        " --drafter eagle --drafter-path {input.drafter} --workload-file {input.workload}"
        " --temperature {wildcards.temperature} --out {output} > {log} 2>&1"


rule summarize_records:
    input:
        model=f"{RESULTS}/model",
        records=expand(f"{RESULTS}/records/{{workload}}/{{tag}}", workload=WORKLOADS, tag=RECORD_TEMPERATURES),
    output:
        json=f"{RESULTS}/records/summary.json",
        md=f"{RESULTS}/records/summary.md",
    log:
        f"{RESULTS}/logs/summarize_records.log",
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    conda:
        "../envs/torch.yaml"
    shell:
        "ogspo summarize-records {input.records} --model {input.model} --out-json {output.json}"
        " --out-md {output.md} > {log} 2>&1"
