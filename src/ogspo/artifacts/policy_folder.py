"""A policy folder: ``policy.onnx`` (the exported head; absent for an empty structure),
``structure.json`` and ``export.json`` (what was exported from where). The ONNX graph takes one
input ``features`` [batch, F] float32 and gives one output ``advantage`` [batch] (stop when <= 0)."""

from __future__ import annotations

INPUT_NAME, OUTPUT_NAME = "features", "advantage"


POLICY_FILE, EXPORT_FILE = "policy.onnx", "export.json"

# workload -> {"shipped": "policy" | a static tree's name, "structure": rank paths (null for the policy),
# "static": the fastest static tree's name, "static_structure": its rank paths (what the policy replaces)}:
# what the keep/drop rule chose per workload (learn/ship.py); absent = the folder's one choice everywhere
WORKLOADS_FILE = "workloads.json"
