"""The decoding methods, one record each, and the drafters and target built over the engine.

A `Method` says how the method builds its tree policy (`build`, from the typed `PolicyArgs`), which
artifact of the workflow it reads and which rule writes it (`Artifact`), where its settings live in the
config and how the report names it. Everything else is derived from `METHOD_RECORDS`: `make_policy`
(`ogspo generate --method`, `ogspo.load`), the evaluation's method table (`method_specs`,
`build_policy`), the inputs of rule evaluate (`artifact_inputs`, rules/evaluate.smk) and the enum of
`evaluate.methods` in the config schema (`ogspo.stages.config.load_schema`). Adding a method is one
`Method` in `METHOD_RECORDS` plus the code of its policy.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ogspo.artifacts.records import temperature_tag
from ogspo.artifacts.structure import load_structure
from ogspo.drafter.runtime import EagleDrafter, load_head
from ogspo.engine.drafters import LMDrafter, PromptLookupDrafter, TreeDrafter
from ogspo.engine.kernels import KernelTable
from ogspo.engine.model import load_target, read_manifest
from ogspo.engine.policies import Autoregressive, DynamicTree, StaticTree, TreePolicy, chain
from ogspo.engine.target import LlamaTreeLM, TreeLM, build_tree_lm, fast_path_refusal
from ogspo.methods.ogspo import make_ogspo, make_ogspo_static
from ogspo.methods.routing import make_routing

DRAFTERS = ("eagle", "lookup", "early-exit")


@dataclass(frozen=True)
class PolicyArgs:
    """What a method's `build` receives; each method reads the fields it needs."""

    name: str | None = None  # the label in outputs (None: the method's own)
    k: int = 4  # chain length (chain)
    structure: str | Path | list | None = None  # rank paths, or a JSON file of them (static; ogspo's override)
    total_tokens: int = 60  # EAGLE-3's dynamic tree (eagle, eagle-default)
    depth: int = 5
    top_k: int = 10
    artifact: Path | None = None  # the file or folder the method reads (`Artifact.reads`)
    workload: str | None = None  # the request's workload (ogspo's keep/drop choice, eagle-tuned's winner)
    policy_device: str = "cpu"  # where an ONNX stop policy runs


@dataclass(frozen=True)
class Artifact:
    """What a method reads from a run's results folder (paths relative to results/{device}/, {T} = the
    temperature tag, e.g. T0)."""

    rule: str  # the rule that writes it
    output: str  # that rule's output: an input of rule evaluate
    reads: str  # the path the method is handed (the output, or a file inside it)


@dataclass(frozen=True)
class MethodSpec:
    """One evaluated method: its label in every output row, its kind (a `Method` name) and its settings."""

    name: str
    kind: str
    k: int = 0  # chain length (kind chain)
    tree: tuple[int, int, int] = (0, 0, 0)  # total_tokens, depth, top_k (kind eagle-default)


@dataclass(frozen=True)
class Method:
    name: str
    label: str  # how the report names it
    build: Callable[[PolicyArgs], TreePolicy]
    artifact: Artifact | None = None
    config: str | None = None  # its settings in the config, as a dotted key
    evaluate: bool = True  # a kind of `evaluate.methods`
    specs: Callable[[str, Mapping], list[MethodSpec]] | None = None  # evaluate's rows from the evaluate section (default: one)
    same_as: str | None = None  # evaluate skips it in a cell where it drafts the same fixed tree as this method


