"""Actor weights from advantages, and the chunks the policy sampled as rows of the flat transitions:
shared by the methods that weight the actor's chunks by an advantage (HABC and AWR)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from mmrl.losses import awr_weights


class Weighting(NamedTuple):
    """Actor weights min(exp(beta A), w_max), A first standardised over the batch with `normalize`."""

    beta: float
    w_max: float
    normalize: bool = False


class Chunks(NamedTuple):
    """The policy's decisions as rows of the flat transitions (`executed_chunks`)."""

    decisions: Tensor  # (D,) rows where a chunk was sampled
    rows: Tensor  # (D, horizon) rows of the steps executed from it (clamped)
    executed: Tensor  # (D, horizon) bool: the position was executed from that chunk


def executed_chunks(chunk_step: Tensor, seg_left: Tensor, horizon: int) -> Chunks:
    """Where the policy sampled its chunks in the flat transitions, and which steps it executed from
    each (a chunk ends early at a take-over or at the segment's end)."""
    decisions = torch.nonzero(chunk_step == 0).flatten()
    offsets = torch.arange(horizon)
    rows = (decisions[:, None] + offsets).clamp(max=len(chunk_step) - 1)
    executed = (offsets < seg_left[decisions, None]) & (chunk_step[rows] == offsets)
    return Chunks(decisions, rows, executed)


def spread_over_chunks(weights: Tensor, decision_weights: Tensor, chunks: Chunks) -> None:
    """Give every step executed from a chunk its decision's weight, in place in the per-transition
    `weights` (steps no chunk executed keep theirs)."""
    weights[chunks.rows[chunks.executed]] = decision_weights[:, None].expand_as(chunks.rows)[chunks.executed]


def advantage_weights(advantages: Tensor, weighting: Weighting) -> Tensor:
    """min(exp(beta A), w_max) through the shared `awr_weights` (whose temperature divides A)."""
    return awr_weights(
        advantages, beta=1.0 / weighting.beta, max_weight=weighting.w_max, normalize=weighting.normalize
    )


def weight_stats(weights: Tensor, w_max: float) -> dict[str, float]:
    """Mean, max and clipped share of the policy's actor weights."""
    return {
        "weight_mean": float(weights.mean()),
        "weight_max": float(weights.max()),
        "weight_clip_fraction": float((weights >= w_max * (1 - 1e-6)).float().mean()),
    }
