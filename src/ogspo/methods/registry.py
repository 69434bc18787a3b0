"""Named decoding methods and drafters, built over the engine (used by the CLI and later stages)."""

from __future__ import annotations

from pathlib import Path

from ogspo.artifacts.structure import load_structure
from ogspo.drafter.runtime import EagleDrafter, load_head
from ogspo.engine.drafters import LMDrafter, PromptLookupDrafter, TreeDrafter
from ogspo.engine.kernels import KernelTable
from ogspo.engine.policies import Autoregressive, DynamicTree, StaticTree, TreePolicy, chain
from ogspo.engine.target import LlamaTreeLM, TreeLM, build_tree_lm, fast_path_refusal
from ogspo.methods.ogspo import make_ogspo
from ogspo.methods.routing import make_routing

# Decode-time methods (`make_policy`, `ogspo generate --method`).
METHODS = ("ar", "chain", "static", "eagle", "ogspo", "routing")
DRAFTERS = ("eagle", "lookup", "early-exit")


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
    name: str | None = None,
    workload: str | None = None,
) -> TreePolicy:
    """The tree policy of a decode-time method; `name` labels it in outputs (default: the method's own).
    `workload` (method ogspo): the request's workload, whose keep/drop choice in the policy folder's
    workloads.json is used (the policy, a static tree or autoregressive decoding)."""
    if method == "ar":
        return Autoregressive(name=name or "ar")
    if method == "chain":
        if k < 1:
            raise ValueError(f"chain needs k >= 1, got {k}")
        return chain(k)
    if method == "static":
        if structure is None:
            raise ValueError("method 'static' needs a structure (a JSON list of rank paths or a JSON file)")
        return StaticTree(load_structure(structure), name=name or "static")
    if method == "eagle":
        return DynamicTree(total_tokens=total_tokens, depth=depth, top_k=top_k, name=name)
    if method == "ogspo":
        return make_ogspo(policy_path=policy_path, structure=structure, device=policy_device, name=name or "ogspo",
                          workload=workload)
    if method == "routing":  # pre-drafting routing baseline: a template per cycle, chosen before drafting
        return make_routing(router_path, name=name or "routing")
    raise ValueError(f"unknown method '{method}'; allowed: {', '.join(METHODS)}")


def make_drafter(
    name: str, *, target_model, max_len: int, early_exit_layers: int = 6, path: str | Path | None = None,
    target_checksum: str | None = None, kernels: KernelTable | None = None,
) -> TreeDrafter:
    """`eagle`: the trained EAGLE-3-style head in folder `path`; `lookup`: prompt lookup (n-gram);
    `early-exit`: the target's first layers + its LM head (with the device's kernel table)."""
    if name == "eagle":
        if path is None:
            raise ValueError("drafter 'eagle' needs the trained head's folder (--drafter-path)")
        head, meta = load_head(Path(path), target_model=target_model, target_checksum=target_checksum)
        if head.lm_rows.device.type == "cpu":  # the head's matmuls on the measured kernels, in the target's dtype
            head.use_kernels(kernels, next(target_model.parameters()).dtype)
        return EagleDrafter(head, max_len=max_len, drafter_id=f"eagle:{meta['id']}")
    if name == "lookup":
        return PromptLookupDrafter()
    if name == "early-exit":
        refusal = fast_path_refusal(target_model.config)
        if refusal is not None:
            raise ValueError(f"drafter 'early-exit' runs on the fast path only, and this model cannot: {refusal}")
        return LMDrafter(LlamaTreeLM(target_model, max_len=max_len, n_layers=early_exit_layers, kernels=kernels))
    raise ValueError(f"unknown drafter '{name}'; allowed: {', '.join(DRAFTERS)}")


def make_target(
    hf_model, *, max_len: int, backend: str = "auto", drafter: TreeDrafter | None = None, kernels: KernelTable | None = None
) -> TreeLM:
    """The target for the engine, with the device's kernel table; it also returns the hidden states a
    feature-fed drafter needs."""
    layers = drafter.feature_layers if drafter is not None else ()
    return build_tree_lm(hf_model, backend=backend, max_len=max_len, feature_layers=layers, kernels=kernels)


# Method kinds of `evaluate.methods`; `chain` expands to one method per `evaluate.chains` entry.
EVAL_METHODS = (
    "ar", "ar-aa", "chain", "eagle-default", "eagle-tuned", "sequoia", "routing", "ogspo", "ogspo-structure", "ogspo-policy",
)


# Kinds that read an artifact; the path template holds `{T}` (the temperature tag, e.g. T0).
ARTIFACT_KINDS = ("eagle-tuned", "sequoia", "routing", "ogspo", "ogspo-structure", "ogspo-policy")


REFERENCE = "ar"


# The A/A check: autoregressive decoding again, as a method of its own; its ratio to `ar` must contain 1.00.
AA_CHECK = "ar-aa"


TUNED = "eagle-tuned"
