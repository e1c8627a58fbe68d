"""The rewards a text-to-image trainer scores: each configured term built from the registry and checked
to give one number per image, their weighted sum (each term z-scored within its group when asked),
and the reward-hacking check that compares the trained reward's held-out change with the gold
reward's, paired prompt by prompt."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from diffusion_rl.models import one_line
from diffusion_rl.reward_config import RewardConfig
from diffusion_rl.reward_server import RewardServerError
from diffusion_rl.rewards import OPTIONS_KEY
from mmrl.config import ConfigError
from mmrl.registry import REWARDS, UnknownNameError
from mmrl.rewards import RewardFn, RewardOutputError, checked_rewards

NOISE_SE = 2.0  # a held-out change counts as beyond noise past this many paired standard errors


class RewardFailed(Exception):
    """A reward could not score a batch: its server failed, it returned something other than one number
    per sample (`checked_rewards`), or it cannot score a prompt (a ValueError); the message names the
    reward and what it did."""


def scored(name: str, fn: RewardFn, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """Reward `name`'s values of `images` (``fn(images, prompts=prompts)``), checked to be one float32
    number per image, on the CPU; RewardFailed otherwise."""
    try:
        return checked_rewards(fn(images, prompts=prompts), len(images), name).cpu()
    except RewardServerError as err:
        raise RewardFailed(f"reward {name!r}: {err}") from err
    except RewardOutputError as err:
        raise RewardFailed(str(err)) from err
    except ValueError as err:
        raise RewardFailed(f"reward {name!r} cannot score these prompts or images: {one_line(err)}") from err


class RewardTerm(NamedTuple):
    name: str  # the registered reward
    label: str  # its metrics: reward_<label>, heldout_<label>
    weight: float | dict[str, Any]  # a number or a schedule (`reward_config.weight_at`)
    fn: RewardFn


def build_reward(name: str, options: dict[str, Any], prefix: str) -> RewardFn:
    """The registered reward `name` built with `options`; a ConfigError naming `prefix` + name/options."""
    try:
        return REWARDS.get(name)(**options)
    except UnknownNameError as err:
        raise ConfigError(f"config error: {prefix}name: {err}") from None
    except TypeError as err:
        raise ConfigError(
            f"config error: {prefix}options = {options}: {err}; give {name}'s own options "
            f"({prefix}options={{}} for none: a recipe's options stay when only {prefix}name is overridden)"
        ) from None
    except ConfigError as err:  # the factory's own check of an option, named where this config holds it
        raise ConfigError(str(err).replace(OPTIONS_KEY, f"{prefix}options")) from None


def build_reward_terms(reward: RewardConfig) -> list[RewardTerm]:
    """Every trained reward with its weight: the terms, or the one reward with weight 1."""
    if reward.terms is None:
        name = str(reward.name)
        return [RewardTerm(name, name, 1.0, build_reward(name, reward.options, "reward."))]
    return [
        RewardTerm(
            t["name"], t["label"], t["weight"], build_reward(t["name"], t["options"], f"reward.terms[{i}].")
        )
        for i, t in enumerate(reward.terms)
    ]


def group_zscore(values: torch.Tensor, group_sizes: Sequence[int], eps: float = 1e-6) -> torch.Tensor:
    """(r - mean_g) / (std_g + eps) within consecutive groups of the given sizes (population std, in
    float64 as the GRPO advantage computes it); a group of equal values gets exactly 0."""
    r = values.double()
    parts = [(g - g.mean()) / (g.std(unbiased=False) + eps) for g in r.split(list(group_sizes))]
    return torch.cat(parts) if parts else r


def combine_rewards(
    raw: dict[str, torch.Tensor], weights: dict[str, float], group_sizes: Sequence[int], normalize: str
) -> torch.Tensor:
    """The trained reward: sum over terms of weight * reward, each term first z-scored within each
    group (consecutive leaves, `group_sizes`) when `normalize` is "group"; float32."""
    total = torch.zeros(sum(group_sizes), dtype=torch.float64)
    for name, values in raw.items():
        term = group_zscore(values, group_sizes) if normalize == "group" else values.double()
        total += weights[name] * term
    return total.float()


def paired_se(first: Sequence[float] | None, last: Sequence[float] | None) -> float | None:
    """Standard error of the mean paired change from `first` to `last` (the same prompts and noise in
    both); None without per-prompt scores for both, of one length, for at least two prompts."""
    if first is None or last is None or len(first) != len(last) or len(first) < 2:
        return None
    diff = torch.tensor(last, dtype=torch.float64) - torch.tensor(first, dtype=torch.float64)
    return float(diff.std() / len(diff) ** 0.5)


def reward_hacking_record(
    first: dict[str, Any] | None,
    last: dict[str, Any] | None,
    trained_key: str,
    gold_key: str,
    margin: float = 0.0,
    first_scores: dict[str, Sequence[float]] | None = None,
    last_scores: dict[str, Sequence[float]] | None = None,
) -> dict[str, Any] | None:
    """The change of the trained reward's and the gold reward's held-out means from the `first` to
    the `last` evaluation, with their paired standard errors where the per-prompt scores of both are
    given; None when either evaluation lacks either mean.

    ``gold_fell``: the gold mean fell by more than `margin` and, with a standard error, by more than
    `NOISE_SE` of them. ``reward_hacking_suspected``: that, while the trained mean rose by more than
    `margin`. A gold fall with the trained reward flat or falling is a run that degraded, not one
    that games its reward."""
    if first is None or last is None:
        return None
    try:
        trained = float(last[trained_key]) - float(first[trained_key])
        gold = float(last[gold_key]) - float(first[gold_key])
    except (KeyError, TypeError, ValueError):
        return None
    first_scores, last_scores = first_scores or {}, last_scores or {}
    trained_se = paired_se(first_scores.get(trained_key), last_scores.get(trained_key))
    gold_se = paired_se(first_scores.get(gold_key), last_scores.get(gold_key))
    gold_fell = gold < -margin and (gold_se is None or gold < -NOISE_SE * gold_se)
    return {
        "reward_hacking_suspected": bool(gold_fell and trained > margin),
        "gold_fell": bool(gold_fell),
        "trained_metric": trained_key,
        "trained_delta": trained,
        "trained_se": trained_se,
        "gold_metric": gold_key,
        "gold_delta": gold,
        "gold_se": gold_se,
    }
