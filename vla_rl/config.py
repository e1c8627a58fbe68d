"""Config of the `vla_online` trainer (`mmrl train vla/habc`, vla/awr, vla/bc, vla/dagger, vla/grpo): one
dataclass per section, the checks that need more than one field, and the size check made at setup.

`method` picks the update rule (`vla_rl.methods.UPDATES`): habc, awr, bc and dagger learn from the replay
buffer (`vla_rl.methods.buffer`), grpo from each iteration's own episodes (`vla_rl.methods.grpo`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mmrl.advantages import check_group_size
from mmrl.config import BaseConfig, ConfigError, option
from mmrl.registry import ADVANTAGES
from mmrl.resources import check_memory
from mmrl.samplers import build_sampler
from vla_rl.branching import BranchPlan
from vla_rl.evaluate import TASK_HELP
from vla_rl.online import GroupSeeds
from vla_rl.pretrain import checked_task
from vla_rl.supervisor import TakeoverConfig

# the update rules (`vla_rl.methods.UPDATES`): the replay-buffer methods, then grpo
METHODS = ("habc", "awr", "bc", "dagger", "grpo")
# the parts of HABC that habc.ablate may take out (`vla_rl.methods.habc`)
ABLATIONS = ("viability_critic", "efficiency_critic", "gate", "intervention_credit")
ENV_BYTES = 24 * 2**20  # one simulated task with its camera renderer (rough)


@dataclass
class OnlineModelConfig:
    path: str = option(
        "vla_rl/assets/tiny_vla",
        "VLAPolicy directory to start from (default: the shipped base; `mmrl pretrain vla` remakes it)",
    )


@dataclass
class OnlineRolloutConfig:
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
        100_000,
        "first training reset seed; every iteration uses its own block of seeds (with rollout.task_variants, "
        "the first seed of the pool)",
        min=0,
    )
    max_episode_steps: int = option(0, "time limit of training episodes (0: the task's own)", min=0)
    std_scale: float = option(
        0.3, "exploration: sample chunks with the policy's std times this (grpo's log-probs too)", min=1e-6
    )
    task_variants: int = option(
        0,
        "pool of training reset seeds rollout.seed .. rollout.seed + task_variants - 1 that rollout.sampler "
        "draws each group's from, fed each group's successes (0: fresh seeds every iteration)",
        min=0,
    )
    sampler: str = option(
        "uniform",
        "with rollout.task_variants, which variant each group gets: uniform, beta_thompson (steers towards "
        "variants solved about half the time), dynamic_filter (grpo skips groups outside its success range)",
        registry="sampler",
    )
    sampler_options: dict = option(
        {}, "keyword options of rollout.sampler, e.g. {target: 0.5} or {lo: 0.25, hi: 0.75}"
    )


@dataclass
class CriticConfig:
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
class ActorConfig:
    beta: float = option(5.0, "weights min(exp(beta * A), w_max) (habc and awr)", min=1e-6)
    w_max: float = option(20.0, "largest advantage weight", min=1e-6)
    normalize: bool = option(False, "standardise the advantages over the transitions before weighting")
    per_chunk: bool = option(
        False,
        "weight each sampled chunk as one decision: habc sums its executed steps' one-step advantages "
        "(discounted), awr uses the advantage at the chunk's first state; false weights each step alone",
    )


@dataclass
class HABCConfig:
    gate_k: float = option(10.0, "gate sharpness k in g = sigmoid(k (V_v - tau))", min=0.0)
    gate_tau: float = option(0.5, "viability at which the gate is half open", min=0.0, max=1.0)
    intervention_weight: float = option(1.0, "actor weight of intervention (demonstration) steps", min=0.0)
    ablate: list[str] = option(
        [],
        "HABC's parts taken out, for ablations (method habc): viability_critic (A = A_e), "
        "efficiency_critic (A = A_v), gate (a fixed even mix), intervention_credit (every policy "
        "segment gets its episode's outcome)",
    )


@dataclass
class GRPOConfig:
    advantage: str | None = option(
        None,
        "advantage estimator on binary success: a group one over the episodes of each reset seed (with "
        "grpo.branch_every > 0, over each tree's leaves, every leaf's whole episode trained with its "
        "advantage), or a tree one over each branched group's tree, every edge trained once with its "
        "node's (null: grpo, or tree_depthwise when branching)",
        registry="advantage",
        kinds=("group", "tree"),
    )
    branch_every: int = option(
        0,
        "snapshot branching: sampled chunks between branch points, where a group's branch saves the "
        "MuJoCo state and splits into grpo.branching children that continue from it, instead of every "
        "episode replaying the shared prefix from reset (0: off)",
        min=0,
    )
    branching: list[int] = option(
        [2, 2],
        "children per branch point by depth, the reset state's first (1 past the end); a branch that ends "
        "hands its unused leaf slots back to its parent, so groups keep rollout.group_size leaves",
        min=1,
    )
    loss: str = option(
        "ppo_clip",
        "policy loss on the executed actions' log-probs, called with grpo.clip_low and grpo.clip_high",
        registry="loss",
        kinds=("policy",),
    )
    clip_low: float = option(0.2, "PPO ratio clip below 1", min=0.0)
    clip_high: float = option(0.28, "PPO ratio clip above 1", min=0.0)


@dataclass
class OnlineTrainConfig:
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
class OnlineEvalConfig:
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
class VLAOnlineConfig(BaseConfig):
    trainer: str = option("vla_online", "trainer name", registry="trainer")
    method: str = option("habc", f"update rule: {', '.join(METHODS[:-1])} or {METHODS[-1]}", choices=METHODS)
    model: OnlineModelConfig = field(default_factory=OnlineModelConfig)
    rollout: OnlineRolloutConfig = field(default_factory=OnlineRolloutConfig)
    intervention: TakeoverConfig = field(default_factory=TakeoverConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    habc: HABCConfig = field(default_factory=HABCConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    train: OnlineTrainConfig = field(default_factory=OnlineTrainConfig)
    eval: OnlineEvalConfig = field(default_factory=OnlineEvalConfig)

    def __post_init__(self) -> None:
        self.rollout.task = checked_task(self.rollout.task, "rollout.task")
        if self.grpo.advantage is None:
            self.grpo.advantage = "tree_depthwise" if self.grpo.branch_every else "grpo"
        r = self.rollout
        if r.num_envs % r.group_size:
            raise ConfigError(
                f"config error: rollout.group_size = {r.group_size} must divide "
                f"rollout.num_envs = {r.num_envs} (a wave of episodes holds whole groups)"
            )
        if self.method == "grpo":
            if r.group_size < 2:
                raise ConfigError(
                    f"config error: rollout.group_size = {r.group_size}: method grpo compares episodes of "
                    "the same reset seed, so it needs rollout.group_size >= 2"
                )
            self.check_grpo_advantage()
        elif self.grpo.branch_every:
            raise ConfigError(
                f"config error: grpo.branch_every = {self.grpo.branch_every} branches GRPO groups, but "
                f"method = {self.method!r}: use method=grpo, or grpo.branch_every=0"
            )
        self.check_ablations()
        if self.train.demos and self.train.demo_episodes:
            raise ConfigError(
                f"config error: train.demos = {self.train.demos!r} and train.demo_episodes = "
                f"{self.train.demo_episodes} both give demonstrations: set one (train.demo_episodes=0 "
                "to use the dataset)"
            )
        self.check_task_variants()
        train_seeds = range(r.seed, r.seed + (r.task_variants or self.steps * seed_block(self)))
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

    def check_task_variants(self) -> None:
        """A sampler needs a pool of variants, at least one per group of a wave, and options it takes."""
        r = self.rollout
        if not r.task_variants:
            if r.sampler != "uniform" or r.sampler_options:
                raise ConfigError(
                    f"config error: rollout.sampler = {r.sampler!r} (options {r.sampler_options}) draws from "
                    "the pool of rollout.task_variants, but rollout.task_variants = 0 gives every group a "
                    "fresh seed: set rollout.task_variants, e.g. 64"
                )
            return
        per_wave = r.num_envs // r.group_size
        if r.task_variants < per_wave:
            raise ConfigError(
                f"config error: rollout.task_variants = {r.task_variants} is fewer than the {per_wave} "
                "groups of a wave (rollout.num_envs / rollout.group_size): raise it"
            )
        build_sampler(r.sampler, r.sampler_options, r.task_variants, self.seed, "rollout.sampler_options")

    def check_ablations(self) -> None:
        ablate = self.habc.ablate
        unknown = [name for name in ablate if name not in ABLATIONS]
        if unknown:
            raise ConfigError(
                f"config error: habc.ablate = {ablate}: unknown part(s) {unknown}; "
                f"choose from {list(ABLATIONS)}"
            )
        if {"viability_critic", "efficiency_critic"} <= set(ablate):
            raise ConfigError(
                f"config error: habc.ablate = {ablate} takes out both critics, which leaves no advantage: "
                "keep one (the AWR baseline is method=awr)"
            )
        if ablate and self.method != "habc":
            raise ConfigError(
                f"config error: habc.ablate = {ablate} takes parts out of HABC, but method = "
                f"{self.method!r}: use method=habc, or habc.ablate=[]"
            )

    def check_grpo_advantage(self) -> None:
        """A flat group needs a group advantage (of a size it accepts); a branched one, a group advantage
        of a size it accepts or a tree advantage, no take-overs (the supervisor is not part of a
        snapshot) and a branching list."""
        g, r = self.grpo, self.rollout
        tree = ADVANTAGES.has_kind(g.advantage, "tree")
        if not tree:  # a flat group, or a tree's leaves
            check_group_size(g.advantage, r.group_size, "rollout.group_size")
        if not g.branch_every:
            if tree:
                raise ConfigError(
                    f"config error: grpo.advantage = {g.advantage!r} scores the nodes of branched groups, "
                    "but grpo.branch_every = 0 runs flat groups: use a group advantage such as grpo, or "
                    "set grpo.branch_every > 0"
                )
            return
        if not g.branching:
            raise ConfigError(
                "config error: grpo.branching = []: give the number of children of the reset state at least, "
                f"e.g. [{r.group_size}]"
            )
        if self.intervention.enabled:
            raise ConfigError(
                f"config error: intervention.enabled = true with grpo.branch_every = {g.branch_every}: "
                "the supervisor's state is not part of a snapshot, so branched groups run without "
                "take-overs: set intervention.enabled=false"
            )


def branch_plan(cfg: VLAOnlineConfig) -> BranchPlan:
    """How the config's GRPO groups branch (`vla_rl.branching`)."""
    return BranchPlan(cfg.rollout.group_size, cfg.grpo.branch_every, tuple(cfg.grpo.branching))


def check_env_size(cfg: VLAOnlineConfig, image_size: int) -> None:
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


def seed_block(cfg: VLAOnlineConfig) -> int:
    """Reset seeds reserved per iteration: enough groups for the most waves an iteration can run
    (every episode takes at least one step, so a wave takes at least num_envs steps)."""
    waves = math.ceil(cfg.rollout.env_steps / cfg.rollout.num_envs)
    return waves * (cfg.rollout.num_envs // cfg.rollout.group_size)


def group_seeds(cfg: VLAOnlineConfig) -> GroupSeeds:
    """The reset seeds of the config's groups: fresh ones every iteration, or with
    rollout.task_variants the sampler's draws from the pool."""
    r = cfg.rollout
    sampler = (
        build_sampler(r.sampler, r.sampler_options, r.task_variants, cfg.seed, "rollout.sampler_options")
        if r.task_variants
        else None
    )
    return GroupSeeds(r.seed, r.group_size, r.num_envs // r.group_size, seed_block(cfg), sampler)
