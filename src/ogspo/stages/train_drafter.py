"""Stage `train_drafter`: the EAGLE-3-style draft head for the prepared target (`drafter.train`)."""

from __future__ import annotations

from pathlib import Path

from ogspo.drafter.train import TrainResult, train_drafter
from ogspo.engine.kernels import read_kernel_table
from ogspo.engine.model import load_target, model_checksum


def run_train_drafter(*, model_dir: Path, workloads_dir: Path, out_dir: Path, work_dir: Path, fortunes_dir: Path | None,
                      config: dict, seed: int, device: str = "cpu", kernels_path: Path | None = None) -> TrainResult:
    """Load the prepared target on `device` and train its head there into `out_dir` (checkpoints in
    `work_dir`); the target writes and reads the head's data with the device's kernel table."""
    model, tokenizer = load_target(model_dir, device=device)
    kernels = None if kernels_path is None else read_kernel_table(kernels_path)
    return train_drafter(model=model, tokenizer=tokenizer, target_checksum=model_checksum(model_dir), workloads_dir=workloads_dir,
                         out_dir=out_dir, work_dir=work_dir, fortunes_dir=fortunes_dir, config=config, seed=seed, kernels=kernels)
