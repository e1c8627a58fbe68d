"""The run directory's records: one JSON object per step in ``metrics.jsonl``, optional TensorBoard,
``launches.jsonl``, strict JSON files (`write_json`) and the lock that keeps one run per directory
(`lock_run_dir`); and reading them back for reports and comparisons (`check_run_dir`,
`read_metric_rows`, `metric_number`)."""

from __future__ import annotations

import fcntl
import json
import math
import os
import platform
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from mmrl import __version__
from mmrl.checkpoint import replace_text
from mmrl.config import ConfigError
from mmrl.tracking import Tracker, is_media

METRICS_FILE = "metrics.jsonl"
LAUNCHES_FILE = "launches.jsonl"
LOCK_FILE = ".lock"


def _plain_number(value: Any) -> Any:
    """A metric as JSON data: tensors as their mean, NaN and infinities as the strings "nan", "inf" and
    "-inf" (JSON has neither; the string keeps them visible instead of dropping them), nested values
    alike, numpy scalars as numbers."""
    if isinstance(value, torch.Tensor):
        value = value.detach().float().mean().item() if value.numel() else float("nan")
    value = _plain_data(value)
    if isinstance(value, dict):
        return {str(k): _plain_number(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain_number(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _plain_data(value: Any) -> Any:
    """A numpy value or a tensor as Python numbers (one, or nested lists); anything else as it is."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    return value


def strict_json(value: Any, non_finite: dict[str, str] | None = None, key: str = "") -> Any:
    """`value` as strict JSON data: each NaN or infinity (which Python's json writes as a bare ``NaN``
    or ``Infinity`` that other readers reject) becomes null, with its dotted key and what it was added
    to `non_finite`; tuples become lists, numpy values and tensors numbers or lists of them."""
    value = _plain_data(value)
    if isinstance(value, dict):
        return {str(k): strict_json(v, non_finite, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(v, non_finite, f"{key}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, float) and not math.isfinite(value):
        if non_finite is not None:
            non_finite[key] = str(value)
        return None
    return value


def write_json(path: Path, value: Any, indent: int | None = 1) -> dict[str, str]:
    """Write `value` to `path` as strict JSON (see `strict_json`) through a temporary sibling renamed
    into place, so that a reader never meets half a file; return the keys whose numbers were not
    finite (written as null) with what they were."""
    non_finite: dict[str, str] = {}
    replace_text(path, json.dumps(strict_json(value, non_finite), indent=indent, allow_nan=False))
    return non_finite


MEDIA_DIRS = ("samples", "videos")  # where trainers write the images and videos of their rollouts


class MetricsLog:
    """Append-only metrics: ``metrics.jsonl`` always, and the `trackers` (`mmrl.tracking`)."""

    def __init__(
        self, run_dir: Path, trackers: Sequence[Tracker] = (), resume_step: int | None = None
    ) -> None:
        self.path = run_dir / METRICS_FILE
        if resume_step is not None:
            truncate_after(self.path, resume_step)
        self.trackers = list(trackers)
        self.media_trackers = [tracker for tracker in self.trackers if tracker.takes_media]
        # watched only for a tracker that takes them; a resumed run's earlier samples were logged
        self.media_dirs = [run_dir / name for name in MEDIA_DIRS] if self.media_trackers else []
        self.samples_seen = set(self.sample_files())

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{str(k): _plain_number(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row, allow_nan=False) + "\n")
        numbers = {k: v for k, v in row.items() if k != "step" and isinstance(v, int | float)}
        for tracker in self.trackers:
            tracker.log(step, numbers)
        self.log_samples(step)

    def log_eval(self, when: str, step: int, metrics: dict[str, Any]) -> None:
        """A held-out evaluation (`when`: before, after) to the trackers."""
        numbers = {k: v for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        for tracker in self.trackers:
            tracker.log_eval(when, step, numbers)
        self.log_samples(step)

    def sample_files(self) -> list[Path]:
        found = [path for folder in self.media_dirs if folder.is_dir() for path in folder.rglob("*")]
        return sorted(path for path in found if path.is_file() and is_media(path))

    def log_samples(self, step: int) -> None:
        """The images and videos written to ``samples/`` and ``videos/`` since the last call, to the
        trackers."""
        new = [path for path in self.sample_files() if path not in self.samples_seen]
        self.samples_seen.update(new)
        if new:
            for tracker in self.media_trackers:
                tracker.log_media(step, new)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


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


def metric_number(value: Any) -> float | None:
    """A metric value as a float; the strings runlog writes for NaN/inf count, other values do not."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
        return float(value)
    return None


def read_metric_rows(run: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl ([] without one), refusing a row whose step is not a number
    (ConfigError naming the file and the row): no curve could place it, and runs never log one."""
    rows = read_metrics(run)
    for index, row in enumerate(rows, 1):
        step = row.get("step", 0) if isinstance(row, dict) else 0
        if isinstance(step, bool) or not isinstance(step, int | float) or not math.isfinite(step):
            raise ConfigError(
                f"{str(run / METRICS_FILE)!r}: row {index} has step = {step!r}, not a number: fix that "
                "row (steps count from 1) or delete it"
            )
    return [row for row in rows if isinstance(row, dict)]


def _run_markers(run: Path) -> list[str]:
    names = ["config.yaml", METRICS_FILE, "eval.json"]
    found = [n for n in names if (run / n).is_file()]
    return found + [p.name for p in sorted(run.glob("eval_*.json"))]


def check_run_dir(run_dir: str | Path) -> Path:
    """The run directory as a Path; FileNotFoundError that says what a run directory holds (and names
    the run directories inside, when given their parent) if it is not one."""
    run = Path(run_dir)
    if not run.exists():
        raise FileNotFoundError(f"run directory {str(run)!r} does not exist")
    if not run.is_dir():
        raise FileNotFoundError(f"{str(run)!r} is a file, not a run directory; give the output_dir of a run")
    if _run_markers(run):
        return run
    inside = sorted(str(p.parent) for p in run.glob("**/config.yaml") if "checkpoints" not in p.parts)[:8]
    hint = f"; run directories inside it: {', '.join(inside)}" if inside else ""
    raise FileNotFoundError(
        f"{str(run)!r} is not a run directory (it has no config.yaml, metrics.jsonl, eval.json or "
        f"eval_*.json); give the output_dir of a run{hint}"
    )


def truncate_after(path: Path, step: int) -> None:
    """Drop the rows of the JSON-lines file `path` logged after `step` (by a run killed past its last
    checkpoint, which the resumed run logs again), and a row cut short; the file is replaced whole."""
    if not path.is_file():
        return
    kept = [row for row in read_jsonl(path) if row.get("step", 0) <= step]
    replace_text(path, "".join(json.dumps(_plain_number(row), allow_nan=False) + "\n" for row in kept))


def record_launch(
    run_dir: Path, from_step: int, device: torch.device, processes: int, setup_seconds: float
) -> None:
    """Append this launch (a start or a resume) to ``launches.jsonl``: what the run was made with, which
    the numbers it logs depend on, and the seconds it took to get to its first step (loading the
    models, caching, reading the checkpoint). Step seconds depend on the machine and the thread count,
    and on a CPU the thread count changes float rounding, so two runs compare exactly only when these
    agree."""
    record = {
        "from_step": from_step,
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "setup_seconds": round(setup_seconds, 3),
        "device": str(device),
        "processes": processes,
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "mmrl": __version__,
        "python": platform.python_version(),
    }
    with (run_dir / LAUNCHES_FILE).open("a") as f:
        f.write(json.dumps(record, allow_nan=False) + "\n")


def read_launches(run_dir: Path) -> list[dict[str, Any]]:
    """The launches recorded in a run directory, oldest first ([] for runs made before the file)."""
    return [row for row in read_jsonl(run_dir / LAUNCHES_FILE) if isinstance(row, dict)]


# ---------------------------------------------------------------------------------------------
# One run per directory


@dataclass
class _HeldLock:
    """A run directory's lock this process holds: the open lock file, and how many trainers use it."""

    file: IO[str]
    holders: int = 0


_HELD: dict[Path, _HeldLock] = {}  # by resolved run directory


def lock_holder(run_dir: Path) -> str | None:
    """Who holds `run_dir`'s lock, as its lock file names them ("process 1234 on host h, since ..."), or
    None when no other process does. Reads only: nothing is written, a missing file is not made."""
    if run_dir.resolve() in _HELD:
        return None
    try:
        file = (run_dir / LOCK_FILE).open()
    except OSError:  # none yet (or unreadable: taking the lock says why)
        return None
    with file:
        try:
            fcntl.flock(file, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _describe_holder(file.read())
    return None


def lock_run_dir(run_dir: Path) -> Callable[[], None]:
    """Take `run_dir`'s lock (an advisory ``flock`` on ``run_dir/.lock``, made with the directory if
    missing) and return the function that releases it. The operating system releases it when the
    process exits or is killed, so a dead run never leaves a stale lock. A directory this process
    holds already is shared (several trainers of one process); one another process holds is a
    ConfigError naming it."""
    key = run_dir.resolve()
    if key not in _HELD:
        run_dir.mkdir(parents=True, exist_ok=True)
        file = os.fdopen(os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644), "r+")
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe_holder(file.read())
            file.close()
            raise ConfigError(_locked_message(run_dir, holder)) from None
        file.truncate(0)
        started = datetime.now(UTC).isoformat(timespec="seconds")
        file.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": started}))
        file.flush()
        _HELD[key] = _HeldLock(file)
    held = _HELD[key]
    held.holders += 1
    released = False

    def release() -> None:
        nonlocal released
        if released:
            return
        released = True
        held.holders -= 1
        if held.holders == 0:
            del _HELD[key]
            held.file.close()  # closing the descriptor releases the lock

    return release


def check_unlocked(run_dir: Path) -> None:
    """A ConfigError naming the process that holds `run_dir`'s lock, if another one does."""
    holder = lock_holder(run_dir)
    if holder is not None:
        raise ConfigError(_locked_message(run_dir, holder))


def _locked_message(run_dir: Path, holder: str) -> str:
    return (
        f"run directory {str(run_dir)!r} is in use by another run ({holder}): wait for it to end or stop "
        "it, or choose another output_dir=..."
    )


def _describe_holder(text: str) -> str:
    try:
        record = json.loads(text)
        return f"process {int(record['pid'])} on host {record['host']}, since {record['since']}"
    except (ValueError, KeyError, TypeError):
        return "a process that has not named itself yet"
