"""The run directory of a trainer: its checks before anything is written, its lock, its checkpoints
and the exact resume from them (`RunDirectory`, the part of `mmrl.trainer.Trainer` that reads and
writes ``RUN_DIR/checkpoints``), and the config changes a resume reports."""

from __future__ import annotations

import warnings
import weakref
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object

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
)
from mmrl.config import BaseConfig, ConfigError, check_output_dir, read_yaml, save_config, to_dict
from mmrl.run_stops import StopRecords, TrainingStopped
from mmrl.runlog import check_unlocked, lock_run_dir


class RunDirectory(StopRecords):
    """How a `Trainer` uses its run directory: `prepare_run_dir` checks it and the checkpoint to
    resume from, `start_run_dir` writes it first, `save` checkpoints a step (`stop` the last good one
    of a run that stops), `restore` and `restore_rngs` continue a run exactly, `evaluate_checkpoint`
    scores the newest checkpoint. The model, optimizer and state it saves are the trainer's."""

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

    def stop(self, step: int, reason: str) -> str:
        """Checkpoint the last completed step (its weights are finite: the failing update was not
        applied), record why the run stopped in ``stopped.json``; return the message for the user."""
        self.save(step)
        checkpoint = self.checkpoint_dir / f"step_{step:08d}"
        self.record_stop(step, reason, checkpoint)
        return f"{reason}; stopped at step {step + 1}, checkpoint of step {step} saved in {checkpoint}"

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
