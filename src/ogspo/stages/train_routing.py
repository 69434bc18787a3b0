"""Stage `train_routing`: the pre-drafting router from records folders."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from ogspo.artifacts.io import write_text
from ogspo.artifacts.latency import LatencyModel
from ogspo.artifacts.records import load_records
from ogspo.artifacts.router import (
    REPORT_FILE,
    ROUTER_FEATURES,
    ROUTER_FEATURES_VERSION,
    ROUTER_FILE,
    template_name,
    write_router,
)
from ogspo.learn.routing import (
    RoutingTrainResult,
    check_templates,
    combine_routing,
    routing_data,
    routing_settings,
    train_router,
)


def run_train_routing(*, records_dirs: list[Path], latency_path: Path, config: dict | None, seed: int,
                      out_dir: Path) -> RoutingTrainResult:
    """Stage `train_routing`: writes `out_dir`/router.json and train.json (figures)."""

    if not records_dirs:
        raise ValueError("train-routing needs at least one records folder")
    cfg = routing_settings(config)
    recs = [load_records(Path(d)) for d in records_dirs]
    latency = LatencyModel.from_json(latency_path).at_temperature(recs[0].meta["temperature"])
    templates = check_templates(cfg["templates"], recs[0].template)
    for d, r in zip(records_dirs, recs):
        if r.template.paths != recs[0].template.paths:
            raise ValueError(f"records folder {d} was collected with another template than {records_dirs[0]}")
    data = combine_routing([routing_data(records=r, templates=templates, latency=latency) for r in recs])
    result = train_router(data=data, seed=seed, config=cfg)
    result.router.meta = {"seed": seed, "records": [str(d) for d in records_dirs]}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_router(result.router, out_dir / ROUTER_FILE)
    report = {
        "feature_names": list(ROUTER_FEATURES), "features_version": ROUTER_FEATURES_VERSION,
        "templates": [S.to_list() for S in templates], "template_names": [template_name(S) for S in templates],
        "lambda": result.router.lam, "lambdas": result.lambdas, "round_throughputs": result.round_throughputs,
        "train": asdict(result.train), "holdout": asdict(result.holdout) if result.holdout else None,
        "n_train_requests": result.n_train_requests, "n_holdout_requests": result.n_holdout_requests,
        "train_seconds": result.seconds, "settings": result.settings, "seed": seed,
        "records": [str(d) for d in records_dirs],
    }
    write_text(out_dir / REPORT_FILE, json.dumps(report, indent=1) + "\n")
    return result