def structure_policy(path: str | Path, name: str) -> TreePolicy:
    """A static tree from a structure.json (autoregressive decoding for an empty one)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"method '{name}': structure file {path} does not exist")
    structure = load_structure(path)
    if len(structure) == 0:  # the solver found drafting not worth it: decode autoregressively
        return Autoregressive(name=name)
    return StaticTree(structure, name=name)


def read_tuned(path: Path) -> dict[str, tuple[int, int, int]]:
    """Winners of a tune_eagle JSON: workload -> (total_tokens, depth, top_k)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"method 'eagle-tuned': tuning file {path} does not exist (rule tune_eagle)")
    data = json.loads(path.read_text())
    winners = data.get("winners") if isinstance(data, dict) else None
    if not isinstance(winners, dict):
        raise ValueError(f"{path}: not a tune_eagle output (no 'winners' object)")
    return {w: tuple(int(x) for x in v) for w, v in winners.items()}


def _needs(a: PolicyArgs, method: str, what: str) -> Path:
    if a.artifact is None:
        raise ValueError(f"method '{method}' needs {what}")
    return Path(a.artifact)


def _chain(a: PolicyArgs) -> TreePolicy:
    if a.k < 1:
        raise ValueError(f"chain needs k >= 1, got {a.k}")
    return chain(a.k)


def _static(a: PolicyArgs) -> TreePolicy:
    if a.structure is None:
        raise ValueError("method 'static' needs a structure (a JSON list of rank paths or a JSON file)")
    return StaticTree(load_structure(a.structure), name=a.name or "static")


def _eagle_tuned(a: PolicyArgs) -> TreePolicy:
    path = _needs(a, "eagle-tuned", "its tuning file (rule tune_eagle)")
    winners = read_tuned(path)
    if a.workload not in winners:
        raise ValueError(f"{path} has no tuned EAGLE-3 tree for workload '{a.workload}' (has {', '.join(sorted(winners))})")
    total, depth, top_k = winners[a.workload]
    if total == 0:  # "do not speculate" won the tuning
        return Autoregressive(name=a.name or "eagle-tuned")
    return DynamicTree(total_tokens=total, depth=depth, top_k=top_k, name=a.name or "eagle-tuned")


def _chain_specs(kind: str, ev: Mapping) -> list[MethodSpec]:
    if not ev.get("chains"):
        raise ValueError("evaluate.methods has 'chain' but evaluate.chains is empty; give chain lengths, e.g. [4]")
    return [MethodSpec(name=f"chain{k}", kind=kind, k=int(k)) for k in ev["chains"]]


def _eagle_default_specs(kind: str, ev: Mapping) -> list[MethodSpec]:
    return [MethodSpec(name=kind, kind=kind, tree=tuple(int(x) for x in ev.get("eagle_default", (60, 5, 10))))]


