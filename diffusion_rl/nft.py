"""DiffusionNFT: online RL for flow models on the forward process, not on sampling likelihoods.

One training step, read top to bottom in `DiffusionNFTTrainer.train_step`:

1. the sampler (`train.sampler`) picks prompts;
2. the old policy (the data-collecting one) draws `rollout.group_size` clean samples per prompt with
   any solver (`rollout.solver`: the ODE, `ode_stride` included, or Flow-GRPO's SDE): no log-probs are
   kept, only the clean latents. With `explore` (Sol-RL) it first draws a pool of `explore.pool`
   candidates per prompt with its weights in low precision (`explore.precision`, e.g. NVFP4) and
   optionally fewer steps, rewards them, and regenerates only the best and the worst
   `rollout.group_size / 2` in full precision from the same keyed initial noise
   (`diffusion_rl.quantized_exploration`); the rank agreement (Kendall tau) of the pool's and the
   replay's rewards is logged;
3. the samples are rewarded; the group advantage (`train.advantage`; by default DiffusionNFT's
   per-prompt mean over the batch's std) maps to an optimality r = clip(A, -C, C) / 2C + 1/2 in [0, 1];
4. each clean sample x0 is noised at `train.timesteps_per_sample` levels t, drawn without repeats
   from the sampler's own noise levels as DiffusionNFT's code does (or t ~ U(0, 1) with
   `train.noise_levels: uniform`), x_t = (1 - t) x0 + t eps, and the loss (`train.loss`,
   `mmrl.losses.diffusion_nft`, its policy term scaled by C as in DiffusionNFT's code) pulls the implicit
   positive policy (old + beta (trained - old)) towards x0 with weight r and the implicit negative one
   (old - beta (trained - old)) with weight 1 - r; classifier-free guidance is never used in
   training (a guidance-distilled model, FLUX.1-dev, trains at the embedded guidance it sampled with);
5. the old policy moves towards the trained one by an EMA whose decay follows
   `train.old_decay_start / old_decay_rate / old_decay_max` in the optimizer steps taken so far,
   this step's included (DiffusionNFT's schedule: decay 0.001 after the first update).

Every draw is keyed by (seed, step, ...), so a resumed run repeats exactly.
"""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from typing import Any

import torch

from diffusion_rl.branch_rollout import TreePlan, rollout_trees
from diffusion_rl.config import DiffusionNFTConfig, RolloutConfig
from diffusion_rl.inputs import check_prompt_count
from diffusion_rl.memory_plan import PlannedRollout
from diffusion_rl.models import Conditioning, FlowPipeline
from diffusion_rl.quantized_exploration import KeptLeaves, keep_for_replay, rank_agreement
from diffusion_rl.sampling import save_grid
from diffusion_rl.trainer import (
    FORWARD_LATENTS,
    TRAINING_LATENTS,
    DiffusionTrainer,
    split_evenly,
    update_summary,
)
from mmrl.losses import nft_optimality
from mmrl.noise import NoiseKey, keyed_rand_batch, keyed_randn_batch
from mmrl.precision import explore_precision
from mmrl.registry import ADVANTAGES, LOSSES, TRAINERS
from mmrl.resources import check_memory

TRAIN_STREAM = 1 << 32  # streams of the update's noise: above any denoising step index of a rollout


def old_policy_decay(optimizer_steps: int, start: int, rate: float, maximum: float) -> float:
    """The EMA decay of the old policy once `optimizer_steps` updates have been taken: 0 (old =
    trained) before `start`, then growing by `rate` per optimizer step up to `maximum`."""
    return 0.0 if optimizer_steps < start else min((optimizer_steps - start) * rate, maximum)


def noise_levels_per_sample(cfg: DiffusionNFTConfig) -> int:
    """How many noise levels each clean sample is trained at per update: `train.timesteps_per_sample`,
    or DiffusionNFT's int(0.99 x rollout.steps) of the sampler's levels (at least one)."""
    levels = cfg.train.timesteps_per_sample
    return levels if levels is not None else max(1, int(0.99 * cfg.rollout.steps))


