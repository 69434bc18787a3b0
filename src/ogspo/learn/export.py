"""Export of the OGSPO policy head to ONNX and a policy folder (run at decode time by `methods.ogspo`).

The ONNX graph has one input ``features`` [batch, F] float32 (order = the metadata's feature names)
and one output ``advantage`` [batch] (stop when <= 0). Metadata props (all strings):
``ogspo_features_version``, ``ogspo_feature_names`` (JSON list), ``ogspo_structure`` (JSON list of
rank paths), ``ogspo_lambda``, ``ogspo_version``, plus any ``ogspo_*`` extras given.

A policy *folder* holds ``policy.onnx``, ``structure.json`` (``{"structure": [[0], [1], ...]}``) and
``export.json`` (what was exported from where). An empty structure (autoregressive decoding is best)
comes without ``policy.onnx``, and so does a static tree the keep/drop rule shipped instead of the
policy (``export.json`` then says ``"static": true``). `write_policy_folder` writes one; `run_export_policy` (stage
`export_policy`) writes one from a rounds folder's ``policy.pt`` + ``structure.json``.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from ogspo import __version__
from ogspo.artifacts.io import write_text
from ogspo.artifacts.policy_folder import EXPORT_FILE, INPUT_NAME, OUTPUT_NAME, POLICY_FILE
from ogspo.artifacts.structure import STRUCTURE_FILE, write_structure
from ogspo.engine.tree import Structure
from ogspo.methods.features import FEATURE_NAMES, FEATURES_VERSION

OPSET = 17


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


def write_policy_folder(*, head, structure: Structure, lam: float | None, out_dir: Path, info: dict) -> ExportResult | None:
    """A policy folder: policy.onnx (when there is a head and a structure), structure.json and export.json
    (`info` plus the export's size and time). Returns the ONNX export, None without one. A non-empty
    structure without a head is a static tree and needs `info["static"]`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if head is None and len(structure) > 0 and not info.get("static"):
        raise ValueError("a policy folder with a structure needs a policy head (or info['static'] for a static tree)")
    exp = None
    if head is not None and len(structure) > 0:
        exp = export_policy(head=head, path=out_dir / POLICY_FILE, structure=structure, lam=lam,
                            extra={k: v for k, v in info.items() if isinstance(v, (str, int, float))})
    stale = out_dir / POLICY_FILE
    if exp is None and stale.exists():
        stale.unlink()
    write_structure(structure, out_dir / STRUCTURE_FILE)
    report = {
        **info, "autoregressive": len(structure) == 0, "static": bool(info.get("static")), "structure": structure.to_list(),
        "lambda": lam,
        "features_version": FEATURES_VERSION, "feature_names": list(FEATURE_NAMES),
        "onnx_bytes": exp.bytes if exp else 0, "export_seconds": exp.seconds if exp else 0.0,
    }
    write_text(out_dir / EXPORT_FILE, json.dumps(report, indent=1) + "\n")
    return exp
