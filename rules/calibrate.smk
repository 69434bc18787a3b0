# Stage: per-device latency model (docs/DESIGN.md §4): t_verify table over tree size x context length,
# t_draft over frontier width, t_fixed from real engine cycles; held-out validation error.


rule calibrate_latency:
    input:
        model=f"{RESULTS}/model",
        drafter=drafter_input,
        kernels=KERNELS,
    output:
        json=f"{RESULTS}/latency/latency.json",
        png=report(f"{RESULTS}/latency/latency.png", caption="../workflow/report/latency_fit.rst", category="Latency model"),
    params:
        config=stage_config(config, "calibrate_latency"),
    log:
        f"{RESULTS}/logs/calibrate_latency.log",
    benchmark:
        f"{RESULTS}/benchmarks/calibrate_latency.tsv"
    threads: TIMING_THREADS
    resources:
        mem_mb=lambda wildcards, input: model_memory_mb(input.model, 4000),
        gpu=GPU,
        runtime=30,
    conda:
        "../envs/torch.yaml"
    shell:
        "ogspo calibrate-latency --config-json {params.config:q} --model {input.model}"
        " --drafter eagle --drafter-path {input.drafter} --kernels {input.kernels} --out-json {output.json} --out-png {output.png} > {log} 2>&1"
