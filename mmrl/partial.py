"""Partial rollouts (APRIL): launch more groups than a step trains, end the step's generation as soon as
enough groups are complete, and carry the unfinished ones into the next step.

This module is the bookkeeping only, the same for any trainer: what a group's members are
(conversations, denoising chains, episodes) and how they generate is the trainer's. A member reports
whether it has `finished` and how many tokens each policy version sampled for it. One step:

    plan = groups.begin_step(step)               # drop the groups too stale to train; how many to launch
    items = plan.relaunch + sampler.sample(plan.new)
    groups.launch(step, items, make_members)     # relaunched items first, then new ones
    while True:                                  # the trainer generates a wave of every unfinished member
        ...
        if groups.enough():
            break
    trained = groups.take_trained()              # complete groups, oldest launch first; the rest carry on
    metrics = groups.metrics(step, trained)

A group's `launch_step` is the policy version that sampled its first token; with `slot` (its place
among the groups launched that step) it names the group's sampling noise, so that a carried group
samples what it would have sampled had it run in one piece under the same policy. Continued members
sample their new tokens under the newer policy, with that policy's log-probs, while their earlier
tokens keep theirs: the PPO ratio against the stored log-probs is the importance correction.
`max_staleness` bounds how old that correction may get: a group whose first token is more policy
versions old than that by the step that would train it is dropped, counted, and its item relaunched.

The state dict is flat, like a sampler's (`mmrl.samplers`): the keys in `TENSOR_KEYS` hold tensors, the
others JSON scalars. It holds the groups' identities, not their members: the trainer stores what
rebuilds its members and hands them back to `load_state_dict`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch


class PartialMember(Protocol):
    """What the bookkeeping asks of one member of a group (one conversation)."""

    @property
    def finished(self) -> bool: ...

    @property
    def tokens_by_version(self) -> Mapping[int, int]:
        """Tokens sampled for this member by each policy version (the step that sampled them)."""
        ...


M = TypeVar("M", bound=PartialMember)


def groups_in_flight(target: int, over_provision: float) -> int:
    """Groups a step starts with: the target and the over-provision, rounded up."""
    return math.ceil(target * (1 + over_provision) - 1e-9)


@dataclass
class PartialGroup(Generic[M]):
    """One item's group: launched at `launch_step` in launch slot `slot`, with its members."""

    item: int
    launch_step: int
    slot: int
    members: list[M]

    @property
    def complete(self) -> bool:
        return all(member.finished for member in self.members)

    def staleness(self, step: int) -> int:
        """Policy versions between the one that sampled the group's first token and `step`'s."""
        return step - self.launch_step


@dataclass
class StepPlan:
    """What a step launches: the items of the dropped groups again, then `new` freshly sampled ones."""

    dropped: list[PartialGroup]
    relaunch: list[int]
    new: int


