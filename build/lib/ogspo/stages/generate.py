"""`ogspo generate`: decode one prompt with a named method, streaming text as it is committed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ogspo.engine.decode import GenerationResult, SpeculativeEngine
from ogspo.methods.registry import make_drafter, make_policy, make_target
from ogspo.stages.model import load_target, model_checksum


@dataclass
class GenerateResult:
    method: str
    text: str
    generation: GenerationResult


def encode_prompt(tokenizer, prompt: str, *, chat: bool) -> list[int]:
    if not prompt.strip():
        raise ValueError("empty prompt: give some text")
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer(prompt).input_ids


def generate_text(
    *,
    model_dir: Path,
    prompt: str,
    method: str = "eagle",
    drafter: str = "lookup",
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    chat: bool = False,
    policy_args: dict | None = None,
    early_exit_layers: int = 6,
    drafter_path: Path | None = None,
    max_len: int = 4096,
    kernels=None,
    device: str = "cpu",
    dtype: str | None = None,
    stream: Callable[[str], None] | None = None,
) -> GenerateResult:


    policy = make_policy(method, **(policy_args or {}))  # validate before loading the model
    model, tokenizer = load_target(model_dir, dtype=dtype, device=device)
    ids = encode_prompt(tokenizer, prompt, chat=chat)
    draft = None
    if method != "ar":
        draft = make_drafter(drafter, target_model=model, max_len=max_len, early_exit_layers=early_exit_layers,
                             path=drafter_path, target_checksum=model_checksum(model_dir), kernels=kernels)
    target = make_target(model, max_len=max_len, drafter=draft, kernels=kernels)
    engine = SpeculativeEngine(
        target=target,
        policy=policy,
        drafter=draft,
        temperature=temperature,
        top_p=top_p,
        eos_token_id=tokenizer.eos_token_id,
    )
    shown = [""]
    tokens: list[int] = []

    def on_tokens(new: list[int]) -> None:
        tokens.extend(new)
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        if stream and text.startswith(shown[0]):
            stream(text[len(shown[0]) :])
            shown[0] = text

    res = engine.generate(ids, max_new_tokens=max_new_tokens, seed=seed, on_tokens=on_tokens)
    return GenerateResult(method=policy.name, text=tokenizer.decode(res.tokens, skip_special_tokens=True), generation=res)
