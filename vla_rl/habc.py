"""Online fine-tuning of the VLA with HABC, and its baselines in the same loop (`mmrl train vla/habc`).

Each training step is one iteration: roll out the stochastic policy on fresh reset seeds until at least
`rollout.env_steps` environment steps were taken (policy and expert steps alike: the budget that
recipes share), with the scripted-expert supervisor of `vla_rl.online` taking over when the policy
strays; store every step with its kind (policy / intervention) in the `ReplayBuffer`; then update.
`method` chooses the update:

- habc: two critic heads on one shared trunk over the privileged env state (a small MLP: cheap, and
  in simulation the critic may see what the policy may not; the actor still sees image + proprio).
  Viability V_v(s) ~ P(success | s) is trained on policy-executed segments only; efficiency V_e(s)
  (-1 per step) only on policy segments that ended in the policy's own success. One-step advantages
  A_x = r_x + gamma_x V_x(s') - V_x(s) (the `td1` estimator); the gate g = sigmoid(k (V_v(s) - tau))
  mixes them, A = (1 - g) A_v + g A_e, viability first while success is uncertain; actor loss
  -E[min(exp(beta A), w_max) log pi(a | s)] over action chunks. Intervention-aware credit: a policy
  segment is labelled with the episode's outcome only when it ends the episode; one that ends in a
  take-over is labelled failure (the supervisor judged that the policy could not finish), so the
  success the expert then brings never reaches the policy's actions. Intervention segments are
  demonstrations: actor weight `habc.intervention_weight`, never credited with an outcome, never
  critic data. A_e is measured in units of 1 / (1 - gamma_e) steps (the head predicts
  (1 - gamma_e) V_e in [-1, 0]) so that both advantages live on comparable [-1, 1] scales.
- awr: one critic head regresses the Monte-Carlo return gamma^(steps to end) * success of every step,
  policy and expert alike; A = G - V(s); the same clipped exponential weights; no gate, no
  intervention-aware credit.
- bc: behaviour cloning on intervention steps and on the policy steps of successful episodes.
- dagger: every visited state is relabelled by the scripted expert (chunk targets are the expert's
  actions along the visited trajectory).
- grpo: binary success, advantages normalised within groups of episodes that share a reset seed
  (`grpo` estimator), PPO-clip on the log-probs of the actions the policy executed from each sampled
  chunk, on this iteration's rollouts only (the recipe turns interventions off).

With `actor.per_chunk` (the recipes), a chunk the policy sampled is weighted as one decision: habc sums
the discounted one-step advantages of the steps executed from it (the chunk's n-step TD error), awr
takes the advantage at its first state. With `train.demos` (the recipes), `train.demo_fraction` of
every actor batch comes from demonstrations (weight 1), whatever the method: without them the online
data alone pulled the base down (docs/results.md). A policy pretrained with the auxiliary object-position
head keeps that loss in every actor update (`train.state_weight`), on online and demonstration rows.

The actor loss is over action chunks. An expert step t regresses steps t .. t+horizon-1 of its own
segment (masked past the segment's end); a policy step is trained only where the policy sampled a
chunk, on the actions it executed from that chunk (a step inside a chunk was decided at an earlier
state). Each position carries the weight of its own step. Exploration samples from the policy with its
std times `rollout.std_scale`: the BC base's std (near 1 on the gripper, whose demonstrated commands
sit at the bounds) makes full-width samples fail where the mean succeeds.
Critic targets are TD(lambda) returns within a segment (`critic.lam`; 1 = the binary outcome itself,
the default, which needs no target network); advantages are always one-step. Metrics every iteration:
rollout success, take-overs per episode, env steps and episodes so far, critic losses, gate mean and
weight statistics; held-out success with the deterministic policy every `eval_every` iterations and
in eval.json before and after; checkpoints hold the critics, their optimizer and the replay buffer
too, so a resumed run continues exactly. At the end OUTPUT_DIR holds the policy (policy/), the rollout
counters with the training episodes it took to first reach 80% held-out success (rollouts.json),
held-out success against env steps (success.png) and GIFs of the final policy (videos/).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from safetensors.numpy import load_file, save_file
from torch import Tensor, nn

from mmrl import advantages as _advantages  # noqa: F401  (fills the ADVANTAGES registry)
from mmrl.config import BaseConfig, ConfigError, option, shipped_path
from mmrl.losses import aggregate_loss, awr_weights
from mmrl.registry import ADVANTAGES, LOSSES, TRAINERS
from mmrl.resources import check_memory
from mmrl.trainer import StepSkipped, Trainer, warmup_cosine
from vla_rl.buffer import ReplayBuffer
from vla_rl.dataset import RobotDataset, open_dataset
from vla_rl.evaluate import TASK_HELP, evaluate_policy, wilson_interval, write_gif
from vla_rl.evaluate import run_episodes as run_eval_episodes
from vla_rl.lerobot_format import ACTION_KEY, IMAGE_KEY, STATE_KEY
from vla_rl.online import Episode, Transitions, add_to_buffer, rollouts
from vla_rl.policy import CONFIG_NAME, WEIGHTS_NAME, ClippedGaussian, VLAPolicy, instruction_words
from vla_rl.pretrain import checked_task, frame_tensors
from vla_rl.recording import expert_demonstrations
from vla_rl.supervisor import TakeoverRule

METHODS = ("habc", "awr", "bc", "dagger", "grpo")
ENV_BYTES = 24 * 2**20  # one simulated task with its camera renderer (rough)


# ---------------------------------------------------------------------------------------------
# Config


@dataclass
class HABCModelConfig:
    path: str = option(
        "vla_rl/assets/tiny_vla",
        "VLAPolicy directory to start from (default: the shipped base; `mmrl pretrain vla` remakes it)",
    )


@dataclass
class HABCRolloutConfig:
    task: str = option("PickPlace", TASK_HELP)
    env_steps: int = option(
        1600,
        "env steps per iteration, at least: waves of num_envs episodes run until this many were taken",
        min=1,
    )
    num_envs: int = option(
        8,
        "environments stepped in lockstep (one wave of episodes)",
        min=1,
        max=1024,
        why="each is a simulator with a renderer",
    )
    group_size: int = option(1, "episodes per reset seed (grpo normalises success within such groups)", min=1)
    seed: int = option(
        100_000, "first training reset seed; every iteration uses its own block of seeds", min=0
    )
    max_episode_steps: int = option(0, "time limit of training episodes (0: the task's own)", min=0)
    std_scale: float = option(
        0.3, "exploration: sample chunks with the policy's std times this (grpo's log-probs too)", min=1e-6
    )


@dataclass
class HABCInterventionConfig:
    enabled: bool = option(True, "let the scripted expert take over when the policy strays")
    window: int = option(8, "policy steps over which the disagreement with the expert is averaged", min=1)
    threshold: float = option(
        1.0, "mean RMS gap to the expert's action over the window that counts as straying", min=0.0
    )
    takeover_steps: int = option(12, "steps the expert drives before handing control back", min=1)
    deadline: int = option(
        0, "steps after which, still without success, the expert takes over once (0: never)", min=0
    )
    max_per_episode: int = option(4, "take-overs per episode at most", min=0)
    release_guard: bool = option(
        False,
        "also take over before the policy opens the gripper where that drops the held object away "
        "from its goal (PickPlace; the last action entry is the gripper, < 0 opens)",
    )


@dataclass
class HABCCriticConfig:
    hidden: int = option(128, "width of the critics' shared trunk (2 layers)", min=1)
    lr: float = option(1e-3, "Adam learning rate of the critics", min=0.0)
    updates: int = option(100, "critic minibatch updates per iteration", min=0)
    batch_size: int = option(256, "transitions per critic update (per head)", min=1)
    gamma_v: float = option(0.99, "discount of the viability head", min=0.0, max=1.0)
    gamma_e: float = option(0.98, "discount of the efficiency head (-1 reward per step)", min=0.0, max=0.999)
    lam: float = option(
        1.0, "TD(lambda) of the critic targets: 1 regresses the outcome itself, 0 is TD(0)", min=0.0, max=1.0
    )


@dataclass
class HABCActorConfig:
    beta: float = option(5.0, "weights min(exp(beta * A), w_max) (habc and awr)", min=1e-6)
    w_max: float = option(20.0, "largest advantage weight", min=1e-6)
    normalize: bool = option(False, "standardise the advantages over the transitions before weighting")
    per_chunk: bool = option(
        False,
        "weight each sampled chunk as one decision: habc sums its executed steps' one-step advantages "
        "(discounted), awr uses the advantage at the chunk's first state; false weights each step alone",
    )


@dataclass
class HABCGateConfig:
    gate_k: float = option(10.0, "gate sharpness k in g = sigmoid(k (V_v - tau))", min=0.0)
    gate_tau: float = option(0.5, "viability at which the gate is half open", min=0.0, max=1.0)
    intervention_weight: float = option(1.0, "actor weight of intervention (demonstration) steps", min=0.0)


@dataclass
class HABCGRPOConfig:
    clip_low: float = option(0.2, "PPO ratio clip below 1", min=0.0)
    clip_high: float = option(0.28, "PPO ratio clip above 1", min=0.0)


@dataclass
class HABCTrainConfig:
    lr: float = option(3e-4, "AdamW learning rate of the policy", min=0.0)
    lr_schedule: str = option(
        "constant",
        "constant, or cosine: decayed to 0 over the run's iterations",
        choices=("constant", "cosine"),
    )
    weight_decay: float = option(0.0, "AdamW weight decay", min=0.0)
    updates: int = option(32, "actor minibatch updates per iteration", min=0)
    batch_size: int = option(64, "action chunks per actor update", min=1)
    max_grad_norm: float = option(1.0, "gradient clipping norm", min=0.0)
    nan_patience: int = option(5, "non-finite updates in a row before the run stops", min=1)
    buffer_capacity: int = option(
        8000, "transitions kept per kind (policy, intervention), oldest evicted first", min=1
    )
    failure_capacity: int = option(
        1, "transitions of whole failed episodes kept (no method trains on them)", min=1
    )
    demos: str | None = option(
        None, "LeRobot dataset of demonstrations (e.g. the base's OUTPUT_DIR/demos) mixed into actor batches"
    )
    demo_episodes: int = option(
        0,
        "scripted-expert demonstrations of rollout.task to record into OUTPUT_DIR/demos at the start (reset "
        "seeds 0, 1, ...: those `mmrl pretrain vla` records) and mix in like train.demos; 0: none",
        min=0,
    )
    demo_fraction: float = option(
        0.5, "share of each actor batch drawn from train.demos (weight 1, like pretraining)", min=0.0, max=1.0
    )
    state_weight: float = option(
        1.0,
        "weight of the policy's auxiliary object-position loss in actor updates (a policy pretrained "
        "with one; see `mmrl pretrain vla` train.state_weight)",
        min=0.0,
    )


@dataclass
class HABCEvalConfig:
    episodes: int = option(100, "held-out evaluation episodes (deterministic policy)", min=1)
    seed: int = option(
        1_000_000, "reset seed of the first evaluation episode (disjoint from training seeds)", min=0
    )
    num_envs: int = option(
        8,
        "environments stepped in lockstep during evaluation",
        min=1,
        max=1024,
        why="each is a simulator with a renderer",
    )
    videos: int = option(
        2, "GIFs of the final policy on the first held-out episodes, written to OUTPUT_DIR/videos", min=0
    )


@dataclass
class VLAHABCConfig(BaseConfig):
    trainer: str = option("vla_habc", "trainer name", registry="trainer")
    method: str = option("habc", "update rule: habc, awr, bc, dagger or grpo", choices=METHODS)
    model: HABCModelConfig = field(default_factory=HABCModelConfig)
    rollout: HABCRolloutConfig = field(default_factory=HABCRolloutConfig)
    intervention: HABCInterventionConfig = field(default_factory=HABCInterventionConfig)
    critic: HABCCriticConfig = field(default_factory=HABCCriticConfig)
    actor: HABCActorConfig = field(default_factory=HABCActorConfig)
    habc: HABCGateConfig = field(default_factory=HABCGateConfig)
    grpo: HABCGRPOConfig = field(default_factory=HABCGRPOConfig)
    train: HABCTrainConfig = field(default_factory=HABCTrainConfig)
    eval: HABCEvalConfig = field(default_factory=HABCEvalConfig)

    def __post_init__(self) -> None:
        self.rollout.task = checked_task(self.rollout.task, "rollout.task")
        r = self.rollout
        if r.num_envs % r.group_size:
            raise ConfigError(
                f"config error: rollout.group_size = {r.group_size} must divide "
                f"rollout.num_envs = {r.num_envs} (a wave of episodes holds whole groups)"
            )
        if self.method == "grpo" and r.group_size < 2:
            raise ConfigError(
                f"config error: rollout.group_size = {r.group_size}: method grpo compares episodes of "
                "the same reset seed, so it needs rollout.group_size >= 2"
            )
        if self.train.demos and self.train.demo_episodes:
            raise ConfigError(
                f"config error: train.demos = {self.train.demos!r} and train.demo_episodes = "
                f"{self.train.demo_episodes} both give demonstrations: set one (train.demo_episodes=0 "
                "to use the dataset)"
            )
        train_seeds = range(r.seed, r.seed + self.steps * seed_block(self))
        held_out = range(self.eval.seed, self.eval.seed + self.eval.episodes)
        if self.train.demo_episodes > held_out.start:
            raise ConfigError(
                f"config error: train.demo_episodes = {self.train.demo_episodes} records demonstrations from "
                f"reset seeds 0..{self.train.demo_episodes - 1}, which reach the evaluation seeds from "
                f"eval.seed = {self.eval.seed}: record fewer or raise eval.seed"
            )
        if train_seeds.start < held_out.stop and held_out.start < train_seeds.stop:
            raise ConfigError(
                f"config error: eval.seed = {self.eval.seed} makes evaluation seeds "
                f"{held_out.start}..{held_out.stop - 1} overlap the training seeds "
                f"{train_seeds.start}..{train_seeds.stop - 1} (rollout.seed = {r.seed}): "
                "choose seeds that do not overlap"
            )


def check_env_size(cfg: VLAHABCConfig, image_size: int) -> None:
    """Refuse environments and a replay buffer that cannot fit in memory: every environment holds a
    simulator and its renderer, every stored transition a uint8 camera frame (twice while a checkpoint
    copies the buffer); the buffer holds at most its capacity and at most what the run's env-step
    budget collects."""
    envs = cfg.rollout.num_envs + cfg.eval.num_envs
    capacity = 2 * cfg.train.buffer_capacity + cfg.train.failure_capacity
    frames = min(capacity, cfg.steps * cfg.rollout.env_steps)
    check_memory(
        envs * ENV_BYTES + frames * 2 * 3 * image_size**2,
        f"{envs} environments (rollout.num_envs + eval.num_envs) and a replay buffer of {frames} frames of "
        f"{image_size} px (2 x train.buffer_capacity + train.failure_capacity, or steps x rollout.env_steps)",
        ["rollout.num_envs", "eval.num_envs", "train.buffer_capacity"],
    )


def seed_block(cfg: VLAHABCConfig) -> int:
    """Reset seeds reserved per iteration: enough groups for the most waves an iteration can run
    (every episode takes at least one step, so a wave takes at least num_envs steps)."""
    waves = math.ceil(cfg.rollout.env_steps / cfg.rollout.num_envs)
    return waves * (cfg.rollout.num_envs // cfg.rollout.group_size)


# ---------------------------------------------------------------------------------------------
# HABC math (pure functions on tensors)


def gate(viability: Tensor, k: float, tau: float) -> Tensor:
    """g = sigmoid(k (V_v - tau)): near 0 while success is unlikely, near 1 once it is likely."""
    return torch.sigmoid(k * (viability - tau))


def one_step_advantage(
    reward: Tensor, value: Tensor, next_value: Tensor, done: Tensor, gamma: float
) -> Tensor:
    """A = r + gamma (1 - done) V(s') - V(s) per transition, through the shared `td1` estimator."""
    values = torch.stack([value, next_value], -1)
    return ADVANTAGES.get("td1")(reward[:, None], values, done[:, None], gamma=gamma).values[:, 0]


def habc_advantages(
    r_v: Tensor,
    v: Tensor,
    v_next: Tensor,
    done_v: Tensor,
    r_e: Tensor,
    e: Tensor,
    e_next: Tensor,
    done_e: Tensor,
    gamma_v: float,
    gamma_e: float,
    k: float,
    tau: float,
    chunks: tuple[Tensor, Tensor, Tensor] | None = None,
) -> dict[str, Tensor]:
    """A_v, A_e (one-step, each with its own reward, values and terminal flags), the gate g from
    V_v(s), and A = (1 - g) A_v + g A_e, one entry per transition.

    With `chunks` (`executed_chunks`' decisions, rows, executed) one entry per decision instead: A_v
    and A_e are the chunk's advantages (`chunk_advantage`) and g is read at the state where the chunk
    was sampled, so per-step and per-chunk weighting share one gate mix."""
    a_v = one_step_advantage(r_v, v, v_next, done_v, gamma_v)
    a_e = one_step_advantage(r_e, e, e_next, done_e, gamma_e)
    g = gate(v, k, tau)
    if chunks is not None:
        decisions, rows, executed = chunks
        a_v = chunk_advantage(a_v, rows, executed, gamma_v)
        a_e = chunk_advantage(a_e, rows, executed, gamma_e)
        g = g[decisions]
    return {"a_v": a_v, "a_e": a_e, "gate": g, "advantage": (1 - g) * a_v + g * a_e}


def advantage_weights(advantages: Tensor, beta: float, w_max: float, normalize: bool = False) -> Tensor:
    """min(exp(beta A), w_max) through the shared `awr_weights` (whose temperature divides A)."""
    return awr_weights(advantages, beta=1.0 / beta, max_weight=w_max, normalize=normalize)


def executed_chunks(chunk_step: Tensor, seg_left: Tensor, horizon: int) -> tuple[Tensor, Tensor, Tensor]:
    """The policy's decisions as rows of the flat transitions: `decisions` (D,) where a chunk was
    sampled, `rows` (D, horizon) the rows of the steps executed from it (clamped), and `executed`
    (D, horizon) which of those positions were executed from that chunk."""
    decisions = torch.nonzero(chunk_step == 0).flatten()
    offsets = torch.arange(horizon)
    rows = (decisions[:, None] + offsets).clamp(max=len(chunk_step) - 1)
    executed = (offsets < seg_left[decisions, None]) & (chunk_step[rows] == offsets)
    return decisions, rows, executed


def chunk_advantage(step_advantage: Tensor, rows: Tensor, executed: Tensor, gamma: float) -> Tensor:
    """A decision's one-step advantage in the semi-MDP whose actions are chunks: the discounted sum of
    the one-step advantages of the k steps executed from it, sum_i gamma^i A(t+i) (the TD terms
    telescope to r_t + ... + gamma^k V(s_{t+k}) - V(s_t))."""
    discount = gamma ** torch.arange(rows.shape[1], dtype=step_advantage.dtype)
    return (step_advantage[rows] * discount * executed).sum(1)


def viability_rewards(tr: Transitions) -> tuple[Tensor, Tensor]:
    """Intervention-aware outcome rewards of the viability head, and its terminal flags.

    A policy segment ends at its last step: with the episode's outcome when it ends the episode, with
    0 when the expert takes over after it. Intervention rows get reward 0 and are never trained on,
    so the outcome reaches policy-executed steps only."""
    label = (tr.success & tr.seg_ends_episode & ~tr.intervention).float()
    last = tr.last & ~tr.intervention
    return torch.where(last, label, 0.0), last


def head_rows(tr: Transitions) -> tuple[Tensor, Tensor]:
    """Rows each head trains on: viability on every policy-executed step (never an intervention step),
    efficiency on the policy segments that ended in the policy's own success."""
    policy = ~tr.intervention
    return torch.nonzero(policy).flatten(), torch.nonzero(policy & tr.success & tr.seg_ends_episode).flatten()


def efficiency_rewards(tr: Transitions, gamma_e: float) -> tuple[Tensor, Tensor]:
    """-1 per step in units of 1 / (1 - gamma_e), terminal at a successful final step."""
    return torch.full((len(tr),), -(1.0 - gamma_e)), tr.terminated & tr.success


def segment_returns(
    rewards: Tensor,
    values: Tensor,
    next_values: Tensor,
    dones: Tensor,
    tr: Transitions,
    rows: Tensor,
    gamma: float,
    lam: float,
) -> Tensor:
    """TD(lambda) targets of `rows` (whole segments, in order), segment by segment through `gae`."""
    targets = torch.empty(len(rows))
    if not len(rows):
        return targets
    seg = tr.seg[rows]
    bounds = torch.cat(
        [torch.tensor([0]), torch.nonzero(seg[1:] != seg[:-1]).flatten() + 1, torch.tensor([len(rows)])]
    )
    gae = ADVANTAGES.get("gae")
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        r = rows[lo:hi]
        vals = torch.cat([values[r], next_values[r[-1:]]])
        targets[lo:hi] = gae(rewards[r], vals, dones[r], gamma=gamma, lam=lam).returns
    return targets


# ---------------------------------------------------------------------------------------------
# Critics


class Critics(nn.Module):
    """Viability and efficiency heads on one shared trunk over the privileged env state.

    A small MLP on the state vector (not the image): cheap to train every iteration on CPU, and in
    simulation a critic may use what the deployed policy cannot see. Inputs are standardised with
    statistics fixed from the first rollouts. Outputs: V_v = sigmoid(logit) in [0, 1] and the scaled
    efficiency u = (1 - gamma_e) V_e = -sigmoid(.) in [-1, 0].
    """

    def __init__(self, state_dim: int, hidden: int) -> None:
        super().__init__()
        self.trunk = nn.Sequential(
            nn.Linear(state_dim, hidden),
            nn.LayerNorm(hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
        )
        self.heads = nn.Linear(hidden, 2)
        self.register_buffer("mean", torch.zeros(state_dim))
        self.register_buffer("std", torch.ones(state_dim))
        self.register_buffer("ready", torch.tensor(False))

    def fit_normalization(self, states: Tensor) -> None:
        """Fix the input statistics once, from the first states seen."""
        if not bool(self.ready):
            self.mean.copy_(states.mean(0))
            self.std.copy_(states.std(0).clamp(min=1e-3))
            self.ready.fill_(True)

    def forward(self, state: Tensor) -> tuple[Tensor, Tensor]:
        """(viability logit, scaled efficiency u) per state."""
        out = self.heads(self.trunk((state - self.mean) / self.std))
        return out[:, 0], -torch.sigmoid(out[:, 1])


# ---------------------------------------------------------------------------------------------
# Trainer


def _stream(seed: int, step: int, stream: int) -> int:
    """A generator seed per (run seed, iteration, purpose): rollouts and minibatches repeat on resume."""
    return (seed * 1_000_003 + step * 101 + stream) % 2**63


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else math.nan


def _finite(metrics: dict[str, Any]) -> dict[str, Any]:
    """Drop the metrics that had nothing to average this iteration (e.g. no efficiency data yet)."""
    return {k: v for k, v in metrics.items() if not (isinstance(v, float) and math.isnan(v))}


@TRAINERS.register("vla_habc")
class VLAHABCTrainer(Trainer):
    """Online fine-tuning of a pretrained VLAPolicy with HABC or a baseline (see the module docstring)."""

    config_class = VLAHABCConfig
    config: VLAHABCConfig

    def __init__(self, config: VLAHABCConfig, accelerator: Accelerator | None = None) -> None:
        path = shipped_path(config.model.path)
        missing = [name for name in (CONFIG_NAME, WEIGHTS_NAME) if not (path / name).is_file()]
        if missing:
            raise ConfigError(
                f"config error: model.path = {config.model.path!r} holds no policy "
                f"({' or '.join(missing)} missing): run `mmrl pretrain vla` first, or set model.path "
                "to a directory written by VLAPolicy.save_pretrained"
            )
        super().__init__(config, accelerator)

    # ----- setup -----------------------------------------------------------------------------
    def setup(self) -> None:
        """Load the policy, make the training envs, the expert, the critics and the replay buffer."""
        import sim
        from sim.experts import expert_for

        cfg = self.config
        if self.accelerator.num_processes > 1:
            raise ConfigError(
                "the vla_habc trainer runs in one process: "
                "launch it without accelerate's multi-process options"
            )
        try:
            self.policy = VLAPolicy.from_pretrained(
                shipped_path(cfg.model.path), device=self.accelerator.device
            ).train()
        except ConfigError as err:
            raise ConfigError(f"config error: model.path = {cfg.model.path!r}: {err}") from None
        check_env_size(cfg, self.policy.config.image_size)
        kwargs: dict[str, Any] = {"obs_mode": "state+rgb", "image_size": self.policy.config.image_size}
        if cfg.rollout.max_episode_steps:
            kwargs["max_episode_steps"] = cfg.rollout.max_episode_steps
        self.envs = [sim.make(cfg.rollout.task, **kwargs) for _ in range(cfg.rollout.num_envs)]
        proprio_dim = self.envs[0].get_wrapper_attr("proprio_dim")
        if proprio_dim != self.policy.config.proprio_dim:
            raise ConfigError(
                f"config error: model.path = {cfg.model.path!r} expects proprio_dim = "
                f"{self.policy.config.proprio_dim}, task {cfg.rollout.task} gives {proprio_dim}: "
                "use a policy pretrained on a compatible task"
            )
        self.expert = expert_for(cfg.rollout.task)
        added = self.policy.add_words(instruction_words(self.envs[0].get_wrapper_attr("instruction")))
        if added and self.is_main:  # before the optimizer, which must hold the grown embedding
            print(f"added the words {', '.join(added)} of task {cfg.rollout.task} to the policy's vocabulary")
        optimizer = torch.optim.AdamW(
            self.policy.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay
        )
        self.model, self.optimizer = self.accelerator.prepare(self.policy, optimizer)
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
        return frame_tensors(dataset, self.policy)

    @property
    def horizon(self) -> int:
        """Actions per predicted chunk: the length of every actor target."""
        return self.policy.config.horizon

    # ----- state that survives a restart -------------------------------------------------------
    def trainer_state(self) -> dict[str, Any]:
        """Critics, their optimizer, the replay buffer (its own save format, as arrays) and counters."""
        with tempfile.TemporaryDirectory() as tmp:
            self.buffer.save(tmp)
            buffer = {
                "arrays": load_file(os.path.join(tmp, "buffer.safetensors")),
                "meta": (Path(tmp) / "buffer.json").read_text(),
            }
        return {
            "critics": self.critics.state_dict(),
            "critic_optimizer": self.critic_optimizer.state_dict(),
            "buffer": buffer,
            "episode_length": {str(k): v for k, v in self.episode_length.items()},
            "counters": dict(self.counters),
        }

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

    # ----- one iteration -----------------------------------------------------------------------
    def collect(self, step: int) -> list[Episode]:
        """Waves of num_envs episodes until the iteration's env-step budget is reached."""
        cfg, r, iv = self.config, self.config.rollout, self.config.intervention
        generator = torch.Generator().manual_seed(_stream(cfg.seed, step, 0))
        takeover = (
            TakeoverRule(
                iv.threshold,
                iv.takeover_steps,
                window=iv.window,
                deadline=iv.deadline,
                max_per_episode=iv.max_per_episode,
                release_guard=iv.release_guard,
            )
            if iv.enabled
            else None
        )
        groups_per_wave = r.num_envs // r.group_size
        first_group = r.seed + step * seed_block(cfg)
        episodes: list[Episode] = []
        steps, wave = 0, 0
        while steps < r.env_steps:
            groups = [first_group + wave * groups_per_wave + j // r.group_size for j in range(r.num_envs)]
            batch = rollouts(
                self.policy, self.envs, self.expert, groups, groups, takeover, generator, r.std_scale
            )
            episodes += batch
            steps += sum(e.length for e in batch)
            wave += 1
        return episodes

    def train_step(self, step: int) -> dict[str, Any]:
        """One iteration: supervised rollouts into the buffer, then the method's critic and actor updates."""
        cfg = self.config
        episodes = self.collect(step)
        for episode in episodes:
            self.episode_length[add_to_buffer(self.buffer, episode)] = episode.length
        kept = {s.episode for kind in ("policy", "intervention") for s in self.buffer.segments[kind]}
        self.episode_length = {k: v for k, v in self.episode_length.items() if k in kept}
        lengths = np.array([e.length for e in episodes])
        success = np.array([e.success for e in episodes])
        takeovers = np.array([e.interventions for e in episodes])
        expert_steps = sum(int(e.is_intervention.sum()) for e in episodes)
        self.counters["env_steps"] += int(lengths.sum())
        self.counters["episodes"] += len(episodes)
        self.counters["interventions"] += int(takeovers.sum())
        self.counters["successes"] += int(success.sum())
        sizes = self.buffer.sizes()
        metrics: dict[str, Any] = {
            "success_rate": float(success.mean()),
            "autonomous_success_rate": float((success & (takeovers == 0)).mean()),
            "interventions_per_episode": float(takeovers.mean()),
            "intervention_step_fraction": expert_steps / float(lengths.sum()),
            "episode_steps": float(lengths.mean()),
            "rollout_episodes": len(episodes),
            "env_steps": self.counters["env_steps"],
            "episodes": self.counters["episodes"],
            "buffer_policy": sizes["policy"],
            "buffer_intervention": sizes["intervention"],
        }
        # the iteration's learning rate, from the config alone: a run resumed with more steps re-spreads it
        lr = cfg.train.lr * (warmup_cosine(step, 0, cfg.steps) if cfg.train.lr_schedule == "cosine" else 1.0)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        metrics["lr"] = lr
        generator = torch.Generator().manual_seed(_stream(cfg.seed, step, 1))
        update = self.update_grpo(episodes, generator) if cfg.method == "grpo" else self.update(generator)
        metrics.update(update)
        return _finite(metrics)

    def update(self, generator: torch.Generator) -> dict[str, Any]:
        """The critic and actor updates of every method but grpo, on the whole replay buffer."""
        cfg = self.config
        metrics: dict[str, Any] = {}
        tr = Transitions.from_buffer(self.buffer, self.episode_length)
        if cfg.method == "habc":
            metrics.update(self.train_critics(tr, generator, outcome_only=False))
            weights, rows, stats = self.habc_weights(tr)
        elif cfg.method == "awr":
            metrics.update(self.train_critics(tr, generator, outcome_only=True))
            weights, rows, stats = self.awr_weights(tr)
        elif cfg.method == "bc":
            rows = tr.actor_rows[(tr.intervention | tr.success)[tr.actor_rows]]
            weights, stats = torch.ones(len(tr)), {}
        else:  # dagger: every visited state, relabelled by the expert
            rows, weights, stats = torch.arange(len(tr)), torch.ones(len(tr)), {}
        metrics.update(stats)
        metrics.update(self.update_actor(tr, rows, weights, generator, relabel=cfg.method == "dagger"))
        return metrics

    # ----- critics -----------------------------------------------------------------------------
    def critic_targets(self, tr: Transitions, outcome_only: bool) -> dict[str, Tensor]:
        """Rows and targets of each head. outcome_only (awr): the viability head regresses the Monte-Carlo
        return of every step and the efficiency head is unused."""
        c = self.config.critic
        if outcome_only:
            rows = torch.arange(len(tr))
            target = tr.success.float() * c.gamma_v ** (tr.steps_left - 1).float()
            return {"v_rows": rows, "v_target": target, "e_rows": rows[:0], "e_target": torch.zeros(0)}
        with torch.no_grad():
            logit, u = self.critics(tr.state)
            logit_next, u_next = self.critics(tr.next_state)
        r_v, done_v = viability_rewards(tr)
        r_e, done_e = efficiency_rewards(tr, c.gamma_e)
        v_rows, e_rows = head_rows(tr)
        v_target = segment_returns(
            r_v, torch.sigmoid(logit), torch.sigmoid(logit_next), done_v, tr, v_rows, c.gamma_v, c.lam
        )
        e_target = segment_returns(r_e, u, u_next, done_e, tr, e_rows, c.gamma_e, c.lam)
        return {
            "v_rows": v_rows,
            "v_target": v_target.clamp(0, 1),
            "e_rows": e_rows,
            "e_target": e_target.clamp(-1, 0),
        }

    def train_critics(
        self, tr: Transitions, generator: torch.Generator, outcome_only: bool
    ) -> dict[str, Any]:
        """Minibatch updates of the critic heads on their targets (BCE for viability, MSE for u)."""
        c = self.config.critic
        self.critics.fit_normalization(tr.state)
        targets = self.critic_targets(tr, outcome_only)
        v_losses, e_losses, skipped = [], [], 0
        for _ in range(c.updates if len(targets["v_rows"]) else 0):
            loss = torch.zeros(())
            v_pick = torch.randint(len(targets["v_rows"]), (c.batch_size,), generator=generator)
            logit, _ = self.critics(tr.state[targets["v_rows"][v_pick]])
            v_loss = F.binary_cross_entropy_with_logits(logit, targets["v_target"][v_pick])
            loss = loss + v_loss
            if len(targets["e_rows"]):
                e_pick = torch.randint(len(targets["e_rows"]), (c.batch_size,), generator=generator)
                _, u = self.critics(tr.state[targets["e_rows"][e_pick]])
                e_loss = F.mse_loss(u, targets["e_target"][e_pick])
                loss = loss + e_loss
                e_losses.append(e_loss.item())
            if not torch.isfinite(loss):
                skipped += 1
                continue
            self.critic_optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(self.critics.parameters(), 1.0)
            self.critic_optimizer.step()
            v_losses.append(v_loss.item())
        return {
            "critic_v_loss": _mean(v_losses),
            "critic_e_loss": _mean(e_losses),
            "critic_e_transitions": len(targets["e_rows"]),
            "critic_skipped_updates": skipped,
        }

    def habc_weights(self, tr: Transitions) -> tuple[Tensor, Tensor, dict[str, Any]]:
        """Per-transition actor weights: clipped exp(beta A) on policy steps, intervention_weight on
        intervention steps."""
        c, a, h = self.config.critic, self.config.actor, self.config.habc
        with torch.no_grad():
            logit, u = self.critics(tr.state)
            logit_next, u_next = self.critics(tr.next_state)
        r_v, done_v = viability_rewards(tr)
        r_e, done_e = efficiency_rewards(tr, c.gamma_e)
        chunks = executed_chunks(tr.chunk_step, tr.seg_left, self.horizon) if a.per_chunk else None
        out = habc_advantages(
            r_v, torch.sigmoid(logit), torch.sigmoid(logit_next), done_v, r_e, u, u_next, done_e,
            c.gamma_v, c.gamma_e, h.gate_k, h.gate_tau, chunks,
        )  # fmt: skip
        policy = ~tr.intervention
        weights = torch.full((len(tr),), h.intervention_weight)
        stats: dict[str, Any] = {}
        if not policy.any():
            return weights, tr.actor_rows, stats
        # per chunk: one entry per decision; per step: one per transition, of which the policy's count
        a_v, a_e, g, advantage = (
            out[k] if chunks is not None else out[k][policy] for k in ("a_v", "a_e", "gate", "advantage")
        )
        w = advantage_weights(advantage, a.beta, a.w_max, a.normalize)
        if chunks is not None:  # a decision's weight on every step executed from its chunk
            _, rows, executed = chunks
            weights[rows[executed]] = w[:, None].expand_as(rows)[executed]
        else:
            weights[policy] = w
        stats = {
            "gate_mean": float(g.mean()),
            "viability_mean": float(torch.sigmoid(logit)[policy].mean()),
            "adv_v_mean": float(a_v.mean()),
            "adv_e_mean": float(a_e.mean()),
            "adv_std": float(advantage.std(unbiased=False)),
            **self.weight_stats(w),
        }
        return weights, tr.actor_rows, stats

    def awr_weights(self, tr: Transitions) -> tuple[Tensor, Tensor, dict[str, Any]]:
        """Monte-Carlo advantages G - V(s) over every step; the same clipped exponential weights."""
        a, c = self.config.actor, self.config.critic
        with torch.no_grad():
            value = torch.sigmoid(self.critics(tr.state)[0])
        advantage = tr.success.float() * c.gamma_v ** (tr.steps_left - 1).float() - value
        w = advantage_weights(advantage, a.beta, a.w_max, a.normalize)
        if a.per_chunk:  # every step executed from a chunk takes the weight of the chunk's first state
            decisions, rows, executed = executed_chunks(tr.chunk_step, tr.seg_left, self.horizon)
            w[rows[executed]] = w[decisions][:, None].expand_as(rows)[executed]
        stats = {"viability_mean": float(value.mean()), "adv_std": float(advantage.std(unbiased=False))}
        return w, tr.actor_rows, stats | self.weight_stats(w)

    def weight_stats(self, w: Tensor) -> dict[str, float]:
        """Mean, max and clipped share of the policy steps' actor weights."""
        return {
            "weight_mean": float(w.mean()),
            "weight_max": float(w.max()),
            "weight_clip_fraction": float((w >= self.config.actor.w_max * (1 - 1e-6)).float().mean()),
        }

    # ----- actor updates ------------------------------------------------------------------------
    def with_state_loss(self, loss: Tensor, dist: ClippedGaussian) -> Tensor:
        """`loss` plus `train.state_weight` times the policy's auxiliary object-position loss, when the
        batch had the env state and the policy has the head: every actor update keeps it (and so every
        parameter gets a gradient, as DDP requires)."""
        if dist.state_loss is None or self.config.train.state_weight == 0:
            return loss
        return loss + self.config.train.state_weight * dist.state_loss

    @staticmethod
    def state_loss_metric(dist: ClippedGaussian) -> dict[str, float]:
        """The update's auxiliary loss for the metrics, when the policy computed one."""
        return {} if dist.state_loss is None else {"state_loss": dist.state_loss.item()}

    def actor_step(self, loss: Tensor) -> dict[str, float] | None:
        """Backward and step; None (the update skipped, as a NaN is data, not a crash) if not finite."""
        cfg = self.config.train
        try:
            grad_norm = self.optimizer_step(loss, cfg.max_grad_norm, cfg.nan_patience, what="actor ")
        except StepSkipped:
            return None
        return {"loss": loss.item(), "grad_norm": float(grad_norm)}

    def update_actor(
        self, tr: Transitions, rows: Tensor, weights: Tensor, generator: torch.Generator, relabel: bool
    ) -> dict[str, Any]:
        """Weighted chunk regression on minibatches drawn uniformly from `rows`, with a `demo_fraction`
        share of each batch drawn from the demonstrations (weight 1) when `train.demos` is set."""
        cfg = self.config.train
        horizon = self.horizon
        n_demo = round(cfg.batch_size * cfg.demo_fraction) if self.demo_frames is not None else 0
        n_online = cfg.batch_size - n_demo if len(rows) else 0
        device = self.accelerator.device
        results: list[dict[str, float]] = []
        skipped = 0
        for _ in range(cfg.updates if n_online + n_demo else 0):
            parts = []  # (inputs, target actions, mask, weight), each (B, horizon, ...)
            if n_online:
                pick = rows[torch.randint(len(rows), (n_online,), generator=generator)]
                chunk, mask = tr.chunk_rows(pick, horizon, executed=not relabel)
                if relabel:
                    targets = self.expert(tr.state[chunk].reshape(-1, tr.state.shape[1]).numpy())
                    actions = torch.from_numpy(targets).reshape(*chunk.shape, -1).float()
                else:
                    actions = tr.action[chunk]
                inputs = tr.policy_inputs(self.policy, pick) | {"state": tr.state[pick].to(device)}
                parts.append((inputs, actions, mask, weights[chunk]))
            if n_demo:
                demo = torch.randint(len(self.demo_frames["actions"]), (n_demo,), generator=generator)
                frames = {k: v[demo] for k, v in self.demo_frames.items()}
                inputs = {k: frames[k].to(device) for k in ("image", "proprio", "state", "tokens")}
                parts.append((inputs, frames["actions"], frames["mask"], torch.ones(n_demo, horizon)))
            inputs = {k: torch.cat([p[0][k] for p in parts]) for k in parts[0][0]}
            actions, mask, weight = (torch.cat([p[i] for p in parts]).to(device) for i in (1, 2, 3))
            self.model.train()
            dist = self.model(inputs)
            loss = aggregate_loss(-weight * dist.log_prob(actions).sum(-1), mask, "token_mean")
            out = self.actor_step(self.with_state_loss(loss, dist))
            if out is None:
                skipped += 1
            else:
                results.append(out | self.state_loss_metric(dist))
        return {
            "loss": _mean([r["loss"] for r in results]),
            "grad_norm": _mean([r["grad_norm"] for r in results]),
            "state_loss": _mean([r["state_loss"] for r in results if "state_loss" in r]),
            "actor_updates": len(results),
            "skipped_updates": skipped,
            "skipped_steps": self.skipped_steps,
        }

    def update_grpo(self, episodes: list[Episode], generator: torch.Generator) -> dict[str, Any]:
        """PPO-clip on the executed part of every chunk the policy sampled in this iteration's episodes,
        with the episode's group-normalised binary success as advantage (zero-advantage chunks dropped)."""
        cfg, g, scale = self.config.train, self.config.grpo, self.config.rollout.std_scale
        horizon = self.horizon
        rewards = torch.tensor([float(e.success) for e in episodes])
        adv = ADVANTAGES.get("grpo")(
            rewards=rewards, group_ids=torch.tensor([e.group for e in episodes])
        ).values
        chunks = [
            (i, t0, k) for i, e in enumerate(episodes) for t0, k in e.decisions if k > 0 and adv[i] != 0
        ]
        stats: dict[str, Any] = {"grpo_chunks": len(chunks), "grpo_adv_abs_mean": float(adv.abs().mean())}
        if not chunks:
            return stats | {"loss": math.nan, "actor_updates": 0, "skipped_updates": 0}

        def batch_of(items: list[tuple[int, int, int]]) -> tuple[dict[str, Tensor], Tensor, Tensor, Tensor]:
            obs = {
                "image": np.stack([episodes[i].images[t0] for i, t0, _ in items]),
                "state": np.stack([episodes[i].states[t0] for i, t0, _ in items]),
            }
            actions = np.zeros((len(items), horizon, episodes[0].actions.shape[1]), np.float32)
            mask = torch.zeros(len(items), horizon, dtype=torch.bool)
            for b, (i, t0, k) in enumerate(items):
                actions[b, :k] = episodes[i].actions[t0 : t0 + k]
                mask[b, :k] = True
            a = torch.tensor([float(adv[i]) for i, _, _ in items])
            device = self.accelerator.device
            inputs = self.policy.prepare(obs, [episodes[i].instruction for i, _, _ in items])
            inputs["state"] = torch.as_tensor(obs["state"], dtype=torch.float32, device=device)
            return inputs, torch.from_numpy(actions).to(device), mask.to(device), a.to(device)

        old_parts = []
        with torch.no_grad():  # the behaviour log-probs: the policy has not changed since the rollouts
            for start in range(0, len(chunks), cfg.batch_size):
                inputs, actions, _, _ = batch_of(chunks[start : start + cfg.batch_size])
                old_parts.append(self.policy(inputs).scaled(scale).log_prob(actions).sum(-1))
        old = torch.cat(old_parts)
        results, metrics, skipped = [], [], 0
        order = torch.randperm(len(chunks), generator=generator)
        cursor = 0
        for _ in range(cfg.updates):
            if cursor >= len(order):
                order, cursor = torch.randperm(len(chunks), generator=generator), 0
            pick = order[cursor : cursor + cfg.batch_size]
            cursor += cfg.batch_size
            inputs, actions, mask, a = batch_of([chunks[i] for i in pick.tolist()])
            self.model.train()
            dist = self.model(inputs)
            logp = dist.scaled(scale).log_prob(actions).sum(-1)
            out = LOSSES.get("ppo_clip")(logp, old[pick], a, mask, clip_low=g.clip_low, clip_high=g.clip_high)
            step = self.actor_step(self.with_state_loss(out.loss, dist))
            if step is None:
                skipped += 1
                continue
            results.append(step | self.state_loss_metric(dist))
            metrics.append({k: float(v) for k, v in out.metrics.items()})
        return stats | {
            "loss": _mean([r["loss"] for r in results]),
            "grad_norm": _mean([r["grad_norm"] for r in results]),
            "state_loss": _mean([r["state_loss"] for r in results if "state_loss" in r]),
            "clip_fraction": _mean([m["clip_fraction"] for m in metrics]),
            "approx_kl": _mean([m["approx_kl"] for m in metrics]),
            "actor_updates": len(results),
            "skipped_updates": skipped,
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
                self.write_videos()
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
        episodes = run_eval_episodes(
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


def success_curve(run_dir: Path, counters: dict[str, int]) -> list[tuple[int, int, float]]:
    """(env steps, episodes, held-out success) at every evaluation of a run: before training (0, 0),
    each `eval_every` row of metrics.jsonl, and after training (the final counters)."""
    evaluations = json.loads((run_dir / "eval.json").read_text())
    curve = [(0, 0, evaluations["before"]["success_rate"])] if "before" in evaluations else []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "eval_success_rate" in row:
            curve.append((row["env_steps"], row["episodes"], row["eval_success_rate"]))
    if "after" in evaluations and (not curve or curve[-1][0] != counters["env_steps"]):
        curve.append((counters["env_steps"], counters["episodes"], evaluations["after"]["success_rate"]))
    return curve


def episodes_to(curve: list[tuple[int, int, float]], rate: float) -> int | None:
    """Training episodes before the first evaluation at or above `rate` (None: never reached)."""
    return next((episodes for _, episodes, success in curve if success >= rate), None)


def plot_success(curve: list[tuple[int, int, float]], episodes: int, method: str, path: Path) -> None:
    """Held-out success against env steps with Wilson 95% intervals, episodes marked on the points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, rollouts, rates = zip(*curve, strict=True) if curve else ((), (), ())
    intervals = [wilson_interval(round(rate * episodes), episodes) for rate in rates]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.errorbar(
        steps,
        rates,
        yerr=[
            [r - lo for r, (lo, _) in zip(rates, intervals, strict=True)],
            [hi - r for r, (_, hi) in zip(rates, intervals, strict=True)],
        ],
        marker="o",
        capsize=3,
        label=f"{method}: held-out success ({episodes} episodes, Wilson 95%)",
    )
    for x, y, n in zip(steps, rates, rollouts, strict=True):
        ax.annotate(f"{n} ep.", (x, y), textcoords="offset points", xytext=(0, 8), ha="center", fontsize=7)
    ax.axhline(0.8, color="grey", linestyle=":", linewidth=1)
    ax.set(xlabel="environment steps (policy and expert)", ylabel="success rate", ylim=(0, 1.05))
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


__all__ = [
    "METHODS",
    "Critics",
    "VLAHABCConfig",
    "VLAHABCTrainer",
    "advantage_weights",
    "efficiency_rewards",
    "episodes_to",
    "gate",
    "habc_advantages",
    "plot_success",
    "success_curve",
    "head_rows",
    "one_step_advantage",
    "viability_rewards",
]
