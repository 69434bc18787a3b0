"""The layers' non-matmul work (engine.layer_ops): torch ops and the native ops agree, the native
attention gives a token the same bits alone or inside any tree, and a target switching between
them by row count stays lossless."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_tree_policies_equal_greedy, tiny_model

from ogspo.engine import kernels as K
from ogspo.engine import native
from ogspo.engine.layer_ops import Step, TorchLayerOps, make_layer_ops
from ogspo.engine.target import LlamaTreeLM

pytestmark = pytest.mark.skipif(native.load() is None, reason=f"native kernel not built here: {native.unavailable_reason()}")
H, KV, HD, DIM, INTER, MAX_LEN = 6, 2, 32, 96, 80, 128


def _ops(name):
    return make_layer_ops(name, n_heads=H, kv_heads=KV, head_dim=HD, eps=1e-5)


def _tree(m: int, g: torch.Generator):
    """A random tree of m pending nodes (node 0 the root; a parent precedes its children): its
    ancestor mask [m, m] (self included) and depths."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, m)]
    attend = torch.zeros(m, m, dtype=torch.bool)
    depth = [0] * m
    for i in range(m):
        j = i
        while j >= 0:
            attend[i, j] = True
            j = parents[j]
        depth[i] = int(attend[i].sum()) - 1
    return attend, torch.tensor(depth), parents


def _caches(g, context):
    keys = torch.zeros(1, KV, MAX_LEN, HD)
    values = torch.zeros(1, KV, MAX_LEN, HD)
    keys[:, :, :context] = torch.randn(1, KV, context, HD, generator=g)
    values[:, :, :context] = torch.randn(1, KV, context, HD, generator=g)
    return keys, values


def _rope(g):
    return torch.randn(MAX_LEN, HD, generator=g), torch.randn(MAX_LEN, HD, generator=g)


