# Stage: side-by-side evaluation (docs/DESIGN.md §7) and the report.
# - tune_eagle: the fair EAGLE-3 baseline, a grid of dynamic trees decoded for real on calib prompts,
#   per workload, at one temperature (winner = highest geometric-mean throughput), with Sequoia's static
#   tree beside it: the best baseline of each cell (ar, eagle-tuned, sequoia) is picked there.
# - evaluate: every method of `evaluate.methods` on the held-out eval prompts of every workload at every
#   records temperature, side by side cycle by cycle (evaluate.interleave), every method generating
#   the same number of tokens, with the T=0 lossless check (a real mismatch fails the job with one line
#   naming method, workload and prompt).
# - report: report/summary.json, report.md and PNG plots.
# Method artifacts are passed as path templates, {T} = temperature tag (T0, T1).

from ogspo.methods.registry import artifact_inputs

# method kind -> (its artifact per temperature tag, the path template `ogspo evaluate --artifact` hands it),
# from each method's record (ogspo.methods.registry.METHOD_RECORDS)
EVAL_ARTIFACTS = artifact_inputs(config["evaluate"]["methods"], RESULTS)


rule tune_eagle:
    input:
        model=f"{RESULTS}/model",
        drafter=drafter_input,
        workloads=expand(f"{RESULTS}/workloads/{{workload}}.parquet", workload=WORKLOADS),
        kernels=KERNELS,
        sequoia=f"{RESULTS}/sequoia/T{{temperature}}",
    output:
        f"{RESULTS}/evaluate/tune_T{{temperature}}.json",
    wildcard_constraints:
        temperature=r"[0-9.]+",
    params:
        config=stage_config(config, "tune_eagle"),
    log:
        f"{RESULTS}/logs/tune_eagle/T{{temperature}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/tune_eagle_T{{temperature}}.tsv"
    threads: TIMING_THREADS
    resources:
        mem_mb=lambda wildcards, input: model_memory_mb(input.model, 2000),
        gpu=GPU,
        runtime=30,
    conda:
        "../envs/torch.yaml"
    shell:
        "ogspo tune-eagle --config-json {params.config:q} --model {input.model} --drafter eagle"
        " --drafter-path {input.drafter} --kernels {input.kernels} --workloads {input.workloads} --temperature {wildcards.temperature}"
        " --static {input.sequoia}/structure.json --out {output} > {log} 2>&1"


rule evaluate:
    input:
        model=f"{RESULTS}/model",
        drafter=drafter_input,
        workloads=expand(f"{RESULTS}/workloads/{{workload}}.parquet", workload=WORKLOADS),
        latency=f"{RESULTS}/latency/latency.json",
        kernels=KERNELS,
        oracle=expand(f"{RESULTS}/solve/oracle_{{tag}}.json", tag=RECORD_TEMPERATURES),
        artifacts=sorted({made.format(T=tag) for made, _ in EVAL_ARTIFACTS.values() for tag in RECORD_TEMPERATURES}),
    output:
        requests=f"{RESULTS}/evaluate/requests.parquet",
        summary=f"{RESULTS}/evaluate/summary.json",
    params:
        config=stage_config(config, "evaluate"),
        oracle=lambda wildcards, input: [f"{tag}={path}" for tag, path in zip(RECORD_TEMPERATURES, input.oracle)],
        # a function: strings in params are expanded as wildcards, and {T} is for `ogspo evaluate`
        artifacts=lambda wildcards: [f"{k}={reads}" for k, (_, reads) in EVAL_ARTIFACTS.items()],
    log:
        f"{RESULTS}/logs/evaluate.log",
    benchmark:
        f"{RESULTS}/benchmarks/evaluate.tsv"
    threads: TIMING_THREADS
    resources:
        mem_mb=lambda wildcards, input: model_memory_mb(input.model, 4000),
        gpu=GPU,
        runtime=60,
    conda:
        "../envs/torch.yaml"
    shell:
        "ogspo evaluate --config-json {params.config:q} --model {input.model} --drafter eagle"
        " --drafter-path {input.drafter} --kernels {input.kernels} --workloads {input.workloads} --latency {input.latency}"
        " --oracle {params.oracle} --artifact {params.artifacts:q} --out-requests {output.requests}"
        " --out-summary {output.summary} > {log} 2>&1"


rule report:
    input:
        summary=f"{RESULTS}/evaluate/summary.json",
        requests=f"{RESULTS}/evaluate/requests.parquet",
        latency=f"{RESULTS}/latency/latency.json",
        records=f"{RESULTS}/records/summary.json",
        policy=expand(f"{RESULTS}/policy/{{tag}}", tag=RECORD_TEMPERATURES),
        rounds=expand(f"{RESULTS}/rounds/{{tag}}", tag=RECORD_TEMPERATURES),
        sequoia=expand(f"{RESULTS}/sequoia/{{tag}}", tag=RECORD_TEMPERATURES),
        ogspo=expand(f"{RESULTS}/ogspo/{{tag}}", tag=RECORD_TEMPERATURES),
        drafter_eval=f"{RESULTS}/drafter_eval/acceptance.json",
        heads=list(HEADS.values()),
    output:
        summary=f"{RESULTS}/report/summary.json",
        md=f"{RESULTS}/report/report.md",
        plots=[
            report(f"{RESULTS}/report/throughput.png", caption="../workflow/report/throughput.rst", category="Evaluation"),
            report(f"{RESULTS}/report/latency.png", caption="../workflow/report/latency_check.rst", category="Evaluation"),
        ],
    params:
        structures=lambda wildcards, input: [f"{tag}={d}/structure.json" for tag, d in zip(RECORD_TEMPERATURES, input.policy)],
        rounds=lambda wildcards, input: [f"{tag}={d}/rounds.parquet" for tag, d in zip(RECORD_TEMPERATURES, input.rounds)],
        sequoia=lambda wildcards, input: [f"{tag}={d}/sequoia.json" for tag, d in zip(RECORD_TEMPERATURES, input.sequoia)],
        on_device=lambda wildcards, input: [f"{tag}={d}/device.json" for tag, d in zip(RECORD_TEMPERATURES, input.ogspo)],
        out_dir=lambda wildcards, output: os.path.dirname(output.summary),
        heads=" ".join(f"{label}={path}" for label, path in HEADS.items()),
    log:
        f"{RESULTS}/logs/report.log",
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    conda:
        "../envs/torch.yaml"
    shell:
        "ogspo report --evaluate-summary {input.summary} --requests {input.requests} --latency {input.latency}"
        " --records-summary {input.records} --structure {params.structures} --rounds {params.rounds}"
        " --sequoia {params.sequoia} --on-device {params.on_device} --drafter-eval {input.drafter_eval} --head {params.heads} --out {params.out_dir} > {log} 2>&1"
