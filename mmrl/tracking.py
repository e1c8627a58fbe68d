"""Where a run's numbers go beside ``metrics.jsonl`` (config key `tracking`): TensorBoard event files
in ``RUN_DIR/tensorboard`` and Weights & Biases.

Every tracker gets each step's metrics, the held-out evaluations before and after training and the
images and videos the trainer writes to ``RUN_DIR/samples`` and ``RUN_DIR/videos``
(`MetricsLog.log_samples`). A W&B
run also gets the resolved config; its id is kept in ``RUN_DIR/wandb_run_id``, so a resumed run
continues the same W&B run, and its files live under ``RUN_DIR/wandb`` (in offline mode, to be
uploaded later with ``wandb sync RUN_DIR/wandb/offline-run-*``).
"""

from __future__ import annotations

import importlib.util
import netrc
import os
import uuid
from pathlib import Path
from typing import Any

from mmrl.config import ConfigError, WandbConfig
from mmrl.registry import closest

TRACKERS = ("tensorboard", "wandb")
WANDB_ID_FILE = "wandb_run_id"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
VIDEO_SUFFIXES = (".gif", ".mp4")
INSTALL = {"tensorboard": "pip install 'mmrl[tensorboard]'", "wandb": "pip install 'mmrl[wandb]'"}


def check_tracking(tracking: Any, wandb: WandbConfig) -> None:
    """A ConfigError naming `tracking`'s problem: not a list of known trackers, a tracker twice, a
    tracker whose package is not installed, or W&B online without a login (where `wandb.init` would
    stop the run at a login prompt)."""
    if not isinstance(tracking, list) or not all(isinstance(name, str) for name in tracking):
        raise ConfigError(f"config error: tracking = {tracking!r}: give a list, e.g. [tensorboard, wandb]")
    for name in tracking:
        if name not in TRACKERS:
            hint = closest(name, list(TRACKERS))
            did_you_mean = f" (did you mean {hint!r}?)" if hint else ""
            raise ConfigError(
                f"config error: tracking: unknown tracker {name!r}{did_you_mean}; choose from "
                f"{', '.join(TRACKERS)}"
            )
    if len(set(tracking)) != len(tracking):
        raise ConfigError(f"config error: tracking = {tracking!r} names a tracker twice")
    for name in tracking:
        if importlib.util.find_spec(name) is None:  # each tracker's package has its name
            raise ConfigError(
                f"config error: tracking: {name} is not installed: {INSTALL[name]} (or leave it out)"
            )
    if "wandb" in tracking and wandb_online(wandb.mode) and not wandb_logged_in():
        raise ConfigError(
            "config error: tracking: wandb is online but not logged in: run `wandb login` or set "
            "WANDB_API_KEY, or log offline with wandb.mode=offline (and later `wandb sync "
            "RUN_DIR/wandb/offline-run-*`)"
        )


def wandb_online(mode: str) -> bool:
    """Whether W&B would log online: `wandb.mode`, or with auto W&B's own WANDB_MODE."""
    if mode != "auto":
        return mode == "online"
    return os.environ.get("WANDB_MODE", "online").lower() not in ("offline", "dryrun", "disabled")


def wandb_logged_in() -> bool:
    """Whether W&B has an API key: WANDB_API_KEY, or the entry `wandb login` writes in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


class Tracker:
    """What a tracker is given; each method does nothing unless the tracker has a use for it."""

    takes_media = False  # whether `log_media` does something (the run's media folders are then watched)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def log_eval(self, when: str, step: int, metrics: dict[str, float]) -> None:
        pass

    def log_media(self, step: int, paths: list[Path]) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardTracker(Tracker):
    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def log_eval(self, when: str, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(f"eval_{when}/{key}", value, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    takes_media = True

    def __init__(self, run_dir: Path, settings: WandbConfig, config: dict[str, Any]) -> None:
        import wandb

        id_file = run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        self.wandb = wandb
        self.run = wandb.init(
            project=settings.project,
            name=settings.name or run_dir.resolve().name,
            tags=list(settings.tags),
            mode=None if settings.mode == "auto" else settings.mode,
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            config=config,
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_eval(self, when: str, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.run.summary[f"eval_{when}/{key}"] = value

    def log_media(self, step: int, paths: list[Path]) -> None:
        media = {}
        for path in paths:
            kind = self.wandb.Video if path.suffix in VIDEO_SUFFIXES else self.wandb.Image
            media[f"samples/{path.stem}"] = kind(str(path))
        self.run.log(media, step=step)

    def close(self) -> None:
        self.run.finish()


def open_trackers(
    tracking: list[str], run_dir: Path, wandb: WandbConfig, config: dict[str, Any]
) -> list[Tracker]:
    """The trackers `tracking` names (checked by `check_tracking`), for the run in `run_dir`."""
    trackers: list[Tracker] = []
    for name in tracking:
        if name == "tensorboard":
            trackers.append(TensorBoardTracker(run_dir))
        else:
            trackers.append(WandbTracker(run_dir, wandb, config))
    return trackers


def is_media(path: Path) -> bool:
    return path.suffix.lower() in (*IMAGE_SUFFIXES, *VIDEO_SUFFIXES)
