"""Every tensor the engine and the torch stages create is on the device they were configured with.

While they run, a torch function mode watches the tensor factories: a factory called from ogspo's
code without an explicit `device=` fails the test, and so does `torch.from_numpy` (always a CPU
tensor, whatever the target's device). The models are built before. So passing here means ogspo
creates each tensor on a device it chose (the target's, or the CPU on purpose), which is what lets
the same code run a CUDA target (benchmarks/gpu_check.sh runs the engine there)."""

import contextlib
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from engine_helpers import make_head, tiny_model
from torch.overrides import TorchFunctionMode

import ogspo
from ogspo.drafter.data import annotate_text, generate_annotated, generate_batched
from ogspo.drafter.runtime import EagleDrafter
from ogspo.drafter.train import make_batch, ttt_loss
from ogspo.engine.decode import SpeculativeEngine
from ogspo.engine.drafters import LMDrafter
from ogspo.engine.policies import DynamicTree, StaticTree, chain
from ogspo.engine.target import LlamaTreeLM, build_tree_lm
from ogspo.engine.tree import Structure
from ogspo.methods.harness import SpeedProbe, make_method_engine, run_request
from ogspo.methods.registry import MethodSpec
from ogspo.stages.calibrate_latency import calibrate_latency
from ogspo.stages.collect_records import collect_records
from ogspo.stages.measure_drafter import time_expand

PROMPT = [5, 9, 13, 2, 7, 11]
PACKAGE = str(Path(ogspo.__file__).parent)
FACTORIES = {torch.tensor, torch.as_tensor, torch.arange, torch.ones, torch.zeros, torch.full, torch.empty, torch.eye,
             torch.rand, torch.randn, torch.randint, torch.linspace}
FROM_NUMPY = torch.from_numpy
SKIPPED = (str(Path(torch.__file__).parent), str(Path(mock.__file__)))


def _caller_in_ogspo() -> str | None:
    """`file:line` of the code that called the factory, if that is ogspo's (torch's own frames and
    unittest.mock's are skipped)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(SKIPPED):
        frame = frame.f_back
    if frame is not None and frame.f_code.co_filename.startswith(PACKAGE):
        return f"{frame.f_code.co_filename[len(PACKAGE) + 1:]}:{frame.f_lineno}"
    return None


class RequireDevice(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            where = _caller_in_ogspo()
            if where is not None:
                raise AssertionError(f"{where}: torch.{func.__name__} without device=")
        return func(*args, **kwargs)


def _from_numpy(array):
    where = _caller_in_ogspo()
    if where is not None:
        raise AssertionError(f"{where}: torch.from_numpy makes a CPU tensor whatever the device; use torch.as_tensor(x, "
                             "device=...)")
    return FROM_NUMPY(array)


@contextlib.contextmanager
def explicit_devices_only():
    with RequireDevice(), mock.patch.object(torch, "from_numpy", _from_numpy):
        yield


def _eagle_setup(max_len=128):
    model = tiny_model(0).float()
    head = make_head(model, draft_vocab=48)
    drafter = EagleDrafter(head, max_len=max_len)
    target = build_tree_lm(model, max_len=max_len, feature_layers=drafter.feature_layers)
    return model, target, drafter


def test_the_check_catches_a_tensor_without_a_device():
    """The check itself: a function of ogspo's that creates a tensor without naming a device fails it;
    the same call from elsewhere (here, this test) is not ogspo's to check."""
    scope: dict = {}
    exec(compile("import torch\ndef make():\n    return torch.zeros(2)\n", f"{PACKAGE}/unnamed_device.py", "exec"), scope)
    with explicit_devices_only():
        with pytest.raises(AssertionError, match="unnamed_device.py:3: torch.zeros without device="):
            scope["make"]()
        assert torch.zeros(2).device.type == "cpu"
        assert torch.zeros(2, device="cpu").device.type == "cpu"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_creates_every_tensor_on_the_target_device(temperature):
    model, target, eagle = _eagle_setup()
    lm_drafter = LMDrafter(LlamaTreeLM(tiny_model(0), max_len=128, n_layers=1))
    policies = [(chain(3), lm_drafter), (StaticTree(Structure.full([2, 2])), eagle),
                (DynamicTree(total_tokens=6, depth=3, top_k=2), eagle)]
    with explicit_devices_only():
        for policy, drafter in policies:
            engine = SpeculativeEngine(target=target, policy=policy, drafter=drafter, temperature=temperature)
            res = engine.generate(PROMPT, max_new_tokens=12, seed=3)
            assert len(res.tokens) == 12
            engine.cycle_from(PROMPT + res.tokens[:3], res.tokens[3], request_seed=3, index=4)


def test_stages_create_every_tensor_on_the_configured_device(tmp_path):
    model, target, drafter = _eagle_setup(max_len=256)
    with explicit_devices_only():
        cal = calibrate_latency(target=target, drafter=drafter, tree_sizes=[1, 4], context_lengths=[16, 32],
                                draft_widths=[1, 2], reps=1, warmup=0, seed=0, held_out_sizes=(), held_out_contexts=(),
                                fixed_tokens=4)
        collect_records(target=target, drafter=drafter, template=Structure.full([2, 1]), prompts=[PROMPT], temperature=1.0,
                        seed=0, max_new_tokens=6, out_dir=tmp_path / "records", shard_size=1, model_checksum="m" * 64,
                        drafter_id="eagle")
        me = make_method_engine(MethodSpec(name="eagle6-3-2", kind="eagle-default", tree=(6, 3, 2)),
                                DynamicTree(total_tokens=6, depth=3, top_k=2), target=target, drafter=drafter,
                                temperature=0.0)
        run_request(me, PROMPT, max_new_tokens=8, seed=1, latency=cal.model, speed=SpeedProbe())  # with the speed probe
        time_expand(drafter, PROMPT, target, widths=(1, 2), reps=1)


def test_drafter_training_creates_every_tensor_on_the_configured_device():
    model = tiny_model(3, vocab=64, layers=3).float()
    lm = build_tree_lm(model, max_len=40, feature_layers=(0, 1, 2))
    head = make_head(model, draft_vocab=48)
    t2d = torch.full((64,), -1, dtype=torch.long)
    t2d[head.d2t] = torch.arange(48)
    prompts = [[1, 2, 3], [5, 9, 9, 4, 2, 7]]
    with explicit_devices_only():
        seqs = generate_batched(lm, prompts, max_new_tokens=5, batch=2, top_k=4, eos_token_id=None, temperature=1.0, seed=1)
        seqs += generate_annotated(lm, prompts, max_new_tokens=5, pack=2, top_k=4, eos_token_id=None)
        seqs += annotate_text(lm, [[4, 5, 6, 7, 8, 9, 10, 11, 12, 13]], top_k=4, rows=4)
        windows = np.array([[i, 0] for i in range(len(seqs))])
        batch = make_batch(seqs, windows, t2d, 16, torch.device("cpu"))
        loss, _, _ = ttt_loss(head.train(), batch, 2, 0.7)
        loss.backward()
    assert all(s.feats.device.type == "cpu" for s in seqs)
