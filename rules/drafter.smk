# Stage 2: train the EAGLE-3 draft head on the target's own answers and on ShareGPT conversations,
# fine-tune it with GTO on the trees it is decoded with, then measure both heads' acceptance on the
# held-out eval prompts.


rule train_drafter:
    input:
        model=f"{RESULTS}/model",
        workloads=expand(f"{RESULTS}/workloads/{{workload}}.parquet", workload=WORKLOADS),
        kernels=KERNELS,
    output:
        directory(f"{RESULTS}/drafter"),
    params:
        config=stage_config(config, "train_drafter"),
        workloads_dir=lambda wildcards, input: os.path.dirname(input.workloads[0]),
        work_dir=f"{RESULTS}/work/drafter",
    log:
        f"{RESULTS}/logs/train_drafter.log",
    benchmark:
        f"{RESULTS}/benchmarks/train_drafter.tsv"
    threads: 2
    resources:
        mem_mb=lambda wildcards, input: model_memory_mb(input.model, 6000),
        gpu=GPU,
        runtime=60,
    conda:
        "../envs/torch.yaml"
    shell:
        "ogspo train-drafter --config-json {params.config:q} --model {input.model}"
        " --workloads {params.workloads_dir} --kernels {input.kernels} --out {output} --work {params.work_dir} > {log} 2>&1"


rule train_gto:
    input:
        model=f"{RESULTS}/model",
        drafter=f"{RESULTS}/drafter",
        workloads=expand(f"{RESULTS}/workloads/{{workload}}.parquet", workload=WORKLOADS),
    output:
        directory(f"{RESULTS}/drafter_gto"),
    params:
        config=stage_config(config, "train_gto"),
        workloads_dir=lambda wildcards, input: os.path.dirname(input.workloads[0]),
    log:
        f"{RESULTS}/logs/train_gto.log",
    benchmark:
        f"{RESULTS}/benchmarks/train_gto.tsv"
    threads: 2
    resources:
        mem_mb=lambda wildcards, input: model_memory_mb(input.model, 6000),
        gpu=GPU,
        runtime=30,
    conda:
        "../envs/torch.yaml"
    shell:
        "ogspo train-gto --config-json {params.config:q} --model {input.model} --drafter {input.drafter}"
        " --workloads {params.workloads_dir} --out {output} > {log} 2>&1"


rule measure_drafter:
    input:
        unpack(lambda wildcards: HEADS),
        model=f"{RESULTS}/model",
        workloads=expand(f"{RESULTS}/workloads/{{workload}}.parquet", workload=WORKLOADS),
        kernels=KERNELS,
    output:
        json=f"{RESULTS}/drafter_eval/acceptance.json",
        md=f"{RESULTS}/drafter_eval/acceptance.md",
    params:
        config=stage_config(config, "measure_drafter"),
        gto=f"--gto-drafter {HEADS['gto']}" if "gto" in HEADS else "",
        workloads_dir=lambda wildcards, input: os.path.dirname(input.workloads[0]),
    log:
        f"{RESULTS}/logs/measure_drafter.log",
    benchmark:
        f"{RESULTS}/benchmarks/measure_drafter.tsv"
    threads: TIMING_THREADS
    resources:
        mem_mb=lambda wildcards, input: model_memory_mb(input.model, 2000),
        gpu=GPU,
        runtime=60,
    conda:
        "../envs/torch.yaml"
    shell:
        "ogspo measure-drafter --config-json {params.config:q} --model {input.model} --drafter {input.base}"
        " {params.gto}"
        " --workloads {params.workloads_dir} --kernels {input.kernels} --out-json {output.json} --out-md {output.md} > {log} 2>&1"
