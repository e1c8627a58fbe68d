"""How a run stops early: the exceptions that end a run or skip a step, and ``stopped.json``, the record
of why a started run stopped, at which step and which checkpoint it resumes from (`StopRecords`, the
part of `mmrl.trainer.Trainer` that writes it)."""

from __future__ import annotations

import errno
import traceback
from pathlib import Path
from typing import Any

from mmrl.checkpoint import list_checkpoints, write_errno
from mmrl.config import ConfigError
from mmrl.runlog import write_json

STOPPED_FILE = "stopped.json"


class TrainingStopped(RuntimeError):
    """The run cannot go on (e.g. NaN losses in a row, NaN weights, reward server down, an exception
    in a step). The trainer records the reason and the checkpoint to resume from in ``stopped.json``;
    the message says both. `recorded` is False when stopped.json could not be written."""

    def __init__(self, message: str, recorded: bool = True) -> None:
        super().__init__(message)
        self.recorded = recorded


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) ended a started run: ``stopped.json`` records the step and the checkpoint to
    resume from, and the message says both. Still a KeyboardInterrupt, for code that catches one."""

    def __init__(self, message: str, recorded: bool = True) -> None:
        super().__init__(message)
        self.recorded = recorded


class UpdateFailed(RuntimeError):
    """The optimizer step raised part way (e.g. a learning rate so large that Adam's step size overflows
    float32): some weights may be updated and others not, so the run stops without checkpointing them."""


class StepSkipped(Exception):
    """This step's update was dropped (a non-finite loss, log-prob or gradient is data, not a crash);
    `metrics` is what the step logs. Raised by `Trainer.skip_step`, caught by `Trainer.train`."""

    def __init__(self, reason: str, metrics: dict[str, Any]) -> None:
        super().__init__(reason)
        self.metrics = metrics


class StopRecords:
    """What a `Trainer` does when its run stops early: record the step, the reason and the checkpoint
    to resume from in ``stopped.json`` and turn the exception that ended the run into the one the user
    sees (`stopped_by`). It reads the run's state that `Trainer.__init__` sets (`run_dir`,
    `checkpoint_dir`, `run_started`, `stop_recorded`, `doing`, `step_number`)."""

    def stop_without_saving(self, step: int, reason: str) -> str:
        """Record why the run stopped without writing a checkpoint (the weights are bad); the newest
        checkpoint on disk, written before, is the one to resume from. Return the user's message."""
        kept = list_checkpoints(self.checkpoint_dir)
        checkpoint = kept[-1] if kept else None
        self.record_stop(step, reason, checkpoint)
        where = f"the last good checkpoint is {checkpoint}" if checkpoint else "and none was written before"
        return (
            f"{reason} (step {step}); no checkpoint of these weights is written, {where}: lower train.lr, "
            "check the rewards and the config, then resume=true"
        )

    def record_stop(
        self, step: int, reason: str, checkpoint: Path | None, error: BaseException | None = None
    ) -> bool:
        """Write ``stopped.json``: the step, the reason, the checkpoint to resume from and, for an
        exception, its type, message and traceback (for a bug report). Return whether it was written
        (a full disk may refuse it too)."""
        self.stop_recorded = True
        if not self.is_main:
            return True
        record: dict[str, Any] = {
            "step": step,
            "reason": reason,
            "checkpoint": str(checkpoint) if checkpoint else None,
        }
        if error is not None:
            record["error"] = {"type": type(error).__name__, "message": str(error)}
            record["traceback"] = "".join(traceback.format_exception(error))
        try:
            write_json(self.run_dir / STOPPED_FILE, record)
        except OSError:
            return False
        return True

    def stopped_by(self, err: BaseException) -> BaseException:
        """What an exception that ends a started run becomes, once stopped.json records it with the
        step, the newest checkpoint and the traceback: Ctrl-C a `TrainingInterrupted`, anything else (a
        full disk, an exception in a step, a reward, an environment) a `TrainingStopped` whose message
        says what happened, where, and what to resume from. A ConfigError is recorded and stays one;
        an exception before the run started, or once a stop is recorded, is returned as it is."""
        if not self.run_started or self.stop_recorded:
            return err
        kept = list_checkpoints(self.checkpoint_dir)
        checkpoint = kept[-1] if kept else None
        resume = (
            f"the newest checkpoint is {checkpoint}: continue with --resume"
            if checkpoint is not None
            else "no checkpoint is written yet: the run starts again from step 0"
        )
        if isinstance(err, KeyboardInterrupt):
            reason = f"interrupted (Ctrl-C) {self.doing}"
        elif isinstance(err, ConfigError | TrainingStopped):
            reason = str(err)
        elif write_errno(err) == errno.ENOSPC:
            written = getattr(err, "directory", None) or (
                Path(err.filename).parent if getattr(err, "filename", None) else self.run_dir
            )
            reason = f"no space left on device (ENOSPC) in {written}, {self.doing}"
            resume = f"free space there (or move the run to a larger disk), then continue; {resume}"
        else:
            message = " ".join(str(err).split())
            reason = f"{type(err).__name__}{': ' + message if message else ''} {self.doing}"
            resume = f"fix the cause (the traceback is in {STOPPED_FILE}), then continue; {resume}"
        recorded = self.record_stop(self.step_number, reason, checkpoint, err)
        if isinstance(err, ConfigError):
            return err
        if not recorded:
            resume += f"; {STOPPED_FILE} could not be written either"
        stopped_class = TrainingInterrupted if isinstance(err, KeyboardInterrupt) else TrainingStopped
        return stopped_class(f"{reason}; {resume}", recorded)
