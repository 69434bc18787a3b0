# Stage 1: prepare the target model (GGUF -> safetensors folder) and the prompt workloads.


rule prepare_model:
    output:
        directory(f"{RESULTS}/model"),
    params:
        config=stage_config(config, "prepare_model"),
    log:
        f"{RESULTS}/logs/prepare_model.log",
    threads: 2
    resources:
        mem_mb=4000,
        runtime=30,
    conda:
        "../envs/torch.yaml"
    shell:
        "ogspo prepare-model --config-json {params.config:q} --out {output} > {log} 2>&1"


rule prepare_workloads:
    input:
        model=f"{RESULTS}/model",
        prompts=prompt_files,
    output:
        expand(f"{RESULTS}/workloads/{{workload}}.parquet", workload=WORKLOADS),
    params:
        config=stage_config(config, "prepare_workloads"),
        out_dir=lambda wildcards, output: os.path.dirname(output[0]),
    log:
        f"{RESULTS}/logs/prepare_workloads.log",
    threads: 1
    resources:
        mem_mb=2000,
        runtime=15,
    conda:
        "../envs/torch.yaml"
    shell:
        "ogspo prepare-workloads --config-json {params.config:q} --model {input.model}"
        " --out {params.out_dir} > {log} 2>&1"
