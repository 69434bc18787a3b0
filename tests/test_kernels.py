"""Matmul kernels chosen by measurement (engine.kernels) and the engine's native GEMM."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import assert_tree_policies_equal_greedy, hf_greedy, tiny_model

from ogspo.engine import kernels as K
from ogspo.engine import native
from ogspo.engine.decode import SpeculativeEngine
from ogspo.engine.drafters import LMDrafter
from ogspo.engine.policies import chain
from ogspo.engine.target import LlamaTreeLM

needs_native = pytest.mark.skipif(native.load() is None, reason=f"native kernel not built here: {native.unavailable_reason()}")
ALL = K.BASE_KERNELS + K.native_kernels(2)


def _table(choice: dict[str, list[str]], rows: list[int], pad_to: dict[str, list[int]] | None = None,
           shapes=None) -> K.KernelTable:
    return K.KernelTable(
        key=K.device_key("cpu", torch.float32), shapes=shapes or {}, rows=rows, choice=choice,
        pad_to=pad_to or {c: list(rows) for c in choice},
    )


@pytest.mark.parametrize("kernel", ALL)
@pytest.mark.parametrize("out_features,in_features", [(100, 576), (64, 32), (33, 7)])
def test_every_kernel_computes_the_product(kernel, out_features, in_features):
    if kernel.startswith("native") and native.load() is None:
        pytest.skip(native.unavailable_reason())
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=g)
    weight = K.Weight(w, {kernel})
    for m in (1, 2, 3, 5, 8, 13, 17, 40):
        x = torch.randn(m, in_features, generator=g)
        ref = (x.double() @ w.double().T).float()  # [m, out]
        got = weight.apply(kernel, x)
        assert got.shape == (m, out_features)
        torch.testing.assert_close(got, ref, atol=1e-4 * in_features**0.5, rtol=1e-4)
    x3 = torch.randn(2, 3, in_features, generator=g)  # leading dims are kept
    assert weight.apply(kernel, x3).shape == (2, 3, out_features)


@needs_native
def test_native_rows_are_batch_invariant():
    """A row's bits do not depend on how many rows share the call, nor on the thread count."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3072, 576, generator=g)
    packed = native.PackedWeight(w)
    x = torch.randn(40, 576, generator=g)
    one = torch.cat([packed.matmul(x[i : i + 1], 1) for i in range(40)])
    for m in (2, 3, 4, 7, 8, 12, 16, 25, 40):
        for threads in (1, 2):
            assert torch.equal(packed.matmul(x[:m], threads), one[:m]), f"{m} rows on {threads} threads"


def test_lookup_pads_to_the_cheaper_row_count_and_past_the_table():
    t = _table({"qkv": ["linear", "matmul_t", "matmul_t", "linear"]}, [1, 2, 4, 8], {"qkv": [1, 4, 4, 8]})
    assert t.lookup("qkv", 1) == ("linear", 1)
    assert t.lookup("qkv", 2) == ("matmul_t", 4)  # padded: 4 rows were measured cheaper than 2
    assert t.lookup("qkv", 3) == ("matmul_t", 3)  # between entries: the next entry's kernel, unpadded
    assert t.lookup("qkv", 100) == ("linear", 100)  # past the table: the last kernel


def test_padded_matmul_keeps_the_real_rows():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(48, 40, generator=g)
    kernel = K.native_kernels(1)[0] if native.load() is not None else "matmul_t"
    mm = K.Matmul("o", [w], _table({"o": [kernel, kernel]}, [2, 8], {"o": [8, 8]}))
    x = torch.randn(2, 40, generator=g)
    got = mm(0, x)
    assert got.shape == (2, 48)
    torch.testing.assert_close(got, x @ w.T, atol=1e-5, rtol=1e-5)
    if kernel.startswith("native"):  # batch-invariant: padding changes no bit
        assert torch.equal(got, K.Weight(w, {kernel}).apply(kernel, x))


