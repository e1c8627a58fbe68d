"""Policy losses: pure functions on tensors. `LOSSES` holds the policy losses a trainer's `train.loss`
can name: each is called as loss(logp, old_logp, advantages, mask, **options) and returns a
`LossOutput`; the trainers pass ppo_clip's options (clip_low, clip_high, adv_clip and, where they
have it, aggregation), so a new loss takes those keywords too. The KL estimates and the AWR weights
are plain functions the trainers add or use where their method needs them.

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
) -> Tensor:
    """Reduce a per-token (or per-step) loss to a scalar.

    token_mean: mean over every unmasked element of the batch (long sequences weigh more).
    sequence_mean: mean over each sequence's unmasked elements, then over sequences with any.
    sum_norm: sum / (B * norm_length) with a fixed length (Dr.GRPO: no length bias either way).
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}: choose one of {', '.join(AGGREGATIONS)}")
    mask = _bool_mask(mask, per_element)
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


@LOSSES.register("ppo_clip", kind="policy")
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
) -> LossOutput:
    """PPO clipped surrogate with separate low/high clip ranges (DAPO clip-higher).

    ratio = exp(logp - old_logp) is clipped to [1 - clip_low, 1 + clip_high]; the per-element loss is
    -min(ratio * A, clip(ratio) * A), so entries whose clipped term is active get no gradient.
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
    loss = aggregate_loss(torch.maximum(unclipped, clipped), mask, aggregation, norm_length)
    with torch.no_grad():
        metrics = {
            "clip_fraction": _masked_mean((clipped > unclipped).float(), mask),
            "approx_kl": _masked_mean(ratio - 1.0 - log_ratio, mask),  # k3 estimate of KL(old || new)
            "ratio_mean": _masked_mean(ratio, mask),
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


def _bool_mask(mask: Tensor | None, like: Tensor) -> Tensor:
    if mask is None:
        return torch.ones_like(like, dtype=torch.bool)
    return mask.to(torch.bool).expand_as(like)


def _broadcast_advantages(advantages: Tensor, logp: Tensor) -> Tensor:
    if advantages.dim() == 1 and logp.dim() == 2:
        advantages = advantages[:, None]
    return advantages.expand_as(logp)


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, values, 0.0).sum() / mask.sum().clamp(min=1)