METHOD_RECORDS: dict[str, Method] = {m.name: m for m in (
    Method("ar", "autoregressive decoding (the reference)", lambda a: Autoregressive(name=a.name or "ar")),
    Method("ar-aa", "autoregressive decoding again (the A/A check)", lambda a: Autoregressive(name=a.name or "ar-aa")),
    Method("chain", "a chain of k drafted tokens", _chain, config="evaluate.chains", specs=_chain_specs),
    Method("static", "a static tree given as rank paths", _static, evaluate=False),
    Method("eagle", "EAGLE-3's dynamic tree", lambda a: DynamicTree(total_tokens=a.total_tokens, depth=a.depth, top_k=a.top_k,
                                                                   name=a.name), evaluate=False),
    Method("eagle-default", "EAGLE-3's dynamic tree at its default settings",
           lambda a: DynamicTree(total_tokens=a.total_tokens, depth=a.depth, top_k=a.top_k, name=a.name or "eagle-default"),
           config="evaluate.eagle_default", specs=_eagle_default_specs),
    Method("eagle-tuned", "EAGLE-3's dynamic tree tuned per workload", _eagle_tuned, config="evaluate.eagle_grid",
           artifact=Artifact("tune_eagle", "evaluate/tune_{T}.json", "evaluate/tune_{T}.json")),
    Method("sequoia", "Sequoia's static tree",
           lambda a: structure_policy(_needs(a, "sequoia", "its structure.json"), a.name or "sequoia"),
           config="baselines.sequoia", artifact=Artifact("build_sequoia", "sequoia/{T}", "sequoia/{T}/structure.json")),
    Method("routing", "pre-drafting routing among templates",
           lambda a: make_routing(a.artifact, name=a.name or "routing"),
           config="baselines.routing", artifact=Artifact("train_routing", "routing/{T}", "routing/{T}/router.json")),
    Method("ogspo", "OGSPO: the learned structure and stop policy, kept or dropped per workload, chosen on the device",
           lambda a: make_ogspo(policy_path=a.artifact, structure=a.structure, device=a.policy_device, name=a.name or "ogspo",
                                workload=a.workload),
           config="on_device", artifact=Artifact("choose_on_device", "ogspo/{T}", "ogspo/{T}")),
    Method("ogspo-static", "the static tree OGSPO's stop policy replaces (where no policy ships: ogspo's own, not run)",
           lambda a: make_ogspo_static(policy_path=a.artifact, workload=a.workload, name=a.name or "ogspo-static"),
           config="rounds", artifact=Artifact("export_policy", "policy/{T}", "policy/{T}"), same_as="ogspo"),
    Method("ogspo-structure", "OGSPO's structure as a static tree (ablation)",
           lambda a: structure_policy(_needs(a, "ogspo-structure", "its structure.json"), a.name or "ogspo-structure"),
           config="solve", artifact=Artifact("export_policy", "policy/{T}", "policy/{T}/structure.json")),
    Method("ogspo-policy", "OGSPO's stop policy on the records' full template (ablation)",
           lambda a: make_ogspo(policy_path=a.artifact, device=a.policy_device, name=a.name or "ogspo-policy"),
           config="policy", artifact=Artifact("train_policy_only", "ablation/policy_only/{T}", "ablation/policy_only/{T}")),
)}

REFERENCE = "ar"  # the reference of every speedup and of the lossless check
AA_CHECK = "ar-aa"  # autoregressive decoding again, as a method of its own: its ratio to `ar` must contain 1.00
TUNED = "eagle-tuned"
OGSPO_STATIC = "ogspo-static"  # the static tree ogspo's stop policy replaces: what the policy must beat


def method_names() -> tuple[str, ...]:
    """Every method `make_policy` builds (`ogspo generate --method`)."""
    return tuple(METHOD_RECORDS)


def evaluate_kinds() -> tuple[str, ...]:
    """The method kinds of `evaluate.methods` (the config schema's enum)."""
    return tuple(m.name for m in METHOD_RECORDS.values() if m.evaluate)


def artifact_kinds() -> tuple[str, ...]:
    """The evaluated kinds that read an artifact of the workflow."""
    return tuple(m.name for m in METHOD_RECORDS.values() if m.evaluate and m.artifact is not None)


def artifact_inputs(methods: list[str], results: str) -> dict[str, tuple[str, str]]:
    """Per evaluated kind of `methods` that reads an artifact: (the rule output evaluate waits for, the
    path handed to `ogspo evaluate --artifact`), both under `results` with {T} (rules/evaluate.smk)."""
    return {m: (f"{results}/{METHOD_RECORDS[m].artifact.output}", f"{results}/{METHOD_RECORDS[m].artifact.reads}")
            for m in methods if m in artifact_kinds()}


def method_label(name: str) -> str:
    """How the report names an evaluated method's row (`chain4`: a chain of 4 drafted tokens)."""
    if name in METHOD_RECORDS:
        return METHOD_RECORDS[name].label
    if name.startswith("chain") and name[5:].isdigit():
        return f"a chain of {name[5:]} drafted tokens"
    return name


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
    artifact: str | Path | None = None,
    name: str | None = None,
    workload: str | None = None,
) -> TreePolicy:
    """The tree policy of a method; `name` labels it in outputs (default: the method's own). The file or
    folder a method reads is `artifact`; `policy_path` (ogspo: the policy folder) and `router_path`
    (routing: router.json or its folder) are its names for those two. `workload` (method ogspo): the
    request's workload, whose keep/drop choice in the policy folder's workloads.json is used."""
    if method not in METHOD_RECORDS:
        raise ValueError(f"unknown method '{method}'; allowed: {', '.join(METHOD_RECORDS)}")
    given = artifact or policy_path or router_path
    args = PolicyArgs(name=name, k=k, structure=structure, total_tokens=total_tokens, depth=depth, top_k=top_k,
                      artifact=None if given is None else Path(given), workload=workload, policy_device=policy_device)
    return METHOD_RECORDS[method].build(args)


