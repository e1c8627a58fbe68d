"""BranchGRPO for flow-matching text-to-image models; flat GRPO is the depth-1 case.

One training step, read top to bottom in `BranchGRPOTrainer.train_step`:

1. pick prompts; 2. (optional, Sol-RL) explore a large candidate pool with the policy quantised
(e.g. NVFP4) and keep the best and worst candidates by reward; 3. roll out denoising trees: every
node branches `branch_factor` ways at each split step, the model is evaluated once per node and
step (children of a split share their parent's velocity), and every random draw is keyed by
(seed, step, prompt, node key, denoising step) so any subset of leaves can be replayed exactly;
4. reward the leaves, fuse rewards up the tree, depth-wise advantages per node; 5. PPO-clip on the
log-prob of every stochastic step of every trained edge (an edge parent -> child carries A(child)).

Flat GRPO (DanceGRPO / Flow-GRPO) is ``split_steps: [0]`` with ``branch_factor`` = group size and a
flat advantage estimator (``grpo`` or ``grpo_global_std``). The Mix variant is ``sde_window``: SDE
steps inside the window and at split steps, ODE elsewhere, and only SDE steps are trained.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from diffusion_rl.models import Conditioning, FlowPipeline
from diffusion_rl.sampling import evaluate_alignment, save_grid
from diffusion_rl.sde import (
    StepOutput,
    adams_bashforth2_step,
    initial_noise_std,
    ode_step,
    sde_step,
    sde_step_mask,
)
from diffusion_rl.shapes import train_prompts
from mmrl.advantages import check_group_size
from mmrl.config import BaseConfig, ConfigError, option, shipped_path
from mmrl.losses import gaussian_kl_same_std, ppo_clip
from mmrl.noise import NoiseKey, keyed_randn_batch
from mmrl.precision import explore_precision
from mmrl.registry import ADVANTAGES, REWARDS, TRAINERS, UnknownNameError
from mmrl.resources import check_enough_prompts, check_memory
from mmrl.samplers import UniformSampler
from mmrl.trainer import Trainer, TrainingStopped
from mmrl.tree import RolloutTree, depthwise_node_advantages, width_prune

# latent-sized tensors one sample's denoiser forward holds at its peak (rough, from the tiny UNet)
FORWARD_LATENTS = 64
TRAINING_LATENTS = 512  # the same with gradients


# ---------------------------------------------------------------------------------------------
# Config


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
        elif self.train.advantage != "tree_depthwise":
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


# ---------------------------------------------------------------------------------------------
# Rollout trees


@dataclass
class StepRecord:
    """One stochastic denoising step of an edge: enough to recompute its log-prob later."""

    step: int
    x: torch.Tensor
    x_next: torch.Tensor
    old_logp: float


@dataclass
class TreePlan:
    """The shape every tree of a rollout takes, and which steps are stochastic."""

    steps: int
    split_steps: list[int]
    branch_factor: int
    sde_mask: list[bool]

    def child_key(self, parent_key: int, index: int) -> int:
        """Heap numbering of a k-ary tree: keys (and so noise) do not depend on which nodes exist."""
        return parent_key * self.branch_factor + index + 1

    def leaf_keys(self) -> list[int]:
        keys = [0]
        for _ in self.split_steps:
            keys = [self.child_key(k, i) for k in keys for i in range(self.branch_factor)]
        return keys


def ancestors(plan: TreePlan, leaf_keys: list[int]) -> set[int]:
    """Every key on the paths from the root to `leaf_keys` (the skeleton of a replay)."""
    keep = {0}
    for key in leaf_keys:
        while key not in keep:
            keep.add(key)
            key = (key - 1) // plan.branch_factor
    return keep


def plan_for(rollout: RolloutConfig, steps: int | None = None, branch_factor: int | None = None) -> TreePlan:
    """The rollout's tree plan, optionally with fewer steps (split steps rescaled) or another factor."""
    steps = steps or rollout.steps
    splits = [s * steps // rollout.steps for s in rollout.split_steps]
    if len(set(splits)) != len(splits):
        raise ConfigError(
            f"config error: explore.steps = {steps} is too few to keep the split steps "
            f"{rollout.split_steps} of {rollout.steps} steps apart"
        )
    window = None
    if rollout.sde_window is not None:
        window = (
            rollout.sde_window[0] * steps // rollout.steps,
            rollout.sde_window[1] * steps // rollout.steps,
        )
    sde_mask = sde_step_mask(steps, splits, window)
    if rollout.sde == "ddim":  # DDIM's last step (to sigma = 0) has no noise: it is an ODE step
        sde_mask[-1] = False
    return TreePlan(steps, splits, branch_factor or rollout.branch_factor, sde_mask)


def check_rollout_size(
    cfg: BranchGRPOConfig, pipe: FlowPipeline, prompts: int, processes: int, device: torch.device
) -> None:
    """Refuse a step that would draw a prompt twice, or whose rollouts and updates cannot fit on
    `device`: every stochastic step of every node keeps its input and output latents, each model
    evaluation runs on all of a step's nodes at once (twice with guidance), and each update runs
    `train.micro_batch` steps with gradients."""
    r = cfg.rollout
    source = f"prompts of prompt_file = {cfg.prompt_file!r}" if cfg.prompt_file else "built-in prompts"
    check_enough_prompts(
        "rollout.prompts_per_step",
        r.prompts_per_step,
        processes,
        prompts,
        f"the {prompts} {source}",
        "lower rollout.prompts_per_step or give a longer prompt_file",
    )
    latent = 4 * math.prod(pipe.latent_shape())
    side = pipe.latent_shape()[-1] * pipe.vae_scale
    plans = {"rollout.branch_factor": plan_for(r)}
    if cfg.explore.enabled:
        plans["explore.branch_factor"] = plan_for(r, cfg.explore.steps, cfg.explore.branch_factor)
    per_prompt = {}  # key of the branch factor: (bytes, leaves, stochastic node steps) per prompt
    for key, plan in plans.items():
        rows, records = 1, 0
        for i in range(plan.steps):
            rows *= plan.branch_factor if i in plan.split_steps else 1
            records += rows if plan.sde_mask[i] else 0
        need = latent * (2 * records + 2 * FORWARD_LATENTS * rows) + 4 * 3 * side**2 * rows
        per_prompt[key] = (need, rows, records)
    factor = max(per_prompt, key=lambda key: per_prompt[key][0])  # the larger tree: rollout or exploration
    need, leaves, _ = per_prompt[factor]
    micro_batch = min(cfg.train.micro_batch, r.prompts_per_step * per_prompt["rollout.branch_factor"][2])
    check_memory(
        r.prompts_per_step * need + 2 * micro_batch * TRAINING_LATENTS * latent,
        f"rollout trees of {r.prompts_per_step} prompts x {leaves} leaves of {side}x{side} px and updates "
        f"of {micro_batch} denoising steps (rollout.prompts_per_step x "
        f"{factor}^len(rollout.split_steps), rollout.image_size, train.micro_batch)",
        ["rollout.prompts_per_step", factor, "rollout.image_size", "train.micro_batch"],
        device,
    )


@torch.no_grad()
def rollout_trees(
    pipe: FlowPipeline,
    cond: Conditioning,
    uncond: Conditioning,
    tree_ids: list[int],
    plan: TreePlan,
    rollout: RolloutConfig,
    seed: int,
    step: int,
    skeletons: list[set[int]] | None = None,
) -> tuple[list[RolloutTree], torch.Tensor, int]:
    """Denoise one tree per prompt; return the trees, the leaf latents (tree-major order) and the
    number of model evaluations. `tree_ids` name the trees in their noise keys and must differ within
    a step (a prompt drawn twice still gets two different trees). A node's `state` holds its noise
    key and its `StepRecord`s; a skeleton (a set of keys) restricts the tree to those nodes, for exact
    replays."""
    device = pipe.device
    sigmas = pipe.sigmas(plan.steps)
    trees = [RolloutTree(root_state={"key": 0, "records": []}) for _ in tree_ids]
    rows = [(t, 0) for t in range(len(trees))]  # (tree index, node id)

    # Noise is keyed by position on the full schedule (rollout.steps), so an exploration pass with
    # fewer steps starts from the same initial noise as its full-step replay and draws the same noise
    # at its split steps. Initial noise is keyed by the node that starts from it (the root, or with
    # `shared_initial_noise` off each child of the first split) and by rollout.steps, never a step index.
    same_splits = len(plan.split_steps) == len(rollout.split_steps)
    full_split = dict(zip(plan.split_steps, rollout.split_steps, strict=True)) if same_splits else {}

    def schedule_index(i: int) -> int:
        return full_split.get(i, i * rollout.steps // plan.steps)

    def branch(parents: list[tuple[int, int]]) -> tuple[list[tuple[int, int]], list[int]]:
        """Add every node's children (those in the skeleton); return their rows and their parents'."""
        new_rows, parent_rows = [], []
        for r, (t, node) in enumerate(parents):
            parent_key = trees[t].nodes[node].state["key"]
            for c in range(plan.branch_factor):
                key = plan.child_key(parent_key, c)
                if skeletons is not None and key not in skeletons[t]:
                    continue
                new_rows.append((t, trees[t].add_child(node, state={"key": key, "records": []})))
                parent_rows.append(r)
        return new_rows, parent_rows

    splits = set(plan.split_steps)

    def deterministic(i: int) -> bool:
        return not plan.sde_mask[i] and i not in splits

    if not rollout.shared_initial_noise:  # the split at step 0 happens before it, on the initial noise
        rows, _ = branch(rows)
        splits.discard(0)
    initial_keys = [
        NoiseKey(seed, step, tree_ids[t], trees[t].nodes[n].state["key"], rollout.steps) for t, n in rows
    ]
    x = keyed_randn_batch(pipe.latent_shape(), initial_keys, device=device) * initial_noise_std(sigmas[0])
    evaluations = 0
    previous: tuple[torch.Tensor, torch.Tensor] | None = None  # last ODE velocity and its sigma step
    i = 0
    while i < plan.steps:
        tree_index = [t for t, _ in rows]
        v = pipe.velocity(
            x, sigmas[i].expand(len(rows)), cond[tree_index], rollout.guidance_scale, uncond[tree_index]
        )
        evaluations += len(rows)
        if deterministic(i):  # ODE: up to `ode_stride` steps in one, never across a stochastic step
            end = i + 1
            while end < min(i + rollout.ode_stride, plan.steps) and deterministic(end):
                end += 1
            if previous is None:
                x_next = ode_step(v, x, sigmas[i], sigmas[end])
            else:
                x_next = adams_bashforth2_step(v, previous[0], x, sigmas[i], sigmas[end], previous[1])
            previous = (v, sigmas[end] - sigmas[i]) if rollout.ode_stride > 1 else None
            x, i = x_next, end
            continue
        previous = None
        if i in splits:  # children share the parent's velocity at the split step
            rows, parent_rows = branch(rows)
            x, v = x[parent_rows], v[parent_rows]
        if plan.sde_mask[i]:
            keys = [
                NoiseKey(seed, step, tree_ids[t], trees[t].nodes[n].state["key"], schedule_index(i))
                for t, n in rows
            ]
            noise = keyed_randn_batch(pipe.latent_shape(), keys, device=device)
            scale = rollout.noise_level * (rollout.split_noise_scale if i in plan.split_steps else 1.0)
            out = sde_step(rollout.sde, v, x, sigmas[i], sigmas[i + 1], noise_scale=scale, noise=noise)
            for r, (t, n) in enumerate(rows):
                trees[t].nodes[n].state["records"].append(
                    StepRecord(i, x[r].clone(), out.prev_sample[r].clone(), float(out.log_prob[r]))
                )
            x = out.prev_sample
        i += 1
    for t, tree in enumerate(trees):  # leaves in tree order, matching `rows`
        assert [n for tt, n in rows if tt == t] == tree.leaves()
    for tree in trees:
        for node in tree.nodes:
            node.old_logp = torch.tensor([r.old_logp for r in node.state["records"]])
    return trees, x, evaluations


# ---------------------------------------------------------------------------------------------
# Trainer


def split_evenly(items: list[Any], parts: int) -> list[list[Any]]:
    """`items` cut into `parts` consecutive pieces whose sizes differ by at most one."""
    size, extra = divmod(len(items), parts)
    bounds = [i * size + min(i, extra) for i in range(parts + 1)]
    return [items[bounds[i] : bounds[i + 1]] for i in range(parts)]


def kendall_tau(a: torch.Tensor, b: torch.Tensor) -> float:
    """Rank agreement of two score vectors (tau-a; 1 = same order)."""
    n = len(a)
    if n < 2:
        return float("nan")
    da = torch.sign(a.unsqueeze(0) - a.unsqueeze(1))
    db = torch.sign(b.unsqueeze(0) - b.unsqueeze(1))
    return float((da * db).triu(1).sum() / (n * (n - 1) / 2))


def load_prompts(prompt_file: str | None) -> list[str]:
    if prompt_file is None:
        return train_prompts()
    path = Path(prompt_file)
    if not path.is_file():
        raise ConfigError(
            f"config error: prompt_file = {prompt_file!r} does not exist; give a text file with one "
            "prompt per line, or null for the built-in shapes prompts"
        )
    prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ConfigError(f"config error: prompt_file = {prompt_file!r} holds no prompts (one per line)")
    return prompts


def resolve_model_path(path: str) -> Path:
    """A model directory as given (relative to the working directory), or relative to the repository."""
    found = shipped_path(path)
    if found.is_dir():
        return found
    raise ConfigError(
        f"config error: model.path = {path!r} is not a directory; run `mmrl pretrain diffusion` "
        "and pass model.path=runs/pretrain/diffusion/pipeline, or give a local model directory"
    )


@TRAINERS.register("branch_grpo")
class BranchGRPOTrainer(Trainer):
    config_class = BranchGRPOConfig
    config: BranchGRPOConfig

    def setup(self) -> None:
        cfg = self.config
        self.prompts = load_prompts(cfg.prompt_file)
        try:
            self.reward_fn = REWARDS.get(cfg.reward.name)(**cfg.reward.options)
        except UnknownNameError as err:
            raise ConfigError(f"config error: reward.name: {err}") from None
        except TypeError as err:
            raise ConfigError(f"config error: reward.options = {cfg.reward.options}: {err}") from None
        model_dir = resolve_model_path(cfg.model.path)
        try:
            self.pipe = FlowPipeline.from_pretrained(model_dir)
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError(f"config error: model.path = {cfg.model.path!r}: {err}") from None
        self.pipe.to(self.accelerator.device)
        if cfg.rollout.image_size is not None:
            try:
                self.pipe.set_image_size(cfg.rollout.image_size)
            except ValueError as err:
                raise ConfigError(
                    f"config error: rollout.image_size = {cfg.rollout.image_size}: {err}"
                ) from None
        check_rollout_size(
            cfg, self.pipe, len(self.prompts), self.accelerator.num_processes, self.accelerator.device
        )
        self.reference = None
        if cfg.train.kl_coef > 0:
            self.reference = copy.deepcopy(self.pipe.denoiser).requires_grad_(False)
        if cfg.model.lora_rank > 0:
            from peft import LoraConfig

            self.pipe.denoiser.requires_grad_(False)
            self.pipe.denoiser.add_adapter(
                LoraConfig(
                    r=cfg.model.lora_rank,
                    lora_alpha=cfg.model.lora_alpha or cfg.model.lora_rank,
                    init_lora_weights="gaussian",
                    target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                )
            )
        params = [p for p in self.pipe.denoiser.parameters() if p.requires_grad]
        self.trained_params = params
        self.ema = [p.detach().clone() for p in params] if cfg.train.ema_decay > 0 else None
        optimizer = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=0.0)
        self.model, self.optimizer = self.accelerator.prepare(self.pipe.denoiser, optimizer)
        self.sampler = UniformSampler(len(self.prompts), seed=cfg.seed)
        self.plan = plan_for(cfg.rollout)
        self.uncond_one = self.pipe.encode_prompts([""])

    def trainer_state(self) -> dict[str, Any]:
        state = {"sampler": self.sampler.state_dict()}
        if self.ema is not None:
            state["ema"] = self.ema
        return state

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
        if self.ema is not None:
            for ema, saved in zip(self.ema, state["ema"], strict=True):
                ema.copy_(saved)

    @contextmanager
    def ema_weights(self) -> Iterator[None]:
        """Swap the EMA weights into the model for the duration (no-op without EMA)."""
        if self.ema is None:
            yield
            return
        live = [p.detach().clone() for p in self.trained_params]
        with torch.no_grad():
            for p, ema in zip(self.trained_params, self.ema, strict=True):
                p.copy_(ema)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, saved in zip(self.trained_params, live, strict=True):
                    p.copy_(saved)

    def evaluate(self) -> dict[str, float]:
        cfg = self.config.eval
        with self.ema_weights():
            return evaluate_alignment(self.pipe, cfg.prompts, cfg.steps, cfg.guidance_scale, self.config.seed)

    # -- one step -------------------------------------------------------------------------------

    def pick_prompts(self) -> tuple[list[int], list[int], list[str]]:
        """This process's share of the step's prompts: their slots in the step's draw (unique across
        processes, the trees' noise ids), their indices in the prompt list, and their texts."""
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        n = self.config.rollout.prompts_per_step
        chosen = self.sampler.sample(n * world)  # the same on every process (same sampler state)
        slots = list(range(rank, n * world, world))
        return slots, [chosen[s] for s in slots], [self.prompts[chosen[s]] for s in slots]

    def score(self, latents: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        from diffusion_rl.rewards import RewardServerError

        images = self.pipe.decode(latents)
        try:
            rewards = self.reward_fn(images, prompts=prompts).float().cpu()
        except RewardServerError as err:
            raise TrainingStopped(f"reward server failed: {err}") from err
        return rewards, images

    def train_step(self, step: int) -> dict[str, Any]:
        cfg = self.config
        started = time.perf_counter()
        slots, ids, prompts = self.pick_prompts()
        cond = self.pipe.encode_prompts(prompts)
        uncond = self.uncond_one[[0] * len(prompts)]
        metrics: dict[str, Any] = {}
        skeletons = None
        plan = self.plan
        if cfg.explore.enabled:
            skeletons, plan, explore_metrics = self.explore(slots, prompts, cond, uncond, step)
            metrics.update(explore_metrics)
        trees, leaves, evaluations = rollout_trees(
            self.pipe, cond, uncond, slots, plan, cfg.rollout, cfg.seed, step, skeletons
        )
        leaf_prompts = [prompts[t] for t, tree in enumerate(trees) for _ in tree.leaves()]
        rewards, images = self.score(leaves, leaf_prompts)
        if not torch.isfinite(rewards).all():
            return self.skip_step("non-finite reward", cfg.train.nan_patience)
        if cfg.explore.enabled:
            metrics["kendall_tau_lowp_vs_full"] = self.rank_agreement(trees, rewards)
        offset = 0
        for tree in trees:
            for leaf in tree.leaves():
                tree.set_leaf_reward(leaf, float(rewards[offset]))
                offset += 1
        advantages = self.node_advantages(trees, ids)
        groups = self.training_samples(trees, advantages, step)
        loss_metrics = self.optimise(groups, cond, uncond, step)
        metrics.update(loss_metrics)
        metrics.update(
            reward=rewards.mean(),
            reward_std=rewards.std(),
            nfe=evaluations / len(trees),
            trained_steps=sum(len(group) for group in groups),
            leaves_per_prompt=len(rewards) / len(trees),
            skipped_steps=self.skipped_steps,
            step_seconds=time.perf_counter() - started,  # wall-clock of the rollout, reward and update
        )
        if self.is_main and step % 10 == 0:
            save_grid(images[:32], self.samples_dir / f"step_{step:06d}.png")
        return metrics

    def explore(
        self, slots: list[int], prompts: list[str], cond: Conditioning, uncond: Conditioning, step: int
    ) -> tuple[list[set[int]], TreePlan, dict[str, Any]]:
        """Low-precision candidate pool; keep the best and worst leaves; return their skeletons."""
        cfg = self.config
        plan = plan_for(cfg.rollout, cfg.explore.steps, cfg.explore.branch_factor)
        with explore_precision(self.pipe.denoiser, cfg.explore.precision, cfg.explore.quantize_activations):
            trees, leaves, evaluations = rollout_trees(
                self.pipe, cond, uncond, slots, plan, cfg.rollout, cfg.seed, step
            )
        leaf_prompts = [prompts[t] for t, tree in enumerate(trees) for _ in tree.leaves()]
        rewards, _ = self.score(leaves, leaf_prompts)
        per_tree = rewards.view(len(trees), -1)
        keep = cfg.explore.keep // 2
        skeletons, self.explore_rewards = [], {}
        for t, tree in enumerate(trees):
            order = per_tree[t].argsort(descending=True).tolist()
            chosen = sorted(set(order[:keep] + order[-keep:]))
            leaf_nodes = tree.leaves()
            keys = [tree.nodes[leaf_nodes[c]].state["key"] for c in chosen]
            skeletons.append(ancestors(plan, keys))
            self.explore_rewards.update(
                {(t, k): float(per_tree[t, c]) for k, c in zip(keys, chosen, strict=True)}
            )
        full_plan = TreePlan(
            cfg.rollout.steps,
            plan_for(cfg.rollout).split_steps,
            plan.branch_factor,
            plan_for(cfg.rollout).sde_mask,
        )
        return (
            skeletons,
            full_plan,
            {"explore_nfe": evaluations / len(trees), "explore_reward": rewards.mean()},
        )

    def rank_agreement(self, trees: list[RolloutTree], rewards: torch.Tensor) -> float:
        """Kendall tau between exploration (low precision) and replay rewards of the kept leaves."""
        low, high = [], []
        offset = 0
        for t, tree in enumerate(trees):
            for leaf in tree.leaves():
                low.append(self.explore_rewards[(t, tree.nodes[leaf].state["key"])])
                high.append(float(rewards[offset]))
                offset += 1
        return kendall_tau(torch.tensor(low), torch.tensor(high))

    def node_advantages(self, trees: list[RolloutTree], ids: list[int]) -> dict[tuple[int, int], float]:
        """A(node) for every non-root node, keyed by (tree index, node id)."""
        cfg = self.config
        if cfg.train.advantage == "tree_depthwise":
            return depthwise_node_advantages(trees, cfg.rollout.reward_fusion, cfg.train.adv_clip)
        # flat estimators: one group per prompt, statistics over every process's leaves
        leaves = [(t, leaf) for t, tree in enumerate(trees) for leaf in tree.leaves()]
        local = [(ids[t], trees[t].nodes[leaf].reward) for t, leaf in leaves]
        gathered = self.gather([local], "every process's leaf rewards")
        rank = self.accelerator.process_index
        offset = sum(len(part) for part in gathered[:rank])
        everything = [item for part in gathered for item in part]
        groups = torch.tensor(
            [g * self.accelerator.num_processes + r for r, part in enumerate(gathered) for g, _ in part]
        )  # a prompt drawn by two processes forms two groups
        result = ADVANTAGES.get(cfg.train.advantage)(torch.tensor([r for _, r in everything]), groups)
        values = (result.values * result.loss_mask).clamp(-cfg.train.adv_clip, cfg.train.adv_clip)
        mine = values[offset : offset + len(leaves)]
        advantages = {}
        for (t, leaf), a in zip(leaves, mine.tolist(), strict=True):
            for _, child in trees[t].path_to(leaf):  # every edge on a flat path is the leaf's own
                advantages[(t, child)] = a
        return advantages

    def training_samples(
        self, trees: list[RolloutTree], advantages: dict[tuple[int, int], float], step: int
    ) -> list[list[tuple[int, StepRecord, float]]]:
        """(tree index, step record, advantage) for every stochastic step of every trained edge, in
        groups that share their input: siblings' first steps start from their parent's latent at the
        split, so the update evaluates the model once for them, as the rollout did."""
        cfg = self.config
        groups: dict[tuple[int, int, int], list[tuple[int, StepRecord, float]]] = {}
        for t, tree in enumerate(trees):
            edges = tree.edges()
            if cfg.prune.width != "none":
                node_adv = [advantages.get((t, n), 0.0) for n in range(len(tree))]  # indexed by node id
                edges = width_prune(tree, node_adv, mode=cfg.prune.width)
            for parent, child in edges:
                if tree.nodes[child].depth in cfg.prune.depths:
                    continue
                a = advantages.get((t, child), 0.0)
                for k, record in enumerate(tree.nodes[child].state["records"]):
                    key = (t, parent if k == 0 else child, record.step)
                    groups.setdefault(key, []).append((t, record, a))
        return list(groups.values())

    def optimise(
        self,
        groups: list[list[tuple[int, StepRecord, float]]],
        cond: Conditioning,
        uncond: Conditioning,
        step: int,
    ) -> dict[str, Any]:
        """PPO-clip over all samples: shuffled (keyed by seed and step, so resumes are exact) and split
        into `train.minibatches` optimizer steps, each accumulated over micro-batches. Every mini-batch
        after the first is off-policy, which is where the ratio clip acts. Groups of samples with one
        input are shuffled as units, so they share a micro-batch and one model evaluation."""
        cfg = self.config
        if not groups:
            return {"loss": 0.0}
        order = torch.randperm(
            len(groups), generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        ).tolist()
        shuffled = [sample for i in order for sample in groups[i]]
        minibatches = [part for part in split_evenly(shuffled, cfg.train.minibatches) if part]
        sigmas = self.pipe.sigmas(cfg.rollout.steps)
        split_steps = set(self.plan.split_steps)
        stats, grad_norms = [], []
        for minibatch in minibatches:
            self.optimizer.zero_grad(set_to_none=True)
            for start in range(0, len(minibatch), cfg.train.micro_batch):
                chunk = minibatch[start : start + cfg.train.micro_batch]
                old = torch.tensor([r.old_logp for _, r, _ in chunk], device=self.pipe.device)
                adv = torch.tensor([a for _, _, a in chunk], device=self.pipe.device)
                out = self.chunk_log_probs(self.model, chunk, cond, uncond, sigmas, split_steps)
                result = ppo_clip(
                    out.log_prob,
                    old,
                    adv,
                    clip_low=cfg.train.clip_low,
                    clip_high=cfg.train.clip_high,
                    adv_clip=cfg.train.adv_clip,
                )
                loss = result.loss
                if self.reference is not None:
                    with torch.no_grad():
                        ref = self.chunk_log_probs(self.reference, chunk, cond, uncond, sigmas, split_steps)
                    kl = gaussian_kl_same_std(out.mean, ref.mean, out.std).mean()
                    loss = loss + cfg.train.kl_coef * kl
                if not self.all_finite(loss, out.log_prob):
                    return self.skip_step("non-finite loss or log-prob", cfg.train.nan_patience)
                self.backward(loss * len(chunk) / len(minibatch))
                stats.append((len(chunk), result.metrics, float(loss.detach())))
            grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), cfg.train.max_grad_norm)
            if not torch.isfinite(torch.as_tensor(grad_norm)):
                return self.skip_step("non-finite gradient", cfg.train.nan_patience)
            self.optimizer.step()
            grad_norms.append(float(grad_norm))
            if self.ema is not None:
                with torch.no_grad():
                    for ema, p in zip(self.ema, self.trained_params, strict=True):
                        ema.lerp_(p, 1 - cfg.train.ema_decay)
        self.nan_streak = 0
        total = sum(n for n, _, _ in stats)
        merged = {k: sum(n * float(m[k]) for n, m, _ in stats) / total for k in stats[0][1]}
        return {
            "loss": sum(n * value for n, _, value in stats) / total,
            "grad_norm": sum(grad_norms) / len(grad_norms),
            **merged,
        }

    def chunk_log_probs(
        self,
        denoiser: torch.nn.Module,
        chunk: list[tuple[int, StepRecord, float]],
        cond: Conditioning,
        uncond: Conditioning,
        sigmas: torch.Tensor,
        split_steps: set[int],
    ) -> StepOutput:
        """Log-probs of a micro-batch of stored steps under `denoiser` (the policy or the reference).
        Rows with the same prompt, step and latent (siblings at a split) share one model evaluation."""
        tree_index = torch.tensor([t for t, _, _ in chunk], device=self.pipe.device)
        steps = torch.tensor([r.step for _, r, _ in chunk], device=self.pipe.device)
        x = torch.stack([r.x for _, r, _ in chunk])
        x_next = torch.stack([r.x_next for _, r, _ in chunk])
        sigma, sigma_next = sigmas[steps], sigmas[steps + 1]
        rows = torch.cat([tree_index[:, None], steps[:, None], x.flatten(1)], dim=1).float()
        _, inverse = torch.unique(rows, dim=0, return_inverse=True)
        first = torch.full((int(inverse.max()) + 1,), len(chunk), device=x.device)
        first = first.scatter_reduce(0, inverse, torch.arange(len(chunk), device=x.device), "amin")
        prompts = tree_index[first].tolist()
        v = self.pipe.velocity(
            x[first],
            sigma[first],
            cond[prompts],
            self.config.rollout.guidance_scale,
            uncond[prompts],
            denoiser=denoiser,
        )[inverse]
        is_split = torch.tensor([r.step in split_steps for _, r, _ in chunk])
        return self.recompute(v, x, sigma, sigma_next, x_next, is_split)

    def recompute(
        self,
        v: torch.Tensor,
        x: torch.Tensor,
        sigma: torch.Tensor,
        sigma_next: torch.Tensor,
        x_next: torch.Tensor,
        is_split: torch.Tensor,
    ) -> StepOutput:
        """Log-prob of the stored steps under velocity `v`, with each step's rollout noise scale."""
        cfg = self.config.rollout
        scales = {False: cfg.noise_level, True: cfg.noise_level * cfg.split_noise_scale}
        if scales[False] == scales[True] or is_split.all() or not is_split.any():
            scale = scales[bool(is_split[0])]
            return sde_step(cfg.sde, v, x, sigma, sigma_next, noise_scale=scale, prev_sample=x_next)
        log_prob = torch.empty(len(x), device=x.device)
        mean = torch.empty(x.shape, device=x.device)
        std = torch.empty((len(x),) + (1,) * (x.dim() - 1), device=x.device)
        for split in (False, True):
            idx = (is_split == split).nonzero().squeeze(1).to(x.device)
            part = sde_step(
                cfg.sde,
                v[idx],
                x[idx],
                sigma[idx],
                sigma_next[idx],
                noise_scale=scales[split],
                prev_sample=x_next[idx],
            )
            log_prob[idx], mean[idx] = part.log_prob, part.mean
            std[idx] = part.std.expand((len(idx),) + (1,) * (x.dim() - 1))
        return StepOutput(x_next, log_prob, mean, std)

    def train(self) -> dict[str, Any]:
        result = super().train()
        if self.is_main:
            self.save_result()
        return result

    def save_result(self) -> None:
        """The trained model (EMA weights when train.ema_decay > 0): a full pipeline (save_pretrained), or
        a LoRA result that plain diffusers loads at the trained strength with `pipe.load_lora_weights`
        and that names its base model (model.path) for `FlowPipeline.from_pretrained`."""
        out = self.run_dir / "final"
        denoiser = self.accelerator.unwrap_model(self.model)
        with self.ema_weights():
            if self.config.model.lora_rank > 0:
                self.pipe.save_lora_weights(out, denoiser, self.config.model.path)
            else:
                self.pipe.with_denoiser(denoiser).save_pretrained(out)
