"""benchmarks/bench_peers.py's parsing and pairing, on llama.cpp output recorded from a real run
(tests/data/peers/: a `llama-server` /completion response and `llama-bench -o json`); the benchmark
itself compiles llama.cpp for minutes and is not run here."""

import json
import math
import sys
from pathlib import Path

import polars as pl
import pytest

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data" / "peers"
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_peers  # noqa: E402
import llamacpp  # noqa: E402

from ogspo.analysis.compare import ratio_intervals  # noqa: E402


@pytest.mark.parametrize("name", ["completion.json", "completion_lookup.json"])  # AR, and n-gram lookup decoding
def test_completion_response_parses_to_tokens_and_complete_request_seconds(name):
    resp = json.loads((DATA / name).read_text())
    c = llamacpp.parse_completion(resp)
    assert len(c.tokens) == resp["timings"]["predicted_n"] and all(isinstance(t, int) for t in c.tokens)
    assert c.prompt_tokens == resp["timings"]["prompt_n"] > 0
    assert c.seconds == pytest.approx((resp["timings"]["prompt_ms"] + resp["timings"]["predicted_ms"]) / 1e3)
    assert c.throughput == pytest.approx(len(c.tokens) / c.seconds)
    assert (c.drafted, c.accepted) == (resp["timings"].get("draft_n", 0), resp["timings"].get("draft_n_accepted", 0))
    assert (c.drafted > 0) == ("lookup" in name) and c.accepted <= c.drafted


def test_completion_without_tokens_names_the_missing_field():
    resp = json.loads((DATA / "completion.json").read_text())
    del resp["tokens"]
    with pytest.raises(ValueError, match="return_tokens"):
        llamacpp.parse_completion(resp)


def test_bench_json_parses_one_row_per_file_and_test():
    rows = llamacpp.parse_bench((DATA / "bench.json").read_text())
    tests = {(r.model, r.test) for r in rows}
    assert len(tests) == len(rows) and {t for _, t in tests} == {"pp128", "tg128"}
    assert all(r.tokens_per_second > 0 and r.stddev >= 0 for r in rows)
    assert all(r.model.endswith(".gguf") and "/" not in r.model for r in rows)


def test_first_divergence():
    assert llamacpp.first_divergence([1, 2, 3], [1, 2, 3]) == -1
    assert llamacpp.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert llamacpp.first_divergence([1, 2], [1, 2, 3]) == 2


def test_cmake_flags_leave_amx_out_where_the_cpu_has_it():
    plain = llamacpp.cmake_flags({"avx2", "fma"})
    assert "-DGGML_NATIVE=ON" in plain and not any("AMX" in f for f in plain)
    amx = llamacpp.cmake_flags({"avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"})
    assert "-DGGML_NATIVE=OFF" in amx and "-DGGML_AVX512=ON" in amx and "-DGGML_AVX512_BF16=ON" in amx
    assert "-DGGML_AVX512_VNNI=OFF" in amx and {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_BF16=OFF"} <= set(amx)
    assert llamacpp.cpu_flags("processor\t: 0\nflags\t\t: fpu avx2 amx_tile\n") == {"fpu", "avx2", "amx_tile"}


def test_best_method_comes_from_the_dag_and_pairs_request_by_request(tmp_path):
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"rows": [
        {"workload": "a", "temperature": 0.0, "method": "sequoia", "throughput": 40.0},
        {"workload": "a", "temperature": 0.0, "method": "eagle-tuned", "throughput": 38.0},
        {"workload": "a", "temperature": 1.0, "method": "eagle-tuned", "throughput": 90.0},  # T=1: not a candidate
        {"workload": "b", "temperature": 0.0, "method": "eagle-tuned", "throughput": 30.0},
        {"workload": "b", "temperature": 0.0, "method": "ar", "throughput": 99.0},  # not a speculative method
    ]}))
    best = bench_peers.dag_best(summary, bench_peers.SPEC_METHODS)
    assert best == {"a": "sequoia", "b": "eagle-tuned"}
    rows = []
    for w, base in (("a", 10.0), ("b", 20.0)):
        for pid in ("p0", "p1"):
            for m, f in (("llama.cpp-f32", 1.0), ("ogspo-sequoia", 1.5), ("ogspo-eagle-tuned", 0.5)):
                rows.append(dict(workload=w, temperature=0.0, prompt_id=pid, repeat=0, method=m, throughput=base * f))
    df = bench_peers.with_best(pl.DataFrame(rows), best)
    picked = df.filter(pl.col("method") == "ogspo-best").sort("workload")
    assert picked["throughput"].to_list() == [15.0, 15.0, 10.0, 10.0]  # a: sequoia 1.5x, b: eagle-tuned 0.5x
    r = ratio_intervals(df, "ogspo-best", "llama.cpp-f32")
    assert r["cells"][("a", 0.0)].ratio == pytest.approx(1.5) and r["cells"][("b", 0.0)].ratio == pytest.approx(0.5)
    assert r["pooled"].ratio == pytest.approx(math.sqrt(1.5 * 0.5)) and r["pooled"].n == 4


def test_top_logprobs_parse_from_a_recorded_n_probs_response():
    resp = json.loads((DATA / "completion_probs.json").read_text())
    top = llamacpp.parse_top_logprobs(resp)
    assert len(top) == 2 and top[0][1] >= top[1][1] and all(isinstance(t, int) for t, _ in top)
    assert top[0][0] == resp["tokens"][0]  # greedy: the best candidate is what was generated
    del resp["completion_probabilities"]
    with pytest.raises(ValueError, match="n_probs"):
        llamacpp.parse_top_logprobs(resp)


def test_bench_rows_at_a_depth_give_seconds_per_forward():
    rows = llamacpp.parse_bench((DATA / "bench_depth.json").read_text())
    assert [(r.test, r.depth) for r in rows] == [("pp1", 16), ("pp2", 16)]
    assert all(r.seconds == pytest.approx(int(r.test[2:]) / r.tokens_per_second) for r in rows)


def test_eagle3_args_name_the_head_and_the_chain_settings():
    args = llamacpp.eagle3_args(Path("/h/head.gguf"), 4, 0.35)
    assert args == ("--spec-type", "draft-eagle3", "-md", "/h/head.gguf", "--spec-draft-n-max", "4", "--spec-draft-p-min", "0.35")
