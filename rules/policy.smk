# Stage: OGSPO (docs/DESIGN.md §5) from all workloads' records at one temperature.
# - ogspo_rounds: from the oracle's structure, alternate policy updates (backward induction) and structure
#   updates (SCIP), each candidate policy checked by same-trace executions (the real engine, target and
#   drafter re-running record cycles with their random numbers) and accepted only if its corrected J
#   improves; then the keep/drop rule: the policy ships only if it beats every static tree (its S at any
#   depth, Sequoia's) on held-out record requests, else that static tree ships (rounds.json "ship");
#   rounds.parquet/png/json, same_trace.parquet, policy.pt (when the policy ships) and structure.json.
# - export_policy: that head as the policy folder the `ogspo` method reads (policy.onnx, structure.json,
#   export.json; an empty structure exports autoregressive decoding).
# - choose_on_device: what `ogspo` ships per workload, decided by decoding on calib prompts its own choice,
#   autoregressive decoding and the static trees its records replay fastest, side by side (the latency model
#   prices a tree to a few percent, the top candidates differ by about that much); the policy folder again,
#   with the choice per workload in workloads.json and the table in device.json. The `ogspo` method reads it.
# - train_policy_only: the policy-only ablation, the head trained with the full records template as
#   structure (no structure optimisation), exported the same way.
# Records are complete when their folder's complete.flag exists (rules/records.smk).


rule ogspo_rounds:
    input:
        records=expand(f"{RESULTS}/records/{{workload}}/T{{{{temperature}}}}/complete.flag", workload=WORKLOADS),
        latency=f"{RESULTS}/latency/latency.json",
        oracle=f"{RESULTS}/solve/oracle_T{{temperature}}.json",
        sequoia=f"{RESULTS}/sequoia/T{{temperature}}",
        model=f"{RESULTS}/model",
        drafter=drafter_input,
        workloads=expand(f"{RESULTS}/workloads/{{workload}}.parquet", workload=WORKLOADS),
        kernels=KERNELS,
    output:
        report(directory(f"{RESULTS}/rounds/T{{temperature}}"), patterns=["{name}.png"], caption="../workflow/report/rounds.rst",
               category="OGSPO rounds", subcategory="T{temperature}"),
    wildcard_constraints:
        temperature=r"[0-9.]+",
    params:
        config=stage_config(config, "ogspo_rounds"),
        records=lambda wildcards, input: [os.path.dirname(f) for f in input.records],
        workloads=lambda wildcards, input: os.path.dirname(input.workloads[0]),
    log:
        f"{RESULTS}/logs/ogspo_rounds/T{{temperature}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/ogspo_rounds_T{{temperature}}.tsv"
    threads: TIMING_THREADS
    resources:
        mem_mb=lambda wildcards, input: model_memory_mb(input.model, 4000),
        gpu=GPU,
        runtime=60,
    conda:
        "../envs/torch.yaml"
    shell:
        "ogspo ogspo-rounds --config-json {params.config:q} --records {params.records} --latency {input.latency}"
        " --oracle {input.oracle} --model {input.model} --drafter eagle --drafter-path {input.drafter} --kernels {input.kernels}"
        " --workloads {params.workloads} --sequoia {input.sequoia}/structure.json --out {output} > {log} 2>&1"


rule export_policy:
    input:
        f"{RESULTS}/rounds/T{{temperature}}",
    output:
        directory(f"{RESULTS}/policy/T{{temperature}}"),
    wildcard_constraints:
        temperature=r"[0-9.]+",
    log:
        f"{RESULTS}/logs/export_policy/T{{temperature}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/export_policy_T{{temperature}}.tsv"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    conda:
        "../envs/torch.yaml"
    shell:
        "OMP_NUM_THREADS={threads} ogspo export-policy --rounds {input} --out {output} > {log} 2>&1"


rule choose_on_device:
    input:
        policy=f"{RESULTS}/policy/T{{temperature}}",
        records=expand(f"{RESULTS}/records/{{workload}}/T{{{{temperature}}}}/complete.flag", workload=WORKLOADS),
        latency=f"{RESULTS}/latency/latency.json",
        sequoia=f"{RESULTS}/sequoia/T{{temperature}}",
        model=f"{RESULTS}/model",
        drafter=drafter_input,
        workloads=expand(f"{RESULTS}/workloads/{{workload}}.parquet", workload=WORKLOADS),
        kernels=KERNELS,
    output:
        directory(f"{RESULTS}/ogspo/T{{temperature}}"),
    wildcard_constraints:
        temperature=r"[0-9.]+",
    params:
        config=stage_config(config, "choose_on_device"),
        records=lambda wildcards, input: [os.path.dirname(f) for f in input.records],
    log:
        f"{RESULTS}/logs/choose_on_device/T{{temperature}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/choose_on_device_T{{temperature}}.tsv"
    threads: TIMING_THREADS
    resources:
        mem_mb=lambda wildcards, input: model_memory_mb(input.model, 3000),
        gpu=GPU,
        runtime=30,
    conda:
        "../envs/torch.yaml"
    shell:
        "ogspo choose-on-device --config-json {params.config:q} --model {input.model} --drafter eagle"
        " --drafter-path {input.drafter} --kernels {input.kernels} --workloads {input.workloads} --records {params.records}"
        " --latency {input.latency} --policy {input.policy} --sequoia {input.sequoia}/structure.json"
        " --temperature {wildcards.temperature} --out {output} > {log} 2>&1"


rule train_policy_only:
    input:
        records=expand(f"{RESULTS}/records/{{workload}}/T{{{{temperature}}}}/complete.flag", workload=WORKLOADS),
        latency=f"{RESULTS}/latency/latency.json",
    output:
        directory(f"{RESULTS}/ablation/policy_only/T{{temperature}}"),
    wildcard_constraints:
        temperature=r"[0-9.]+",
    params:
        config=stage_config(config, "train_policy_only"),
        records=lambda wildcards, input: [os.path.dirname(f) for f in input.records],
    log:
        f"{RESULTS}/logs/train_policy_only/T{{temperature}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/train_policy_only_T{{temperature}}.tsv"
    threads: 1
    resources:
        mem_mb=4000,
        runtime=30,
    conda:
        "../envs/torch.yaml"
    shell:
        "OMP_NUM_THREADS={threads} ogspo train-policy-only --config-json {params.config:q} --records {params.records}"
        " --latency {input.latency} --template --out {output} > {log} 2>&1"
