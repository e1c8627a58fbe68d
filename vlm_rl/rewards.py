"""Rollout-guided rewards that teach *when* a pixel tool is worth using.

The group of rollouts of one question tells whether the question can be answered without the tool:
if some tool-free rollout got it right, tool use there is a detour and ranks below a correct direct
answer; if none did, a correct answer with the tool ranks first. Published ranking (adaptive
pixel-space reasoning):

    a tool-free rollout correct:  direct correct 1.0 > tool correct 0.8 > tool wrong 0.5 > direct wrong 0
    none:                         tool correct 1.0 > tool wrong 0.5 > direct wrong 0

Alternative (`scheme: tool_cost`): correctness minus a fixed cost per rollout that used the tool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from mmrl.registry import REWARDS
from mmrl.rewards import RewardFn, answer_match


def adaptive_tool_rewards(
    correct: Tensor,
    used_tool: Tensor,
    group_ids: Tensor,
    scheme: Literal["ranking", "tool_cost"] = "ranking",
    tool_cost: float = 0.2,
) -> Tensor:
    """Rewards [N] for N rollouts; `group_ids[i]` names rollout i's question (any integers)."""
    correct, used_tool = correct.bool(), used_tool.bool()
    if scheme == "tool_cost":
        return correct.float() - tool_cost * used_tool.float()
    if scheme != "ranking":
        raise ValueError(f"unknown scheme {scheme!r}: choose 'ranking' or 'tool_cost'")
    _, group = torch.unique(group_ids, return_inverse=True)
    direct_correct = (correct & ~used_tool).float()
    answerable = (
        torch.zeros(int(group.max()) + 1 if len(group) else 0).index_add_(0, group, direct_correct) > 0
    )
    tool_correct_reward = torch.where(answerable[group], 0.8, 1.0)
    return torch.where(
        used_tool,
        torch.where(correct, tool_correct_reward, 0.5),
        torch.where(correct, 1.0, 0.0),
    ).float()


@REWARDS.register("adaptive_tool")
def adaptive_tool(scheme: Literal["ranking", "tool_cost"] = "ranking", tool_cost: float = 0.2) -> RewardFn:
    """`adaptive_tool_rewards` on completions: correctness by rule-based answer match (`answers`,
    `options`); needs the per-rollout `used_tool` and `group_ids` fields."""
    if scheme not in ("ranking", "tool_cost"):
        raise ValueError(f"unknown scheme {scheme!r}: choose 'ranking' or 'tool_cost'")
    match = answer_match()

    def reward(
        completions: Sequence[str],
        answers: Sequence[str],
        used_tool: Sequence[bool],
        group_ids: Sequence[int],
        options: Sequence[Sequence[str]] | None = None,
        **_: Any,
    ) -> Tensor:
        correct = match(completions, answers=answers, options=options)
        return adaptive_tool_rewards(
            correct, torch.tensor(list(used_tool)), torch.tensor(list(group_ids)), scheme, tool_cost
        )

    return reward