def check_nft_size(
    cfg: DiffusionNFTConfig, pipe: FlowPipeline, prompts: int, processes: int, device: torch.device
) -> None:
    """Refuse a step that would draw a prompt twice or that cannot fit on `device`: a step samples
    every group at once (twice the rows with guidance) and keeps its clean latents and their noised
    copies; each update runs `train.micro_batch` noised samples with gradients."""
    r, t = cfg.rollout, cfg.train
    check_prompt_count(cfg, prompts, processes)
    latent = 4 * math.prod(pipe.latent_shape())
    side = pipe.latent_shape()[-1] * pipe.vae_scale
    rows = r.prompts_per_step * max(r.group_size, cfg.explore.pool if cfg.explore.enabled else 0)
    guided = 2 if r.guidance_scale != 1.0 else 1
    levels = noise_levels_per_sample(cfg)
    kept = rows * (1 + 3 * levels)  # clean latents; noised latents, noise, old velocity
    need = latent * (kept + guided * FORWARD_LATENTS * rows) + 4 * 3 * side**2 * rows
    check_memory(
        need + 2 * t.micro_batch * TRAINING_LATENTS * latent,
        f"a step of {r.prompts_per_step} prompts x {rows // r.prompts_per_step} samples of {side}x{side} px, "
        f"{levels} noise levels each, and updates of {t.micro_batch} noised samples "
        "(rollout.prompts_per_step x rollout.group_size or explore.pool, rollout.image_size, "
        "train.micro_batch)",
        ["rollout.prompts_per_step", "explore.pool" if cfg.explore.enabled else "rollout.group_size"]
        + ["rollout.image_size", "train.micro_batch"],
        device,
    )


