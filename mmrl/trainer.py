"""The loop every trainer shares: run directory, Accelerate, checkpoints, exact resume, metrics.

A trainer subclasses `Trainer`, names its config dataclass in `config_class`, and implements
`setup` (build model, optimizer, sampler), `train_step` and `evaluate`; whatever else must
survive a restart goes through `trainer_state` / `load_trainer_state`. The base class saves
model, optimizer, LR schedule, every RNG of every process and the trainer state, so a run killed
at any point and resumed ends with the same parameters as one that never stopped.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import math
import os
import random
import sys
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, ClassVar, NoReturn

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from mmrl.checkpoint import (
    Checkpoint,
    NoUsableCheckpoint,
    list_checkpoints,
    load_latest_checkpoint,
    load_model_weights,
    remove_unfinished_writes,
    rng_state,
    save_checkpoint,
    set_aside,
    set_rng_state,
    write_errno,
)
from mmrl.config import BaseConfig, ConfigError, check_output_dir, read_yaml, save_config, to_dict
from mmrl.memory_plan import MemoryPlan
from mmrl.runlog import MetricsLog, check_unlocked, lock_run_dir, record_launch, strict_json, write_json
from mmrl.watch import CollectiveWatch

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


def build_optimizer(
    name: str, params: Iterable[Any], lr: float, weight_decay: float
) -> torch.optim.Optimizer:
    """`adamw`: torch's AdamW. `adamw_8bit`: bitsandbytes' AdamW8bit, whose two moments are stored in 8
    bits with a float32 scale per block of 256 (tensors under 4096 elements keep float32 moments)."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    import bitsandbytes  # Trainer checks that it is installed before anything is written

    return bitsandbytes.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay)


