# Stage: the run's trees as serving-engine settings (ogspo.stages.export_tree): per temperature, the
# shipped OGSPO structure, Sequoia's tree and tuned EAGLE-3's settings, each as vLLM's
# speculative_token_tree and SGLang's nearest flags, replayed on the records under the device's latency model.


rule export_tree:
    input:
        latency=f"{RESULTS}/latency/latency.json",
        records=expand(f"{RESULTS}/records/{{workload}}/{{tag}}/complete.flag", workload=WORKLOADS, tag=RECORD_TEMPERATURES),
        policy=expand(f"{RESULTS}/ogspo/{{tag}}", tag=RECORD_TEMPERATURES),
        sequoia=expand(f"{RESULTS}/sequoia/{{tag}}", tag=RECORD_TEMPERATURES),
        tune=expand(f"{RESULTS}/evaluate/tune_{{tag}}.json", tag=RECORD_TEMPERATURES),
    output:
        f"{RESULTS}/export/trees.json",
    params:
        results=lambda wildcards, input: os.path.dirname(os.path.dirname(input.latency)),
        tags=RECORD_TEMPERATURES,
    log:
        f"{RESULTS}/logs/export_tree.log",
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    conda:
        "../envs/torch.yaml"
    shell:
        "ogspo export-tree --results {params.results} --temperatures {params.tags} --out {output} > {log} 2>&1"
