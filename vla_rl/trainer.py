"""Online fine-tuning of the VLA with HABC, and its baselines in the same loop (`mmrl train vla/habc`).

Each training step is one iteration: roll out the stochastic policy on fresh reset seeds until at least
`rollout.env_steps` environment steps were taken (policy and expert steps alike: the budget that
recipes share), with the scripted-expert supervisor of `vla_rl.online` taking over when the policy
strays; store every step with its kind (policy / intervention) in the `ReplayBuffer`; then update by
`method`, through its update rule in `vla_rl.methods.UPDATES` (all alike: `MethodUpdate.update`):
habc, awr, bc and dagger train the critics on their targets, then the actor on their rows and weights,
over the whole buffer (`vla_rl.methods.buffer`, HABC's math in `vla_rl.methods.habc`); grpo updates on
the iteration's own episodes (`vla_rl.methods.grpo`), with `grpo.branch_every` on groups branched from
MuJoCo snapshots (`vla_rl.branching`), whose env steps count each shared prefix once.

With `train.demos` or `train.demo_episodes` (the recipes), `train.demo_fraction` of every actor batch
comes from demonstrations (weight 1), whatever the method: without them the online data alone pulled the
base down (docs/results.md). A policy pretrained with the auxiliary object-position head keeps that loss
in every actor update (`train.state_weight`), on online and demonstration rows. Exploration samples from
the policy with its std times `rollout.std_scale`: the BC base's std (near 1 on the gripper, whose
demonstrated commands sit at the bounds) makes full-width samples fail where the mean succeeds.

Metrics every iteration: rollout success, take-overs per episode, env steps and episodes so far,
critic losses, gate mean and weight statistics; held-out success with the deterministic policy every
`eval_every` iterations and in eval.json before and after; checkpoints hold the critics, their
optimizer and the replay buffer too, so a resumed run continues exactly. At the end OUTPUT_DIR holds
the policy (policy/), the rollout counters with the training episodes it took to first reach 80%
held-out success (rollouts.json), held-out success against env steps (success.png) and GIFs of the
final policy (videos/).
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from safetensors.numpy import load_file, save_file
from torch import Tensor

from mmrl.config import ConfigError, shipped_path
from mmrl.memory_plan import MemoryPlan
from mmrl.registry import TRAINERS
from mmrl.run_stops import StepSkipped
from mmrl.trainer import Trainer, warmup_cosine
from vla_rl.branching import BranchedGroups, branched_rollouts
from vla_rl.config import VLAOnlineConfig, branch_plan, check_env_size, group_seeds
from vla_rl.curves import episodes_to, plot_success, success_curve
from vla_rl.dataset import RobotDataset, open_dataset
from vla_rl.episodes import check_first_observation, make_env
from vla_rl.evaluate import evaluate_episodes, evaluate_policy, write_gif
from vla_rl.lerobot_format import ACTION_KEY, IMAGE_KEY, STATE_KEY
from vla_rl.lerobot_policy import FLOW_MATCHING, import_lerobot
from vla_rl.loading import is_lerobot_policy_dir, load
from vla_rl.memory_plan import online_memory_plan
from vla_rl.methods import UPDATES
from vla_rl.methods.critics import Critics
from vla_rl.methods.interface import Collected, mean_or_nan
from vla_rl.online import Episode, add_to_buffer, rollouts
from vla_rl.policy import CONFIG_NAME, WEIGHTS_NAME, ClippedGaussian, instruction_words
from vla_rl.pretrain import frame_tensors
from vla_rl.recording import expert_demonstrations
from vla_rl.replay_buffer import ReplayBuffer


def _stream(seed: int, step: int, stream: int) -> int:
    """A generator seed per (run seed, iteration, purpose): rollouts and minibatches repeat on resume."""
    return (seed * 1_000_003 + step * 101 + stream) % 2**63


def _finite(metrics: dict[str, Any]) -> dict[str, Any]:
    """Drop the metrics that had nothing to average this iteration (e.g. no efficiency data yet)."""
    return {k: v for k, v in metrics.items() if not (isinstance(v, float) and math.isnan(v))}


def check_lerobot_run(config: VLAOnlineConfig, path: Path) -> None:
    """What fine-tuning a LeRobot policy needs, checked before anything runs: a flow-matching policy
    (chunks sampled from noise, a weighted flow-matching loss), a buffer method, sampling at the
    policy's own spread, LeRobot importable."""
    try:
        import_lerobot()
    except ImportError as err:
        where = f"model.path = {config.model.path!r} is a LeRobot policy"
        raise ConfigError(f"config error: {where}: {err}") from None
    kind = json.loads((path / CONFIG_NAME).read_text())["type"]
    where = f"model.path = {config.model.path!r} is a LeRobot {kind!r} policy"
    if kind not in FLOW_MATCHING:
        raise ConfigError(
            f"config error: {where}; fine-tuning takes flow-matching policies ({', '.join(FLOW_MATCHING)}), "
            f"other LeRobot policies run in `mmrl eval vla` only"
        )
    if config.method == "grpo":
        raise ConfigError(
            f"config error: {where}, which has no action log-probabilities for GRPO's ratio: use "
            "method=habc, awr, bc or dagger"
        )
    if config.rollout.std_scale != 1.0:
        raise ConfigError(
            f"config error: {where}; rollout.std_scale = {config.rollout.std_scale}, but a flow-matching "
            "policy samples at its own spread: set rollout.std_scale=1.0"
        )


