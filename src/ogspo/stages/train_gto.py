"""Stage `train_gto`: GTO fine-tuning of the `train_drafter` head (`drafter.gto`)."""

from __future__ import annotations

from pathlib import Path

from ogspo.drafter.train_gto import GTOResult, train_gto
from ogspo.engine.model import load_target, model_checksum


def run_train_gto(*, model_dir: Path, drafter_dir: Path, workloads_dir: Path, out_dir: Path,
                  fortunes_dir: Path | None, config: dict, seed: int, device: str = "cpu") -> GTOResult:
    """Load the prepared target on `device` and fine-tune the head in `drafter_dir` there into `out_dir`
    (the training data from train_drafter's data cache)."""
    model, tokenizer = load_target(model_dir, device=device)
    return train_gto(model=model, tokenizer=tokenizer, base_dir=drafter_dir, target_checksum=model_checksum(model_dir),
                     workloads_dir=workloads_dir, out_dir=out_dir, fortunes_dir=fortunes_dir, config=config,
                     seed=seed)