@TRAINERS.register("diffusion_nft")
class DiffusionNFTTrainer(DiffusionTrainer):
    config_class = DiffusionNFTConfig
    config: DiffusionNFTConfig

    def setup(self) -> None:
        super().setup()
        cfg = self.config
        r = cfg.rollout
        self.advantage_fn = ADVANTAGES.get(cfg.train.advantage)
        self.loss_fn = LOSSES.get(cfg.train.loss)
        if cfg.eval.guidance_scale != r.guidance_scale and self.is_main:
            print(
                f"warning: DiffusionNFT trains the model as it samples, at rollout.guidance_scale = "
                f"{r.guidance_scale:g}; the held-out evaluation at eval.guidance_scale = "
                f"{cfg.eval.guidance_scale:g} scores a sampler it never trained (set both alike)",
                file=sys.stderr,
            )
        # a group is a depth-1 tree whose children start from their own initial noise
        self.sampling = RolloutConfig(
            prompts_per_step=r.prompts_per_step,
            steps=r.steps,
            guidance_scale=r.guidance_scale,
            sde="flow_grpo",
            noise_level=r.noise_level,
            split_steps=[0],
            branch_factor=r.group_size,
            shared_initial_noise=False,
            ode_stride=r.ode_stride if r.solver == "ode" else 1,
        )
        self.plan = TreePlan(r.steps, [0], r.group_size, [r.solver == "sde"] * r.steps)
        if cfg.explore.enabled:  # pool and replay number the candidates alike: a kept key is its noise
            pool, steps = cfg.explore.pool, cfg.explore.steps or r.steps
            self.pool_sampling = replace(self.sampling, branch_factor=pool)
            self.pool_plan = TreePlan(steps, [0], pool, [r.solver == "sde"] * steps)
            self.replay_plan = TreePlan(r.steps, [0], pool, [r.solver == "sde"] * r.steps)
        self.old_policy = [p.detach().clone() for p in self.trained_params]
        self.optimizer_steps = 0  # the old policy's decay schedule counts them

    @staticmethod
    def planned_rollout(config: DiffusionNFTConfig, guidance_embedded: bool) -> PlannedRollout:
        """A prompt's group (and exploration pool) for the memory plan. The update trains the velocity
        without classifier-free guidance (a guidance-distilled model at its embedded guidance), and the
        old policy is a second copy of the trained weights."""
        r, explore = config.rollout, config.explore
        leaves = max(r.group_size, explore.pool if explore.enabled else 0)
        explore_rows = explore.pool * (explore.steps or r.steps) if explore.enabled else 0
        train_guidance = r.guidance_scale if guidance_embedded else 1.0
        return PlannedRollout([r.group_size] * r.steps, leaves, train_guidance, explore_rows, policy_copies=1)

    def check_size(self) -> None:
        check_nft_size(
            self.config, self.pipe, len(self.prompts), self.accelerator.num_processes, self.accelerator.device
        )

    def trainer_state(self) -> dict[str, Any]:
        return super().trainer_state() | {
            "old_policy": self.old_policy,
            "optimizer_steps": self.optimizer_steps,
        }

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        super().load_trainer_state(state)
        for old, saved in zip(self.old_policy, state["old_policy"], strict=True):
            old.copy_(saved)
        self.optimizer_steps = int(state["optimizer_steps"])

    # -- one step -------------------------------------------------------------------------------

    def train_step(self, step: int) -> dict[str, Any]:
        cfg = self.config
        chosen, slots, prompts = self.pick_prompts()
        cond = self.pipe.encode_prompts(prompts)
        uncond = self.uncond_one[[0] * len(prompts)]

        metrics: dict[str, Any] = {}
        plan, sampling, kept = self.plan, self.sampling, None
        with self.swapped_weights(self.old_policy):  # the data come from the old policy
            if cfg.explore.enabled:
                kept, explore_metrics = self.explore(slots, prompts, cond, uncond, step)
                plan, sampling = self.replay_plan, self.pool_sampling
                metrics.update(explore_metrics)
            trees, clean, evaluations = rollout_trees(
                self.pipe,
                cond,
                uncond,
                slots,
                plan,
                sampling,
                cfg.seed,
                step,
                None if kept is None else kept.skeletons,
            )
        rewards, images = self.score(trees, clean, prompts)
        if not torch.isfinite(rewards).all():
            self.skip_step("non-finite reward", cfg.train.nan_patience)
        metrics.update(self.reward_metrics())
        if kept is not None:
            metrics["kendall_tau_lowp_vs_full"] = rank_agreement(kept, trees, rewards)

        everyone = self.gather_rewards(slots, rewards)
        keep = self.sampler.update(chosen, everyone.rewards, everyone.groups)
        result = self.advantage_fn(everyone.rewards, everyone.groups)
        advantages = (result.values * result.loss_mask)[everyone.offset : everyone.offset + len(rewards)]
        optimality = nft_optimality(advantages, cfg.train.adv_clip)
        group = cfg.rollout.group_size
        trained = [i for i in range(len(rewards)) if keep[slots[i // group]]]  # the sampler may drop groups
        sample_ids = [slots[i // group] * group + i % group for i in trained]

        if trained:
            samples = (clean[trained], cond[[i // group for i in trained]], optimality[trained], sample_ids)
            metrics.update(self.optimise(*samples, step))
        decay = old_policy_decay(
            self.optimizer_steps, cfg.train.old_decay_start, cfg.train.old_decay_rate, cfg.train.old_decay_max
        )
        self.update_old_policy(decay)
        metrics.update(
            reward=rewards.mean(),
            reward_std=rewards.std(),
            optimality_mean=optimality.mean(),
            nfe=evaluations / len(trees),
            trained_samples=len(trained),
            old_policy_decay=decay,
            skipped_steps=self.skipped_steps,
        )
        if self.is_main and step % 10 == 0:
            save_grid(images[:32], self.samples_dir / f"step_{step:06d}.png")
        return metrics

    def explore(
        self, slots: list[int], prompts: list[str], cond: Conditioning, uncond: Conditioning, step: int
    ) -> tuple[KeptLeaves, dict[str, Any]]:
        """Sol-RL's pool, drawn with the weights in low precision and rewarded; the best and the worst
        `rollout.group_size / 2` candidates of every prompt are kept for the full-precision replay."""
        cfg = self.config
        e = cfg.explore
        with explore_precision(self.pipe.denoiser, e.precision, e.quantize_activations):
            trees, leaves, evaluations = rollout_trees(
                self.pipe, cond, uncond, slots, self.pool_plan, self.pool_sampling, cfg.seed, step
            )
        rewards, _ = self.score(trees, leaves, prompts)
        if not torch.isfinite(rewards).all():
            self.skip_step("non-finite exploration reward", cfg.train.nan_patience)
        kept = keep_for_replay(self.pool_plan, trees, rewards, cfg.rollout.group_size)
        return kept, {"explore_nfe": evaluations / len(trees), "explore_reward": rewards.mean()}

    def noised(
        self, clean: torch.Tensor, sample_ids: list[int], step: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x0, t, x_t, rows): every clean sample at `noise_levels_per_sample` noise levels, the levels
        and the noise keyed by (seed, step, sample id), so a resume draws them again. With
        `train.noise_levels: sampler` a sample's levels are the first of a keyed shuffle of the
        rollout's `rollout.steps` levels (the sigmas it denoised at, 0 excluded); with `uniform`,
        t ~ U(0, 1)."""
        cfg = self.config
        seed, per_sample = cfg.seed, noise_levels_per_sample(cfg)
        if cfg.train.noise_levels == "sampler":
            levels = self.pipe.sigmas(cfg.rollout.steps)[:-1].to(clean.device, torch.float32)
            draw = [
                NoiseKey(seed, step, s, 0, TRAIN_STREAM + 2 * j)
                for s in sample_ids
                for j in range(len(levels))
            ]
            shuffle = keyed_rand_batch((), draw, device=clean.device).view(len(sample_ids), len(levels))
            t = levels[shuffle.argsort(dim=1, stable=True)[:, :per_sample]].flatten()
        else:
            draw = [
                NoiseKey(seed, step, s, 0, TRAIN_STREAM + 2 * j)
                for s in sample_ids
                for j in range(per_sample)
            ]
            t = keyed_rand_batch((), draw, device=clean.device)
        eps_keys = [
            NoiseKey(seed, step, s, 0, TRAIN_STREAM + 2 * j + 1)
            for s in sample_ids
            for j in range(per_sample)
        ]
        eps = keyed_randn_batch(self.pipe.latent_shape(), eps_keys, device=clean.device)
        x0 = clean.repeat_interleave(per_sample, dim=0)
        shape = (-1, *([1] * (x0.dim() - 1)))
        x_t = (1 - t.view(shape)) * x0 + t.view(shape) * eps
        rows = torch.arange(len(clean), device=clean.device).repeat_interleave(per_sample)
        return x0, t, x_t, rows

    def velocity(
        self, denoiser: torch.nn.Module, x_t: torch.Tensor, t: torch.Tensor, cond: Conditioning
    ) -> torch.Tensor:
        """The velocity the update trains: without classifier-free guidance, but for a guidance-distilled
        model (FLUX.1-dev) at the embedded guidance the rollouts sampled with, whose policy it is."""
        embedded = self.pipe.guidance_embedded
        guidance = self.config.rollout.guidance_scale if embedded else 1.0
        return self.pipe.velocity(x_t, t, cond, guidance, denoiser=denoiser)

    @torch.no_grad()
    def velocities(
        self, denoiser: torch.nn.Module, x_t: torch.Tensor, t: torch.Tensor, cond: Conditioning
    ) -> torch.Tensor:
        """`velocity` of `denoiser` at every noised sample, a micro-batch at a time, without gradients."""
        size = self.config.train.micro_batch
        return torch.cat(
            [
                self.velocity(denoiser, x_t[i : i + size], t[i : i + size], cond[i : i + size])
                for i in range(0, len(x_t), size)
            ]
        )

    def optimise(
        self,
        clean: torch.Tensor,
        cond: Conditioning,
        optimality: torch.Tensor,
        sample_ids: list[int],
        step: int,
    ) -> dict[str, Any]:
        """The forward-process loss over every noised sample: the old policy's (and the reference's)
        velocities first, then shuffled (keyed) mini-batches of `train.micro_batch`."""
        cfg = self.config.train
        x0, t, x_t, rows = self.noised(clean, sample_ids, step)
        cond = cond[rows.tolist()]
        optimality = optimality.to(x0.device)[rows]
        with self.swapped_weights(self.old_policy):
            old_velocity = self.velocities(self.pipe.denoiser, x_t, t, cond)
        reference = None if self.reference is None else self.velocities(self.reference, x_t, t, cond)
        order = torch.randperm(
            len(x0), generator=torch.Generator().manual_seed(self.config.seed * 1_000_003 + step)
        )
        minibatches = [part for part in split_evenly(order.tolist(), cfg.minibatches) if part]
        stats, grad_norms = [], []
        for minibatch in minibatches:
            self.optimizer.zero_grad(set_to_none=True)
            for start in range(0, len(minibatch), cfg.micro_batch):
                index = minibatch[start : start + cfg.micro_batch]
                velocity = self.velocity(self.model, x_t[index], t[index], cond[index])
                out = self.loss_fn(
                    velocity,
                    old_velocity[index],
                    x_t[index],
                    x0[index],
                    t[index],
                    optimality[index],
                    beta=cfg.beta,
                    scale=cfg.adv_clip if cfg.loss_scale is None else cfg.loss_scale,
                    reference_velocity=None if reference is None else reference[index],
                    kl_coef=cfg.kl_coef,
                )
                if not self.all_finite(out.loss):
                    self.skip_step("non-finite loss", cfg.nan_patience)
                self.backward(out.loss * len(index) / len(minibatch))
                stats.append((len(index), out.metrics, float(out.loss.detach())))
            grad_norms.append(float(self.apply_gradients(cfg.max_grad_norm, cfg.nan_patience)))
            self.optimizer_steps += 1
            self.update_ema()
        return update_summary(stats, grad_norms)

    def update_old_policy(self, decay: float) -> None:
        """old <- decay * old + (1 - decay) * trained (decay 0: the old policy is the trained one)."""
        with torch.no_grad():
            for old, p in zip(self.old_policy, self.trained_params, strict=True):
                old.lerp_(p.detach(), 1 - decay)