def demo_frames(dataset: RobotDataset, horizon: int) -> dict[str, Tensor]:
    """Every demonstration frame for a LeRobot policy: image (N, 3, H, W) uint8, the full env state,
    the instruction's index into `dataset.tasks`, the action chunk and its mask."""
    parts: dict[str, list[Tensor]] = {"image": [], "state": [], "task": []}
    for index in range(len(dataset.episodes)):
        episode = dataset.episode(index)
        parts["image"].append(episode[IMAGE_KEY])
        parts["state"].append(episode[STATE_KEY].float())
        parts["task"].append(torch.full((len(episode[IMAGE_KEY]),), dataset.tasks.index(episode["task"])))
    chunks = [dataset.chunk(i, horizon) for i in range(len(dataset))]
    return {k: torch.cat(v) for k, v in parts.items()} | {
        "actions": torch.stack([c[0] for c in chunks]).float(),
        "mask": torch.stack([c[1] for c in chunks]),
    }


def check_policy_dir(config: VLAOnlineConfig) -> bool:
    """A ConfigError unless model.path holds a policy (ours, or a LeRobot one this environment can
    run); whether it is LeRobot's."""
    path = shipped_path(config.model.path)
    missing = [name for name in (CONFIG_NAME, WEIGHTS_NAME) if not (path / name).is_file()]
    if missing:
        raise ConfigError(
            f"config error: model.path = {config.model.path!r} holds no policy "
            f"({' or '.join(missing)} missing): set it to a directory written by VLAPolicy.save_pretrained "
            "(RUN/policy of `mmrl pretrain vla`) or to a LeRobot policy directory (pretrained_model/ of "
            "`lerobot-train`; a tiny SmolVLA from `mmrl replica smolvla`, in the LeRobot environment)"
        )
    lerobot = is_lerobot_policy_dir(path)
    if lerobot:
        check_lerobot_run(config, path)
    return lerobot


