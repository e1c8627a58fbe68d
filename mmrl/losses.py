"""Training losses: pure functions on tensors. `LOSSES` holds the losses a trainer's `train.loss` can
name, of two kinds (see `mmrl.registry.LOSSES`):

- policy losses are called as loss(logp, old_logp, advantages, mask, **options) and return a
  `LossOutput`; the trainers pass ppo_clip's options (clip_low, clip_high, adv_clip and, where they
  have them, aggregation and weights), so a new one takes those keywords too.
- forward-process losses are called as loss(velocity, old_velocity, x_t, x0, t, optimality, **options)
  on noised clean samples of a flow-matching policy (diffusion_nft) and return a `LossOutput`.

The KL estimates, the AWR weights and the DiffusionNFT optimality map are plain functions the
trainers add or use where their method needs them.

Log-probs are per sequence `[B]` or per token/step `[B, T]` with a mask `[B, T]` (True = counts);
advantages are `[B]` (broadcast over T) or shaped like the log-probs. Masked entries never reach
the loss or its gradient, whatever values they hold.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from mmrl.registry import LOSSES

AGGREGATIONS = ("token_mean", "sequence_mean", "sum_norm")
KL_ESTIMATORS = ("k1", "k2", "k3")


class LossOutput(NamedTuple):
    loss: Tensor
    metrics: dict[str, Tensor]  # detached scalars for logging


def aggregate_loss(
    per_element: Tensor,
    mask: Tensor | None = None,
    aggregation: str = "token_mean",
    norm_length: int | None = None,
    weights: Tensor | None = None,
) -> Tensor:
    """Reduce a per-token (or per-step) loss to a scalar.

    token_mean: mean over every unmasked element of the batch (long sequences weigh more); with
    `weights` (shaped like the loss, positive) the weighted mean, so an element that stands for
    several samples (a denoising step that several leaves of a tree share) counts as that many.
    sequence_mean: mean over each sequence's unmasked elements, then over sequences with any.
    sum_norm: sum / (B * norm_length) with a fixed length (Dr.GRPO: no length bias either way).
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}: choose one of {', '.join(AGGREGATIONS)}")
    mask = _bool_mask(mask, per_element)
    if weights is not None:
        if aggregation != "token_mean" or weights.shape != per_element.shape:
            raise ValueError(
                f"weights must be shaped like the loss {tuple(per_element.shape)} and need token_mean "
                f"aggregation, got {tuple(weights.shape)} with {aggregation}"
            )
        weights = torch.where(mask, weights, 0.0)
        return (per_element * weights).where(mask, 0.0).sum() / weights.sum().clamp(min=1e-12)
    values = torch.where(mask, per_element, 0.0)
    if values.dim() == 1:
        values, mask = values[:, None], mask[:, None]
    if aggregation == "token_mean":
        return values.sum() / mask.sum().clamp(min=1)
    if aggregation == "sequence_mean":
        lengths = mask.sum(dim=-1)
        per_sequence = values.sum(dim=-1) / lengths.clamp(min=1)
        return per_sequence.sum() / (lengths > 0).sum().clamp(min=1)
    if norm_length is None or norm_length <= 0:
        raise ValueError(f"aggregation 'sum_norm' needs a positive norm_length, got {norm_length}")
    return values.sum() / (values.shape[0] * norm_length)


