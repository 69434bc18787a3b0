# Stage: posterior verification records (docs/DESIGN.md §3): per workload and temperature,
# draft the whole template T every cycle and learn its outcome (one forward over T or the accepted path
# row by row, records.verify); resumable parquet shards. Then a summary.
# The declared output is a completion flag, not the folder: Snakemake deletes a job's outputs
# before (re)running it, and the shards already written must survive an interrupted run.


rule collect_records:
    input:
        model=f"{RESULTS}/model",
        drafter=drafter_input,
        workload=f"{RESULTS}/workloads/{{workload}}.parquet",
        kernels=KERNELS,
    output:
        f"{RESULTS}/records/{{workload}}/T{{temperature}}/complete.flag",
    wildcard_constraints:
        temperature=r"[0-9.]+",
    params:
        config=stage_config(config, "collect_records"),
        out_dir=lambda wildcards, output: os.path.dirname(output[0]),
    log:
        f"{RESULTS}/logs/collect_records/{{workload}}-T{{temperature}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/collect_records_{{workload}}_T{{temperature}}.tsv"
    threads: TIMING_THREADS
    resources:
        mem_mb=lambda wildcards, input: model_memory_mb(input.model, 4000),
        gpu=GPU,
        runtime=60,
    conda:
        "../envs/torch.yaml"
    shell:
        "ogspo collect-records --config-json {params.config:q} --model {input.model}"
        " --drafter eagle --drafter-path {input.drafter} --kernels {input.kernels} --workload-file {input.workload}"
        " --temperature {wildcards.temperature} --out {params.out_dir} > {log} 2>&1 && touch {output}"


rule summarize_records:
    input:
        model=f"{RESULTS}/model",
        flags=expand(f"{RESULTS}/records/{{workload}}/{{tag}}/complete.flag", workload=WORKLOADS, tag=RECORD_TEMPERATURES),
    output:
        json=f"{RESULTS}/records/summary.json",
        md=f"{RESULTS}/records/summary.md",
    params:
        dirs=lambda wildcards, input: [os.path.dirname(f) for f in input.flags],
    log:
        f"{RESULTS}/logs/summarize_records.log",
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    conda:
        "../envs/torch.yaml"
    shell:
        "ogspo summarize-records {params.dirs} --model {input.model} --out-json {output.json}"
        " --out-md {output.md} > {log} 2>&1"