@TRAINERS.register("vla_online")
class VLAOnlineTrainer(Trainer):
    """Online fine-tuning of a pretrained policy (ours or a LeRobot one) by any of the update rules of
    `vla_rl.methods` (see the module docstring)."""

    config_class = VLAOnlineConfig
    config: VLAOnlineConfig

    def __init__(self, config: VLAOnlineConfig, accelerator: Accelerator | None = None) -> None:
        self.lerobot = check_policy_dir(config)
        super().__init__(config, accelerator)

    @classmethod
    def memory_plan(cls, config: VLAOnlineConfig, recipe: str, processes: int) -> MemoryPlan:
        check_policy_dir(config)
        return online_memory_plan(config, recipe, processes)

    # ----- setup -----------------------------------------------------------------------------
    def setup(self) -> None:
        """Load the policy, make the training envs (their first observation and the expert's first
        action checked), the expert, the critics and the replay buffer."""
        from sim import expert_for
        from sim.env import snapshot_error

        cfg = self.config
        if self.accelerator.num_processes > 1:
            raise ConfigError(
                "the vla_online trainer runs in one process: "
                "launch it without accelerate's multi-process options"
            )
        try:
            self.policy = load(shipped_path(cfg.model.path), device=self.accelerator.device).train()
        except ConfigError as err:
            raise ConfigError(f"config error: model.path = {cfg.model.path!r}: {err}") from None
        check_env_size(cfg, self.policy.config.image_size)
        kwargs: dict[str, Any] = {"obs_mode": "state+rgb", "image_size": self.policy.config.image_size}
        if cfg.rollout.max_episode_steps:
            kwargs["max_episode_steps"] = cfg.rollout.max_episode_steps
        self.envs = [
            make_env(cfg.rollout.task, "rollout.task", **kwargs) for _ in range(cfg.rollout.num_envs)
        ]
        if self.branched and (problem := snapshot_error(self.envs[0])):
            raise ConfigError(
                f"config error: grpo.branch_every = {cfg.grpo.branch_every} with rollout.task = "
                f"{cfg.rollout.task!r}: {problem}; set grpo.branch_every=0 for this task"
            )
        proprio_dim = self.envs[0].get_wrapper_attr("proprio_dim")
        expected = self.policy.config.state_dim if self.lerobot else self.policy.config.proprio_dim
        if expected and proprio_dim != expected:
            raise ConfigError(
                f"config error: model.path = {cfg.model.path!r} expects {expected} proprioception "
                f"entries, task {cfg.rollout.task} gives {proprio_dim}: "
                "use a policy pretrained on a compatible task"
            )
        try:
            self.expert = expert_for(cfg.rollout.task)
        except TypeError as err:  # an external task registered without one
            raise ConfigError(f"config error: rollout.task = {cfg.rollout.task!r}: {err}") from None
        check_first_observation(self.envs[0], cfg.eval.seed, "rollout.task", self.expert)
        if not self.lerobot:  # a LeRobot policy's tokenizer reads any instruction
            added = self.policy.add_words(instruction_words(self.envs[0].get_wrapper_attr("instruction")))
            if added and self.is_main:  # before the optimizer, which must hold the grown embedding
                print(f"added the words {', '.join(added)} of task {cfg.rollout.task} to the vocabulary")
        trainable = [p for p in self.policy.parameters() if p.requires_grad]  # SmolVLA freezes its VLM
        self.prepare_model_and_optimizer(
            self.policy, trainable, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay
        )
        self.critics = Critics(self.envs[0].observation_space["state"].shape[0], cfg.critic.hidden)
        self.critic_optimizer = torch.optim.Adam(self.critics.parameters(), lr=cfg.critic.lr)
        capacity = {
            "policy": cfg.train.buffer_capacity,
            "intervention": cfg.train.buffer_capacity,
            "failure": cfg.train.failure_capacity,
        }
        self.buffer = ReplayBuffer(capacity)
        self.demo_frames = (
            self.load_demos(open_dataset(cfg.train.demos, "train.demos")) if cfg.train.demos else None
        )
        self.episode_length: dict[int, int] = {}
        self.counters = {"env_steps": 0, "episodes": 0, "interventions": 0, "successes": 0}
        self.group_seeds = group_seeds(cfg)

    def start_run_dir(self) -> None:
        """The run directory, then the demonstrations `train.demo_episodes` asks for, recorded into it
        (or read back when the run resumes)."""
        super().start_run_dir()
        cfg = self.config
        if cfg.train.demo_episodes:
            dataset = expert_demonstrations(
                self.run_dir / "demos",
                cfg.rollout.task,
                cfg.train.demo_episodes,
                0,
                self.demo_features(),
                key="train.demo_episodes",
                image_size=self.policy.config.image_size,
            )
            self.demo_frames = self.load_demos(dataset)

    def demo_features(self) -> dict[str, tuple[int, ...]]:
        """The shapes a demonstration dataset needs to train this policy on this task."""
        env, size = self.envs[0], self.policy.config.image_size
        return {
            IMAGE_KEY: (size, size, 3),
            STATE_KEY: env.observation_space["state"].shape,
            ACTION_KEY: env.action_space.shape,
        }

    def load_demos(self, dataset: RobotDataset) -> dict[str, Tensor]:
        """Every frame of the demonstrations as training tensors, after checking they fit the policy
        and task."""
        try:
            dataset.check_features(self.demo_features())
        except ValueError as err:
            raise ConfigError(
                f"config error: train.demos = {str(dataset.root)!r} does not fit task "
                f"{self.config.rollout.task}: {err}"
            ) from None
        if not self.lerobot:
            return frame_tensors(dataset, self.policy)
        self.demo_tasks = list(dataset.tasks)  # demo_frames' "task" indexes these
        return demo_frames(dataset, self.horizon)

    def demo_inputs(self, frames: dict[str, Tensor]) -> dict[str, Any]:
        """The policy's batch for demonstration frames drawn from `demo_frames`."""
        if not self.lerobot:
            return {k: frames[k].to(self.accelerator.device) for k in ("image", "proprio", "state", "tokens")}
        obs = {"image": frames["image"].permute(0, 2, 3, 1).numpy(), "state": frames["state"].numpy()}
        return self.policy.prepare(obs, [self.demo_tasks[i] for i in frames["task"].tolist()])

    @property
    def branched(self) -> bool:
        """GRPO groups branch from snapshots (`grpo.branch_every`, which only method grpo takes)."""
        return self.config.grpo.branch_every > 0

    @property
    def horizon(self) -> int:
        """Actions per predicted chunk: the length of every actor target."""
        return self.policy.config.horizon

    # ----- state that survives a restart -------------------------------------------------------
    def trainer_state(self) -> dict[str, Any]:
        """Critics, their optimizer, the replay buffer (its own save format, as arrays), counters and,
        with rollout.task_variants, the sampler."""
        with tempfile.TemporaryDirectory() as tmp:
            self.buffer.save(tmp)
            buffer = {
                "arrays": load_file(os.path.join(tmp, "buffer.safetensors")),
                "meta": (Path(tmp) / "buffer.json").read_text(),
            }
        state = {
            "critics": self.critics.state_dict(),
            "critic_optimizer": self.critic_optimizer.state_dict(),
            "buffer": buffer,
            "episode_length": {str(k): v for k, v in self.episode_length.items()},
            "counters": dict(self.counters),
        }
        if self.group_seeds.sampler is not None:
            state["sampler"] = self.group_seeds.sampler.state_dict()
        return state

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        """Inverse of `trainer_state`."""
        self.critics.load_state_dict(state["critics"])
        self.critic_optimizer.load_state_dict(state["critic_optimizer"])
        with tempfile.TemporaryDirectory() as tmp:
            save_file(dict(state["buffer"]["arrays"]), os.path.join(tmp, "buffer.safetensors"))
            (Path(tmp) / "buffer.json").write_text(state["buffer"]["meta"])
            self.buffer = ReplayBuffer.load(tmp)
        self.episode_length = {int(k): int(v) for k, v in state["episode_length"].items()}
        self.counters = {k: int(v) for k, v in state["counters"].items()}
        if self.group_seeds.sampler is not None:
            self.group_seeds.sampler.load_state_dict(state["sampler"])

    # ----- one iteration -----------------------------------------------------------------------
    def collect(self, step: int) -> list[Episode]:
        """Waves of num_envs episodes until the iteration's env-step budget is reached."""
        cfg, r = self.config, self.config.rollout
        generator = torch.Generator().manual_seed(_stream(cfg.seed, step, 0))
        takeover = cfg.intervention.rule()
        self.group_seeds.start(step)
        episodes: list[Episode] = []
        steps, wave = 0, 0
        while steps < r.env_steps:
            seeds, groups = (np.repeat(ids, r.group_size).tolist() for ids in self.group_seeds.wave(wave))
            batch = rollouts(
                self.policy, self.envs, self.expert, seeds, groups, takeover, generator, r.std_scale
            )
            self.group_seeds.feed(batch)
            episodes += batch
            steps += sum(e.length for e in batch)
            wave += 1
        return episodes

    def collect_branched(self, step: int) -> BranchedGroups:
        """Waves of num_envs / group_size branched groups until the iteration's env-step budget is
        reached, counting each shared prefix once."""
        cfg, r = self.config, self.config.rollout
        self.group_seeds.start(step)
        collected = BranchedGroups([], [], 0, 0)
        wave = 0
        while collected.env_steps < r.env_steps:
            seeds, groups = self.group_seeds.wave(wave)
            noise = (cfg.seed, step, wave * len(groups))
            batch = branched_rollouts(
                self.policy, self.envs, seeds, groups, branch_plan(cfg), noise, r.std_scale
            )
            self.group_seeds.feed(batch.leaves)
            collected.extend(batch)
            wave += 1
        return collected

    def train_step(self, step: int) -> dict[str, Any]:
        """One iteration: supervised rollouts into the buffer, then the method's critic and actor updates."""
        cfg = self.config
        branched = self.collect_branched(step) if self.branched else None
        episodes = branched.leaves if branched is not None else self.collect(step)
        for episode in episodes:
            self.episode_length[add_to_buffer(self.buffer, episode)] = episode.length
        kept = {s.episode for kind in ("policy", "intervention") for s in self.buffer.segments[kind]}
        self.episode_length = {k: v for k, v in self.episode_length.items() if k in kept}
        lengths = np.array([e.length for e in episodes])
        success = np.array([e.success for e in episodes])
        takeovers = np.array([e.interventions for e in episodes])
        unassisted = takeovers == 0
        expert_steps = sum(int(e.is_intervention.sum()) for e in episodes)
        self.counters["env_steps"] += int(lengths.sum()) if branched is None else branched.env_steps
        self.counters["episodes"] += len(episodes)
        self.counters["interventions"] += int(takeovers.sum())
        self.counters["successes"] += int(success.sum())
        sizes = self.buffer.sizes()
        metrics: dict[str, Any] = {
            "success_rate": float(success.mean()),
            "autonomous_success_rate": float((success & unassisted).mean()),
            "interventions_per_episode": float(takeovers.mean()),
            "intervention_step_fraction": expert_steps / float(lengths.sum()),
            "episode_steps": float(lengths.mean()),
            "rollout_episodes": len(episodes),
            "env_steps": self.counters["env_steps"],
            "episodes": self.counters["episodes"],
            "buffer_policy": sizes["policy"],
            "buffer_intervention": sizes["intervention"],
        }
        if cfg.intervention.enabled:  # failures the take-over rule let through: high while it is blind
            metrics["failed_without_takeover"] = float((~success & unassisted).mean())
        if branched is not None:  # what the same leaves would have cost replayed from reset
            metrics["replayed_env_steps"] = int(lengths.sum())
            metrics["branch_points"] = branched.branch_points
        dropped = self.group_seeds.dropped  # groups the sampler filtered out: grpo does not train on them
        if self.group_seeds.sampler is not None:
            metrics["dropped_groups"] = len(dropped)
        # the iteration's learning rate, from the config alone: a run resumed with more steps re-spreads it
        lr = cfg.train.lr * (warmup_cosine(step, 0, cfg.steps) if cfg.train.lr_schedule == "cosine" else 1.0)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        metrics["lr"] = lr
        generator = torch.Generator().manual_seed(_stream(cfg.seed, step, 1))
        collected = Collected(episodes, branched, dropped)
        metrics.update(UPDATES[cfg.method].update(self, collected, generator))
        return _finite(metrics)

    # ----- actor -------------------------------------------------------------------------------
    def actor_step(self, loss: Tensor, dist: ClippedGaussian | None) -> dict[str, float] | None:
        """Backward and step on `loss` plus `train.state_weight` times the policy's auxiliary
        object-position loss (when the batch had the env state and the policy has the head: every
        actor update keeps it, and so every parameter gets a gradient, as DDP requires). Returns the
        step's metrics, or None: the update skipped, as a NaN is data, not a crash."""
        cfg = self.config.train
        state_loss = dist.state_loss if dist is not None else None
        if state_loss is not None and cfg.state_weight != 0:
            loss = loss + cfg.state_weight * state_loss
        try:
            grad_norm = self.optimizer_step(loss, cfg.max_grad_norm, cfg.nan_patience, what="actor ")
        except StepSkipped:
            return None
        out = {"loss": loss.item(), "grad_norm": float(grad_norm)}
        return out if state_loss is None else out | {"state_loss": state_loss.item()}

    def actor_metrics(self, steps: list[dict[str, float] | None]) -> dict[str, Any]:
        """The mean of each metric over the actor steps that ran, and how many ran and were skipped."""
        done = [s for s in steps if s is not None]
        names = dict.fromkeys(k for s in done for k in s)
        return {k: mean_or_nan([s[k] for s in done if k in s]) for k in names} | {
            "actor_updates": len(done),
            "skipped_updates": len(steps) - len(done),
            "skipped_steps": self.skipped_steps,
        }

    # ----- evaluation and the end of a run --------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Held-out success of the deterministic policy on fixed seeds (disjoint from training seeds)."""
        e = self.config.eval
        return evaluate_policy(
            self.policy,
            self.config.rollout.task,
            e.episodes,
            e.seed,
            num_envs=e.num_envs,
            progress=self.config.progress,
        )

    def train(self) -> dict[str, Any]:
        """The shared loop, then to OUTPUT_DIR: the policy, the rollout counters with the episodes it
        took to reach 80% held-out success (rollouts.json), success.png and evaluation GIFs."""
        try:
            result = super().train()
            if self.is_main:
                self.policy.save_pretrained(self.run_dir / "policy")
                curve = success_curve(self.run_dir, self.counters)
                summary = {
                    "method": self.config.method,
                    **self.counters,
                    "episodes_to_80": episodes_to(curve, 0.8),
                }
                (self.run_dir / "rollouts.json").write_text(json.dumps(summary, indent=1))
                plot_success(
                    curve, self.config.eval.episodes, self.config.method, self.run_dir / "success.png"
                )
                try:  # the run's results are saved: GIFs that cannot be made must not fail it
                    self.write_videos()
                except Exception as err:
                    reason = " ".join(f"{type(err).__name__}: {err}".split())
                    print(f"warning: the final policy's GIFs were not written ({reason})", file=sys.stderr)
        finally:
            for env in getattr(self, "envs", []):
                env.close()
        return result

    def write_videos(self) -> None:
        """GIFs of the final deterministic policy on the first `eval.videos` held-out episodes (the same
        seeds the evaluation starts with), named by seed and outcome."""
        e = self.config.eval
        if not e.videos:
            return
        episodes = evaluate_episodes(
            self.policy,
            self.config.rollout.task,
            e.videos,
            e.seed,
            num_envs=e.num_envs,
            progress=False,
            videos=e.videos,
        )
        for k, (frames, by_expert) in sorted(episodes.videos.items()):
            outcome = "success" if episodes.success[k] else "failure"
            write_gif(frames, by_expert, self.run_dir / "videos" / f"seed{episodes.seeds[k]}_{outcome}.gif")