def test_calibration_keeps_the_fastest_and_pads_only_to_cheaper():
    """Each row count keeps its fastest kernel, or the plan of a larger row count measured at least
    pad_margin cheaper; never a smaller one."""
    g = torch.Generator().manual_seed(3)
    weights = {"o": [torch.randn(64, 64, generator=g) for _ in range(3)],
               "down": [torch.randn(32, 96, generator=g) for _ in range(3)]}
    rows = [1, 2, 4, 8]
    t = K.calibrate_kernels(weights, rows=rows, reps=2, candidates=("linear", "matmul_t"), max_seconds=30, pad_margin=0.03)
    assert t.rows == rows and t.shapes == {"o": [64, 64], "down": [32, 96]}
    for c in weights:
        tm = t.timings_us[c]
        assert set(tm) == {"linear", "matmul_t"}
        best = [min(tm[k][i] for k in tm) for i in range(len(rows))]
        for i, r in enumerate(rows):
            j = rows.index(t.pad_to[c][i])
            assert j >= i  # never pads down
            assert tm[t.choice[c][i]][j] == best[j]  # the fastest kernel of the row count it runs at
            if j > i:  # chosen on the unrounded medians; the table keeps 0.1 us (each figure off by <= 0.05)
                assert best[j] <= 0.97 * best[i] + 0.1 and best[j] == min(best[i:])


def test_table_round_trip_and_one_line_errors(tmp_path):
    t = _table({"o": ["linear", "mkldnn"]}, [1, 8], shapes={"o": [32, 32]})
    path = tmp_path / "kernels.json"
    K.write_kernel_table(t, path)
    back = K.read_kernel_table(path)
    assert back.choice == t.choice and back.rows == t.rows and back.key == t.key
    doc = json.loads(path.read_text())
    doc["choice"]["o"] = ["linear", "fastest"]
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"unknown kernel\(s\) \['fastest'\] for 'o'; allowed: linear"):
        K.read_kernel_table(path)
    with pytest.raises(FileNotFoundError, match="calibrate_kernels writes it"):
        K.read_kernel_table(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="measured for o weights of shape \\[32, 32\\], this model has \\[64, 32\\]"):
        t.check_shapes({"o": [64, 32]})


def test_target_refuses_a_table_of_another_dtype_or_shape():
    model = tiny_model(0)  # float64
    shapes = {c: list(w.w.shape) for c, w in ((c, m.weights[0]) for c, m in LlamaTreeLM(model, max_len=8).mm.items())}
    table = _table({c: ["linear"] for c in K.CLASSES}, [1], shapes=shapes)
    with pytest.raises(ValueError, match="measured for float32 weights, the target is float64"):
        LlamaTreeLM(model, max_len=8, kernels=table)
    shapes["qkv"] = [1, 1]
    with pytest.raises(ValueError, match="run `ogspo calibrate-kernels` for this model"):
        LlamaTreeLM(model.float(), max_len=8, kernels=_table({c: ["linear"] for c in K.CLASSES}, [1], shapes=shapes))


def test_every_policy_is_lossless_with_a_mixed_kernel_table():
    """fp32 tiny target whose matmuls switch kernel with the row count (and pad): every tree policy
    still equals transformers' greedy decoding token for token."""
    target_model = tiny_model(0).float()
    draft_model = tiny_model(1).float()
    shapes = {c: list(m.weights[0].w.shape) for c, m in LlamaTreeLM(target_model, max_len=8).mm.items()}
    have = [k for k in ALL if not k.startswith("native") or native.load() is not None]
    rows = [1, 2, 3, 4, 6, 8, 16, 32]
    choice = {c: [have[(i + j) % len(have)] for j in range(len(rows))] for i, c in enumerate(K.CLASSES)}
    pad_to = {c: [rows[min(j + (j % 2), len(rows) - 1)] for j in range(len(rows))] for c in K.CLASSES}
    target = LlamaTreeLM(target_model, max_len=256, kernels=_table(choice, rows, pad_to, shapes))
    assert_tree_policies_equal_greedy(target, target_model, draft_model)
    selfdraft = SpeculativeEngine(target=target, policy=chain(4), drafter=LMDrafter(LlamaTreeLM(target_model, max_len=256)))
    res = selfdraft.generate([3, 7, 11], max_new_tokens=30)
    assert res.tokens == hf_greedy(target_model, [3, 7, 11], 30) and res.tau > 1.5  # trees really were verified


def test_reference_kernel_without_a_table_is_f_linear():
    model = tiny_model(0).float()
    lm = LlamaTreeLM(model, max_len=8)
    assert all(mm.plan(m) == ("linear", m) for mm in lm.mm.values() for m in (1, 5, 64))
    w = lm.mm["o"].weights[0]
    assert w.w_t is None and w.packed is None  # no extra layouts without a table
    x = torch.randn(3, w.in_features)
    assert torch.equal(lm.mm["o"](0, x), F.linear(x, w.w))


