"""OGSPO at decode time: the exported policy head under onnxruntime as the engine's stop hook, over
the structure it was trained for, and the size rule (size.json, when the policy folder has one) that
chooses how many of the drafted nodes to verify (docs/DESIGN.md §5)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from ogspo.artifacts.policy_folder import EXPORT_FILE, INPUT_NAME, POLICY_FILE, WORKLOADS_FILE
from ogspo.artifacts.size_rule import SIZE_FILE, SizeRule, read_size_rule
from ogspo.artifacts.structure import STRUCTURE_FILE, load_structure
from ogspo.engine.policies import Autoregressive, CycleContext, Draft, StaticTree, TreePolicy
from ogspo.engine.tree import DraftTree, Structure, confidence_order
from ogspo.methods.features import FEATURE_NAMES, FEATURES_VERSION, RecentAccept, state_features


class OnnxPolicy:
    """The exported head under onnxruntime (session created once), usable as the engine's stop hook:
    `hook(tree, level, ctx)`. The context length comes from the engine's `CycleContext`, and the
    request's `History` is tracked from it cycle by cycle (`RecentAccept`)."""

    def __init__(self, path: Path, *, device: str = "cpu"):
        try:
            import onnxruntime as ort
        except ImportError:
            raise ImportError("the ogspo method runs its policy with onnxruntime: pip install 'ogspo[cpu]', or "
                              "'ogspo[gpu]' on CUDA machines (never both)") from None

        path = Path(path)
        if path.is_dir():
            path = path / POLICY_FILE
        if not path.is_file():
            raise FileNotFoundError(f"policy file {path} does not exist")
        candidates = ["CPUExecutionProvider"]
        if device.startswith("cuda") and "CUDAExecutionProvider" in ort.get_available_providers():
            candidates.append("CUDAExecutionProvider")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        try:
            sessions = {p: ort.InferenceSession(str(path), sess_options=opts, providers=[p]) for p in candidates}
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises several error types for bad files
            raise ValueError(f"policy file {path} is not a readable ONNX model ({exc.__class__.__name__})") from None
        self.session = sessions["CPUExecutionProvider"]
        self.path = path
        self.metadata: dict[str, str] = dict(self.session.get_modelmeta().custom_metadata_map)
        if "ogspo_features_version" not in self.metadata:
            raise ValueError(f"policy file {path} has no ogspo metadata (not written by export_policy)")
        version = int(self.metadata["ogspo_features_version"])
        names = tuple(json.loads(self.metadata["ogspo_feature_names"]))
        if version != FEATURES_VERSION or names != FEATURE_NAMES:
            raise ValueError(
                f"policy file {path} uses features version {version} ({len(names)} features); this ogspo computes "
                f"version {FEATURES_VERSION} ({len(FEATURE_NAMES)} features): retrain the policy"
            )
        inputs = self.session.get_inputs()
        if [i.name for i in inputs] != [INPUT_NAME] or inputs[0].shape[-1] != len(FEATURE_NAMES):
            raise ValueError(f"policy file {path} does not take one input '{INPUT_NAME}' [batch, {len(FEATURE_NAMES)}]")
        paths = json.loads(self.metadata.get("ogspo_structure", "[]"))
        self.structure = Structure(paths) if paths else None
        self.lam = float(self.metadata["ogspo_lambda"]) if self.metadata.get("ogspo_lambda") else None
        # the provider is chosen by measurement: for a head this small the CPU often beats a GPU launch
        self.provider_seconds = {p: _seconds_per_call(sess) for p, sess in sessions.items()} if len(sessions) > 1 else {}
        if self.provider_seconds:
            self.session = sessions[min(self.provider_seconds, key=self.provider_seconds.get)]
        self.providers = self.session.get_providers()
        self.recent = RecentAccept()
        self.calls = 0
        self.stops = 0

    def reset(self) -> None:
        self.recent.reset()

    def advantage(self, features: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(np.asarray(features, dtype=np.float32).reshape(-1, len(FEATURE_NAMES)))  # [B, F]
        return self.session.run(None, {INPUT_NAME: x})[0]  # [B]

    def decide(self, features: np.ndarray) -> bool:
        """True = stop now (predicted advantage of continuing <= 0)."""
        return bool(self.advantage(features)[0] <= 0)

    def features(self, tree: DraftTree, level: int, ctx: CycleContext) -> np.ndarray:
        """The state features after `level` (the first level of a cycle also updates the `History`). [F]"""
        if level == 1:
            self.recent.update(ctx)
        return state_features(tree, level, context_length=ctx.context_length, history=self.recent.value)

    def __call__(self, tree: DraftTree, level: int, ctx: CycleContext) -> bool:
        stop = self.decide(self.features(tree, level, ctx))
        self.calls += 1
        self.stops += stop
        return stop


def _seconds_per_call(session, calls: int = 200) -> float:
    """Median seconds of one single-state call of `session` (after a warm-up)."""
    x = np.zeros((1, len(FEATURE_NAMES)), dtype=np.float32)  # [1, F]
    for _ in range(20):
        session.run(None, {INPUT_NAME: x})
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        session.run(None, {INPUT_NAME: x})
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def load_policy_dir(path: Path, *, device: str = "cpu") -> tuple[Structure, "OnnxPolicy | None", SizeRule | None]:
    """(structure, ONNX policy, size rule or None) of a policy folder; the policy and the structure must
    agree. An empty structure (the oracle chose autoregressive decoding) comes without a policy, and so
    does a static tree the keep/drop rule shipped (export.json says "static": true)."""

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"policy folder {path} does not exist")
    if not (path / STRUCTURE_FILE).is_file():
        raise FileNotFoundError(f"policy folder {path} has no {STRUCTURE_FILE}")
    structure = load_structure(path / STRUCTURE_FILE)
    if len(structure) == 0:  # the oracle chose not to draft: no head was trained
        return structure, None, None
    if not (path / POLICY_FILE).is_file() and _is_static(path):  # the policy lost to a static tree: no head ships
        return structure, None, None
    policy = OnnxPolicy(path / POLICY_FILE, device=device)
    if policy.structure is not None and policy.structure.paths != structure.paths:
        raise ValueError(f"policy folder {path}: {STRUCTURE_FILE} differs from the structure the policy was trained for")
    size = read_size_rule(path / SIZE_FILE) if (path / SIZE_FILE).is_file() else None
    if size is not None and size.max_nodes < len(structure):
        raise ValueError(f"policy folder {path}: {SIZE_FILE} covers {size.max_nodes} nodes, the structure has {len(structure)}")
    return structure, policy, size


