"""The `branch_grpo` config: one dataclass per section, and the checks that refuse a config whose
pieces do not fit together (a split the schedule does not have, a pruned depth the tree does not
have, a leaf-only advantage on a branching tree) before any model is loaded."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mmrl.advantages import check_group_size
from mmrl.config import BaseConfig, ConfigError, option
from mmrl.registry import ADVANTAGES


@dataclass
class ModelConfig:
    path: str = option(
        "diffusion_rl/assets/tiny_flow",
        "local model directory: FlowPipeline.save_pretrained output or a diffusers pipeline (SD3, SD1.x)",
    )
    lora_rank: int = option(0, "LoRA rank on the denoiser's attention; 0 trains every weight", min=0)
    lora_alpha: float = option(0.0, "LoRA alpha (0: equal to the rank)", min=0.0)


@dataclass
class RolloutConfig:
    prompts_per_step: int = option(4, "prompts per step on each process", min=1)
    steps: int = option(20, "denoising steps", min=1)
    image_size: int | None = option(
        None,
        "image side in pixels (null: the model's own size)",
        min=1,
        max=4096,
        why="models draw up to 2048 px",
    )
    guidance_scale: float = option(3.0, "classifier-free guidance scale (1: none)", min=1.0)
    sde: Literal["flow_grpo", "dance_grpo", "ddim"] = option("flow_grpo", "SDE form of the stochastic steps")
    noise_level: float = option(0.7, "Flow-GRPO a / DanceGRPO eta / DDIM eta", min=0.0)
    split_steps: list[int] = option([0, 3, 6, 9], "steps where every node branches (flat GRPO: [0])", min=0)
    branch_factor: int = option(
        2,
        "children per node at a split (flat GRPO: the group size)",
        min=2,
        max=1024,
        why="groups hold 4 to 256",
    )
    split_noise_scale: float = option(1.0, "noise multiplier at split steps", min=0.0)
    shared_initial_noise: bool = option(
        True,
        "children of a split at step 0 start from their parent's noise (DanceGRPO); false: each from its "
        "own (Flow-GRPO), which costs one more model evaluation per child",
    )
    sde_window: list[int] | None = option(None, "[start, end): SDE only there and at splits (Mix); null: all")
    ode_stride: int = option(
        1,
        "ODE steps outside the SDE window taken this many at a time, second-order (MixGRPO-Flash); "
        "1: one Euler step each",
        min=1,
    )
    reward_fusion: Literal["mean", "logprob_weighted"] = option("mean", "how a node's reward is fused")


@dataclass
class PruneConfig:
    depths: list[int] = option([], "depth pruning: edges into these depths are not trained", min=1)
    width: Literal["none", "top_half_per_branch", "best_worst_quarter"] = option(
        "none", "width pruning of the last depth's edges"
    )


@dataclass
class ExploreConfig:
    """Sol-RL: explore in low precision, replay the chosen leaves in full precision, train on those."""

    enabled: bool = option(False, "explore a candidate pool in low precision first")
    precision: str = option("nvfp4-emulated", "precision of the exploration pass", registry="precision")
    branch_factor: int = option(
        4,
        "branch factor of the exploration trees (pool = factor ** splits)",
        min=2,
        max=1024,
        why="pool size",
    )
    steps: int | None = option(None, "denoising steps while exploring (null: rollout.steps)", min=1)
    keep: int = option(16, "leaves kept per prompt: the best keep/2 and the worst keep/2", min=2)
    quantize_activations: bool = option(False, "also fake-quantise Linear inputs (W4A4)")


@dataclass
class TrainConfig:
    lr: float = option(1e-4, "AdamW learning rate", min=0.0)
    advantage: str = option(
        "tree_depthwise",
        "advantage estimator: tree_depthwise, or a group one when rollout.split_steps = [0]",
        registry="advantage",
        kinds=("group", "tree"),
    )
    loss: str = option(
        "ppo_clip",
        "policy loss on every trained denoising step's log-prob (see `mmrl list`)",
        registry="loss",
        kinds=("policy",),
    )
    sampler: str = option(
        "uniform",
        "prompt sampler (dynamic_filter and beta_thompson learn from every prompt's leaf rewards)",
        registry="sampler",
    )
    sampler_options: dict = option(
        {},
        "keyword options of the sampler, e.g. {success_threshold: 0.7} (the reward counted as a success "
        "by dynamic_filter and beta_thompson; set it on the trained reward's scale)",
    )
    clip_low: float = option(1e-4, "PPO ratio clip below 1 (per-step ratios are close to 1)", min=0.0)
    clip_high: float = option(1e-4, "PPO ratio clip above 1", min=0.0)
    adv_clip: float = option(5.0, "advantages clipped to [-adv_clip, adv_clip]", min=0.0)
    kl_coef: float = option(0.0, "weight of the KL between policy and reference step means", min=0.0)
    max_grad_norm: float = option(1.0, "gradient clipping norm", min=0.0)
    minibatches: int = option(
        1, "optimizer steps per iteration, each on a shuffled share of the samples", min=1
    )
    micro_batch: int = option(64, "denoising steps per forward/backward", min=1)
    nan_patience: int = option(3, "consecutive non-finite steps before the run stops", min=1)
    ema_decay: float = option(
        0.0, "EMA of the trained weights, used to evaluate and save the result (0: off)", min=0.0, max=0.9999
    )


@dataclass
class RewardConfig:
    name: str = option("geneval_mini", "reward (see `mmrl list`)", registry="reward")
    options: dict = option({}, "keyword options of the reward factory")


@dataclass
class EvalConfig:
    prompts: int = option(64, "held-out prompts", min=1)
    steps: int = option(20, "ODE sampling steps", min=1)
    guidance_scale: float = option(3.0, "classifier-free guidance", min=1.0)


@dataclass
class BranchGRPOConfig(BaseConfig):
    trainer: str = option("branch_grpo", "trainer name", registry="trainer")
    prompt_file: str | None = option(None, "text file with one prompt per line (null: the shapes prompts)")
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    prune: PruneConfig = field(default_factory=PruneConfig)
    explore: ExploreConfig = field(default_factory=ExploreConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        r = self.rollout
        if not r.split_steps or sorted(set(r.split_steps)) != r.split_steps or r.split_steps[-1] >= r.steps:
            raise ConfigError(
                f"config error: rollout.split_steps = {r.split_steps} must be increasing and below "
                f"rollout.steps = {r.steps}"
            )
        if not r.shared_initial_noise and r.split_steps[0] != 0:
            raise ConfigError(
                f"config error: rollout.shared_initial_noise = false needs a split at step 0 (the children "
                f"that get their own initial noise), but rollout.split_steps = {r.split_steps}"
            )
        if r.sde == "ddim" and r.split_steps[-1] >= r.steps - 1:
            raise ConfigError(
                f"config error: rollout.split_steps = {r.split_steps}: with rollout.sde = ddim the last "
                f"step ({r.steps - 1}) has no noise, so nothing can branch there; split earlier"
            )
        if r.sde_window is not None and (
            len(r.sde_window) != 2 or not 0 <= r.sde_window[0] <= r.sde_window[1] <= r.steps
        ):
            raise ConfigError(
                f"config error: rollout.sde_window = {r.sde_window} must be [start, end] with "
                f"0 <= start <= end <= rollout.steps = {r.steps}"
            )
        if len(r.split_steps) == 1:
            check_group_size(self.train.advantage, r.branch_factor, "rollout.branch_factor")
        elif not ADVANTAGES.has_kind(self.train.advantage, "tree"):
            raise ConfigError(
                f"config error: train.advantage = {self.train.advantage!r} scores leaves only, but "
                f"rollout.split_steps = {r.split_steps} builds trees whose shared edges need node "
                "advantages: use train.advantage=tree_depthwise, or rollout.split_steps=[0]"
            )
        if self.explore.enabled and self.explore.keep % 2:
            raise ConfigError(
                f"config error: explore.keep = {self.explore.keep} must be even (best and worst halves)"
            )
        self.check_tree_keys()

    def check_tree_keys(self) -> None:
        """Keys that refer to the tree's depths or leaves must fit the tree that rollout.split_steps
        builds: depth d holds the edges below the d-th split, so the leaves sit at depth len(split_steps).
        Otherwise a pruned depth or a kept leaf that does not exist is silently nothing."""
        depths, prune = len(self.rollout.split_steps), self.prune
        tree = f"rollout.split_steps = {self.rollout.split_steps} gives depths 1 to {depths}"
        outside = sorted({d for d in prune.depths if d > depths})
        if outside:
            raise ConfigError(
                f"config error: prune.depths = {prune.depths}: no depth {outside[0]} in the tree ({tree}, "
                f"depth {depths} being the leaves): give depths between 1 and {depths}"
            )
        if set(range(1, depths + 1)) <= set(prune.depths):
            raise ConfigError(
                f"config error: prune.depths = {prune.depths} prunes every depth ({tree}), so nothing would "
                "be trained: leave at least one depth out"
            )
        if prune.width != "none" and depths in prune.depths:
            raise ConfigError(
                f"config error: prune.width = {prune.width} prunes the leaves' edges (depth {depths}), but "
                f"prune.depths = {prune.depths} drops that whole depth: remove {depths} from prune.depths or "
                "set prune.width=none"
            )
        pool = self.explore.branch_factor**depths
        if self.explore.enabled and self.explore.keep > pool:
            raise ConfigError(
                f"config error: explore.keep = {self.explore.keep} leaves, but an exploration tree has "
                f"{pool} (explore.branch_factor ** {depths} splits): lower explore.keep or raise "
                "explore.branch_factor"
            )
