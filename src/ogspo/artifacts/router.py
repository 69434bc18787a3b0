"""router.json: a pre-drafting router (weights, normalisation, templates, feature names and version)
with its numpy inference; written by `train_routing`, read by the `routing` method."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ogspo import __version__
from ogspo.artifacts.io import write_text
from ogspo.engine.tree import Structure

ROUTER_FORMAT = "ogspo-router"


ROUTER_FEATURES_VERSION = 1


ROUTER_FEATURES: tuple[str, ...] = ("log_context", "recent_accept", "last_commit", "last_drafted", "last_full", "first_cycle")


ROUTER_FILE, REPORT_FILE = "router.json", "train.json"


@dataclass
class Router:
    """Plain data + numpy inference: scores = MLP((features - mean) / scale), one per template."""

    templates: list[Structure]
    mean: np.ndarray  # [F]
    scale: np.ndarray  # [F]
    layers: list[tuple[np.ndarray, np.ndarray]]  # (W [out, in], b [out]); ReLU between layers
    lam: float = 0.0
    feature_names: tuple[str, ...] = ROUTER_FEATURES
    meta: dict = field(default_factory=dict)

    def scores(self, features: np.ndarray) -> np.ndarray:
        h = (np.asarray(features, dtype=np.float64).reshape(-1, len(self.mean)) - self.mean) / self.scale  # [B, F]
        for i, (W, b) in enumerate(self.layers):
            h = h @ W.T + b
            if i < len(self.layers) - 1:
                h = np.maximum(h, 0.0)
        return h  # [B, K]

    def choose(self, features: np.ndarray) -> np.ndarray:
        """Template index per row (argmax score). [B]"""
        return np.argmax(self.scores(features), axis=1)

    def to_json(self) -> dict:

        return {
            "format": ROUTER_FORMAT, "features_version": ROUTER_FEATURES_VERSION, "feature_names": list(self.feature_names),
            "templates": [S.to_list() for S in self.templates], "template_names": [template_name(S) for S in self.templates],
            "mean": self.mean.tolist(), "scale": self.scale.tolist(),
            "layers": [{"weight": W.tolist(), "bias": b.tolist()} for W, b in self.layers],
            "lambda": self.lam, "ogspo_version": __version__, "meta": self.meta,
        }


def template_name(S: Structure) -> str:
    if len(S) == 0:
        return "ar"
    if S.paths == Structure.chain(len(S)).paths:
        return f"chain{len(S)}"
    return f"tree{len(S)}d{S.max_depth}"


def write_router(router: Router, path: Path) -> None:
    write_text(path, json.dumps(router.to_json(), indent=1) + "\n")


def load_router(path: str | Path) -> Router:
    """A router from router.json or the folder holding it; one-line errors for anything else."""
    path = Path(path)
    if path.is_dir():
        path = path / ROUTER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"router file {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"router file {path} is not JSON (expected a router.json written by train-routing)") from None
    if not isinstance(data, dict) or data.get("format") != ROUTER_FORMAT:
        raise ValueError(f"router file {path} is not a router written by train-routing (no \"format\": \"{ROUTER_FORMAT}\")")
    version, names = data.get("features_version"), tuple(data.get("feature_names") or ())
    if version != ROUTER_FEATURES_VERSION or names != ROUTER_FEATURES:
        raise ValueError(f"router file {path} uses features version {version} ({len(names)} features); this ogspo computes "
                         f"version {ROUTER_FEATURES_VERSION} ({len(ROUTER_FEATURES)} features): retrain the router")
    try:
        templates = [Structure(t) for t in data["templates"]]
        mean = np.asarray(data["mean"], dtype=np.float64)
        scale = np.asarray(data["scale"], dtype=np.float64)
        layers = [(np.asarray(l["weight"], dtype=np.float64), np.asarray(l["bias"], dtype=np.float64)) for l in data["layers"]]
        lam = float(data.get("lambda", 0.0))
    except ValueError as exc:
        raise ValueError(f"router file {path}: {' '.join(str(exc).split())}") from None
    except (KeyError, TypeError):
        raise ValueError(f"router file {path} lacks templates, mean, scale or layers (or they are malformed)") from None
    F, K = len(ROUTER_FEATURES), len(templates)
    dims = [F] + [W.shape[0] if W.ndim == 2 else -1 for W, _ in layers]
    ok = (K >= 1 and mean.shape == (F,) and scale.shape == (F,) and (scale > 0).all() and len(layers) >= 1
          and all(W.ndim == 2 and W.shape[1] == dims[i] and b.shape == (W.shape[0],) for i, (W, b) in enumerate(layers))
          and dims[-1] == K)
    if not ok:
        raise ValueError(f"router file {path}: weight shapes do not map {F} features to {K} template scores "
                         f"(layer sizes {dims}, mean {mean.shape}, scale {scale.shape})")
    return Router(templates=templates, mean=mean, scale=scale, layers=layers, lam=lam, meta=data.get("meta") or {})
