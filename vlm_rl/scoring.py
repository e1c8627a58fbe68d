"""Benchmark answers and scores: the option a model's output names (`extract_choice`, by rules, never
by a model), each row's outcome per tool mode, and the scores over them (accuracy or HR-Bench's cycle
average, tool use, per-group tables). An output naming no option counts as wrong and is counted
separately as unanswered."""

from __future__ import annotations

import re
import string
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from mmrl.rewards import extract_answer
from vlm_rl.benchmark_rows import BenchmarkRow, Scoring
from vlm_rl.rollout import rollout_metrics
from vlm_rl.tools import ToolStats

_SPECIAL_TOKEN = re.compile(r"<\|[^|<>]*\|>")  # <|im_end|>, <|endoftext|>, ...
_LEADING_LABEL = re.compile(r"\s*(?:\(([A-Za-z])\)|([A-Z])[.):])(?=\s|$)")


def extract_choice(text: str, options: Sequence[str]) -> str | None:
    """The option letter a model's answer names, or None (unanswered).

    Rules, in order: the last ``<answer>...</answer>`` or ``\\boxed{}`` (a letter, a labelled option
    or an option's text); in free text an opening label ("(B) ...", "B. ...", "B: ..."), then
    `mmrl.rewards.extract_answer`'s letters ("Answer: B", "the answer is (C)", a last "(D)", a lone
    letter), then the one option whose text occurs in it. Special tokens are ignored. A letter
    outside the options, or text matching no option, is no answer."""
    text = _SPECIAL_TOKEN.sub(" ", text).strip()
    if not text:
        return None
    letters = string.ascii_uppercase[: len(options)]
    tagged = "<answer>" in text.lower() or "\\boxed{" in text
    if not tagged and (lead := _LEADING_LABEL.match(text)):
        letter = (lead.group(1) or lead.group(2)).upper()
        if letter in letters:
            return letter
    answer = extract_answer(text, options)
    return answer if answer is not None and answer in letters else None


@dataclass
class Outcome:
    """One row under one tool mode: what `rollout_metrics` reads from a Trajectory, without its tokens
    and images (a benchmark's trajectories are dropped batch by batch)."""

    predicted: str | None
    correct: bool
    used_tool: bool
    tool_stats: ToolStats
    turns: int
    generated_tokens: int
    ended: str
    output: str


@dataclass
class RowResult:
    row: BenchmarkRow
    outcomes: dict[str, Outcome]


def hrbench_score(records: Iterable[tuple[str, str, bool]]) -> dict[str, dict[str, Any]]:
    """HR-Bench's score from (cycle_category, category, correct) per question: accuracy over all
    questions and per category within each cycle, then each averaged over the cycles (a category
    over the cycles that hold it)."""
    per_cycle: dict[str, dict[str, list[bool]]] = defaultdict(lambda: defaultdict(list))
    for cycle, category, correct in records:
        per_cycle[cycle]["all"].append(correct)
        if category:
            per_cycle[cycle][category].append(correct)
    order = sorted(per_cycle, key=lambda c: (not c.isdigit(), int(c) if c.isdigit() else 0, c))
    cycles = {c: {kind: sum(v) / len(v) for kind, v in sorted(per_cycle[c].items())} for c in order}
    kinds = sorted(
        {kind for accuracies in cycles.values() for kind in accuracies}, key=lambda k: (k != "all", k)
    )
    average = {}
    for kind in kinds:
        values = [accuracies[kind] for accuracies in cycles.values() if kind in accuracies]
        average[kind] = sum(values) / len(values)
    return {"cycles": cycles, "average": average}


def _group_table(results: Sequence[RowResult], mode: str, key: str) -> dict[str, dict[str, float]]:
    by_value: dict[str, list[Outcome]] = defaultdict(list)
    for result in results:
        if key in result.row.groups:
            by_value[result.row.groups[key]].append(result.outcomes[mode])
    return {
        value: {
            "n": len(outcomes),
            "accuracy": sum(o.correct for o in outcomes) / len(outcomes),
            "unanswered": sum(o.predicted is None for o in outcomes),
            "tool_ratio": sum(o.used_tool for o in outcomes) / len(outcomes),
        }
        for value, outcomes in sorted(by_value.items())
    }


def score_results(
    results: Sequence[RowResult], modes: Sequence[str], scoring: Scoring = "accuracy"
) -> dict[str, Any]:
    """Per mode: the score (accuracy, or HR-Bench's cycle average), answered / unanswered counts, tool
    use (ratio, calls, errors by kind), accuracy with and without the tool, endings, per-group tables."""
    keys = sorted({key for result in results for key in result.row.groups})
    scores: dict[str, Any] = {}
    for mode in modes:
        outcomes = [result.outcomes[mode] for result in results]
        correct = [o.correct for o in outcomes]
        metrics = rollout_metrics(outcomes, correct)  # type: ignore[arg-type]  # Outcome has what it reads
        tools = sum((o.tool_stats for o in outcomes), ToolStats())
        summary: dict[str, Any] = {
            "score": metrics["accuracy"],
            "accuracy": metrics["accuracy"],
            "scored": len(outcomes),
            "correct": sum(correct),
            "answered": sum(o.predicted is not None for o in outcomes),
            "unanswered": sum(o.predicted is None for o in outcomes),
            "tool_ratio": metrics["tool_ratio"],
            "tool_calls": tools.calls,
            "tool_errors": tools.calls - tools.successes,
            "tool_success_rate": metrics["tool_success_rate"],
            "tool_error_kinds": dict(sorted(tools.errors.items())),
            "accuracy_with_tool": metrics["accuracy_with_tool"],
            "accuracy_without_tool": metrics["accuracy_without_tool"],
            "tokens_per_answer": metrics["tokens_per_answer"],
            "turns": metrics["turns"],
            "ended": dict(Counter(o.ended for o in outcomes)),
            "groups": {key: _group_table(results, mode, key) for key in keys},
        }
        if scoring == "hrbench":
            summary["hrbench"] = hrbench_score(
                (r.row.groups.get("cycle_category", ""), r.row.groups.get("category", ""), o.correct)
                for r, o in zip(results, outcomes, strict=True)
            )
            summary["score"] = summary["hrbench"]["average"].get("all", float("nan"))
        scores[mode] = summary
    return scores
