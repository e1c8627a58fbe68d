"""The diffusion trainers' configs, one dataclass per section: `branch_grpo`'s (`BranchGRPOConfig`) and
`diffusion_nft`'s (`DiffusionNFTConfig`), which share the model, reward (`diffusion_rl.reward_config`)
and evaluation sections; and the checks that refuse a config whose pieces do not fit together (a
split the schedule does not have, a pruned depth the tree does not have, a leaf-only advantage on a
branching tree, an exploration pool smaller than the group it keeps) before any model is loaded."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from diffusion_rl.reward_config import (
    REWARD_KEYS,
    RewardConfig,
    check_options,
    check_reward_name,
    reward_mapping,
)
from mmrl.advantages import check_group_size
from mmrl.config import BaseConfig, ConfigError, option
from mmrl.precision import BaseDtype, base_dtype_option, check_base_dtype
from mmrl.registry import ADVANTAGES


@dataclass
class ModelConfig:
    path: str = option(
        "diffusion_rl/assets/tiny_flow",
        "local model directory: FlowPipeline.save_pretrained output or a diffusers pipeline (SD3, SD1.x)",
    )
    lora_rank: int = option(0, "LoRA rank on the denoiser's attention; 0 trains every weight", min=0)
    lora_alpha: float = option(0.0, "LoRA alpha (0: equal to the rank)", min=0.0)
    lora_targets: Literal["attention", "attention_mlp"] = option(
        "attention",
        "what LoRA adapts: the image stream's attention projections (to_q, to_k, to_v, to_out), or "
        "attention_mlp: those, the text stream's (add_q/k/v_proj, to_add_out) and the MLP projections "
        "(ff, ff_context; FLUX's single blocks' proj_mlp)",
    )
    base_dtype: BaseDtype = base_dtype_option()
    frozen_dtype: Literal["float32", "bfloat16", "float16"] = option(
        "float32",
        "dtype of the text encoders and the VAE, which are never trained (bfloat16: half the memory)",
    )
    gradient_checkpointing: bool = option(
        False, "recompute the denoiser's blocks in the backward pass instead of keeping their activations"
    )
    cache_prompt_embeddings: bool = option(
        False,
        "encode the training and held-out prompts once at the start, keep their embeddings in CPU memory "
        "and move the text encoders off the GPU (`--dry-run` prints the cache's size)",
    )

    def __post_init__(self) -> None:
        check_base_dtype(self.base_dtype, self.lora_rank)


def call_rows_option() -> Any:
    """`rollout.call_rows` of both diffusion trainers (`FlowPipeline._in_fixed_rows`)."""
    return option(
        None,
        "run every denoiser call on exactly this many rows (the last call filled up): a sample then "
        "comes out bit for bit the same in any batch, e.g. a Sol-RL replay equals a fresh sample of its "
        "seed (null: calls take the rows a step has)",
        min=1,
    )


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
    call_rows: int | None = call_rows_option()
    sde: Literal["flow_grpo", "dance_grpo", "ddim"] = option("flow_grpo", "SDE form of the stochastic steps")
    noise_level: float = option(0.7, "Flow-GRPO a / DanceGRPO eta / DDIM eta", min=0.0)
    split_steps: list[int] = option([0, 3, 6, 9], "steps where every node branches (flat GRPO: [0])", min=0)
    branch_factor: int | list[int] = option(
        2,
        "children per node at a split (flat GRPO: the group size), or one number per split step, "
        "e.g. [4, 2, 2] for a wider first split",
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

    def leaves_per_tree(self) -> int:
        return math.prod(split_factors(self.branch_factor, len(self.split_steps)))


def split_factors(branch_factor: int | list[int], splits: int) -> list[int]:
    """Children per node at each of `splits` split steps, from one factor for all or one per split."""
    return [branch_factor] * splits if isinstance(branch_factor, int) else list(branch_factor)


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
        "advantage estimator: a tree one (node credit; tree_depthwise is BranchGRPO's), or a group one "
        "over each tree's leaves (flat credit: an edge counts once per leaf below it with their mean "
        "advantage, which on a branching tree is flat GRPO's loss on the leaves' paths)",
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
class EvalConfig:
    prompts: int = option(64, "held-out prompts", min=1)
    prompt_file: str | None = option(
        None,
        "text file of held-out prompts, one per line, scored by the trained reward(s) and the gold reward "
        "(null: the shapes world's held-out prompts, also scored by geneval_mini as heldout_alignment)",
    )
    steps: int = option(20, "ODE sampling steps", min=1)
    guidance_scale: float = option(3.0, "classifier-free guidance", min=1.0)
    gold_reward: dict | str | None = option(
        None,
        "a held-out reward never trained on, e.g. {name: shapes_strict, options: {}} (or just its name): "
        "the held-out samples are also scored by it (heldout_gold), and eval.json flags a run whose "
        "gold score fell beyond two paired standard errors (divergence.gold_fell), and whose trained "
        "reward rose meanwhile (reward_hacking_suspected); null: none",
    )
    divergence_margin: float = option(
        0.01,
        "the smallest change of a held-out score that counts as a rise or a fall for the reward-hacking "
        "flag, beside the two paired standard errors a fall must also exceed",
        min=0.0,
    )

    def __post_init__(self) -> None:
        gold = self.gold_reward
        if gold is None:
            return
        gold = reward_mapping(
            gold, "eval.gold_reward", REWARD_KEYS, "{name: ..., options: ...} or null", "valid keys"
        )
        self.gold_reward = {
            "name": check_reward_name(gold.get("name"), "eval.gold_reward.name"),
            "options": check_options(gold.get("options", {}), "eval.gold_reward.options"),
        }


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
        if isinstance(r.branch_factor, list) and len(r.branch_factor) != len(r.split_steps):
            raise ConfigError(
                f"config error: rollout.branch_factor = {r.branch_factor} gives {len(r.branch_factor)} "
                f"factors for the {len(r.split_steps)} rollout.split_steps {r.split_steps}: give one per "
                "split step, or one number for all"
            )
        leaves = r.leaves_per_tree()  # one group of a tree's leaves
        if len(r.split_steps) == 1:
            check_group_size(self.train.advantage, leaves, "rollout.branch_factor")
        elif ADVANTAGES.tag(self.train.advantage, "group_size") == "odd" and leaves % 2 == 0:
            raise ConfigError(
                f"config error: {self.train.advantage} needs an odd number of leaves per tree, but "
                f"rollout.branch_factor = {r.branch_factor} with {len(r.split_steps)} splits gives "
                f"{leaves}: use an odd rollout.branch_factor or a tree estimator "
                "(train.advantage=tree_depthwise)"
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


@dataclass
class NFTRolloutConfig:
    prompts_per_step: int = option(4, "prompts per step on each process", min=1)
    group_size: int = option(16, "samples per prompt (one group of the advantage)", min=2, max=1024)
    steps: int = option(10, "denoising steps", min=1)
    image_size: int | None = option(
        None,
        "image side in pixels (null: the model's own size)",
        min=1,
        max=4096,
        why="models draw up to 2048 px",
    )
    solver: Literal["ode", "sde"] = option(
        "ode", "ode: deterministic (seeded initial noise only); sde: Flow-GRPO's stochastic steps"
    )
    noise_level: float = option(0.7, "Flow-GRPO a of the sde solver", min=0.0)
    ode_stride: int = option(
        1, "ode solver: steps taken this many at a time, second-order; 1: one Euler step each", min=1
    )
    guidance_scale: float = option(
        1.0, "classifier-free guidance while sampling (1: none; the update never uses guidance)", min=1.0
    )
    call_rows: int | None = call_rows_option()


@dataclass
class NFTExploreConfig:
    """Sol-RL: a large pool explored in low precision, its best and worst regenerated in full precision."""

    enabled: bool = option(False, "explore a candidate pool in low precision and train on its extremes")
    precision: str = option("nvfp4-emulated", "precision of the exploration pass", registry="precision")
    pool: int = option(
        64,
        "candidates per prompt explored (rollout.group_size of them are kept)",
        min=2,
        max=4096,
        why="pool",
    )
    steps: int | None = option(None, "denoising steps while exploring (null: rollout.steps)", min=1)
    quantize_activations: bool = option(False, "also fake-quantise Linear inputs (W4A4)")


@dataclass
class NFTTrainConfig:
    lr: float = option(1e-4, "AdamW learning rate", min=0.0)
    beta: float = option(
        1.0, "strength of the implicit positive / negative policies around the old one", min=1e-6
    )
    advantage: str = option(
        "grpo_global_std",
        "group advantage estimator whose values map to optimality r = clip(A, -C, C) / 2C + 1/2 "
        "(grpo_global_std: DiffusionNFT's per-prompt mean over the batch's std)",
        registry="advantage",
        kinds=("group",),
    )
    adv_clip: float = option(5.0, "C: advantages clipped to [-C, C] before the map to [0, 1]", min=1e-6)
    loss: str = option(
        "diffusion_nft",
        "forward-process loss on the clean samples (see `mmrl list`)",
        registry="loss",
        kinds=("forward_process",),
    )
    loss_scale: float | None = option(
        None, "multiplies the policy term (null: train.adv_clip, as DiffusionNFT's code)", min=0.0
    )
    noise_levels: Literal["sampler", "uniform"] = option(
        "sampler",
        "where a clean sample's noise levels come from: sampler, a keyed draw without repeats from the "
        "rollout's own rollout.steps levels (DiffusionNFT's code); uniform, t ~ U(0, 1)",
    )
    timesteps_per_sample: int | None = option(
        None,
        "noise levels per clean sample and update (null: DiffusionNFT's int(0.99 x rollout.steps))",
        min=1,
        max=1000,
        why="each costs a forward",
    )
    old_decay_start: int = option(
        0, "the old policy equals the trained one (decay 0) for this many optimizer steps", min=0
    )
    old_decay_rate: float = option(
        0.001, "after that, its EMA decay grows this much per optimizer step", min=0.0
    )
    old_decay_max: float = option(0.5, "up to this decay", min=0.0, max=0.9999)
    kl_coef: float = option(
        0.0, "weight of the squared velocity difference to the frozen start model", min=0.0
    )
    max_grad_norm: float = option(1.0, "gradient clipping norm", min=0.0)
    minibatches: int = option(1, "optimizer steps per iteration, each on a shuffled share", min=1)
    micro_batch: int = option(16, "noised samples per forward/backward", min=1)
    sampler: str = option(
        "uniform",
        "prompt sampler (dynamic_filter and beta_thompson learn from every prompt's rewards)",
        registry="sampler",
    )
    sampler_options: dict = option(
        {}, "keyword options of the sampler, e.g. {success_threshold: 0.7} on the reward's scale"
    )
    nan_patience: int = option(3, "consecutive non-finite steps before the run stops", min=1)
    ema_decay: float = option(
        0.0, "EMA of the trained weights, used to evaluate and save the result (0: off)", min=0.0, max=0.9999
    )


@dataclass
class DiffusionNFTConfig(BaseConfig):
    trainer: str = option("diffusion_nft", "trainer name", registry="trainer")
    prompt_file: str | None = option(None, "text file with one prompt per line (null: the shapes prompts)")
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: NFTRolloutConfig = field(default_factory=NFTRolloutConfig)
    explore: NFTExploreConfig = field(default_factory=NFTExploreConfig)
    train: NFTTrainConfig = field(default_factory=NFTTrainConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        check_group_size(self.train.advantage, self.rollout.group_size, "rollout.group_size")
        levels, steps = self.train.timesteps_per_sample, self.rollout.steps
        if self.train.noise_levels == "sampler" and levels is not None and levels > steps:
            raise ConfigError(
                f"config error: train.timesteps_per_sample = {levels} noise levels per sample, but "
                f"train.noise_levels = 'sampler' draws them without repeats from the rollout's "
                f"rollout.steps = {steps}: use at most {steps}, or train.noise_levels=uniform"
            )
        e, group = self.explore, self.rollout.group_size
        if e.enabled and (group % 2 or group > e.pool):
            raise ConfigError(
                f"config error: with explore.enabled, rollout.group_size = {group} samples per prompt are "
                f"the best half and the worst half of explore.pool = {e.pool} candidates: it must be even "
                "and at most the pool"
            )