@pytest.mark.parametrize("m", [1, 3, 8, 17])
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_ops_match_torch(m, with_bias):
    g = torch.Generator().manual_seed(m)
    context = 40
    attend, depth, _ = _tree(m, g)
    attend = None if m == 1 else attend
    cos, sin = _rope(g)
    mask = None if attend is None else torch.cat([torch.ones(m, context, dtype=torch.bool), attend], 1)[None, None]
    step = Step(positions=(context + depth)[None], start=context, committed=context, attend=attend, mask=mask, cos_table=cos,
                sin_table=sin)
    qkv = torch.randn(1, m, (H + 2 * KV) * HD, generator=g)
    bias = torch.randn((H + 2 * KV) * HD, generator=g) if with_bias else None
    x, r, w = torch.randn(1, m, DIM, generator=g), torch.randn(1, m, DIM, generator=g), torch.randn(DIM, generator=g)
    gu = torch.randn(1, m, 2 * INTER, generator=g)
    ref = TorchLayerOps(n_heads=H, kv_heads=KV, head_dim=HD, eps=1e-5)
    k_ref, v_ref = _caches(torch.Generator().manual_seed(0), context)
    o_ref = ref.rope_attention(qkv, bias, step, k_ref, v_ref)
    x_ref, h_ref = ref.add_rmsnorm(x, r, w)
    for name in ("native1", "native2"):
        ops = _ops(name)
        k, v = _caches(torch.Generator().manual_seed(0), context)
        torch.testing.assert_close(ops.rope_attention(qkv, bias, step, k, v), o_ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)  # the new rows' keys and values written
        torch.testing.assert_close(v, v_ref, atol=1e-6, rtol=1e-6)
        xn, hn = ops.add_rmsnorm(x.clone(), r, w)
        torch.testing.assert_close(xn, x_ref)
        torch.testing.assert_close(hn, h_ref, atol=1e-5, rtol=1e-5)
        xn, hn = ops.add_rmsnorm(x.clone(), None, w)  # no residual: the norm alone
        torch.testing.assert_close(hn, ref.add_rmsnorm(x, None, w)[1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ops.silu_mul(gu), ref.silu_mul(gu), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("context", [32, 33, 38])
def test_native_attention_gives_a_token_the_same_bits_alone_or_in_any_tree(context):
    """Verify a tree of 12 nodes at once; then, for every node, decode its root-to-node path one
    token at a time (the ancestors committed at contiguous rows, as after acceptance): the node's
    attention output is bitwise the same, on 1 or 2 threads. The contexts put a token's keys in the
    last, partial block of 8 keys alone and in a full block inside the tree."""
    g = torch.Generator().manual_seed(5)
    m = 12
    attend, depth, parents = _tree(m, g)
    cos, sin = _rope(g)
    qkv = torch.randn(1, m, (H + 2 * KV) * HD, generator=g)
    tree_step = Step(positions=(context + depth)[None], start=context, committed=context, attend=attend, mask=None, cos_table=cos,
                     sin_table=sin)
    for name in ("native1", "native2"):
        ops = _ops(name)
        k, v = _caches(torch.Generator().manual_seed(1), context)
        tree_out = ops.rope_attention(qkv, None, tree_step, k, v)[0]  # [m, H * hd]
        for node in range(m):
            path = []
            j = node
            while j >= 0:
                path.insert(0, j)
                j = parents[j]
            k, v = _caches(torch.Generator().manual_seed(1), context)
            for t, j in enumerate(path):
                one = Step(positions=torch.tensor([[context + t]]), start=context + t, committed=context + t, attend=None,
                           mask=None,
                           cos_table=cos, sin_table=sin)
                out = _ops("native1" if t % 2 else "native2").rope_attention(qkv[:, j : j + 1], None, one, k, v)[0, 0]
            assert torch.equal(out, tree_out[node]), (name, node)


def test_a_target_switching_layer_ops_by_row_count_is_lossless():
    """fp32 tiny target (head dim 16) whose table runs the native layer ops at some row counts and
    torch's at others: every tree policy equals transformers' greedy decoding token for token."""
    target_model = tiny_model(0, hidden=64, heads=4, kv_heads=2).float()
    draft_model = tiny_model(1, hidden=64, heads=4, kv_heads=2).float()
    lm = LlamaTreeLM(target_model, max_len=8)
    shapes = {c: list(m.weights[0].w.shape) for c, m in lm.mm.items()} | {K.LAYER_OPS: lm.layer_ops_shape}
    rows = [1, 2, 3, 4, 6, 8, 16]
    ops = ["native2", "torch", "native1", "native2", "torch", "native1", "native2"]
    choice = {c: ["linear"] * len(rows) for c in K.CLASSES} | {K.LAYER_OPS: ops}
    table = K.KernelTable(key=K.device_key("cpu", torch.float32), shapes=shapes, rows=rows, choice=choice,
                          pad_to={c: list(rows) for c in choice})
    target = LlamaTreeLM(target_model, max_len=256, kernels=table)
    assert target.layer_ops(1).name == "native2" and target.layer_ops(5).name == "torch"
    assert target.layer_ops(40).name == "native2"  # past the table: its last entry
    assert_tree_policies_equal_greedy(target, target_model, draft_model)


def test_calibration_times_the_layer_ops_for_tree_sizes_only():
    g = torch.Generator().manual_seed(3)
    weights = {"o": [torch.randn(64, 64, generator=g) for _ in range(2)]}
    shape = K.layer_ops_shape(n_heads=H, kv_heads=KV, head_dim=HD, dim=DIM, inter=INTER)
    rows = [1, 2, 4, 8, 128]
    t = K.calibrate_kernels(weights, rows=rows, reps=2, candidates=("linear", "native1", "native2"), max_seconds=30,
                            layer_ops={"shape": shape, "n_layers": 2, "eps": 1e-5, "context": 24, "max_rows": 8})
    assert set(t.timings_us[K.LAYER_OPS]) == {"torch", "native1", "native2"}
    assert all(len(v) == 4 for v in t.timings_us[K.LAYER_OPS].values())  # 1..8 rows timed, not the 128-row prefill
    assert t.choice[K.LAYER_OPS][-1] == "torch" and t.pad_to[K.LAYER_OPS] == rows  # past the timed rows: torch; never padded
    assert t.shapes[K.LAYER_OPS] == shape and t.meta["layer_ops_context"] == 24
    with pytest.raises(ValueError, match=r"layer ops of \[heads, kv heads, head dim, dim, intermediate\]"):
        t.check_shapes({K.LAYER_OPS: [3, *shape[1:]]})  # another head count
    doc = t.to_json()
    doc["choice"][K.LAYER_OPS][0] = "cuda"
    with pytest.raises(ValueError, match=r"unknown kernel\(s\) \['cuda'\] for 'layer_ops'; allowed: torch, native<threads>"):
        K.KernelTable.from_json(doc)


def test_native_ops_refuse_what_they_do_not_run():
    with pytest.raises(RuntimeError, match="head dimension that is a multiple of"):
        make_layer_ops("native1", n_heads=4, kv_heads=2, head_dim=native.vector_width() + 4, eps=1e-5)
    with pytest.raises(ValueError, match="unknown layer ops 'fast'; allowed: torch, native<threads>"):
        make_layer_ops("fast", n_heads=4, kv_heads=2, head_dim=16, eps=1e-5)
    ops = _ops("native1")
    step = Step(positions=torch.zeros(2, 1, dtype=torch.long), start=0, committed=0, attend=None, mask=None,
                cos_table=torch.zeros(4, HD), sin_table=torch.zeros(4, HD))
    with pytest.raises(ValueError, match="single-sequence"):
        ops.rope_attention(torch.zeros(2, 1, (H + 2 * KV) * HD), None, step, torch.zeros(2, KV, 4, HD), torch.zeros(2, KV, 4, HD))


def _one_line(info) -> str:
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_native_attention_refuses_rows_outside_the_cache_or_the_rotary_table():
    """What would read or write out of bounds in C is one clear error instead: rows past the
    cache, a committed prefix past the start, a position past the rotary table, a wrong mask shape,
    a non-contiguous or wrongly shaped cache, another dtype."""
    ops = _ops("native1")
    g = torch.Generator().manual_seed(0)
    cos, sin = _rope(g)
    keys, values = _caches(g, 8)

    def step(m, start, committed=None, positions=None, attend=None, table=(cos, sin)):
        pos = torch.arange(start, start + m)[None] if positions is None else positions
        return Step(positions=pos, start=start, committed=start if committed is None else committed, attend=attend,
                    mask=None, cos_table=table[0], sin_table=table[1])

    qkv = lambda m: torch.randn(1, m, (H + 2 * KV) * HD, generator=g)  # noqa: E731
    ok = ops.rope_attention(qkv(2), None, step(2, 8), keys, values)
    assert ok.shape == (1, 2, H * HD) and torch.isfinite(ok).all()
    cases = [
        (step(4, MAX_LEN - 2), keys, values, "do not fit the cache"),
        (step(2, 8, committed=10), keys, values, "do not fit the cache"),
        (step(2, 8, positions=torch.tensor([[8, MAX_LEN]])), keys, values, "outside the rotary table"),
        (step(2, 8, positions=torch.tensor([[8, -1]])), keys, values, "outside the rotary table"),
        (step(2, 8, committed=6, attend=torch.ones(2, 2, dtype=torch.bool)), keys, values, r"attend must be \[m, pending rows\]"),
        (step(2, 8, table=(cos[:, :8], sin[:, :8])), keys, values, "rotary tables must be contiguous"),
        (step(2, 8), keys.transpose(2, 3), values, "keys must be a contiguous"),
        (step(2, 8), keys, values[:, :1], "values must be a contiguous"),
        (step(2, 8), keys.double(), values, "fp32 CPU tensors: keys"),
    ]
    for st, k, v, match in cases:
        with pytest.raises(ValueError, match=match) as info:
            ops.rope_attention(qkv(st.m), None, st, k, v)
        _one_line(info)
    with pytest.raises(ValueError, match=r"qkv rows of 10") as info:
        ops.rope_attention(torch.zeros(1, 2, 10), None, step(2, 8), keys, values)
    _one_line(info)


def test_native_norm_activation_and_gemm_refuse_bad_shapes_and_take_zero_rows():
    ops = _ops("native1")
    x = torch.randn(1, 3, DIM)
    with pytest.raises(ValueError, match="do not match") as info:
        ops.add_rmsnorm(x, torch.randn(1, 2, DIM), torch.ones(DIM))
    _one_line(info)
    with pytest.raises(ValueError, match="do not match"):
        ops.add_rmsnorm(x, None, torch.ones(DIM + 1))
    with pytest.raises(ValueError, match="in place on a contiguous x"):
        ops.add_rmsnorm(torch.randn(1, DIM, 3).transpose(1, 2), None, torch.ones(DIM))
    with pytest.raises(ValueError, match="even width"):
        ops.silu_mul(torch.randn(1, 2, 2 * INTER + 1))
    with pytest.raises(ValueError, match="fp32 CPU tensors: gate/up"):
        ops.silu_mul(torch.randn(1, 2, 2 * INTER).half())
    w = native.PackedWeight(torch.randn(40, DIM))
    assert w.matmul(torch.zeros(0, DIM), threads=2).shape == (0, 40)  # m = 0: nothing to do (it divided by zero)
    assert w.matmul(torch.zeros(1, 0, DIM), threads=0).shape == (1, 0, 40)
    with pytest.raises(ValueError, match="fp32 CPU rows of 96") as info:
        w.matmul(torch.zeros(2, DIM + 1), threads=1)
    _one_line(info)
    with pytest.raises(ValueError, match="fp32 CPU rows"):
        w.matmul(torch.zeros(2, DIM, dtype=torch.float64), threads=1)


def test_the_native_library_shares_the_openmp_runtime_torch_loaded():
    """One libgomp in the process after the native library is loaded (two runtimes would each keep a
    thread pool spinning on the same cores)."""
    from pathlib import Path

    native.load()
    maps = Path("/proc/self/maps").read_text().splitlines()
    gomp = {line.split()[-1] for line in maps if Path(line.split()[-1]).name.startswith("libgomp")}
    assert len(gomp) <= 1, gomp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_one_call_layer_gives_the_layer_by_layer_bits(dtype):
    """With native kernels for every class and the native layer ops, each decoder layer runs as one
    native call (`decoder_layer`); its logits and features equal the layer-by-layer path's bit for
    bit (fp32 and bf16 weights), and the fp32 target still decodes exactly as transformers does."""
    if native.load() is None or (dtype == torch.bfloat16 and not native.bf16_available()):
        pytest.skip("native kernels (bf16: AVX512-BF16) not available here")
    target_model = tiny_model(0, hidden=64, heads=4, kv_heads=2).to(dtype)
    lm = LlamaTreeLM(target_model, max_len=8)
    shapes = {c: list(m.weights[0].w.shape) for c, m in lm.mm.items()} | {K.LAYER_OPS: lm.layer_ops_shape}
    rows = [1, 2, 4, 8, 16]
    choice = {c: ["native2", "native1", "native2", "native1",
                  "native2"] for c in K.CLASSES} | {K.LAYER_OPS: ["native2"] * len(rows)}
    table = K.KernelTable(key=K.device_key("cpu", dtype), shapes=shapes, rows=rows, choice=choice,
                          pad_to={c: list(rows) for c in choice})
    outs = {}
    for fused in (True, False):
        target = LlamaTreeLM(target_model, max_len=64, kernels=table, feature_layers=(0, 1))
        if not fused:
            target.fused_threads = lambda m, ops: None
        assert (target.fused_threads(3, target.layer_ops(3)) is not None) == fused
        target.prefill([3, 7, 11, 2])
        anc = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a root and two children
        out = target.forward(torch.tensor([5, 9, 1]), torch.tensor([4, 5, 5]), anc)
        outs[fused] = (out.logits, out.features)
    assert torch.equal(outs[True][0], outs[False][0]) and torch.equal(outs[True][1], outs[False][1])
    if dtype == torch.float32:
        draft_model = tiny_model(1, hidden=64, heads=4, kv_heads=2).float()
        assert_tree_policies_equal_greedy(LlamaTreeLM(target_model, max_len=256, kernels=table), target_model, draft_model)
