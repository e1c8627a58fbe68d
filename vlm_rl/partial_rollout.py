"""Partial rollouts (APRIL) of tool-using conversations: what the trainer calls once a step.

`PartialRollouts.step` continues the conversations carried from earlier steps and launches new groups
up to `train.questions_per_step x (1 + rollout.partial.over_provision)`, then generates every
unfinished conversation together in waves (`vlm_rl.rollout.continue_rollout`) until
`train.questions_per_step` groups are complete (every conversation of the group ended). It returns
those groups, the oldest launch first; the rest carry on. The bookkeeping (launches, completion,
staleness and its cap) is `mmrl.partial`'s.

A conversation keeps the key of its launch, (seed, launch step, launch slot x group size + j), with
its generation calls so far in the key's `node`: continuing it later never changes what a token's
noise is, and with nothing carried and no over-provision a step samples exactly what the synchronous
`rollout` of the same questions and keys samples. Its tokens keep the log-probs of the policy that
sampled them. Steps end at turn boundaries, or mid-turn with `rollout.partial.segment_tokens`.

The state dict (for the trainer state) holds what rebuilds the conversations in flight: question
index, launch step and slot per group; per conversation its sampled tokens and log-probs per turn,
how it ended, its generation calls, and the tokens each policy version sampled. `load_state_dict`
replays them (`vlm_rl.rollout.replay_conversation`): images come back from the questions and the
crop tool, never from a pickle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mmrl.noise import NoiseKey
from mmrl.partial import PartialGroup, PartialGroups
from vlm_rl.data import Question, QuestionSet
from vlm_rl.models import VLMAdapter
from vlm_rl.rollout import (
    END_REASONS,
    ToolRolloutConfig,
    Trajectory,
    TurnGenerator,
    continue_rollout,
    replay_conversation,
    sampled_turns,
    start_conversations,
)

ENDINGS = ("", *END_REASONS)  # how a saved conversation ended, by code ("" while running)


@dataclass
class Conversation:
    """One conversation of a group: its trajectory so far, its launch key, and how many of its tokens
    each policy version (training step) sampled."""

    trajectory: Trajectory
    key: NoiseKey
    tokens_by_version: dict[int, int] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return bool(self.trajectory.ended)


@dataclass
class PartialStep:
    """The groups a step trains, the oldest launch first, and the step's partial-rollout metrics."""

    groups: list[PartialGroup[Conversation]]
    metrics: dict[str, float]

    @property
    def trajectories(self) -> list[Trajectory]:
        """The conversations, group by group (group size each)."""
        return [member.trajectory for group in self.groups for member in group.members]

    @property
    def items(self) -> list[int]:
        """The question index of each group."""
        return [group.item for group in self.groups]