@LOSSES.register("ppo_clip", kind="policy", source="PPO, DAPO's clip-higher")
def ppo_clip(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    adv_clip: float | None = None,
    aggregation: str = "token_mean",
    norm_length: int | None = None,
    weights: Tensor | None = None,
) -> LossOutput:
    """PPO clipped surrogate with separate low/high clip ranges (DAPO clip-higher).

    ratio = exp(logp - old_logp) is clipped to [1 - clip_low, 1 + clip_high]; the per-element loss is
    -min(ratio * A, clip(ratio) * A), so entries whose clipped term is active get no gradient.
    `weights` (per element, token_mean only) weigh the mean, see `aggregate_loss`, and the logged
    means alike, so the clip fraction and KL describe the same batch as the loss.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}: choose one of {', '.join(AGGREGATIONS)}")
    mask = _bool_mask(mask, logp)
    advantages = _broadcast_advantages(advantages, logp)
    if adv_clip is not None:
        advantages = advantages.clamp(-adv_clip, adv_clip)
    log_ratio = torch.where(mask, logp - old_logp, 0.0)  # masked entries: ratio 1, no gradient
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = aggregate_loss(torch.maximum(unclipped, clipped), mask, aggregation, norm_length, weights)
    with torch.no_grad():
        metrics = {
            "clip_fraction": aggregate_loss((clipped > unclipped).float(), mask, weights=weights),
            # k3 estimate of KL(old || new)
            "approx_kl": aggregate_loss(ratio - 1.0 - log_ratio, mask, weights=weights),
            "ratio_mean": aggregate_loss(ratio, mask, weights=weights),
            "ratio_max": torch.where(mask, ratio, -torch.inf).max() if mask.any() else ratio.new_tensor(1.0),
        }
    return LossOutput(loss, metrics)


def kl_to_reference(logp: Tensor, ref_logp: Tensor, kind: str = "k3") -> Tensor:
    """Per-element estimate of KL(policy || reference) from samples of the policy (Schulman's k1/k2/k3).

    k1 = logp - ref (unbiased, can be negative); k2 = (logp - ref)^2 / 2 (biased, low variance);
    k3 = exp(ref - logp) - (ref - logp) - 1 (unbiased and >= 0).
    """
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {kind!r}: choose one of {', '.join(KL_ESTIMATORS)}")


def gaussian_kl_same_std(mean: Tensor, ref_mean: Tensor, std: Tensor | float) -> Tensor:
    """Closed-form KL between Gaussians sharing a std, averaged over all but the batch dim.

    Flow-GRPO's KL on SDE step means: ||mean - ref_mean||^2 / (2 std^2) per dim; returns `[B]`.
    """
    per_dim = (mean - ref_mean).square() / (2.0 * torch.as_tensor(std, dtype=mean.dtype) ** 2)
    return per_dim.flatten(1).mean(dim=1) if per_dim.dim() > 1 else per_dim


def awr_weights(
    advantages: Tensor,
    beta: float = 1.0,
    max_weight: float = 20.0,
    normalize: bool = False,
    eps: float = 1e-6,
) -> Tensor:
    """Advantage-weighted regression weights w = min(exp(A / beta), max_weight), in float64 arithmetic.

    normalize=True first standardises A over the batch, (A - mean) / (std + eps), so beta is a
    temperature in units of advantage spread. HABC's exp(beta_habc * A) is beta = 1 / beta_habc here.
    Non-finite advantages raise ValueError: they would give NaN or arbitrary weights.
    """
    advantages = advantages if advantages.is_floating_point() else advantages.float()
    if not torch.isfinite(advantages).all():
        raise ValueError("advantages contain NaN or inf")
    a = advantages.double()
    if normalize:
        a = (a - a.mean()) / (a.std(unbiased=False) + eps)
    weights = torch.exp(a / beta).clamp(max=max_weight)  # exp overflow gives inf, clamped too
    return weights.to(advantages.dtype)


def nft_optimality(advantages: Tensor, clip: float) -> Tensor:
    """DiffusionNFT's optimality r = clamp(A, -clip, clip) / (2 clip) + 1/2, in [0, 1]: r = 1 trains
    only toward a sample, r = 0 only away from it, r = 1/2 (A = 0) leaves it alone.

    clip must be > 0; non-finite advantages raise ValueError (they would give NaN or a silent 0/1)."""
    if not clip > 0:
        raise ValueError(f"nft_optimality: clip must be > 0, got {clip}")
    advantages = advantages if advantages.is_floating_point() else advantages.float()
    if not torch.isfinite(advantages).all():
        raise ValueError("advantages contain NaN or inf")
    return advantages.clamp(-clip, clip) / (2.0 * clip) + 0.5


@LOSSES.register("diffusion_nft", kind="forward_process", source="DiffusionNFT's code")
def diffusion_nft(
    velocity: Tensor,
    old_velocity: Tensor,
    x_t: Tensor,
    x0: Tensor,
    t: Tensor,
    optimality: Tensor,
    beta: float = 1.0,
    scale: float = 1.0,
    reference_velocity: Tensor | None = None,
    kl_coef: float = 0.0,
    min_weight: float = 1e-5,
) -> LossOutput:
    """DiffusionNFT: reinforcement on the forward process. The policy is trained by flow matching on its
    own clean samples x0, noised to x_t = (1 - t) x0 + t eps, so it needs no likelihoods and the samples
    may come from any sampler (ODE, SDE, few steps).

    Two implicit policies share the trained velocity v and the old one v_old:
    v+ = beta v + (1 - beta) v_old and v- = (1 + beta) v_old - beta v. Good samples (optimality r near 1)
    are regressed with v+, bad ones (r near 0) with v-, which moves v away from them:
    per sample  scale * (r * mean(e+^2) / w+ + (1 - r) * mean(e-^2) / w-) / beta, with the errors
    e = x0_hat(v) - x0, x0_hat(v) = x_t - t v, means over all but the batch dim, and adaptive weights
    w = mean|e|, detached and at least min_weight. With reference_velocity and kl_coef > 0,
    kl_coef * mean((v - v_ref)^2) keeps v near a reference. old_velocity and reference_velocity are
    constants here. Shapes: velocity, old_velocity, x_t, x0 (and reference_velocity) `[B, ...]`;
    t and optimality `[B]`.
    """
    if not beta > 0:
        raise ValueError(f"diffusion_nft: beta must be > 0, got {beta}")
    if not min_weight > 0:
        raise ValueError(f"diffusion_nft: min_weight must be > 0, got {min_weight}")
    if not kl_coef >= 0:
        raise ValueError(f"diffusion_nft: kl_coef must be >= 0, got {kl_coef}")
    shape = velocity.shape
    if velocity.dim() < 2:
        raise ValueError(f"diffusion_nft: velocity must be [B, ...] with at least 2 dims, got {tuple(shape)}")
    tensors = {"old_velocity": old_velocity, "x_t": x_t, "x0": x0}
    if reference_velocity is not None:
        tensors["reference_velocity"] = reference_velocity
    for name, value in tensors.items():
        if value.shape != shape:
            raise ValueError(
                f"diffusion_nft: {name} has shape {tuple(value.shape)}, velocity has {tuple(shape)}"
            )
    for name, value in (("t", t), ("optimality", optimality)):
        if value.shape != shape[:1]:
            raise ValueError(
                f"diffusion_nft: {name} must have shape ({shape[0]},) for velocity {tuple(shape)}, "
                f"got {tuple(value.shape)}"
            )
    if not ((optimality >= 0) & (optimality <= 1)).all():
        raise ValueError("diffusion_nft: optimality must lie in [0, 1]")

    dtype = torch.promote_types(velocity.dtype, torch.float32)  # low-precision inputs: error in fp32
    v = velocity.to(dtype)
    v_old = old_velocity.detach().to(dtype)
    x_t, x0 = x_t.to(dtype), x0.to(dtype)
    r = optimality.to(dtype)
    t_b = t.to(dtype).view(-1, *([1] * (v.dim() - 1)))

    v_plus = beta * v + (1.0 - beta) * v_old
    v_minus = (1.0 + beta) * v_old - beta * v
    positive = _adaptive_x0_error(x_t - t_b * v_plus - x0, min_weight)
    negative = _adaptive_x0_error(x_t - t_b * v_minus - x0, min_weight)
    policy = scale * (r * positive + (1.0 - r) * negative) / beta
    loss = policy.mean()
    velocity_kl = None
    if reference_velocity is not None:
        velocity_kl = (v - reference_velocity.detach().to(dtype)).square().flatten(1).mean(dim=1).mean()
        if kl_coef > 0:
            loss = loss + kl_coef * velocity_kl
    with torch.no_grad():
        metrics = {
            "nft_positive_loss": positive.detach().mean(),
            "nft_negative_loss": negative.detach().mean(),
            "nft_optimality_mean": r.mean(),
            "nft_policy_gap": (v.detach() - v_old).square().mean(),
        }
        if velocity_kl is not None:
            metrics["nft_velocity_kl"] = velocity_kl.detach()
    return LossOutput(loss, metrics)


def _adaptive_x0_error(error: Tensor, min_weight: float) -> Tensor:
    """Per sample mean(error^2) / w, w = mean|error| detached and at least min_weight: `[B]`."""
    error = error.flatten(1)
    weight = error.detach().abs().mean(dim=1).clamp(min=min_weight)
    return error.square().mean(dim=1) / weight


def _bool_mask(mask: Tensor | None, like: Tensor) -> Tensor:
    if mask is None:
        return torch.ones_like(like, dtype=torch.bool)
    return mask.to(torch.bool).expand_as(like)


def _broadcast_advantages(advantages: Tensor, logp: Tensor) -> Tensor:
    if advantages.dim() == 1 and logp.dim() == 2:
        advantages = advantages[:, None]
    return advantages.expand_as(logp)