def _is_static(path: Path) -> bool:
    try:
        return json.loads((path / EXPORT_FILE).read_text()).get("static") is True
    except (OSError, json.JSONDecodeError):
        return False


class OgspoTree(StaticTree):
    """OGSPO: the learned structure S drafted level by level, with the exported policy head (ONNX) as
    the stop hook (`self.hook`) evaluated after every level; with a size rule, only the top-V drafted
    nodes by confidence are verified (V chosen by the rule, `artifacts.size_rule`)."""

    def __init__(self, structure: Structure, hook: OnnxPolicy, name: str = "ogspo", size_rule: SizeRule | None = None):
        super().__init__(structure, name=name)
        self.hook = hook
        self.size_rule = size_rule

    def begin(self, prompt: list[int]) -> None:
        self.hook.reset()

    def draft(self, drafter, root, ctx, *, stop_hook=None) -> Draft:
        draft = super().draft(drafter, root, ctx, stop_hook=stop_hook)
        if self.size_rule is None:
            return draft
        return Draft(drafted=draft.drafted, verified=select_size(self.size_rule, draft.drafted, ctx.context_length),
                     level_seconds=draft.level_seconds, stopped_early=draft.stopped_early)


def top_confidence_nodes(tree: DraftTree, V: int) -> np.ndarray:
    """Root plus the V most confident drafted nodes (`confidence_order`), in drafting order. [V + 1]"""
    order = confidence_order(tree.cum_logq, tree.depths)  # [n - 1]
    return np.sort(np.concatenate([[0], order[:V]])).astype(np.int64)