def test_a_class_the_table_did_not_time_runs_the_reference_kernel():
    """A transformers-backend target's table holds no class; the draft head's matmuls on it are
    F.linear (`make gemma3-quick` stopped in collect_records on a KeyError here)."""
    empty = K.KernelTable(key={}, shapes={}, rows=[1], choice={}, pad_to={}, meta={"not_timed": "transformers backend"})
    w = torch.randn(6, 4)
    mm = K.Matmul("qkv", [w], empty)
    x = torch.randn(3, 4)
    assert mm.plan(3) == ("linear", 3) and torch.equal(mm(0, x), F.linear(x, w))


@needs_native
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the AVX2 variant is an x86-64 build")
def test_avx2_build_computes_the_product_batch_invariantly(tmp_path):
    """The AVX2 variant (the AMD EPYC machines' build) checked here by building it explicitly."""
    script = (
        "import torch; from ogspo.engine import native\n"
        "assert native.vector_width() == 8, native.vector_width()\n"
        "g = torch.Generator().manual_seed(0); w = torch.randn(1000, 300, generator=g); x = torch.randn(30, 300, generator=g)\n"
        "p = native.PackedWeight(w); y = p.matmul(x, 2)\n"
        "torch.testing.assert_close(y, (x.double() @ w.double().T).float(), atol=1e-3, rtol=1e-4)\n"
        "one = torch.cat([p.matmul(x[i:i + 1], 1) for i in range(30)])\n"
        "assert all(torch.equal(p.matmul(x[:m], 2), one[:m]) for m in range(1, 31))\n"
    )
    env = dict(os.environ, OGSPO_NATIVE_MARCH="x86-64-v3", OGSPO_CACHE=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_native_kernel_within_the_margin_of_the_fastest_is_kept():
    """Within the timing noise the batch-invariant kernel wins; beyond it, the fastest."""
    assert K._pick(["linear", "native2", "native1"], {"linear": 100.0, "native2": 102.0, "native1": 110.0}, 0.03) == "native2"
    assert K._pick(["linear", "native2"], {"linear": 100.0, "native2": 104.0}, 0.03) == "linear"
    assert K._pick(["linear", "matmul_t"], {"linear": 100.0, "matmul_t": 99.0}, 0.03) == "matmul_t"
    assert K._pick(["torch", "native2"], {"torch": 90.0, "native2": 92.0}, 0.03) == "native2"


needs_bf16 = pytest.mark.skipif(not native.bf16_available(), reason="no native bf16 kernel here (the CPU lacks avx512_bf16)")


@needs_bf16
@pytest.mark.parametrize("out_features,in_features", [(100, 576), (64, 32), (33, 7)])
def test_bf16_kernel_is_the_bf16_product_in_fp32_and_batch_invariant(out_features, in_features):
    """bf16 rows times bf16 weights summed in fp32 (odd `in` padded), fp32 out; a row's bits do not
    depend on how many rows share the call or on the thread count."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    x = torch.randn(30, in_features, generator=g)
    p = native.PackedWeight(w)
    y = p.matmul(x, 2)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, (x.bfloat16().double() @ w.double().T).float(), atol=1e-4, rtol=1e-5)
    one = torch.cat([p.matmul(x[i : i + 1], 1) for i in range(30)])
    assert all(torch.equal(p.matmul(x[:m], 2), one[:m]) for m in range(1, 31))


@needs_bf16
def test_bf16_calibration_refuses_a_kernel_that_is_not_batch_invariant(monkeypatch):
    """A kernel whose rows change with the row count (forced in as a candidate) is refused for bf16
    weights, so the table keeps the native kernel on every class and row count; for fp32 the same
    kernel is only timed."""
    apply = K.Weight.apply

    def skewed(self, kernel, x):
        if kernel != "skewed":
            return apply(self, kernel, x)
        y = native.PackedWeight(self.w).matmul(x, 1)
        return y * (1 + 1e-3 * (y.shape[0] > 1))  # rows among others come out different

    monkeypatch.setattr(K.Weight, "apply", skewed)
    g = torch.Generator().manual_seed(0)
    weights = {c: [torch.randn(48, 32, generator=g).bfloat16()] for c in K.CLASSES}
    table = K.calibrate_kernels(weights, rows=[1, 2, 4], reps=1, candidates=("skewed", "native1"), max_seconds=5)
    assert "not batch-invariant" in table.meta["unavailable"]["skewed"]
    assert all(k == "native1" for ks in table.choice.values() for k in ks)
    assert table.key["dtype"] == "bfloat16"
    fp32 = K.calibrate_kernels({c: [w.float() for w in ws] for c, ws in weights.items()}, rows=[1, 2], reps=1,
                               candidates=("skewed", "native1"), max_seconds=5)
    assert "skewed" not in fp32.meta["unavailable"]


@needs_bf16
def test_bf16_target_tree_decoding_equals_its_own_greedy_steps():
    """A bf16 tiny target (fp32 activations, bf16 matmuls on the native kernel, 1..32 rows): every
    tree policy's tokens equal one-token greedy steps of the same target, token for token."""
    from ogspo.engine.policies import Autoregressive

    target_model = tiny_model(0).to(torch.bfloat16)
    draft_model = tiny_model(1).float()
    shapes = {c: list(m.weights[0].w.shape) for c, m in LlamaTreeLM(target_model, max_len=8).mm.items()}
    rows = [1, 2, 3, 4, 6, 8, 16, 32]
    choice = {c: [("native1", "native2")[(i + j) % 2] for j in range(len(rows))] for i, c in enumerate(K.CLASSES)}
    table = K.KernelTable(key=K.device_key("cpu", torch.bfloat16), shapes=shapes, rows=rows, choice=choice,
                          pad_to={c: list(rows) for c in choice})
    target = LlamaTreeLM(target_model, max_len=256, kernels=table)
    assert target.cache.keys[0].dtype == torch.float32  # activations and cache stay fp32
    ar = SpeculativeEngine(target=target, policy=Autoregressive())
    for prompt in ([3, 7, 11], [9, 1, 4, 4, 20]):
        ref = ar.generate(prompt, max_new_tokens=30).tokens
        for policy in (chain(4), *tree_policies()):
            engine = SpeculativeEngine(target=target, policy=policy, drafter=LMDrafter(LlamaTreeLM(draft_model, max_len=256)))
            assert engine.generate(prompt, max_new_tokens=30).tokens == ref, policy.name
    selfdraft = SpeculativeEngine(target=target, policy=chain(4),
                                  drafter=LMDrafter(LlamaTreeLM(target_model, max_len=256, kernels=table)))
    res = selfdraft.generate([3, 7, 11], max_new_tokens=30)
    assert res.tokens == ar.generate([3, 7, 11], max_new_tokens=30).tokens and res.tau > 3  # trees really were verified


def tree_policies():
    from ogspo.engine.policies import DynamicTree, StaticTree
    from ogspo.engine.tree import Structure

    return [StaticTree(Structure([[0], [1], [0, 0], [1, 0], [0, 0, 0]])), DynamicTree(total_tokens=12, depth=4, top_k=3)]


def test_without_the_bf16_kernel_auto_is_fp32_and_bf16_runs_in_fp32(monkeypatch):
    """$OGSPO_NO_BF16 forces the no-bf16 path: `auto` prepares fp32 and a bf16 model loads as fp32."""
    from ogspo.engine.model import choose_dtype, runtime_dtype

    monkeypatch.setenv(native.NO_BF16, "1")
    assert not native.bf16_available()
    assert choose_dtype(tiny_model(0).float())["dtype"] == "float32"
    assert runtime_dtype("bfloat16", "cpu") == "float32" and runtime_dtype("float32", "cpu") == "float32"
    with pytest.raises(RuntimeError, match="native bf16 kernel unavailable"):
        native.PackedWeight(torch.zeros(4, 4, dtype=torch.bfloat16))


@needs_bf16
def test_auto_measures_and_picks_bf16_where_it_is_faster():
    from ogspo.engine.model import choose_dtype

    model = tiny_model(0, hidden=256, layers=2).float()
    c = choose_dtype(model)
    assert c["dtype"] == ("bfloat16" if c["bf16_ms"] < c["fp32_ms"] else "float32") and "ms" in c["why"]
    assert choose_dtype(model, device="cuda")["dtype"] == "float32"  # auto measures CPU kernels only
