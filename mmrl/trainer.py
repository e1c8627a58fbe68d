"""The loop every trainer shares: Accelerate, the steps, their updates, skipped steps, evaluations,
metrics; its run directory, checkpoints and exact resume are `mmrl.run_dir`, how a run stops early
`mmrl.run_stops`.

A trainer subclasses `Trainer`, names its config dataclass in `config_class`, and implements
`setup` (build model, optimizer, sampler), `train_step` and `evaluate`; whatever else must
survive a restart goes through `trainer_state` / `load_trainer_state`. The base class saves
model, optimizer, LR schedule, every RNG of every process and the trainer state, so a run killed
at any point and resumed ends with the same parameters as one that never stopped.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import sys
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, ClassVar, NoReturn

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from mmrl.checkpoint import Checkpoint
from mmrl.config import BaseConfig, ConfigError, to_dict
from mmrl.memory_plan import MemoryPlan
from mmrl.run_dir import RunDirectory
from mmrl.run_stops import StepSkipped, TrainingStopped, UpdateFailed
from mmrl.runlog import MetricsLog, record_launch, strict_json, write_json
from mmrl.tracking import check_tracking, open_trackers
from mmrl.watch import CollectiveWatch


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


class Trainer(RunDirectory):
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
        check_tracking(config.tracking, config.wandb)
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
        self.setup_seconds = 0.0  # from `train` to the first step (launches.jsonl)
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

    def train(self) -> dict[str, Any]:
        """Run (or resume) training to `config.steps`; return the final evaluation. Whatever can be
        checked is checked before the first write (`prepare_run_dir`, `setup`, `restore`); once the
        run directory is written, whatever ends the run early is recorded in stopped.json
        (`stopped_by`)."""
        started = time.perf_counter()
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
        self.setup_seconds = time.perf_counter() - started  # checks, models, caches, the checkpoint read
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
        log = None
        if self.is_main:
            trackers = open_trackers(
                self.config.tracking, self.run_dir, self.config.wandb, to_dict(self.config)
            )
            log = MetricsLog(self.run_dir, trackers, resume_step=start)
            record_launch(
                self.run_dir,
                start,
                self.accelerator.device,
                self.accelerator.num_processes,
                self.setup_seconds,
            )
        if start == 0:
            self.doing = "in the held-out evaluation before training"
            before = self.evaluate()
            self.write_eval("before", before)
            if log is not None:
                log.log_eval("before", 0, before)
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
            started = time.perf_counter()
            try:
                metrics = self.train_step(step)
            except StepSkipped as skipped:
                metrics = skipped.metrics
            except UpdateFailed as failed:
                raise TrainingStopped(self.stop_without_saving(step + 1, str(failed))) from None
            except TrainingStopped as stop:
                raise TrainingStopped(self.stop(step, str(stop))) from None
            metrics["step_seconds"] = time.perf_counter() - started  # the rollouts, rewards and updates
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
            log.log_eval("after", self.config.steps, after)
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
