"""The run directory's metric log: one JSON object per step in ``metrics.jsonl``, optional TensorBoard."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

METRICS_FILE = "metrics.jsonl"


def _plain_number(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.detach().float().mean().item() if value.numel() else float("nan")
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible instead of dropping them
    return value


class MetricsLog:
    """Append-only metrics: ``metrics.jsonl`` always, TensorBoard when asked and installed."""

    def __init__(self, run_dir: Path, tensorboard: bool = False, resume_step: int | None = None) -> None:
        self.path = run_dir / METRICS_FILE
        if resume_step is not None:
            truncate_after(self.path, resume_step)
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise RuntimeError(
                    "tensorboard=true needs the tensorboard package: pip install 'mmrl[tensorboard]'"
                ) from err
            self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{k: _plain_number(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.writer is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, int | float):
                    self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
    return rows


def truncate_after(path: Path, step: int) -> None:
    """Drop rows logged after `step` (by a run killed past its last checkpoint) before resuming."""
    if not path.is_file():
        return
    kept = [row for row in read_metrics(path.parent) if row.get("step", 0) <= step]
    path.write_text("".join(json.dumps(row) + "\n" for row in kept))
