"""Held-out evaluation of a tool-using VLM: accuracy and tool use, overall and per question kind.

Greedy decoding. Each `tool_mode` is a policy from the same model: "auto" (as trained), "always"
(every answer starts with a tool call) and "never" (the tool-call token is forbidden), so one run
compares a model against its own always-zoom and never-zoom variants on the same questions.
"""

from __future__ import annotations

from collections.abc import Sequence

from vlm_rl.config import ToolMode, ToolRolloutConfig
from vlm_rl.conversation import TurnGenerator
from vlm_rl.data import Question
from vlm_rl.models import VLMAdapter
from vlm_rl.rollout import metrics_by_kind, rollout, rollout_metrics

REPORTED = ("accuracy", "tool_ratio", "tokens_per_answer", "tool_calls", "tool_success_rate")


def evaluate_questions(
    adapter: VLMAdapter,
    questions: Sequence[Question],
    cfg: ToolRolloutConfig,
    modes: Sequence[ToolMode] = ("auto",),
    batch_size: int = 64,
    engine: TurnGenerator | None = None,
) -> dict[str, float]:
    """Metrics named ``{mode}_{metric}`` and ``{mode}_{metric}_{kind}`` (kind: global / detail)."""
    results: dict[str, float] = {}
    for mode in modes:
        trajectories = []
        for start in range(0, len(questions), batch_size):
            chunk = questions[start : start + batch_size]
            trajectories += rollout(adapter, chunk, cfg, keys=None, tool_mode=mode, engine=engine)
        correct = [t.answer == q.answer for t, q in zip(trajectories, questions, strict=True)]
        metrics = rollout_metrics(trajectories, correct)
        results |= {f"{mode}_{name}": metrics[name] for name in REPORTED}
        results[f"{mode}_answered"] = metrics["ended_answer"]
        by_kind = metrics_by_kind(trajectories, correct, [q.kind for q in questions])
        results |= {f"{mode}_{name}": value for name, value in by_kind.items()}
    return results