def fsdp_launch() -> bool:
    """Whether `accelerate launch` was given an FSDP config (it says so in the environment)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true", "yes")


class Trainer:
    config_class: ClassVar[type[BaseConfig]] = BaseConfig

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None

    def __init__(self, config: BaseConfig, accelerator: Accelerator | None = None) -> None:
        self.config = config
        if config.optimizer == "adamw_8bit" and importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError(
                "config error: optimizer = 'adamw_8bit' needs bitsandbytes, which is not installed: "
                "`pip install 'mmrl[adam8bit]'` (or bitsandbytes), or set optimizer=adamw"
            )
        # without CUDA, processes started by `accelerate launch --multi_gpu` / torchrun join over gloo
        self.accelerator = accelerator or Accelerator(cpu=not torch.cuda.is_available())
        if accelerator is None and not torch.cuda.is_available() and fsdp_launch() and self.is_main:
            print(
                "warning: the launch config asks for FSDP, which Accelerate runs on CUDA only: here the "
                "processes run DDP over gloo, each holding the whole model",
                file=sys.stderr,
            )
        self.run_dir = Path(config.output_dir)
        self.checkpoint_dir = self.run_dir / "checkpoints"
        self.samples_dir = self.run_dir / "samples"
        self.nan_streak = 0  # non-finite steps in a row (see `skip_step`)
        self.skipped_steps = 0
        self.resume_from: Checkpoint | None = None  # found by `prepare_run_dir`, loaded by `restore`
        self.corrupt_checkpoints: list[Path] = []  # found by `prepare_run_dir`, set aside by `start_run_dir`
        self.run_started = False  # whether `start_run_dir` has written the run directory
        self.doing = "before the first step"  # what the run is doing, for the message if it stops
        self.step_number = 0  # the step the run is in (1-based; `steps` once training is done)
        self.stop_recorded = False  # whether stopped.json records why this launch stopped
        self.lock: weakref.finalize | None = None  # releases the lock `start_run_dir` took, when called
        self.watch = CollectiveWatch(
            config.collective_warn_seconds, self.accelerator.process_index, self.accelerator.num_processes
        )

    # -- what a trainer implements ------------------------------------------------------------

    def setup(self) -> None:
        """Build model, optimizer, scheduler, sampler; prepare them with `self.accelerator`."""
        raise NotImplementedError

    def train_step(self, step: int) -> dict[str, Any]:
        """One optimisation step; returns metrics (numbers or tensors) for ``metrics.jsonl``."""
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics of the current model."""
        raise NotImplementedError

    @classmethod
    def memory_plan(cls, config: BaseConfig, recipe: str, processes: int) -> MemoryPlan:
        """What a process of this recipe will hold, built on the meta device (`mmrl train RECIPE
        --dry-run`, see `mmrl.memory_plan`); a trainer that can plan itself overrides this."""
        from mmrl.registry import TRAINERS

        unplanned = Trainer.memory_plan.__func__
        planned = [
            name for name in TRAINERS.names() if TRAINERS.get(name).memory_plan.__func__ is not unplanned
        ]
        raise ConfigError(
            f"--dry-run: the {config.trainer} trainer has no memory plan yet; trainers with one: "
            f"{', '.join(planned) or 'none'}"
        )

    def trainer_state(self) -> dict[str, Any]:
        """Extra state that must survive a restart (e.g. the sampler's)."""
        return {}

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        del state

    # -- shared machinery ----------------------------------------------------------------------

    def prepare_model_and_optimizer(
        self,
        model: torch.nn.Module,
        params: Iterable[Any] | None = None,
        *,
        lr: float,
        weight_decay: float = 0.01,
        lr_factor: Callable[[int], float] | None = None,
    ) -> None:
        """AdamW (the config's `optimizer`: `build_optimizer`) over `params` (default: the model's;
        parameter groups allowed), prepared with the model by Accelerate into `self.model` /
        `self.optimizer`, and a LambdaLR schedule from `lr_factor` in `self.scheduler` (none without
        it). weight_decay defaults to AdamW's own."""
        optimizer = build_optimizer(
            self.config.optimizer, model.parameters() if params is None else params, lr, weight_decay
        )
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        if lr_factor is not None:
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor)

    def optimizer_step(
        self,
        loss: torch.Tensor,
        max_grad_norm: float = math.inf,
        patience: int | None = None,
        what: str = "",
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> torch.Tensor:
        """One update from `loss`: zero the gradients, backward, then `apply_gradients`. With
        `patience`, a non-finite loss skips the update first (`skip_step`); `what` names the loss in
        that message ("actor " gives "non-finite actor loss"). `model` and `optimizer` default to the
        trainer's own; pass others for a second network with its own optimizer (e.g. critics)."""
        if patience is not None and not self.all_finite(loss):
            self.skip_step(f"non-finite {what}loss", patience, optimizer)
        (optimizer or self.optimizer).zero_grad(set_to_none=True)
        self.backward(loss)
        return self.apply_gradients(max_grad_norm, patience, what, model=model, optimizer=optimizer)

    def apply_gradients(
        self,
        max_grad_norm: float = math.inf,
        patience: int | None = None,
        what: str = "",
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> torch.Tensor:
        """Clip the accumulated gradients of `model` (default `self.model`) to `max_grad_norm` (inf:
        measure only) and step `optimizer` (default `self.optimizer`); return the gradient norm before
        clipping. With `patience`, a non-finite gradient skips the update instead (`skip_step`) and a
        finite one ends a streak of skipped updates."""
        grad_norm = self.accelerator.clip_grad_norm_((model or self.model).parameters(), max_grad_norm)
        if patience is not None:
            if not self.all_finite(torch.as_tensor(grad_norm)):
                self.skip_step(f"non-finite {what}gradient", patience, optimizer)
            self.nan_streak = 0
        try:
            (optimizer or self.optimizer).step()
        except RuntimeError as err:
            reason = " ".join(str(err).split())
            raise UpdateFailed(
                f"the optimizer step failed part way (RuntimeError: {reason}), so the weights may be partly "
                "updated (a learning rate too large for float32 does this)"
            ) from err
        return grad_norm

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def seed_everything(self) -> None:
        """Seed the global RNGs per process; rollouts use keyed noise, not these."""
        seed = self.config.seed + self.accelerator.process_index
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    def prepare_run_dir(self) -> None:
        """Check the run directory and the checkpoint to resume from before any work: a mistake
        fails here, in one line, instead of after training steps. Nothing is written (the directory
        is not even made): `start_run_dir` writes once `setup` has checked the rest. A directory
        another run holds (its lock) is refused, and so is a resume of a run of another trainer."""
        check_output_dir(self.config.output_dir, "output_dir")
        if self.is_main:
            check_unlocked(self.run_dir)
        for folder in (self.checkpoint_dir, self.samples_dir):
            if folder.exists():
                check_output_dir(folder, f"output_dir (its {folder.name}/ folder)")
        saved = self.run_dir / "config.yaml"
        if self.config.resume and saved.is_file():
            trainer = read_yaml(saved).get("trainer")
            if trainer != self.config.trainer:
                raise ConfigError(
                    f"resume=true: the run in {str(self.run_dir)!r} was trained by {trainer!r} (its "
                    f"config.yaml) and this config names trainer {self.config.trainer!r}: a run continues "
                    f"with its own trainer; resume it with `mmrl train {saved} --resume`, or choose a new "
                    "output_dir=..."
                )
        has_checkpoints = bool(list_checkpoints(self.checkpoint_dir))
        if has_checkpoints and not self.config.resume:
            raise ConfigError(
                f"run directory {str(self.run_dir)!r} already has checkpoints: pass resume=true "
                "(or --resume) to continue it, or choose a new output_dir=..."
            )
        if self.config.resume:
            self.resume_from = self.find_resume_checkpoint()

    def start_run_dir(self) -> None:
        """Make the run directory and take its lock (the main process holds it until the trainer is
        done: `release_run_dir`), clean up after killed checkpoint writes, set aside the corrupt
        checkpoints `prepare_run_dir` found and record the config (after `setup` and `restore`, whose
        own checks of models, data, sizes and the checkpoint must also pass before anything is
        written)."""
        self.accelerator.wait_for_everyone()  # every rank has read the checkpoints before any is moved
        if self.is_main:
            if self.lock is None:
                self.lock = weakref.finalize(self, lock_run_dir(self.run_dir))
            removed = remove_unfinished_writes(self.checkpoint_dir)
            if removed:
                print(f"removed {len(removed)} unfinished checkpoint write(s) in {self.checkpoint_dir}")
            if self.corrupt_checkpoints:
                set_aside(self.checkpoint_dir, self.corrupt_checkpoints)
            self.samples_dir.mkdir(parents=True, exist_ok=True)
            saved = self.run_dir / "config.yaml"
            if self.config.resume and saved.is_file():
                warn_config_changes(saved, self.config)
            save_config(self.config, saved)
        self.run_started = True
        with self.watch.phase("the barrier after preparing the run directory"):
            self.accelerator.wait_for_everyone()

    def release_run_dir(self) -> None:
        """Release the run directory's lock (`start_run_dir` took it); the trainer's end releases it too,
        and so does the end of the process, however it ends."""
        if self.lock is not None:
            self.lock()

    def find_resume_checkpoint(self) -> Checkpoint | None:
        """The newest good checkpoint, checked against this launch; None to start at step 0.

        Every checkpoint corrupt is refused unless ``discard_corrupt_checkpoints=true`` (then
        `start_run_dir` moves them to ``checkpoints/corrupt/``); so is a checkpoint written by another
        number of processes, whose ranks drew other data and would continue on another trajectory."""
        try:
            checkpoint = load_latest_checkpoint(self.checkpoint_dir)
        except NoUsableCheckpoint as err:
            if not self.config.discard_corrupt_checkpoints:
                raise ConfigError(
                    f"{err}: nothing to resume from; pass discard_corrupt_checkpoints=true to set them "
                    "aside and start at step 0, or choose a new output_dir=..."
                ) from None
            self.corrupt_checkpoints = [path for path, _ in err.problems]
            if self.is_main:
                aside = self.checkpoint_dir / "corrupt"
                warnings.warn(f"{err}; moving them to {aside} and starting at step 0", stacklevel=2)
            return None
        if checkpoint is None:
            if self.is_main:
                warnings.warn(
                    f"resume=true but {self.checkpoint_dir} has no checkpoint; starting at step 0",
                    stacklevel=2,
                )
            return None
        writers = len(checkpoint.state["rng"])
        if writers != self.accelerator.num_processes:
            raise ConfigError(
                f"checkpoint {checkpoint.path} was written by {writers} process(es) and this launch has "
                f"{self.accelerator.num_processes}: resume it with {writers} (each process continues its "
                "own data and random streams), or choose a new output_dir=..."
            )
        return checkpoint

    def save(self, step: int) -> None:
        """Checkpoint at `step`: weights, optimizer, schedule, trainer state and every rank's RNGs.
        Non-finite weights are never written: the run stops and the previous checkpoint stays."""
        if not self.weights_finite():
            raise TrainingStopped(self.stop_without_saving(step, "the model's weights are not finite"))
        doing, self.doing = self.doing, f"while writing the checkpoint of step {step} of {self.config.steps}"
        with self.watch.phase(f"the checkpoint of step {step}"):
            rngs = gather_object([rng_state()])
        if self.is_main:
            state = {
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else {},
                "trainer": self.trainer_state(),
                "rng": {str(rank): r for rank, r in enumerate(rngs)},
                "skipped": {"steps": self.skipped_steps, "streak": self.nan_streak},
                "cpu_threads": torch.get_num_threads(),
            }
            save_checkpoint(
                self.checkpoint_dir,
                step,
                state,
                self.accelerator.unwrap_model(self.model),
                keep=self.config.keep_checkpoints,
            )
        with self.watch.phase(f"the barrier after the checkpoint of step {step}"):
            self.accelerator.wait_for_everyone()
        self.doing = doing

    def restore(self) -> int:
        """Load the checkpoint `prepare_run_dir` chose into the model, optimizer, LR schedule and
        trainer state; return the step to continue from (0 if none). It runs before `start_run_dir`
        writes anything, so a checkpoint this config cannot continue (another model, a sampler over
        other data) is refused in one line that names the keys changed since the run started; the
        RNGs are set after (`restore_rngs`)."""
        checkpoint = self.resume_from
        if checkpoint is None:
            return 0
        self.load_weights(checkpoint)
        try:
            self.optimizer.load_state_dict(checkpoint.state["optimizer"])
            if self.scheduler is not None:
                self.scheduler.load_state_dict(checkpoint.state["scheduler"])
            self.load_trainer_state(checkpoint.state["trainer"])
        except Exception as err:  # a trainer's own state loader may raise anything on another layout
            reason = " ".join(f"{type(err).__name__}: {err}".split())
            saved = self.run_dir / "config.yaml"
            changed = config_changes(saved, self.config) if saved.is_file() else []
            fix = (
                f"keys changed since the run started: {', '.join(changed)}; resume with the run's own "
                f"config, `mmrl train {saved} --resume`, or choose a new output_dir=..."
                if changed
                else "no key changed since the run started (was it written by another version of the "
                "trainer?): choose a new output_dir=..."
            )
            raise ConfigError(
                f"checkpoint {checkpoint.path} cannot be continued with this config ({reason}); {fix}"
            ) from None
        skipped = checkpoint.state.get("skipped", {"steps": 0, "streak": 0})
        self.skipped_steps, self.nan_streak = int(skipped["steps"]), int(skipped["streak"])
        return checkpoint.step

    def restore_rngs(self) -> None:
        """Set this process's RNGs from the checkpoint `restore` loaded: after `start_run_dir`, so that
        what a trainer's `start_run_dir` draws does not shift the streams the steps continue."""
        checkpoint = self.resume_from
        if checkpoint is None:
            return
        set_rng_state(checkpoint.state["rng"][str(self.accelerator.process_index)])
        self.warn_other_thread_count(checkpoint)

    def warn_other_thread_count(self, checkpoint: Checkpoint) -> None:
        """A CPU run continued with another number of torch threads rounds its sums in another order, so
        it does not repeat the uninterrupted run bit for bit: say so, with how to match it."""
        written_with, now = checkpoint.state.get("cpu_threads"), torch.get_num_threads()
        if written_with is None or written_with == now or self.accelerator.device.type != "cpu":
            return
        if self.is_main:
            warnings.warn(
                f"checkpoint {checkpoint.path} was written with {written_with} CPU thread(s) and this "
                f"launch has {now}: the run continues, but float rounding differs from the uninterrupted "
                f"run's; launch with OMP_NUM_THREADS={written_with} to repeat it exactly",
                stacklevel=2,
            )

    def load_weights(self, checkpoint: Checkpoint) -> None:
        try:
            load_model_weights(self.accelerator.unwrap_model(self.model), checkpoint)
        except ValueError as err:
            raise ConfigError(
                f"{err}: use the config the run was started with ({self.run_dir / 'config.yaml'})"
            ) from None

    def train(self) -> dict[str, Any]:
        """Run (or resume) training to `config.steps`; return the final evaluation. Whatever can be
        checked is checked before the first write (`prepare_run_dir`, `setup`, `restore`); once the
        run directory is written, whatever ends the run early is recorded in stopped.json
        (`stopped_by`)."""
        written_for, processes = self.config.processes, self.accelerator.num_processes
        if written_for is not None and written_for != processes and self.is_main:
            print(
                f"warning: the recipe's batch sizes are per process and written for {written_for} "
                f"process(es); on {processes} the effective batch differs (`mmrl train RECIPE --dry-run "
                f"--processes {processes}` gives the sizes that keep it)",
                file=sys.stderr,
            )
        self.prepare_run_dir()
        self.seed_everything()
        self.setup()
        start = self.restore()
        self.start_run_dir()
        try:
            return self.train_steps(start)
        except BaseException as err:
            stopped = self.stopped_by(err)
            if stopped is err:
                raise
            raise stopped from err

    def train_steps(self, start: int) -> dict[str, Any]:
        """The run in its started directory: the held-out evaluation before (at step 0), the steps from
        `start` with their checkpoints, the evaluation after; return the latter."""
        self.restore_rngs()
        self.step_number = start
        log = MetricsLog(self.run_dir, self.config.tensorboard, resume_step=start) if self.is_main else None
        if self.is_main:
            record_launch(self.run_dir, start, self.accelerator.device, self.accelerator.num_processes)
        if start == 0:
            self.doing = "in the held-out evaluation before training"
            before = self.evaluate()
            self.write_eval("before", before)
        steps = range(start, self.config.steps)
        bar = tqdm(
            steps,
            desc="train",
            initial=start,
            total=self.config.steps,
            disable=not (self.config.progress and self.is_main),
            dynamic_ncols=True,
        )
        for step in bar:
            self.step_number, self.doing = step + 1, f"in step {step + 1} of {self.config.steps}"
            try:
                metrics = self.train_step(step)
            except StepSkipped as skipped:
                metrics = skipped.metrics
            except UpdateFailed as failed:
                raise TrainingStopped(self.stop_without_saving(step + 1, str(failed))) from None
            except TrainingStopped as stop:
                raise TrainingStopped(self.stop(step, str(stop))) from None
            if not self.weights_finite():
                raise TrainingStopped(
                    self.stop_without_saving(step + 1, "the model's weights are not finite after the update")
                )
            every = self.config.eval_every
            if every and (step + 1) % every == 0 and step + 1 < self.config.steps:
                self.doing = f"in the held-out evaluation after step {step + 1} of {self.config.steps}"
                metrics.update({f"eval_{k}": v for k, v in self.evaluate().items()})
            if log is not None:
                log.log(step + 1, metrics)
            if "reward" in metrics:
                bar.set_postfix(reward=f"{float(metrics['reward']):.3f}")
            if (step + 1) % self.config.checkpoint_every == 0 or step + 1 == self.config.steps:
                self.save(step + 1)
        bar.close()
        self.doing = "in the held-out evaluation after training"
        after = self.evaluate()
        self.write_eval("after", after)
        if log is not None:
            log.close()
        self.doing = "after training, while saving its results"
        return after

    def all_finite(self, *tensors: torch.Tensor) -> bool:
        """Whether every process's tensors are finite, so that all processes skip a step together
        (a process that skipped alone would leave the others waiting in the gradient all-reduce)."""
        device = self.accelerator.device
        checks = [torch.isfinite(torch.as_tensor(t).detach()).all().to(device) for t in tensors]
        bad = (~torch.stack(checks).all()).float().reshape(1) if checks else torch.zeros(1, device=device)
        with self.watch.phase("the all-reduce of the finite-value check"):
            total = self.accelerator.reduce(bad, reduction="sum")
        return float(total) == 0.0

    def backward(self, loss: torch.Tensor) -> None:
        """`accelerator.backward`, watched: under DDP it ends in the gradient all-reduce."""
        with self.watch.phase("the backward pass and its gradient all-reduce"):
            self.accelerator.backward(loss)

    def gather(self, items: list[Any], what: str) -> list[Any]:
        """Every process's `items` (picklable), concatenated in rank order; watched as `what`."""
        with self.watch.phase(f"the gather of {what}"):
            return gather_object(items)

    def weights_finite(self) -> bool:
        """Whether every process's model weights (parameters and floating buffers) are finite."""
        model = self.accelerator.unwrap_model(self.model)
        tensors = [t for t in model.state_dict().values() if t.is_floating_point()]
        return self.all_finite(*[t.to_local() if hasattr(t, "to_local") else t for t in tensors])

    def skip_step(
        self, reason: str, patience: int, optimizer: torch.optim.Optimizer | None = None
    ) -> NoReturn:
        """Drop this step's update (a NaN loss, log-prob or gradient is data, not a crash) by raising
        `StepSkipped` after clearing the gradients of `optimizer` (default the trainer's); after
        `patience` such steps in a row, stop the run with a checkpoint and the reason
        (`TrainingStopped`)."""
        (optimizer or self.optimizer).zero_grad(set_to_none=True)
        self.nan_streak += 1
        self.skipped_steps += 1
        if self.nan_streak >= patience:
            raise TrainingStopped(
                f"{reason} in {self.nan_streak} steps in a row (train.nan_patience = {patience})"
            )
        raise StepSkipped(reason, {"loss": math.nan, "skipped": 1, "skipped_steps": self.skipped_steps})

    def stop(self, step: int, reason: str) -> str:
        """Checkpoint the last completed step (its weights are finite: the failing update was not
        applied), record why the run stopped in ``stopped.json``; return the message for the user."""
        self.save(step)
        checkpoint = self.checkpoint_dir / f"step_{step:08d}"
        self.record_stop(step, reason, checkpoint)
        return f"{reason}; stopped at step {step + 1}, checkpoint of step {step} saved in {checkpoint}"

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

    def evaluate_checkpoint(self) -> dict[str, Any]:
        """Held-out metrics of the newest good checkpoint in the run directory (`mmrl eval`). It only
        reads: a run in progress (holding the directory's lock) can be evaluated."""
        if not self.run_dir.is_dir():
            raise ConfigError(
                f"run directory {str(self.run_dir)!r} (output_dir) does not exist, so there is no checkpoint "
                "to evaluate: give output_dir=... of a run, or train the recipe first"
            )
        try:
            checkpoint = load_latest_checkpoint(self.checkpoint_dir)
        except NoUsableCheckpoint as err:
            raise ConfigError(f"{err}: nothing to evaluate") from None
        if checkpoint is None:
            raise ConfigError(
                f"no checkpoint in {str(self.checkpoint_dir)!r}: train the recipe first, or pass "
                "output_dir=... of a finished run"
            )
        self.seed_everything()
        self.setup()
        self.load_weights(checkpoint)
        self.load_trainer_state(checkpoint.state["trainer"])
        return {"step": checkpoint.step, **self.evaluate()}

    def write_eval(self, key: str, metrics: dict[str, Any]) -> None:
        """Record held-out metrics under ``eval.json[key]`` (``before`` and ``after`` training), as strict
        JSON: a metric that is NaN or infinite is written as null, named in ``eval.json[key]
        ["non_finite"]`` and in a warning."""
        if not self.is_main:
            return
        path = self.run_dir / "eval.json"
        results = json.loads(path.read_text()) if path.is_file() else {}
        non_finite = finite_or_named(metrics, f"the held-out evaluation {key!r}", "eval.json")
        results[key] = {**metrics, "non_finite": non_finite} if non_finite else metrics
        write_json(path, results)


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    """Learning-rate factor: linear warm-up over `warmup` steps, then cosine decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def finite_or_named(metrics: dict[str, Any], what: str, where: str) -> list[str]:
    """The keys of `metrics` (dotted for nested ones) whose numbers are NaN or infinite, after a warning
    line that names them: `where` (a JSON file, stdout) holds them as null, JSON having neither."""
    found: dict[str, str] = {}
    strict_json(metrics, found)
    if found:
        listed = ", ".join(f"{key} = {value}" for key, value in found.items())
        print(
            f"warning: {what} has non-finite values ({listed}): written as null in {where}", file=sys.stderr
        )
    return list(found)


def config_changes(saved_path: Path, config: BaseConfig) -> list[str]:
    """The dotted keys (but ``resume``) whose values in `config` differ from the saved config.yaml."""
    import yaml

    saved = _flatten(yaml.safe_load(saved_path.read_text()) or {})
    now = _flatten(to_dict(config))
    return sorted(k for k in now.keys() | saved.keys() if k != "resume" and now.get(k) != saved.get(k))


def warn_config_changes(saved_path: Path, config: BaseConfig) -> None:
    """Resuming with a different config is allowed (e.g. more steps) but should not be silent."""
    changed = config_changes(saved_path, config)
    if changed:
        warnings.warn(f"resuming with config changes in: {', '.join(changed)}", stacklevel=2)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
