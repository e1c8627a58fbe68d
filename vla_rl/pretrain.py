"""Behaviour-cloning pretraining of the small VLA (`mmrl pretrain vla`): the base that HABC fine-tunes.

The scripted expert of a sim task is recorded into ``OUTPUT_DIR/demos`` (a LeRobotDataset v3; reused
when the run is resumed or re-run), or an existing dataset is read from `data.path`. The policy sees
the camera image, the instruction and proprioception; it is trained to maximise the log-probability of
the expert's next `model.horizon` actions (chunk NLL, padding past an episode's end masked). Success is
measured on held-out reset seeds with the deterministic policy, before and after training
(``eval.json``), and the final policy is written with `save_pretrained` to ``OUTPUT_DIR/policy``.
The recipe deliberately stops short of a good policy (few demonstrations, see configs/pretrain/vla.yaml)
so that RL has room to improve it.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from mmrl.config import BaseConfig, ConfigError, option
from mmrl.registry import TRAINERS
from mmrl.run_stops import TrainingStopped
from mmrl.trainer import Trainer, warmup_cosine
from vla_rl.dataset import RobotDataset, open_dataset
from vla_rl.episodes import check_first_observation, make_env
from vla_rl.evaluate import TASK_HELP, evaluate_policy
from vla_rl.lerobot_checks import check_dataset
from vla_rl.lerobot_format import ACTION_KEY, IMAGE_KEY, STATE_KEY
from vla_rl.policy import VLAConfig, VLAPolicy, chunk_nll, random_shift, task_vocabulary
from vla_rl.recording import expert_demonstrations

if TYPE_CHECKING:
    from sim.experts import Expert


@dataclass
class VLAModelConfig:
    horizon: int = option(8, "actions per predicted chunk", min=1)
    n_action_steps: int = option(4, "actions of each chunk executed before predicting the next", min=1)
    channels: list[int] = option(
        [16, 32, 32], "conv widths of the image encoder (strides 2, 2, 1, ...)", min=1
    )
    keypoints: int = option(32, "spatial-softmax keypoints of the image encoder", min=1)
    word_dim: int = option(32, "instruction word embedding size", min=1)
    text_dim: int = option(64, "instruction GRU state size", min=1)
    hidden: int = option(256, "fusion MLP width", min=1)
    min_std: float = option(0.02, "smallest action standard deviation", min=1e-4)
    max_std: float = option(1.0, "largest action standard deviation", min=1e-4)


@dataclass
class VLADataConfig:
    task: str = option("PickPlace", TASK_HELP)
    path: str | None = option(
        None, "LeRobot dataset to train on; null records expert demonstrations into OUTPUT_DIR/demos"
    )
    episodes: int = option(40, "expert demonstrations to record (when data.path is null)", min=1)
    seed: int = option(0, "reset seed of the first recorded demonstration (then seed+1, ...)", min=0)
    action_noise: float = option(
        0.0, "std of the noise added to the executed expert actions, clean actions recorded (DART)", min=0.0
    )
    image_size: int = option(96, "camera frame side in pixels", min=16)


@dataclass
class VLATrainConfig:
    lr: float = option(1e-3, "AdamW peak learning rate (linear warm-up, cosine decay)", min=0.0)
    warmup_steps: int = option(100, "linear warm-up steps", min=0)
    batch_size: int = option(64, "frames per step on each process", min=1)
    image_shift: int = option(0, "random shift augmentation of the camera frames, pixels (0: off)", min=0)
    weight_decay: float = option(0.0, "AdamW weight decay", min=0.0)
    state_weight: float = option(
        1.0,
        "weight of the auxiliary loss that predicts the task's object positions (its *_pos state "
        "entries) from the image features; 0: no auxiliary head",
        min=0.0,
    )
    max_grad_norm: float = option(1.0, "gradient clipping norm", min=0.0)
    nan_patience: int = option(5, "non-finite losses or gradients in a row before the run stops", min=1)


@dataclass
class VLAEvalConfig:
    episodes: int = option(100, "evaluation episodes (deterministic policy)", min=1)
    seed: int = option(
        1_000_000, "reset seed of the first evaluation episode (held out from the demos)", min=0
    )
    num_envs: int = option(8, "environments stepped in lockstep, one batched policy call per step", min=1)


def task_expert(task: str, key: str) -> Expert:
    """The scripted expert of `task`, or a ConfigError naming config `key` for a task that has none."""
    from sim import expert_for

    try:
        return expert_for(task)
    except TypeError as err:  # an external task registered without one
        raise ConfigError(f"config error: {key} = {task!r}: {err}") from None


def checked_task(task: str, key: str) -> str:
    """The gymnasium id of a sim task (ours or external) named in config `key`, or a ConfigError that
    says what is wrong (an unknown name, or an external task whose package is not installed)."""
    try:
        import sim
    except ImportError as err:
        raise ConfigError(
            f"the vla trainers need the robot extra (pip install 'mmrl[robot]'): {err}"
        ) from None
    try:
        return sim.task_id(task)
    except ValueError as err:
        raise ConfigError(f"config error: {key} = {task!r}: {err}") from None


@dataclass
class VLABCConfig(BaseConfig):
    trainer: str = option("vla_bc", "trainer name", registry="trainer")
    model: VLAModelConfig = field(default_factory=VLAModelConfig)
    data: VLADataConfig = field(default_factory=VLADataConfig)
    train: VLATrainConfig = field(default_factory=VLATrainConfig)
    eval: VLAEvalConfig = field(default_factory=VLAEvalConfig)

    def __post_init__(self) -> None:
        self.data.task = checked_task(self.data.task, "data.task")
        m = self.model
        if m.n_action_steps > m.horizon:
            raise ConfigError(
                f"config error: model.n_action_steps = {m.n_action_steps} "
                f"must be <= model.horizon = {m.horizon}"
            )
        if m.min_std >= m.max_std:
            raise ConfigError(
                f"config error: model.min_std = {m.min_std} must be < model.max_std = {m.max_std}"
            )
        if self.data.path is not None:  # a bad dataset stops here, before the run directory is written
            check_dataset(self.data.path, "data.path", policy_features(self.data.task, self.data.image_size))
        demos = range(self.data.seed, self.data.seed + self.data.episodes)
        held_out = range(self.eval.seed, self.eval.seed + self.eval.episodes)
        if self.data.path is None and demos.start < held_out.stop and held_out.start < demos.stop:
            raise ConfigError(
                f"config error: eval.seed = {self.eval.seed} makes evaluation seeds {held_out.start}.."
                f"{held_out.stop - 1} overlap the demonstration seeds {demos.start}..{demos.stop - 1}: "
                "choose seeds that do not overlap"
            )


def policy_features(task: str, image_size: int) -> dict[str, tuple[int, ...]]:
    """The dataset features the policy trains on for `task` (config data.task), with their shapes
    (images (H, W, C))."""
    env = make_env(task, "data.task", obs_mode="state")
    try:
        state, action = env.observation_space["state"].shape, env.action_space.shape
    finally:
        env.close()
    return {IMAGE_KEY: (image_size, image_size, 3), STATE_KEY: tuple(state), ACTION_KEY: tuple(action)}


def demonstrations(cfg: VLABCConfig, run_dir: os.PathLike) -> RobotDataset:
    """The dataset at data.path, or the run's recorded demonstrations (recorded now if absent), checked
    to fit the policy. The run has not started while they are recorded: an env or expert that fails
    then (TrainingStopped from the episode loop) is a ConfigError naming data.task, and what was
    recorded until then is removed (with the run directory, when the recording made it)."""
    required = policy_features(cfg.data.task, cfg.data.image_size)
    if cfg.data.path is not None:
        return open_dataset(cfg.data.path, "data.path", required)
    root, made_run_dir = os.path.join(run_dir, "demos"), not os.path.exists(run_dir)
    try:
        return expert_demonstrations(
            root,
            cfg.data.task,
            cfg.data.episodes,
            cfg.data.seed,
            required,
            key="data.episodes",
            image_size=cfg.data.image_size,
            action_noise=cfg.data.action_noise,
        )
    except TrainingStopped as err:
        shutil.rmtree(root + ".partial", ignore_errors=True)  # a refused run leaves nothing written
        if made_run_dir and os.path.isdir(run_dir) and not os.listdir(run_dir):
            os.rmdir(run_dir)
        raise ConfigError(
            f"config error: data.task = {cfg.data.task!r}: {err} (while recording its demonstrations)"
        ) from None


def object_positions(layout: dict[str, slice], proprio_dim: int) -> list[int]:
    """State entries of the task's object positions (the parts after the proprioception named *_pos):
    what the auxiliary head learns to read off the image. Empty for a task without any."""
    parts = [part for name, part in layout.items() if name.endswith("_pos") and part.start >= proprio_dim]
    return [i for part in parts for i in range(part.start, part.stop)]


def frame_tensors(dataset: RobotDataset, policy: VLAPolicy) -> dict[str, torch.Tensor]:
    """Every frame as training tensors, images decoded once: image, proprio, state (the full env
    state, for the auxiliary head), tokens, actions, mask."""
    cfg = policy.config
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("image", "proprio", "state", "tokens")}
    for index in tqdm(range(len(dataset.episodes)), desc="decoding demos", disable=None, leave=False):
        episode = dataset.episode(index)
        parts["image"].append(episode[IMAGE_KEY])
        parts["state"].append(episode[STATE_KEY].float())
        parts["proprio"].append(parts["state"][-1][:, : cfg.proprio_dim])
        parts["tokens"].append(policy.tokenize([episode["task"]]).expand(len(episode[IMAGE_KEY]), -1))
    chunks = [dataset.chunk(i, cfg.horizon) for i in range(len(dataset))]
    return {k: torch.cat(v) for k, v in parts.items()} | {
        "actions": torch.stack([c[0] for c in chunks]).float(),
        "mask": torch.stack([c[1] for c in chunks]),
    }


@TRAINERS.register("vla_bc")
class VLABCTrainer(Trainer):
    """Behaviour cloning of the VLA on scripted demonstrations; the result is saved with save_pretrained."""

    config_class = VLABCConfig
    config: VLABCConfig

    def setup(self) -> None:
        """Check the task's first observation (and the expert's first action, when demonstrations are
        recorded) before anything is written, read or record the demonstrations, build the policy."""
        cfg = self.config
        env = make_env(cfg.data.task, "data.task", obs_mode="state+rgb", image_size=cfg.data.image_size)
        try:
            expert = None if cfg.data.path is not None else task_expert(cfg.data.task, "data.task")
            seed = cfg.eval.seed if expert is None else cfg.data.seed  # the first episode the run resets
            check_first_observation(env, seed, "data.task", expert)
            proprio_dim = env.get_wrapper_attr("proprio_dim")
            layout = env.get_wrapper_attr("state_layout")
            instruction = env.get_wrapper_attr("instruction")
        finally:
            env.close()
        if self.is_main:
            demonstrations(cfg, self.run_dir)
        self.accelerator.wait_for_everyone()
        dataset = demonstrations(cfg, self.run_dir)
        # the words of the task's instructions and the demonstrations' (an external task's may be new)
        instructions = [instruction, *dataset.tasks]
        m = cfg.model
        policy_config = VLAConfig(
            vocabulary=task_vocabulary(instructions),
            image_size=cfg.data.image_size,
            proprio_dim=proprio_dim,
            action_dim=env.action_space.shape[0],
            horizon=m.horizon,
            n_action_steps=m.n_action_steps,
            channels=list(m.channels),
            keypoints=m.keypoints,
            state_index=object_positions(layout, proprio_dim) if cfg.train.state_weight > 0 else [],
            word_dim=m.word_dim,
            text_dim=m.text_dim,
            hidden=m.hidden,
            min_std=m.min_std,
            max_std=m.max_std,
        )
        self.policy = VLAPolicy(policy_config)
        stats = dataset.stats[STATE_KEY]
        self.policy.set_normalization(stats["mean"], stats["std"])
        self.frames = frame_tensors(dataset, self.policy)
        self.policy.to(self.accelerator.device)
        self.prepare_model_and_optimizer(
            self.policy, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, lr_factor=self.lr_factor
        )
        # one stream for all processes: each takes its slice of the same draw, and resuming restores it
        self.data_generator = torch.Generator().manual_seed(cfg.seed)

    def lr_factor(self, step: int) -> float:
        return warmup_cosine(step, self.config.train.warmup_steps, self.config.steps)

    def trainer_state(self) -> dict[str, Any]:
        return {"data_generator": self.data_generator.get_state()}

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        self.data_generator.set_state(state["data_generator"])

    def train_step(self, step: int) -> dict[str, Any]:
        cfg = self.config.train
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        draw = torch.randint(
            0, len(self.frames["actions"]), (world * cfg.batch_size,), generator=self.data_generator
        )
        index = draw[rank * cfg.batch_size : (rank + 1) * cfg.batch_size]
        device = self.accelerator.device
        batch = {k: v[index] for k, v in self.frames.items()}
        batch["image"] = random_shift(batch["image"], cfg.image_shift, self.data_generator)
        batch = {k: v.to(device) for k, v in batch.items()}
        self.model.train()
        dist = self.model(batch)
        nll = chunk_nll(dist, batch["actions"], batch["mask"])
        loss = nll if dist.state_loss is None else nll + cfg.state_weight * dist.state_loss
        grad_norm = self.optimizer_step(loss, cfg.max_grad_norm, cfg.nan_patience, what="behaviour-cloning ")
        self.scheduler.step()
        metrics = {"loss": loss.detach(), "nll": nll.detach(), "grad_norm": grad_norm}
        if dist.state_loss is not None:
            metrics["state_loss"] = dist.state_loss.detach()
        return metrics | {"lr": self.scheduler.get_last_lr()[0]}

    def evaluate(self) -> dict[str, float]:
        """Success over the held-out seeds; the main process runs the episodes, the others wait."""
        cfg = self.config
        metrics: dict[str, float] = {}
        if self.is_main:
            metrics = evaluate_policy(
                self.policy,
                cfg.data.task,
                cfg.eval.episodes,
                cfg.eval.seed,
                num_envs=cfg.eval.num_envs,
                progress=cfg.progress,
            )
        self.accelerator.wait_for_everyone()
        return metrics

    def train(self) -> dict[str, Any]:
        result = super().train()
        if self.is_main:
            self.policy.save_pretrained(self.run_dir / "policy")
        return result
