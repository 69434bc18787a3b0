#!/usr/bin/env bash
# The engine on a CUDA machine, with that machine's own python3 (torch, transformers, numpy; no
# snakemake, polars or pyscipopt needed): lossless checks with tiny models, then timings on a model
# of SmolLM2-135M's shape with random weights. Run from a copy of the repository (a few MB travel):
#   bash benchmarks/gpu_check.sh            (add --quick for a smoke run; --device cpu runs it anywhere)
# Prints one Markdown table; with $OUT set it is also written to $OUT/gpu_check.md. Put the table
# into docs/BENCHMARKS.md by hand (that machine may not hold the repository's git checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
exec python3 benchmarks/gpu_check.py "$@"
