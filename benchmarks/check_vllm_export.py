"""Check: every vLLM setting a run's `export/trees.json` marks exact is the tree vLLM drafts.

    PATH=.venv/bin:$PATH python benchmarks/check_vllm_export.py results/cpu/export/trees.json

For each temperature, `ogspo`'s structure per workload and Sequoia's tree: the `vllm` entry if exact, else
the uniform tree beside it, must pass `assert_vllm_drafts_it` (tests/test_export_tree.py: an independent
reading of vLLM's tree proposer, per-level top-k, breadth-first, K = the tree's size). Prints one line per
entry with the replayed tokens/s of the structure, of the uniform tree beside it (where there is one) and
of autoregressive decoding; exit status 1 on the first entry that fails.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_export_tree import assert_vllm_drafts_it  # noqa: E402


def main() -> int:
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_file():
        raise SystemExit("usage: check_vllm_export.py RESULTS/export/trees.json")
    doc = json.loads(Path(sys.argv[1]).read_text())
    for tag, d in doc["temperatures"].items():
        entries = [(f"ogspo {w}", e) for w, e in d.get("ogspo", {}).items()]
        entries += [("sequoia", d["sequoia"])] if "sequoia" in d else []
        for name, e in entries:
            v = e["vllm"]
            exact = v if v["exact"] else v["uniform"]
            try:
                assert_vllm_drafts_it(exact)
            except AssertionError:
                print(f"{tag} {name}: the setting marked exact is not the tree vLLM drafts: {exact}")
                return 1
            rep, nan = e.get("replayed", {}), float("nan")
            beside = "" if v["exact"] else f", the uniform tree's {v['uniform'].get('replayed_tokens_per_second', nan):.1f}"
            print(f"{tag} {name}: {len(e['structure'])} nodes, "
                  f"{'exact' if v['exact'] else 'not uniform: a uniform tree beside'}"
                  f"{' (stop policy not exported)' if 'stop_policy' in e else ''}; replayed tokens/s "
                  f"{rep.get('tokens_per_second', nan):.1f}{beside}, ar {rep.get('ar_tokens_per_second', nan):.1f}")
    print(f"missing: {doc['missing']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
