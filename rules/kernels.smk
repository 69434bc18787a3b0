# Stage: per-device kernel calibration. Every candidate matmul kernel (torch's, oneDNN, numpy's BLAS,
# the engine's own native GEMM) timed on every weight class of the target and every row count; the
# table is an input of every stage that decodes or times the target. Measured tables are cached per
# machine (CPU model, torch version, threads, dtype, shapes, settings), so reruns do not time again.


rule calibrate_kernels:
    input:
        model=f"{RESULTS}/model",
    output:
        f"{RESULTS}/kernels/kernels.json",
    params:
        config=stage_config(config, "calibrate_kernels"),
    log:
        f"{RESULTS}/logs/calibrate_kernels.log",
    benchmark:
        f"{RESULTS}/benchmarks/calibrate_kernels.tsv"
    threads: TIMING_THREADS
    resources:
        mem_mb=lambda wildcards, input: model_memory_mb(input.model, 4000),
        gpu=GPU,
        runtime=15,
    conda:
        "../envs/torch.yaml"
    shell:
        "ogspo calibrate-kernels --config-json {params.config:q} --model {input.model} --out {output} > {log} 2>&1"
