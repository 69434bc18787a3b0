"""Named decoding methods and drafters, built over the engine (used by the CLI and later stages)."""

from __future__ import annotations

import json
from pathlib import Path

from ogspo.engine.drafters import LMDrafter, PromptLookupDrafter, TreeDrafter
from ogspo.engine.kernels import KernelTable
from ogspo.engine.policies import Autoregressive, DynamicTree, StaticTree, TreePolicy, chain
from ogspo.engine.target import LlamaTreeLM, TreeLM, build_tree_lm
from ogspo.engine.tree import Structure

METHODS = ("ar", "chain", "static", "eagle", "ogspo", "routing")
DRAFTERS = ("eagle", "lookup", "early-exit")


def load_structure(spec: str | Path | list) -> Structure:
    """A structure from a list of rank paths, a JSON string of one, or a JSON file holding one."""
    if isinstance(spec, (str, Path)):
        text = str(spec)
        if Path(text).is_file():
            text = Path(text).read_text()
        try:
            spec = json.loads(text)
        except json.JSONDecodeError:
            raise ValueError(f"structure {str(spec)[:60]!r} is neither a JSON list of rank paths nor a JSON file") from None
        if isinstance(spec, dict):
            spec = spec.get("structure", spec.get("paths"))
    if not isinstance(spec, list) or not all(isinstance(p, list) and all(isinstance(r, int) for r in p) for p in spec):
        raise ValueError("a structure is a JSON list of rank paths, e.g. [[0], [1], [0, 0]]")
    return Structure(spec)


def make_policy(
    method: str,
    *,
    k: int = 4,
    structure: str | Path | list | None = None,
    total_tokens: int = 60,
    depth: int = 5,
    top_k: int = 10,
    policy_path: str | Path | None = None,
    policy_device: str = "cpu",
    router_path: str | Path | None = None,
) -> TreePolicy:
    if method == "ar":
        return Autoregressive()
    if method == "chain":
        if k < 1:
            raise ValueError(f"chain needs k >= 1, got {k}")
        return chain(k)
    if method == "static":
        if structure is None:
            raise ValueError("method 'static' needs a structure (a JSON list of rank paths or a JSON file)")
        return StaticTree(load_structure(structure))
    if method == "eagle":
        return DynamicTree(total_tokens=total_tokens, depth=depth, top_k=top_k)
    if method == "ogspo":
        return make_ogspo(policy_path=policy_path, structure=structure, device=policy_device)
    if method == "routing":  # pre-drafting routing baseline: a template per cycle, chosen before drafting
        from ogspo.routing import make_routing

        return make_routing(router_path)
    raise ValueError(f"unknown method '{method}'; allowed: {', '.join(METHODS)}")


class OgspoTree(StaticTree):
    """OGSPO: the learned structure S drafted level by level, with the exported policy head (ONNX) as
    the stop hook evaluated after every level. `bind(target)` before decoding (the hook reads the
    committed context length from the target's cache)."""

    def __init__(self, structure: Structure, hook):
        super().__init__(structure, name="ogspo")
        self.hook = hook

    def bind(self, target: TreeLM) -> "OgspoTree":
        self.hook.bind(target)
        return self

    def draft(self, drafter, root, *, stop_hook=None):
        return super().draft(drafter, root, stop_hook=stop_hook if stop_hook is not None else self.hook)


def make_ogspo(*, policy_path: str | Path | None, structure: str | Path | list | None = None, device: str = "cpu") -> TreePolicy:
    """The `ogspo` method from a policy folder (policy.onnx + structure.json); `structure` overrides the
    folder's structure.json (it must equal the structure the policy was trained for)."""
    if policy_path is None:
        raise ValueError("method 'ogspo' needs a policy folder (--policy DIR with policy.onnx and structure.json)")
    from ogspo.export import load_policy_dir

    S, hook = load_policy_dir(Path(policy_path), device=device)
    if len(S) == 0:  # the oracle found drafting not worth it here: decode autoregressively
        ar = Autoregressive()
        ar.name = "ogspo"
        return ar
    if structure is not None:
        given = load_structure(structure)
        if given.paths != S.paths:
            raise ValueError(f"structure ({len(given)} nodes) differs from the one the policy in {policy_path} was trained for ({len(S)} nodes)")
    return OgspoTree(S, hook)


def make_drafter(
    name: str, *, target_model, max_len: int, early_exit_layers: int = 6, path: str | Path | None = None,
    target_checksum: str | None = None, kernels: KernelTable | None = None,
) -> TreeDrafter:
    """`eagle`: the trained EAGLE-3-style head in folder `path`; `lookup`: prompt lookup (n-gram);
    `early-exit`: the target's first layers + its LM head (with the device's kernel table)."""
    if name == "eagle":
        if path is None:
            raise ValueError("drafter 'eagle' needs the trained head's folder (--drafter-path)")
        from ogspo.drafter.runtime import EagleDrafter, load_head

        head, meta = load_head(Path(path), target_model=target_model, target_checksum=target_checksum)
        return EagleDrafter(head, max_len=max_len, drafter_id=f"eagle:{meta.get('id', Path(path).name)}")
    if name == "lookup":
        return PromptLookupDrafter()
    if name == "early-exit":
        return LMDrafter(LlamaTreeLM(target_model, max_len=max_len, n_layers=early_exit_layers, kernels=kernels))
    raise ValueError(f"unknown drafter '{name}'; allowed: {', '.join(DRAFTERS)}")


def make_target(
    hf_model, *, max_len: int, backend: str = "auto", drafter: TreeDrafter | None = None, kernels: KernelTable | None = None
) -> TreeLM:
    """The target for the engine, with the device's kernel table; it also returns the hidden states a
    feature-fed drafter needs."""
    layers = tuple(getattr(drafter, "feature_layers", ()) or ())
    return build_tree_lm(hf_model, backend=backend, max_len=max_len, feature_layers=layers, kernels=kernels)
