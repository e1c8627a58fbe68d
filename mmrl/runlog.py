"""The run directory's metric log: one JSON object per step in ``metrics.jsonl``, optional TensorBoard."""

from __future__ import annotations

import json
import math
import platform
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from mmrl import __version__

METRICS_FILE = "metrics.jsonl"
LAUNCHES_FILE = "launches.jsonl"


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


def read_jsonl(path: Path) -> list[Any]:
    """The rows of a JSON-lines file ([] when it is absent); a line cut short by a kill is skipped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of a run directory's ``metrics.jsonl``, in the order they were logged."""
    return read_jsonl(run_dir / METRICS_FILE)


def truncate_after(path: Path, step: int) -> None:
    """Drop rows logged after `step` (by a run killed past its last checkpoint) before resuming."""
    if not path.is_file():
        return
    kept = [row for row in read_metrics(path.parent) if row.get("step", 0) <= step]
    path.write_text("".join(json.dumps(row) + "\n" for row in kept))


def record_launch(run_dir: Path, from_step: int, device: torch.device, processes: int) -> None:
    """Append this launch (a start or a resume) to ``launches.jsonl``: what the run was made with, which
    the numbers it logs depend on. Step seconds depend on the machine and the thread count, and on a
    CPU the thread count changes float rounding, so two runs compare exactly only when these agree."""
    record = {
        "from_step": from_step,
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": str(device),
        "processes": processes,
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "mmrl": __version__,
        "python": platform.python_version(),
    }
    with (run_dir / LAUNCHES_FILE).open("a") as f:
        f.write(json.dumps(record) + "\n")


def read_launches(run_dir: Path) -> list[dict[str, Any]]:
    """The launches recorded in a run directory, oldest first ([] for runs made before the file)."""
    return [row for row in read_jsonl(run_dir / LAUNCHES_FILE) if isinstance(row, dict)]