class PartialGroups(Generic[M]):
    """The groups in flight across steps: which to launch, when a step has enough, which to train."""

    TENSOR_KEYS = ("items", "launch_steps", "slots")

    def __init__(self, target: int, over_provision: float, max_staleness: int) -> None:
        if target < 1:
            raise ValueError(f"a step trains at least one group, got target={target}")
        if over_provision < 0:
            raise ValueError(f"over_provision must be >= 0, got {over_provision}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.target = target
        self.over_provision = over_provision
        self.max_staleness = max_staleness
        self.groups: list[PartialGroup[M]] = []  # in flight, in launch order
        self.launched_groups = 0
        self.dropped_groups = 0
        self.dropped_members = 0
        self.step_dropped_members = 0  # this step's, for `metrics`

    @property
    def in_flight(self) -> int:
        return groups_in_flight(self.target, self.over_provision)

    def begin_step(self, step: int) -> StepPlan:
        """Drop the groups whose staleness at `step` would exceed the cap; say what to launch: every
        dropped item again (never lost), then new items up to `in_flight` groups."""
        kept = [g for g in self.groups if g.staleness(step) <= self.max_staleness]
        dropped = [g for g in self.groups if g.staleness(step) > self.max_staleness]
        self.groups = kept
        self.step_dropped_members = sum(len(g.members) for g in dropped)
        self.dropped_groups += len(dropped)
        self.dropped_members += self.step_dropped_members
        relaunch = [g.item for g in dropped]
        new = max(0, self.in_flight - len(kept) - len(relaunch))
        return StepPlan(dropped, relaunch, new)

    def launch(
        self, step: int, items: Sequence[int], make_members: Callable[[int, int], list[M]]
    ) -> list[PartialGroup[M]]:
        """Start one group per item at `step`, in launch slots 0, 1, ...; `make_members(slot, item)`
        builds its members (call once per step: a second call would reuse the slots)."""
        launched = [
            PartialGroup(item, step, slot, make_members(slot, item)) for slot, item in enumerate(items)
        ]
        self.groups.extend(launched)
        self.launched_groups += len(launched)
        return launched

    def complete_groups(self) -> int:
        return sum(g.complete for g in self.groups)

    def enough(self) -> bool:
        """Whether the step can stop generating: `target` groups are complete (or nothing is left).
        Asked after a wave, so that every group launched in a step samples its first tokens in it
        (its launch step is the version that sampled them)."""
        return self.complete_groups() >= min(self.target, len(self.groups))

    def take_trained(self) -> list[PartialGroup[M]]:
        """Up to `target` complete groups, the oldest launch first; the others stay in flight."""
        complete = sorted((g for g in self.groups if g.complete), key=lambda g: (g.launch_step, g.slot))
        trained = complete[: self.target]
        chosen = {id(g) for g in trained}
        self.groups = [g for g in self.groups if id(g) not in chosen]
        return trained

    def metrics(self, step: int, trained: Sequence[PartialGroup[M]]) -> dict[str, float]:
        """Staleness of the trained members (policy versions behind: mean and max), the share of their
        tokens an older policy sampled, the members dropped for staleness (this step and in all),
        and the groups carried into the next step."""
        members = [(g.staleness(step), m) for g in trained for m in g.members]
        tokens = sum(n for _, m in members for n in m.tokens_by_version.values())
        older = sum(n for _, m in members for version, n in m.tokens_by_version.items() if version < step)
        ages = [age for age, _ in members]
        return {
            "partial_staleness_mean": sum(ages) / len(ages) if ages else 0.0,
            "partial_staleness_max": max(ages, default=0),
            "partial_old_token_fraction": older / tokens if tokens else 0.0,
            "partial_dropped": self.step_dropped_members,
            "partial_dropped_total": self.dropped_members,
            "partial_carried_groups": len(self.groups),
        }

    def state_dict(self) -> dict[str, Any]:
        """The groups in flight (item, launch step, slot, in order) and the counters; not the members."""
        return {
            "target": self.target,
            "items": torch.tensor([g.item for g in self.groups], dtype=torch.long),
            "launch_steps": torch.tensor([g.launch_step for g in self.groups], dtype=torch.long),
            "slots": torch.tensor([g.slot for g in self.groups], dtype=torch.long),
            "launched_groups": self.launched_groups,
            "dropped_groups": self.dropped_groups,
            "dropped_members": self.dropped_members,
        }

    def load_state_dict(
        self, state: dict[str, Any], rebuild: Callable[[int, PartialGroup[M]], list[M]]
    ) -> None:
        """Restore the groups in flight; `rebuild(position, group)` returns the members of the group at
        that position of the saved order (the group is passed without them)."""
        if int(state["target"]) != self.target:
            raise ValueError(
                f"partial rollout state is for {state['target']} groups per step but this run trains "
                f"{self.target}"
            )
        self.groups = []
        columns = (state[key].tolist() for key in ("items", "launch_steps", "slots"))
        for position, (item, launch_step, slot) in enumerate(zip(*columns, strict=True)):
            group: PartialGroup[M] = PartialGroup(int(item), int(launch_step), int(slot), [])
            group.members = rebuild(position, group)
            self.groups.append(group)
        self.launched_groups = int(state["launched_groups"])
        self.dropped_groups = int(state["dropped_groups"])
        self.dropped_members = int(state["dropped_members"])
        self.step_dropped_members = 0