def method_specs(methods: list[str], settings: Mapping | None = None, **more) -> list[MethodSpec]:
    """The evaluated methods in config order, from `evaluate.methods` and the evaluate section's settings
    (`settings` and keywords: chains, eagle_default, ...); the autoregressive target is required (reference)."""
    ev = {**(settings or {}), **more}
    kinds = evaluate_kinds()
    unknown = [m for m in methods if m not in kinds]
    if unknown:
        raise ValueError(f"evaluate.methods: unknown method '{unknown[0]}'; allowed: {', '.join(kinds)}")
    if len(set(methods)) != len(methods):
        raise ValueError(f"evaluate.methods lists a method twice: {methods}")
    if REFERENCE not in methods:
        raise ValueError("evaluate.methods must include 'ar' (the reference of speedups and of the lossless check)")
    specs = []
    for m in methods:
        record = METHOD_RECORDS[m]
        specs += record.specs(m, ev) if record.specs is not None else [MethodSpec(name=m, kind=m)]
    return specs


def build_policy(
    spec: MethodSpec, *, temperature: float, workload: str, artifacts: Mapping[str, str], policy_device: str = "cpu"
) -> TreePolicy:
    """The tree policy of one evaluated method at one temperature and workload; artifact paths are
    templates with `{T}` (temperature tag)."""
    record = METHOD_RECORDS[spec.kind]
    path = None
    if record.artifact is not None:
        if spec.kind not in artifacts:
            raise ValueError(f"method '{spec.name}' needs its artifact path (--artifact {spec.kind}=PATH with {{T}})")
        path = Path(artifacts[spec.kind].format(T=temperature_tag(temperature)))
    total, depth, top_k = spec.tree
    args = PolicyArgs(name=spec.name, k=spec.k, total_tokens=total, depth=depth, top_k=top_k, artifact=path,
                      workload=workload, policy_device=policy_device)
    return record.build(args)


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


@dataclass(frozen=True)
class LoadedEngine:
    """A prepared target with its drafter, as the stages that decode need them."""

    target: TreeLM
    drafter: TreeDrafter
    tokenizer: object
    model_checksum: str
    drafter_id: str  # the drafter's own id, or its spec (and folder name)


def load_engine(model_dir: str | Path, *, drafter: str, drafter_path: str | Path | None = None, max_len: int = 2048,
                kernels: KernelTable | None = None, device: str = "cpu") -> LoadedEngine:
    """Load a prepared model folder on `device` in the dtype it was prepared in, with drafter `drafter`
    (`make_drafter`; a trained head's folder as `drafter_path`) and the device's kernel table."""
    checksum = read_manifest(model_dir)["checksum_sha256"]
    model, tokenizer = load_target(model_dir, device=device)
    extra = {} if drafter_path is None else {"path": drafter_path, "target_checksum": checksum}
    built = make_drafter(drafter, target_model=model, max_len=max_len, kernels=kernels, **extra)
    drafter_id = built.drafter_id or (drafter if drafter_path is None else f"{drafter}:{Path(drafter_path).resolve().name}")
    target = make_target(model, max_len=max_len, drafter=built, kernels=kernels)
    return LoadedEngine(target=target, drafter=built, tokenizer=tokenizer, model_checksum=checksum, drafter_id=drafter_id)
