"""The Python API: load a model with a drafter and a tree policy once, then generate or stream.

    import ogspo
    dec = ogspo.load(model="results/cpu/model", drafter="results/cpu/drafter", policy="results/cpu/ogspo/T0",
                     kernels="results/cpu/kernels/kernels.json")
    print(dec.generate("The capital of France is", max_new_tokens=32).text)
    for piece in dec.stream("def fib(n):", max_new_tokens=64, temperature=1.0, seed=3):
        print(piece, end="", flush=True)

`model`: a prepared model folder (`ogspo prepare-model`) or any local Hugging Face folder.
`drafter`: None (no drafting), "lookup", "early-exit", or the folder of a trained draft head
(`ogspo train-drafter`). `policy`: a method name (`method_names()`: "ar", "chain", "eagle", ...) or the
folder of an exported OGSPO policy (`ogspo export-policy`: the learned structure, stop policy and
size rule); default "eagle" (EAGLE-3's dynamic tree) with a drafter, "ar" without. Every method is
lossless: at temperature 0 the tokens are the model's greedy decoding, above it its sampling
distribution. The CLI's `ogspo generate` is a thin wrapper over this.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ogspo.artifacts.prompts import render_chat, render_raw
from ogspo.engine.decode import GenerationResult, SpeculativeEngine
from ogspo.engine.kernels import KernelTable, read_kernel_table
from ogspo.engine.model import load_target, model_checksum
from ogspo.methods.registry import DRAFTERS, make_drafter, make_policy, make_target, method_names


@dataclass
class Completion:
    text: str
    tokens: list[int]
    method: str
    generation: GenerationResult  # timings, cycles, tau


def encode_prompt(tokenizer, prompt: str, *, chat: bool) -> list[int]:
    """The one prompt tokeniser of the API and the CLI: raw text, or one user turn through the chat template."""
    if not prompt.strip():
        raise ValueError("empty prompt: give some text")
    text = render_chat(tokenizer, prompt) if chat else render_raw(tokenizer, prompt)
    return tokenizer(text, add_special_tokens=False).input_ids


class Decoder:
    """A loaded model, drafter and tree policy (see the module docstring); build it with `load`."""

    def __init__(self, *, model: str | Path, drafter: str | Path | None, policy: str | Path | None, device: str,
                 dtype: str | None, max_len: int, kernels: KernelTable | None, early_exit_layers: int, policy_args: dict):
        method, policy_args = _method(policy, drafter, policy_args)
        self.policy = make_policy(method, policy_device=device, **policy_args)  # validated before the model loads
        if self.policy.max_nodes > 1 and drafter is None:
            raise ValueError(f"policy '{self.policy.name}' drafts a tree and needs a drafter ({', '.join(DRAFTERS[1:])} or a "
                             "head folder)")
        self.model, self.tokenizer = load_target(Path(model), dtype=dtype, device=device)
        self.drafter = None
        if drafter is not None:
            name, path = (str(drafter), None) if str(drafter) in DRAFTERS else ("eagle", Path(drafter))
            self.drafter = make_drafter(name, target_model=self.model, max_len=max_len, early_exit_layers=early_exit_layers,
                                        path=path, target_checksum=model_checksum(Path(model)), kernels=kernels)
        self.target = make_target(self.model, max_len=max_len, drafter=self.drafter, kernels=kernels)

    @property
    def method(self) -> str:
        return self.policy.name

    def generate(self, prompt: str, max_new_tokens: int = 128, temperature: float = 0.0, *, top_p: float = 1.0,
                 seed: int = 0, chat: bool = False, on_text: Callable[[str], None] | None = None) -> Completion:
        """Complete `prompt` (`chat`: as a user turn through the chat template) with up to
        `max_new_tokens` tokens; `on_text` receives the text as it is committed, cycle by cycle."""
        ids = encode_prompt(self.tokenizer, prompt, chat=chat)
        engine = SpeculativeEngine(target=self.target, policy=self.policy, drafter=self.drafter, temperature=temperature,
                                   top_p=top_p, eos_token_id=self.tokenizer.eos_token_id)
        shown, tokens = [""], []

        def on_tokens(new: list[int]) -> None:
            tokens.extend(new)
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            if on_text is not None and text.startswith(shown[0]) and len(text) > len(shown[0]):
                on_text(text[len(shown[0]) :])
                shown[0] = text

        res = engine.generate(ids, max_new_tokens=max_new_tokens, seed=seed, on_tokens=on_tokens)
        return Completion(text=self.tokenizer.decode(res.tokens, skip_special_tokens=True), tokens=res.tokens,
                          method=self.method, generation=res)

    def stream(self, prompt: str, max_new_tokens: int = 128, temperature: float = 0.0, **kwargs) -> Iterator[str]:
        """`generate` as an iterator of text pieces (each cycle's committed text), decoding on a worker
        thread; an error in decoding is raised here. Arguments as for `generate`."""
        pieces: queue.Queue = queue.Queue()
        done = object()

        def work() -> None:
            try:
                self.generate(prompt, max_new_tokens, temperature, on_text=pieces.put, **kwargs)
                pieces.put(done)
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
                pieces.put(exc)

        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        while (item := pieces.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
        worker.join()


def _method(policy, drafter, policy_args: dict) -> tuple[str, dict]:
    """(method name, its arguments) from `load`'s `policy`: a method name, or an exported policy folder."""
    if policy is None:
        return ("eagle" if drafter is not None else "ar"), policy_args
    if str(policy) in method_names():
        return str(policy), policy_args
    path = Path(policy)
    if not path.is_dir():
        raise ValueError(f"unknown method '{policy}'; allowed: {', '.join(method_names())}, or an exported policy folder")
    return "ogspo", {**policy_args, "policy_path": path}


def load(model: str | Path, drafter: str | Path | None = None, policy: str | Path | None = None, *, device: str = "cpu",
         dtype: str | None = None, max_len: int = 4096, kernels: str | Path | KernelTable | None = None,
         early_exit_layers: int = 6, **policy_args) -> Decoder:
    """Load `model` with `drafter` and `policy` (see the module docstring) on `device` ("cpu",
    "cuda", "cuda:N"), in `dtype` (default: the dtype it was prepared in). `kernels`: the device's
    kernel table (`ogspo calibrate-kernels`, a path or a table) for the fast path; `policy_args`
    go to the method (`k` of chain; `total_tokens`, `depth`, `top_k` of eagle; `structure` of static;
    `workload` of an exported policy folder: what it ships for that workload, e.g. ogspo/T0's choice made
    on the device; without one, the folder's own structure and policy)."""
    table = read_kernel_table(kernels) if isinstance(kernels, (str, Path)) else kernels
    return Decoder(model=model, drafter=drafter, policy=policy, device=device, dtype=dtype, max_len=max_len, kernels=table,
                   early_exit_layers=early_exit_layers, policy_args=policy_args)
