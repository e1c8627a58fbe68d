"""Samplers: which dataset items (prompts, questions) to roll out next.

A sampler is built as `SAMPLERS.get(name)(num_items, seed=..., **options)` and used in a loop:

    indices = sampler.sample(batch_size)                   # items to roll out
    rewards, group_ids = rollout(indices)                  # group_ids[r] = j: rollout r is of indices[j]
    keep = sampler.update(indices, rewards, group_ids)     # bool mask over indices: groups worth training on

Every random draw comes from the sampler's own `torch.Generator`, never the global RNG, and
`state_dict()` holds everything needed to continue the identical sequence after a restart. The
state dict is flat: the keys in `TENSOR_KEYS` hold tensors (for safetensors), every other value is
a JSON scalar.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from mmrl.config import ConfigError
from mmrl.registry import SAMPLERS


def group_success_counts(
    rewards: Tensor, group_ids: Tensor, success_threshold: float, num_groups: int | None = None
) -> tuple[Tensor, Tensor]:
    """Per-group number of successes (rewards >= `success_threshold`) and of rollouts.

    Groups are numbered 0..num_groups-1 (default: max id + 1); both counts are float64.
    """
    rewards, group_ids = _check_groups(rewards, group_ids)
    if num_groups is None:
        num_groups = int(group_ids.max()) + 1 if group_ids.numel() else 0
    rollouts = torch.bincount(group_ids, minlength=num_groups).double()
    successes = torch.bincount(
        group_ids, weights=(rewards >= success_threshold).double(), minlength=num_groups
    )
    return successes, rollouts


def keep_groups(
    rewards: Tensor,
    group_ids: Tensor,
    lo: float = 0.0,
    hi: float = 1.0,
    success_threshold: float = 0.5,
    num_groups: int | None = None,
) -> Tensor:
    """DAPO dynamic filter: bool mask of the groups that give a learning signal.

    A group is dropped when all its rewards are equal (zero group-relative advantage everywhere) or
    when its success rate (fraction of rewards >= `success_threshold`) is outside [lo, hi].
    """
    rewards, group_ids = _check_groups(rewards, group_ids)
    successes, rollouts = group_success_counts(rewards, group_ids, success_threshold, num_groups)
    rate = successes / rollouts.clamp(min=1)
    rewards = rewards.double()
    highest = torch.full_like(rate, -torch.inf).scatter_reduce(0, group_ids, rewards, "amax")
    lowest = torch.full_like(rate, torch.inf).scatter_reduce(0, group_ids, rewards, "amin")
    varied = highest > lowest  # also False for empty groups
    return varied & (rate >= lo) & (rate <= hi)


def _check_groups(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    rewards, group_ids = torch.as_tensor(rewards), torch.as_tensor(group_ids, dtype=torch.long)
    if rewards.dim() != 1 or rewards.shape != group_ids.shape:
        raise ValueError(
            f"rewards and group_ids must be 1-D and the same length, got {tuple(rewards.shape)} "
            f"and {tuple(group_ids.shape)}"
        )
    return rewards, group_ids


def build_sampler(name: str, options: dict[str, Any], num_items: int, seed: int, key: str) -> Sampler:
    """`SAMPLERS.get(name)(num_items, seed=seed, **options)`, as a trainer builds its sampler from a
    config: an option the sampler does not take, or a value it refuses, is a ConfigError naming `key`
    (the config's options key) with the sampler's message."""
    try:
        return SAMPLERS.get(name)(num_items, seed=seed, **options)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"config error: {key} = {options} for sampler {name!r}: {err}") from None


class Sampler:
    """Base class: a private seeded generator, a no-op update, and state-dict handling for both."""

    TENSOR_KEYS: tuple[str, ...] = ("generator_state",)

    def __init__(self, num_items: int, seed: int = 0) -> None:
        if num_items < 1:
            raise ValueError(f"a sampler needs at least one item, got num_items={num_items}")
        self.num_items = num_items
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, n: int) -> list[int]:
        raise NotImplementedError

    def update(self, indices: Sequence[int], rewards: Tensor, group_ids: Tensor) -> Tensor:
        """Feed back finished groups; return a bool mask over `indices` of the groups to train on.

        `group_ids[r] = j` says rollout r (with reward `rewards[r]`) belongs to the group of `indices[j]`.
        """
        _check_groups(rewards, group_ids)
        return torch.ones(len(indices), dtype=torch.bool)

    def state_dict(self) -> dict[str, Any]:
        return {"num_items": self.num_items, "generator_state": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_items"] != self.num_items:
            raise ValueError(
                f"sampler state is for {state['num_items']} items but this sampler has {self.num_items}"
            )
        self.generator.set_state(state["generator_state"].to(torch.uint8).clone())


@SAMPLERS.register("uniform")
class UniformSampler(Sampler):
    """Epochs of random permutations: every item once per epoch; a draw may span two epochs."""

    TENSOR_KEYS = (*Sampler.TENSOR_KEYS, "permutation")

    def __init__(self, num_items: int, seed: int = 0) -> None:
        super().__init__(num_items, seed)
        self.epoch = 0
        self.position = 0
        self.permutation = torch.randperm(num_items, generator=self.generator)

    def sample(self, n: int) -> list[int]:
        indices: list[int] = []
        while len(indices) < n:
            if self.position == self.num_items:
                self.epoch += 1
                self.position = 0
                self.permutation = torch.randperm(self.num_items, generator=self.generator)
            take = min(n - len(indices), self.num_items - self.position)
            indices.extend(self.permutation[self.position : self.position + take].tolist())
            self.position += take
        return indices

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "epoch": self.epoch,
            "position": self.position,
            "permutation": self.permutation.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.permutation = state["permutation"].to(torch.long).clone()


@SAMPLERS.register("dynamic_filter")
class DynamicFilterSampler(UniformSampler):
    """Uniform sampling plus DAPO's dynamic filter on finished groups (see `keep_groups`).

    The trainer over-samples and keeps drawing until it has enough kept groups; the counters say
    how much rollout work the filter threw away.
    """

    def __init__(
        self, num_items: int, seed: int = 0, lo: float = 0.0, hi: float = 1.0, success_threshold: float = 0.5
    ) -> None:
        super().__init__(num_items, seed)
        self.lo, self.hi, self.success_threshold = lo, hi, success_threshold
        self.groups_seen = 0
        self.groups_dropped = 0

    def update(self, indices: Sequence[int], rewards: Tensor, group_ids: Tensor) -> Tensor:
        keep = keep_groups(rewards, group_ids, self.lo, self.hi, self.success_threshold, len(indices))
        self.groups_seen += len(indices)
        self.groups_dropped += int((~keep).sum())
        return keep

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "groups_seen": self.groups_seen,
            "groups_dropped": self.groups_dropped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.groups_seen = int(state["groups_seen"])
        self.groups_dropped = int(state["groups_dropped"])


@SAMPLERS.register("beta_thompson")
class BetaThompsonSampler(Sampler):
    """VADE-style difficulty sampler: Thompson draws from a per-item Beta posterior on correctness.

    Items whose drawn success probability is closest to `target` (0.5: most reward variance in a
    group, so the largest GRPO signal) are rolled out. After a group of n rollouts with success
    fraction s, the item's posterior decays towards the prior and absorbs the new counts:
        alpha <- lam*alpha + (1-lam)*alpha0 + s*n,   beta <- lam*beta + (1-lam)*beta0 + (1-s)*n.
    Items not rolled out keep their posterior. An item that appears in several groups of one
    update is decayed once and absorbs all their counts.

    Beta draws are X / (X + Y) with X ~ Gamma(alpha), Y ~ Gamma(beta) from `torch._standard_gamma`,
    the kernel behind `torch.distributions.Gamma`, called with this sampler's generator: exact and
    reproducible, and the global RNG is never touched.
    """

    TENSOR_KEYS = (*Sampler.TENSOR_KEYS, "alpha", "beta")

    def __init__(
        self,
        num_items: int,
        seed: int = 0,
        alpha0: float = 1.0,
        beta0: float = 1.0,
        prior_decay: float = 0.9,
        target: float = 0.5,
        success_threshold: float = 0.5,
    ) -> None:
        super().__init__(num_items, seed)
        if alpha0 <= 0 or beta0 <= 0:
            raise ValueError(f"alpha0 and beta0 must be > 0, got {alpha0} and {beta0}")
        if not 0.0 <= prior_decay <= 1.0:
            raise ValueError(f"prior_decay must be in [0, 1], got {prior_decay}")
        self.alpha0, self.beta0 = alpha0, beta0
        self.prior_decay = prior_decay
        self.target = target
        self.success_threshold = success_threshold
        self.alpha = torch.full((num_items,), alpha0, dtype=torch.float64)
        self.beta = torch.full((num_items,), beta0, dtype=torch.float64)

    def draw_success_probabilities(self) -> Tensor:
        """One Thompson draw p ~ Beta(alpha, beta) per item."""
        x = torch._standard_gamma(self.alpha, generator=self.generator)
        y = torch._standard_gamma(self.beta, generator=self.generator)
        return x / (x + y)

    def sample(self, n: int) -> list[int]:
        if n > self.num_items:
            raise ValueError(f"cannot pick {n} distinct items out of {self.num_items}")
        distance = (self.draw_success_probabilities() - self.target).abs()
        return torch.argsort(distance, stable=True)[:n].tolist()

    def update(self, indices: Sequence[int], rewards: Tensor, group_ids: Tensor) -> Tensor:
        group_successes, group_rollouts = group_success_counts(
            rewards, group_ids, self.success_threshold, len(indices)
        )
        items = torch.as_tensor(list(indices), dtype=torch.long)
        successes = torch.zeros(self.num_items, dtype=torch.float64).index_add_(0, items, group_successes)
        rollouts = torch.zeros(self.num_items, dtype=torch.float64).index_add_(0, items, group_rollouts)
        updated = torch.zeros(self.num_items, dtype=torch.bool)
        updated[items] = True
        lam = self.prior_decay
        decayed_alpha = lam * self.alpha + (1 - lam) * self.alpha0 + successes
        decayed_beta = lam * self.beta + (1 - lam) * self.beta0 + (rollouts - successes)
        self.alpha = torch.where(updated, decayed_alpha, self.alpha)
        self.beta = torch.where(updated, decayed_beta, self.beta)
        return torch.ones(len(indices), dtype=torch.bool)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "alpha": self.alpha.clone(), "beta": self.beta.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.alpha = state["alpha"].to(torch.float64).clone()
        self.beta = state["beta"].to(torch.float64).clone()
