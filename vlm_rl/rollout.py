"""The rollout loop of tool-using VLMs: many conversations generate together, in waves, until their
schedule is done (`vlm_rl.schedules`: flat groups, trees, partial rollouts carried across steps).

A wave is one batched generation call (left-padded, KV cache within the call; a conversation is
prefilled again at its next call, after the tool's image was appended) for every conversation the
schedule puts in it. Each conversation takes what the call gave it within its own limits, and its turn
closes, its tool runs or it ends as `vlm_rl.conversation` says; then the schedule decides what becomes
of it (it goes on, branches or closes) and whether the step has enough.

A conversation's launch key, with its generation calls so far in the key's `node`, keys each of its
calls: its tokens do not depend on the batch it was generated in, nor on how its turns were cut into
calls. Without keys (evaluation) decoding is greedy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mmrl.noise import NoiseKey
from vlm_rl.config import ToolMode, ToolRolloutConfig
from vlm_rl.conversation import (
    END_REASONS,
    TOOL_CALL_START,
    Trajectory,
    TurnGenerator,
    call_limit,
    forced_tokens,
    start_conversations,
    take_generated,
)
from vlm_rl.data import Question
from vlm_rl.models import VLMAdapter
from vlm_rl.schedules import Conversation, Generated, Groups, Schedule, StepGroups, TreeRollout, Trees
from vlm_rl.tools import ToolStats


@torch.no_grad()
def generate(
    adapter: VLMAdapter,
    schedule: Schedule,
    cfg: ToolRolloutConfig,
    engine: TurnGenerator | None = None,
    tool_mode: ToolMode = "auto",
) -> Generated:
    """Run `schedule`'s waves until it has none left or says it has enough. A conversation at the
    token limit ends before its call. Every row of a call is keyed, or none is (greedy). `engine`
    generates the turns (default: the adapter's transformers model; or a `VLLMTurnGenerator`)."""
    banned = [TOOL_CALL_START] if tool_mode == "never" else []
    forced = forced_tokens(adapter, tool_mode)
    generated = Generated()
    while rows := schedule.wave():
        calling = []
        for row in rows:
            if len(row.trajectory.sequence) >= cfg.max_tokens:
                row.trajectory.ended = "max_tokens"
                schedule.advance(row, [])
            else:
                calling.append(row)
        if not calling:
            continue
        limits = [call_limit(row.trajectory, cfg, schedule.segment_tokens) for row in calling]
        launch_keys = [row.key for row in calling]
        keys = None
        if None not in launch_keys:
            keys = [
                NoiseKey(k.seed, k.step, k.prompt, row.trajectory.calls)
                for k, row in zip(launch_keys, calling, strict=True)
            ]
        out = (engine or adapter).generate_turn(
            [row.trajectory.sequence for row in calling],
            max(limits),
            keys=keys,
            temperature=cfg.temperature,
            banned_tokens=banned,
            prefix_groups=schedule.prefix_groups(calling),
        )
        generated.prefill_tokens += out.prefill_tokens
        for r, (row, limit) in enumerate(zip(calling, limits, strict=True)):
            first = forced if row.trajectory.turns == 0 else []
            log_probs = take_generated(adapter, row.trajectory, out, r, limit, cfg, first)
            generated.decoded_tokens += len(log_probs)
            schedule.advance(row, log_probs)
        if schedule.enough():
            break
    return generated


def rollout(
    adapter: VLMAdapter,
    questions: Sequence[Question],
    cfg: ToolRolloutConfig,
    keys: Sequence[NoiseKey] | None,
    tool_mode: ToolMode = "auto",
    engine: TurnGenerator | None = None,
) -> list[Trajectory]:
    """One conversation per question (repeat a question for a group), each until it ends. `keys[i]`
    keys conversation i; None decodes greedily."""
    trajectories = start_conversations(adapter, questions, cfg, tool_mode)
    row_keys = keys if keys is not None else [None] * len(trajectories)
    conversations = [Conversation(t, k) for t, k in zip(trajectories, row_keys, strict=True)]
    generate(adapter, Groups(conversations), cfg, engine, tool_mode)
    return trajectories


def tree_rollout(
    adapter: VLMAdapter,
    questions: Sequence[Question],
    cfg: ToolRolloutConfig,
    step_groups: StepGroups,
    engine: TurnGenerator | None = None,
) -> TreeRollout:
    """`step_groups.group_size` leaves per question, grown as trees (`cfg.tree`,
    `vlm_rl.schedules.Trees`) and keyed by their group's slot."""
    trees = Trees(adapter, questions, cfg, step_groups)
    return trees.tree_rollout(generate(adapter, trees, cfg, engine))


def rollout_metrics(trajectories: Sequence[Trajectory], correct: Sequence[bool]) -> dict[str, float]:
    """Accuracy, tool use and its errors, accuracy with and without tools, tokens per answer, endings."""
    n = len(trajectories)
    used = [t.used_tool for t in trajectories]
    with_tool = [c for c, u in zip(correct, used, strict=True) if u]
    without = [c for c, u in zip(correct, used, strict=True) if not u]
    metrics = {
        "accuracy": sum(correct) / max(n, 1),
        "tool_ratio": sum(used) / max(n, 1),
        "accuracy_with_tool": sum(with_tool) / len(with_tool) if with_tool else float("nan"),
        "accuracy_without_tool": sum(without) / len(without) if without else float("nan"),
        "tokens_per_answer": sum(t.generated_tokens for t in trajectories) / max(n, 1),
        "turns": sum(t.turns for t in trajectories) / max(n, 1),
    }
    metrics |= sum((t.tool_stats for t in trajectories), ToolStats()).as_metrics()
    metrics |= {
        f"ended_{reason}": sum(t.ended == reason for t in trajectories) / max(n, 1) for reason in END_REASONS
    }
    return metrics


def metrics_by_kind(
    trajectories: Sequence[Trajectory], correct: Sequence[bool], kinds: Sequence[str]
) -> dict[str, float]:
    """``accuracy_{kind}`` and ``tool_ratio_{kind}`` for each question kind present (the synthetic
    task's global / detail): whether the policy zooms where a zoom is needed shows only per kind."""
    metrics = {}
    for kind in sorted(set(kinds) - {""}):
        rows = [i for i, k in enumerate(kinds) if k == kind]
        part = rollout_metrics([trajectories[i] for i in rows], [correct[i] for i in rows])
        metrics |= {f"accuracy_{kind}": part["accuracy"], f"tool_ratio_{kind}": part["tool_ratio"]}
    return metrics
