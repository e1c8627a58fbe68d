"""BranchGRPO for flow-matching text-to-image models; flat GRPO is the depth-1 case.

One training step, read top to bottom in `BranchGRPOTrainer.train_step`:

1. the sampler (`train.sampler`) picks prompts;
2. (optional, Sol-RL, `diffusion_rl.quantized_exploration`) a large candidate pool is explored with
   the policy quantised (e.g. NVFP4) and only its best and worst leaves are replayed;
3. denoising trees are rolled out (`diffusion_rl.branch_rollout`): every node branches
   `branch_factor` ways at each split step, and every random draw is keyed, so replays are exact;
4. the leaves are rewarded; the sampler sees every prompt's rewards; advantages (`train.advantage`)
   come from a tree estimator on the rewards fused up each tree (node credit), or from a group
   estimator per tree over its leaves (flat credit: an edge carries the mean of its leaves');
5. the policy loss (`train.loss`) on the log-prob of every stochastic step of every trained edge
   (an edge parent -> child carries A(child); with flat credit it counts once per leaf below it, so
   on a branching tree the loss is flat GRPO's on the leaves' paths), then the optimizer step and
   the EMA.

Flat GRPO (DanceGRPO / Flow-GRPO) is ``split_steps: [0]`` with ``branch_factor`` = group size and a
group advantage estimator (``grpo`` or ``grpo_global_std``). The Mix variant is ``sde_window``: SDE
steps inside the window and at split steps, ODE elsewhere, and only SDE steps are trained.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from diffusion_rl.branch_rollout import (
    StepRecord,
    plan_for,
    rollout_trees,
    set_leaf_rewards,
    step_log_probs,
    training_samples,
)
from diffusion_rl.config import BranchGRPOConfig
from diffusion_rl.inputs import check_prompt_count
from diffusion_rl.memory_plan import PlannedRollout
from diffusion_rl.models import Conditioning, FlowPipeline
from diffusion_rl.quantized_exploration import (
    KeptLeaves,
    exploration_plan,
    keep_for_replay,
    rank_agreement,
    replay_plan,
)
from diffusion_rl.sampling import save_grid
from diffusion_rl.sde import StepOutput
from diffusion_rl.trainer import (
    FORWARD_LATENTS,
    TRAINING_LATENTS,
    DiffusionTrainer,
    split_evenly,
    update_summary,
)
from mmrl.credit import assign_credit
from mmrl.losses import LossOutput, gaussian_kl_same_std
from mmrl.precision import explore_precision
from mmrl.registry import LOSSES, TRAINERS
from mmrl.resources import check_memory

# (tree index, a stored stochastic step, its edge's advantage, its weight: the paths it stands for)
Sample = tuple[int, StepRecord, float, float]


def sample_weight(samples: list[Sample]) -> float:
    """The paths `samples` stand for: the denominator of their weighted mean loss."""
    return sum(w for _, _, _, w in samples)


# ---------------------------------------------------------------------------------------------
# Setup


def check_rollout_size(
    cfg: BranchGRPOConfig, pipe: FlowPipeline, prompts: int, processes: int, device: torch.device
) -> None:
    """Refuse a step that would draw a prompt twice, or whose rollouts and updates cannot fit on
    `device`: every stochastic step of every node keeps its input and output latents, each model
    evaluation runs on all of a step's nodes at once (twice with guidance), and each update runs
    `train.micro_batch` steps with gradients."""
    r = cfg.rollout
    check_prompt_count(cfg, prompts, processes)
    latent = 4 * math.prod(pipe.latent_shape())
    side = pipe.latent_shape()[-1] * pipe.vae_scale
    plans = {"rollout.branch_factor": plan_for(r)}
    if cfg.explore.enabled:
        plans["explore.branch_factor"] = exploration_plan(r, cfg.explore)
    per_prompt = {}  # key of the branch factor: (bytes, leaves, stochastic node steps) per prompt
    for key, plan in plans.items():
        per_step = plan.rows_per_step()
        rows = per_step[-1]
        records = sum(n for n, stochastic in zip(per_step, plan.sde_mask, strict=True) if stochastic)
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


@TRAINERS.register("branch_grpo")
class BranchGRPOTrainer(DiffusionTrainer):
    config_class = BranchGRPOConfig
    config: BranchGRPOConfig

    def setup(self) -> None:
        super().setup()
        cfg = self.config
        self.policy_loss = LOSSES.get(cfg.train.loss)
        self.plan = plan_for(cfg.rollout)

    @staticmethod
    def planned_rollout(config: BranchGRPOConfig, guidance_embedded: bool) -> PlannedRollout:
        """A prompt's tree (and exploration pool) for the memory plan; the update trains the guided
        velocity of the sampling steps."""
        r = config.rollout
        steps_rows = plan_for(r).rows_per_step()
        leaves, explore_rows = steps_rows[-1], 0
        if config.explore.enabled:
            pool_rows = exploration_plan(r, config.explore).rows_per_step()
            leaves, explore_rows = max(leaves, pool_rows[-1]), sum(pool_rows)
        return PlannedRollout(steps_rows, leaves, r.guidance_scale, explore_rows)

    def check_size(self) -> None:
        check_rollout_size(
            self.config, self.pipe, len(self.prompts), self.accelerator.num_processes, self.accelerator.device
        )

    # -- one step -------------------------------------------------------------------------------

    def train_step(self, step: int) -> dict[str, Any]:
        samples, cond, uncond, metrics = self.collect_samples(step)
        metrics.update(self.optimise(samples, cond, uncond, step))
        return metrics

    def collect_samples(
        self, step: int
    ) -> tuple[list[list[Sample]], Conditioning, Conditioning, dict[str, Any]]:
        """Steps 1-4 of the module docstring: the trained samples of iteration `step` (grouped as
        `training_samples` returns them), the prompts' conditioning and the rollout's metrics."""
        cfg = self.config
        chosen, slots, prompts = self.pick_prompts()
        cond = self.pipe.encode_prompts(prompts)
        uncond = self.uncond_one[[0] * len(prompts)]
        metrics: dict[str, Any] = {}

        plan, kept = self.plan, None
        if cfg.explore.enabled:  # Sol-RL: replay only the best and worst leaves of a low-precision pool
            kept, explore_metrics = self.explore(slots, prompts, cond, uncond, step)
            plan = replay_plan(cfg.rollout, cfg.explore)
            metrics.update(explore_metrics)
        skeletons = None if kept is None else kept.skeletons
        trees, leaves, evaluations = rollout_trees(
            self.pipe, cond, uncond, slots, plan, cfg.rollout, cfg.seed, step, skeletons
        )

        rewards, images = self.score(trees, leaves, prompts)
        metrics.update(self.reward_metrics())
        if not torch.isfinite(rewards).all():
            self.skip_step("non-finite reward", cfg.train.nan_patience)
        if kept is not None:
            metrics["kendall_tau_lowp_vs_full"] = rank_agreement(kept, trees, rewards)
        set_leaf_rewards(trees, rewards)

        everyone = self.gather_rewards(slots, rewards)
        keep = self.sampler.update(chosen, everyone.rewards, everyone.groups)
        credit = assign_credit(
            trees,
            cfg.train.advantage,
            fusion=cfg.rollout.reward_fusion,
            clip=cfg.train.adv_clip,
            everyone=everyone,
        )
        dropped = {t for t, slot in enumerate(slots) if not keep[slot]}  # filtered out by the sampler
        advantages = {key: 0.0 if key[0] in dropped else a for key, a in credit.nodes.items()}
        samples = training_samples(trees, advantages, cfg.prune, leaf_weighted=credit.per_leaf)
        metrics.update(
            reward=rewards.mean(),
            reward_std=rewards.std(),
            nfe=evaluations / len(trees),
            trained_steps=sum(len(group) for group in samples),
            leaves_per_prompt=len(rewards) / len(trees),
            skipped_steps=self.skipped_steps,
        )
        if self.is_main and step % 10 == 0:
            save_grid(images[:32], self.samples_dir / f"step_{step:06d}.png")
        return samples, cond, uncond, metrics

    def explore(
        self, slots: list[int], prompts: list[str], cond: Conditioning, uncond: Conditioning, step: int
    ) -> tuple[KeptLeaves, dict[str, Any]]:
        """Sol-RL's pool: the exploration trees rolled out with the denoiser in low precision and
        rewarded; the best and worst leaves of each are kept for the full-precision replay."""
        cfg = self.config
        plan = exploration_plan(cfg.rollout, cfg.explore)
        with explore_precision(self.pipe.denoiser, cfg.explore.precision, cfg.explore.quantize_activations):
            trees, leaves, evaluations = rollout_trees(
                self.pipe, cond, uncond, slots, plan, cfg.rollout, cfg.seed, step
            )
        rewards, _ = self.score(trees, leaves, prompts)
        kept = keep_for_replay(plan, trees, rewards, cfg.explore.keep)
        return kept, {"explore_nfe": evaluations / len(trees), "explore_reward": rewards.mean()}

    # -- update ---------------------------------------------------------------------------------

    def optimise(
        self, groups: list[list[Sample]], cond: Conditioning, uncond: Conditioning, step: int
    ) -> dict[str, Any]:
        """The policy loss over all samples: shuffled (keyed by seed and step, so resumes are exact)
        and split into `train.minibatches` optimizer steps, each accumulated over micro-batches. Every
        mini-batch after the first is off-policy, which is where the ratio clip acts. Groups of samples
        with one input are shuffled as units, so they share a micro-batch and one model evaluation."""
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
                loss, metrics = self.chunk_loss(chunk, cond, uncond, sigmas, split_steps)
                self.backward(loss * sample_weight(chunk) / sample_weight(minibatch))
                stats.append((len(chunk), metrics, float(loss.detach())))
            grad_norms.append(float(self.apply_gradients(cfg.train.max_grad_norm, cfg.train.nan_patience)))
            self.update_ema()
        return update_summary(stats, grad_norms)

    def chunk_loss(
        self,
        chunk: list[Sample],
        cond: Conditioning,
        uncond: Conditioning,
        sigmas: torch.Tensor,
        split_steps: set[int],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The policy loss of a micro-batch, plus `train.kl_coef` times the KL of the step means to
        the reference model's, both means weighted by the samples' weights; a non-finite loss or
        log-prob skips the step."""
        cfg = self.config.train
        device = self.pipe.device
        old = torch.tensor([r.old_logp for _, r, _, _ in chunk], device=device)
        adv = torch.tensor([a for _, _, a, _ in chunk], device=device)
        weights = torch.tensor([w for _, _, _, w in chunk], device=device)
        out = self.chunk_log_probs(self.model, chunk, cond, uncond, sigmas, split_steps)
        result: LossOutput = self.policy_loss(
            out.log_prob,
            old,
            adv,
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            adv_clip=cfg.adv_clip,
            weights=weights,
        )
        loss = result.loss
        if self.reference is not None:
            with torch.no_grad():
                ref = self.chunk_log_probs(self.reference, chunk, cond, uncond, sigmas, split_steps)
            kl = gaussian_kl_same_std(out.mean, ref.mean, out.std)
            loss = loss + cfg.kl_coef * (kl * weights).sum() / weights.sum()
        if not self.all_finite(loss, out.log_prob):
            self.skip_step("non-finite loss or log-prob", cfg.nan_patience)
        return loss, result.metrics

    def chunk_log_probs(
        self,
        denoiser: torch.nn.Module,
        chunk: list[Sample],
        cond: Conditioning,
        uncond: Conditioning,
        sigmas: torch.Tensor,
        split_steps: set[int],
    ) -> StepOutput:
        """Log-probs of a micro-batch of stored steps under `denoiser` (the policy or the reference).
        Rows with the same prompt, step and latent (siblings at a split) share one model evaluation."""
        tree_index = torch.tensor([t for t, _, _, _ in chunk], device=self.pipe.device)
        steps = torch.tensor([r.step for _, r, _, _ in chunk], device=self.pipe.device)
        x = torch.stack([r.x for _, r, _, _ in chunk])
        x_next = torch.stack([r.x_next for _, r, _, _ in chunk])
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
        is_split = torch.tensor([r.step in split_steps for _, r, _, _ in chunk])
        return step_log_probs(self.config.rollout, v, x, sigma, sigma_next, x_next, is_split)
