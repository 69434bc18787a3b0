"""Export of the OGSPO policy head to ONNX, and the runtime stop hook that runs it with onnxruntime.

The ONNX graph has one input ``features`` [batch, F] float32 (order = the metadata's feature names)
and one output ``advantage`` [batch] (stop when <= 0). Metadata props (all strings):
``ogspo_features_version``, ``ogspo_feature_names`` (JSON list), ``ogspo_structure`` (JSON list of
rank paths), ``ogspo_lambda``, ``ogspo_version``, plus any ``ogspo_*`` extras given.

A policy *folder* holds ``policy.onnx``, ``structure.json`` (``{"structure": [[0], [1], ...]}``) and
``export.json`` (what was exported from where). An empty structure (autoregressive decoding is best)
comes without ``policy.onnx``. `write_policy_folder` writes one; `run_export_policy` (stage
`export_policy`) writes one from a rounds folder's ``policy.pt`` + ``structure.json``.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ogspo.engine.tree import DraftTree, Structure
from ogspo.policy import FEATURE_NAMES, FEATURES_VERSION, RecentAccept, state_features

INPUT_NAME, OUTPUT_NAME = "features", "advantage"
OPSET = 17
POLICY_FILE, STRUCTURE_FILE, EXPORT_FILE = "policy.onnx", "structure.json", "export.json"


@dataclass
class ExportResult:
    path: Path
    n_features: int
    bytes: int
    seconds: float
    metadata: dict[str, str]


def export_policy(
    *,
    head,
    path: Path,
    feature_names: tuple[str, ...] | list[str] = FEATURE_NAMES,
    version: int = FEATURES_VERSION,
    structure: Structure | None = None,
    lam: float | None = None,
    extra: dict[str, str] | None = None,
) -> ExportResult:
    """Write `head` (features [B, F] -> advantage [B]) to ONNX at `path` (temp file + rename)."""
    import onnx
    import torch

    from ogspo import __version__

    t0 = time.perf_counter()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    F = len(feature_names)
    head = head.eval()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice (no onnxscript needed)
        torch.onnx.export(
            head, (torch.zeros(2, F),), str(tmp), dynamo=False, opset_version=OPSET, input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME], dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
        )
    meta = {
        "ogspo_features_version": str(int(version)),
        "ogspo_feature_names": json.dumps(list(feature_names)),
        "ogspo_structure": json.dumps(structure.to_list() if structure is not None else []),
        "ogspo_lambda": repr(float(lam)) if lam is not None else "",
        "ogspo_version": __version__,
        **{k if k.startswith("ogspo_") else f"ogspo_{k}": str(v) for k, v in (extra or {}).items()},
    }
    model = onnx.load(str(tmp))
    for k, v in meta.items():
        model.metadata_props.add(key=k, value=v)
    onnx.checker.check_model(model)
    onnx.save(model, str(tmp))
    os.replace(tmp, path)
    return ExportResult(path=path, n_features=F, bytes=path.stat().st_size, seconds=time.perf_counter() - t0, metadata=meta)


def write_structure(structure: Structure, path: Path) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"structure": structure.to_list()}) + "\n")
    os.replace(tmp, path)


def write_policy_folder(*, head, structure: Structure, lam: float | None, out_dir: Path, info: dict) -> ExportResult | None:
    """A policy folder: policy.onnx (not for an empty structure), structure.json and export.json
    (`info` plus the export's size and time). Returns the ONNX export, None for an empty structure."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    exp = None
    if len(structure) > 0:
        exp = export_policy(head=head, path=out_dir / POLICY_FILE, structure=structure, lam=lam,
                            extra={k: v for k, v in info.items() if isinstance(v, (str, int, float))})
    stale = out_dir / POLICY_FILE
    if exp is None and stale.exists():
        stale.unlink()
    write_structure(structure, out_dir / STRUCTURE_FILE)
    report = {
        **info, "autoregressive": len(structure) == 0, "structure": structure.to_list(), "lambda": lam,
        "features_version": FEATURES_VERSION, "feature_names": list(FEATURE_NAMES),
        "onnx_bytes": exp.bytes if exp else 0, "export_seconds": exp.seconds if exp else 0.0,
    }
    tmp = out_dir / f".{EXPORT_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp, out_dir / EXPORT_FILE)
    return exp


@dataclass
class ExportStageResult:
    out_dir: Path
    structure: Structure
    export: ExportResult | None  # None when the structure is empty (autoregressive)


def run_export_policy(*, rounds_dir: Path, out_dir: Path) -> ExportStageResult:
    """Stage `export_policy`: the final head of an OGSPO rounds folder (policy.pt + structure.json) as a
    policy folder that `load_policy_dir` / the `ogspo` method read."""
    from ogspo.methods import load_structure
    from ogspo.policy import HEAD_FILE, load_head

    rounds_dir = Path(rounds_dir)
    if not (rounds_dir / STRUCTURE_FILE).is_file():
        raise FileNotFoundError(f"rounds folder {rounds_dir} has no {STRUCTURE_FILE}")
    structure = load_structure(rounds_dir / STRUCTURE_FILE)
    head, meta = (None, {}) if len(structure) == 0 else load_head(rounds_dir / HEAD_FILE)
    if head is not None and meta["structure"] != structure.to_list():
        raise ValueError(f"rounds folder {rounds_dir}: {STRUCTURE_FILE} differs from the structure of {HEAD_FILE}")
    info = {"source": str(rounds_dir), **{k: meta[k] for k in ("round", "seed") if k in meta}}
    exp = write_policy_folder(head=head, structure=structure, lam=meta.get("lambda"), out_dir=out_dir, info=info)
    return ExportStageResult(out_dir=Path(out_dir), structure=structure, export=exp)


class OnnxPolicy:
    """The exported head under onnxruntime (session created once), usable as the engine's stop hook.

    As a hook it needs the committed context length: `bind(target)` (a TreeLM: reads target.cache.length)
    or `bind(context_length=callable)`. `recent_accept` is tracked from that length (`RecentAccept`);
    `reset()` starts a new request explicitly."""

    def __init__(self, path: Path, *, device: str = "cpu"):
        import onnxruntime as ort

        path = Path(path)
        if path.is_dir():
            path = path / POLICY_FILE
        if not path.is_file():
            raise FileNotFoundError(f"policy file {path} does not exist")
        providers = ["CPUExecutionProvider"]
        if device.startswith("cuda") and "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, "CUDAExecutionProvider")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        try:
            self.session = ort.InferenceSession(str(path), sess_options=opts, providers=providers)
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises several error types for bad files
            raise ValueError(f"policy file {path} is not a readable ONNX model ({exc.__class__.__name__})") from None
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
        self.providers = self.session.get_providers()
        self._context_length: Callable[[], int] | None = None
        depth = self.structure.max_depth if self.structure is not None else 64
        self.recent = RecentAccept(max_commit=depth + 1)
        self.calls = 0
        self.stops = 0

    def bind(self, target=None, *, context_length: Callable[[], int] | None = None) -> "OnnxPolicy":
        if context_length is None:
            if target is None:
                raise ValueError("bind needs a target (TreeLM) or a context_length callable")
            context_length = lambda: int(target.cache.length)  # noqa: E731
        self._context_length = context_length
        self.recent.reset()
        return self

    def reset(self) -> None:
        self.recent.reset()

    def advantage(self, features: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(np.asarray(features, dtype=np.float32).reshape(-1, len(FEATURE_NAMES)))  # [B, F]
        return self.session.run(None, {INPUT_NAME: x})[0]  # [B]

    def decide(self, features: np.ndarray) -> bool:
        """True = stop now (predicted advantage of continuing <= 0)."""
        return bool(self.advantage(features)[0] <= 0)

    def features(self, tree: DraftTree, level: int) -> np.ndarray:
        if self._context_length is None:
            raise ValueError("the ogspo stop policy is not bound to a target: call policy.bind(target) first")
        L = self._context_length()
        if level == 1:
            self.recent.update(L)
        return state_features(tree, level, context_length=L, recent_accept=self.recent.value)

    def __call__(self, tree: DraftTree, level: int) -> bool:
        stop = self.decide(self.features(tree, level))
        self.calls += 1
        self.stops += stop
        return stop


def load_policy_dir(path: Path, *, device: str = "cpu") -> tuple[Structure, "OnnxPolicy | None"]:
    """(structure, ONNX policy) of a policy folder; the two must agree. An empty structure (the
    oracle chose autoregressive decoding) comes without a policy."""
    from ogspo.methods import load_structure

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"policy folder {path} does not exist")
    if not (path / STRUCTURE_FILE).is_file():
        raise FileNotFoundError(f"policy folder {path} has no {STRUCTURE_FILE}")
    structure = load_structure(path / STRUCTURE_FILE)
    if len(structure) == 0:  # the oracle chose not to draft: no head was trained
        return structure, None
    policy = OnnxPolicy(path / POLICY_FILE, device=device)
    if policy.structure is not None and policy.structure.paths != structure.paths:
        raise ValueError(f"policy folder {path}: {STRUCTURE_FILE} differs from the structure the policy was trained for")
    return structure, policy


__all__ = [
    "ExportResult", "ExportStageResult", "OnnxPolicy", "export_policy", "load_policy_dir", "run_export_policy",
    "write_policy_folder", "write_structure",
]