def select_size(rule: SizeRule, tree: DraftTree, context_length: int) -> np.ndarray:
    """Root plus the top-V drafted nodes by confidence, V chosen by the size rule; drafting order. [V + 1]"""
    cum = tree.cum_logq
    V = rule.choose(cum[confidence_order(cum, tree.depths)], context_length)
    return top_confidence_nodes(tree, V)


def workload_choice(path: Path, workload: str | None) -> dict | None:
    """The keep/drop rule's choice for `workload` in a policy folder's workloads.json (None: the folder's own)."""
    f = Path(path) / WORKLOADS_FILE
    if workload is None or not f.is_file():
        return None
    try:
        choice = json.loads(f.read_text()).get(workload)
    except (OSError, json.JSONDecodeError, AttributeError):
        raise ValueError(f"policy folder {path}: {WORKLOADS_FILE} is not a JSON object of workload choices") from None
    return choice


def make_ogspo(*, policy_path: str | Path | None, structure: str | Path | list | None = None, device: str = "cpu",
               name: str = "ogspo", workload: str | None = None) -> TreePolicy:
    """The `ogspo` method from a policy folder (policy.onnx + structure.json, and size.json when the size
    decision was kept); `structure` overrides the folder's structure.json (it must equal the structure the
    policy was trained for). With `workload`, the keep/drop rule's choice for it (workloads.json) wins:
    the policy, or a static tree (autoregressive decoding when empty)."""
    if policy_path is None:
        raise ValueError("method 'ogspo' needs a policy folder (--policy DIR with policy.onnx and structure.json)")
    choice = workload_choice(Path(policy_path), workload)
    if choice is not None and choice.get("shipped") != "policy":
        S = Structure([tuple(p) for p in choice.get("structure") or []])
        return StaticTree(S, name=name) if len(S) else Autoregressive(name=name)

    S, hook, size = load_policy_dir(Path(policy_path), device=device)
    if len(S) == 0:  # the oracle found drafting not worth it here: decode autoregressively
        return Autoregressive(name=name)
    if hook is None:  # the keep/drop rule shipped a static tree instead of the policy
        return StaticTree(S, name=name)
    if structure is not None:
        given = load_structure(structure)
        if given.paths != S.paths:
            raise ValueError(f"structure ({len(given)} nodes) differs from the one the policy in {policy_path} was trained for "
                             f"({len(S)} nodes)")
    return OgspoTree(S, hook, name=name, size_rule=size)


def make_ogspo_static(*, policy_path: str | Path | None, workload: str | None = None, name: str = "ogspo-static") -> TreePolicy:
    """The static tree `ogspo`'s stop policy replaces: per workload the keep/drop rule's fastest static
    tree on the record cycles (workloads.json's `static_structure`), which is what `ogspo` itself runs
    wherever no policy ships; without a per-workload choice, the folder's tree when it is static."""
    if policy_path is None:
        raise ValueError("method 'ogspo-static' needs a policy folder (policy.onnx and structure.json)")
    choice = workload_choice(Path(policy_path), workload)
    if choice is not None:
        paths = choice.get("static_structure")
        if paths is None and choice.get("shipped") != "policy":  # a folder written before `static_structure`
            paths = choice.get("structure")
        if paths is None:
            raise ValueError(f"policy folder {policy_path}: {WORKLOADS_FILE} names no static tree for workload '{workload}' "
                             "(rerun rule export_policy)")
        S = Structure([tuple(p) for p in paths])
    else:
        S, hook, _ = load_policy_dir(Path(policy_path), device="cpu")
        if hook is not None:
            raise ValueError(f"policy folder {policy_path} ships a stop policy and names no static tree it replaces "
                             f"(no {WORKLOADS_FILE}: rerun rule export_policy)")
    return StaticTree(S, name=name) if len(S) else Autoregressive(name=name)


def same_tree(a: TreePolicy, b: TreePolicy) -> bool:
    """Whether two policies draft the same fixed tree every cycle (both autoregressive, or static trees
    of the same paths with no stop hook): a method that equals another this way times nothing new."""
    if a.hook is not None or b.hook is not None:
        return False
    if isinstance(a, Autoregressive) and isinstance(b, Autoregressive):
        return True
    return type(a) is StaticTree and type(b) is StaticTree and a.structure.paths == b.structure.paths