class PartialRollouts:
    """Groups of conversations in flight across training steps (see the module docstring)."""

    TENSOR_KEYS = (
        *PartialGroups.TENSOR_KEYS,
        "calls",
        "ended",
        "turns",
        "lengths",
        "turn_lengths",
        "token_ids",
        "log_probs",
        "version_entries",
        "versions",
        "version_tokens",
    )

    def __init__(
        self,
        adapter: VLMAdapter,
        questions: QuestionSet | Sequence[Question],
        cfg: ToolRolloutConfig,
        target_groups: int,
        group_size: int,
        seed: int,
        engine: TurnGenerator | None = None,
    ) -> None:
        self.adapter, self.questions, self.cfg, self.engine = adapter, questions, cfg, engine
        self.group_size, self.seed = group_size, seed
        self.groups: PartialGroups[Conversation] = PartialGroups(
            target_groups, cfg.partial.over_provision, cfg.partial.max_staleness
        )

    def key(self, launch_step: int, slot: int, member: int) -> NoiseKey:
        """A conversation's key for good: where it was launched, not where it is continued."""
        return NoiseKey(self.seed, launch_step, slot * self.group_size + member, 0)

    def start(self, step: int, slot: int, item: int) -> list[Conversation]:
        question = self.questions[item]
        trajectories = start_conversations(self.adapter, [question] * self.group_size, self.cfg)
        return [Conversation(t, self.key(step, slot, j)) for j, t in enumerate(trajectories)]

    @torch.no_grad()
    def step(self, step: int, sample: Callable[[int], list[int]]) -> PartialStep:
        """Drop the groups too stale to train at `step` (their questions go again), launch new groups
        with `sample(n)` (question indices) to fill up, generate until enough groups are complete."""
        plan = self.groups.begin_step(step)
        items = plan.relaunch + (sample(plan.new) if plan.new else [])
        self.groups.launch(step, items, lambda slot, item: self.start(step, slot, item))
        running = [m for g in self.groups.groups for m in g.members if not m.finished]
        before = [m.trajectory.generated_tokens for m in running]
        continue_rollout(
            self.adapter,
            [m.trajectory for m in running],
            self.cfg,
            [m.key for m in running],
            engine=self.engine,
            segment_tokens=self.cfg.partial.segment_tokens,
            enough=self.groups.enough,
        )
        for member, count in zip(running, before, strict=True):
            sampled = member.trajectory.generated_tokens - count
            if sampled:
                member.tokens_by_version[step] = member.tokens_by_version.get(step, 0) + sampled
        trained = self.groups.take_trained()
        metrics = self.groups.metrics(step, trained) | {"partial_launched_groups": len(items)}
        return PartialStep(trained, metrics)

    def state_dict(self) -> dict[str, Any]:
        members = [m for g in self.groups.groups for m in g.members]
        turns = [sampled_turns(m.trajectory) for m in members]
        flat_turns = [turn for conversation in turns for turn in conversation]
        versions = [sorted(m.tokens_by_version.items()) for m in members]

        def longs(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long)

        return {
            **self.groups.state_dict(),
            "group_size": self.group_size,
            "calls": longs([m.trajectory.calls for m in members]),
            "ended": longs([ENDINGS.index(m.trajectory.ended) for m in members]),
            "turns": longs([len(t) for t in turns]),
            "lengths": longs([len(m.trajectory.sequence) for m in members]),
            "turn_lengths": longs([len(ids) for ids, _ in flat_turns]),
            "token_ids": longs([token for ids, _ in flat_turns for token in ids]),
            # float64 holds any sampler's log-probs exactly (the transformers backend's are fp32)
            "log_probs": torch.tensor([lp for _, lps in flat_turns for lp in lps], dtype=torch.float64),
            "version_entries": longs([len(v) for v in versions]),
            "versions": longs([version for v in versions for version, _ in v]),
            "version_tokens": longs([tokens for v in versions for _, tokens in v]),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["group_size"]) != self.group_size:
            raise ValueError(
                f"partial rollout state has groups of {state['group_size']} but this run's have "
                f"{self.group_size}"
            )
        token_ids = split(state["token_ids"].tolist(), state["turn_lengths"].tolist())
        log_probs = split(state["log_probs"].tolist(), state["turn_lengths"].tolist())
        turns = split(list(zip(token_ids, log_probs, strict=True)), state["turns"].tolist())
        entries = state["version_entries"].tolist()
        versions = split(
            list(zip(state["versions"].tolist(), state["version_tokens"].tolist(), strict=True)), entries
        )
        calls, ended, lengths = (state[k].tolist() for k in ("calls", "ended", "lengths"))

        def rebuild(position: int, group: PartialGroup) -> list[Conversation]:
            members = []
            for j in range(self.group_size):
                c = position * self.group_size + j
                trajectory = replay_conversation(
                    self.adapter, self.questions[group.item], self.cfg, turns[c], ENDINGS[ended[c]], calls[c]
                )
                if len(trajectory.sequence) != lengths[c]:
                    raise ValueError(
                        f"a saved conversation of {lengths[c]} tokens replays to {len(trajectory.sequence)}: "
                        "resume with the model and rollout settings it was generated with"
                    )
                members.append(
                    Conversation(trajectory, self.key(group.launch_step, group.slot, j), dict(versions[c]))
                )
            return members

        self.groups.load_state_dict(state, rebuild)


def split(values: list, lengths: list[int]) -> list[list]:
    """`values` cut into consecutive pieces of `lengths`."""
    pieces, start = [], 0
    for length in lengths:
        pieces.append(values[start : start + length])
        start += length
    return pieces
