"""Reward registry and the rule-based text rewards.

Convention: every entry of `REWARDS` is a factory. Calling it with the reward's options (from the
config) returns a reward function

    reward_fn(samples: Sequence, **batch_fields) -> Tensor  # float32, shape [len(samples)]

`samples` are completions (str) for text rewards and images for image rewards; `batch_fields`
carry per-sample metadata as sequences aligned with `samples` (`prompts`, `answers`, `options`,
...). A reward function reads the fields it needs and ignores the rest, so one batch can be
handed to any reward or to a `weighted_sum` of several. Factories are where expensive set-up
(loading a scorer model) happens once.

Model output is only ever parsed with regular expressions, never evaluated.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mmrl.registry import REWARDS

RewardFn = Callable[..., Tensor]
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


class RewardOutputError(ValueError):
    """A reward function returned something that is not one float per sample: a bug in that reward,
    stopped with its name rather than trained on (a short batch would silently drop samples)."""


def checked_rewards(values: Any, count: int, name: str) -> Tensor:
    """What reward `name` returned for `count` samples, as a float32 tensor of shape [count].

    Refuses (RewardOutputError) anything else: another number of values, a non-numeric or complex
    result, a finite value beyond float32's range (it would become inf and be dropped as non-finite).
    NaN and inf pass through: they are data, which the trainers skip and count."""
    try:  # Python or NumPy numbers in float64 first, so that a value past float32's range is seen
        tensor = values if isinstance(values, Tensor) else torch.as_tensor(np.asarray(values))
    except (TypeError, ValueError, RuntimeError):
        raise RewardOutputError(
            f"reward {name!r} returned {type(values).__name__} {str(values)[:60]}, not one number per sample"
        ) from None
    if tensor.is_complex():
        raise RewardOutputError(f"reward {name!r} returned complex values; return one real number per sample")
    if tensor.dim() != 1 or len(tensor) != count:
        raise RewardOutputError(
            f"reward {name!r} returned shape {tuple(tensor.shape)} for {count} samples: it must return "
            f"one value per sample, shape ({count},)"
        )
    wide = tensor.double()
    huge = torch.isfinite(wide) & (wide.abs() > FLOAT32_MAX)
    if huge.any():
        first = int(huge.nonzero()[0])
        raise RewardOutputError(
            f"reward {name!r} returned {float(wide[first]):g} (sample {first}), beyond float32's range "
            f"(+-{FLOAT32_MAX:.3g}): rescale the reward"
        )
    return tensor.float()


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_BOXED = "\\boxed{"
# a bare option letter, e.g. "B", "(b)", "B.", "B)"
_LETTER_ONLY = re.compile(r"\(?([A-Za-z])\)?[.:)]?")
# a labelled option, e.g. "(B) cat", "B. cat", "B) cat", "B: cat"
_LABELLED = re.compile(r"(?:\(([A-Za-z])\)|([A-Za-z])[.):])\s*(.*)", re.DOTALL)
# "answer is (c)", "Answer: B", "the answer is b." (a bare lowercase letter only at the very end)
_ANSWER_IS_LETTER = re.compile(
    r"(?i:\banswer)(?:\s+is)?\s*:?\s*(?:\(([A-Za-z])\)|([A-Z])(?!\w)|([a-z])(?=[.!]?\s*$))"
)
_PAREN_LETTER = re.compile(r"\(([A-Z])\)")


def extract_answer(text: str, options: Sequence[str] | None = None) -> str | None:
    """The final answer in model text, or None if it gives none.

    Looks, in order, at the last `<answer>...</answer>`, the last `\\boxed{...}`, then option letters
    in free text ("the answer is (C)", "Answer: B", a last "(B)", a lone letter). Letters come back
    upper-case. With `options` (option texts for letters A, B, ...), answers are resolved to option
    letters where possible, an option's text counting as its letter; in free text with no letter,
    a single option text that occurs in it is taken as the answer.
    """
    span = _last_tagged(text)
    if span is None:
        span = _last_boxed(text)
    if span is not None:
        span = span.strip()
        if not span:
            return None
        if options:
            return _option_letter(span, options) or span
        letter = _LETTER_ONLY.fullmatch(span)
        return letter.group(1).upper() if letter else span

    valid_letters = string.ascii_uppercase[: len(options)] if options else string.ascii_uppercase
    for match in reversed(list(_ANSWER_IS_LETTER.finditer(text))):
        letter = next(group for group in match.groups() if group).upper()
        if letter in valid_letters:
            return letter
    for match in reversed(list(_PAREN_LETTER.finditer(text))):
        if match.group(1) in valid_letters:
            return match.group(1)
    lone = _LETTER_ONLY.fullmatch(text.strip())
    if lone and lone.group(1).upper() in valid_letters:
        return lone.group(1).upper()
    if options:
        lowered = text.lower()
        found = [
            letter
            for letter, option in zip(valid_letters, options, strict=True)
            if option.strip()
            and re.search(rf"(?<!\w){re.escape(_strip_label(option, letter).lower())}(?!\w)", lowered)
        ]
        if len(found) == 1:
            return found[0]
    return None


def _last_tagged(text: str) -> str | None:
    found = _ANSWER_TAG.findall(text)
    return found[-1] if found else None


def _last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...}, braces balanced (\\boxed{\\frac{1}{2}} -> \\frac{1}{2})."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth = 1
    for i in range(start + len(_BOXED), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + len(_BOXED) : i]
    return None


def _strip_label(option: str, letter: str) -> str:
    """'(A) cat' -> 'cat' for option A; benchmarks store options both with and without labels.

    Only the option's own letter counts as a label, so 'U.S. cities' as option A stays whole.
    """
    labelled = _LABELLED.fullmatch(option.strip())
    if labelled and (labelled.group(1) or labelled.group(2)).upper() == letter and labelled.group(3):
        return labelled.group(3)
    return option.strip()


def _option_letter(span: str, options: Sequence[str]) -> str | None:
    """The option letter that `span` names: a letter, a labelled option, or an option's text."""
    valid_letters = string.ascii_uppercase[: len(options)]
    letter_only = _LETTER_ONLY.fullmatch(span.strip())
    if letter_only and letter_only.group(1).upper() in valid_letters:
        return letter_only.group(1).upper()
    for letter, option in zip(valid_letters, options, strict=True):
        if _normalize(span) == _normalize(_strip_label(option, letter)):
            return letter
    labelled = _LABELLED.fullmatch(span.strip())
    if labelled:
        letter = (labelled.group(1) or labelled.group(2)).upper()
        if letter in valid_letters:
            return letter
    return None


def _normalize(answer: str) -> str:
    """Case- and whitespace-insensitive form; a trailing full stop does not count."""
    return re.sub(r"\s+", "", answer.lower()).rstrip(".")


def _answer_matches(text: str, gold: str, options: Sequence[str] | None) -> bool:
    predicted = extract_answer(text, options)
    if predicted is None:
        return False
    if options:
        gold_letter = _option_letter(gold, options)
        if gold_letter is not None:
            return _option_letter(predicted, options) == gold_letter
    return _normalize(predicted) == _normalize(gold)


@REWARDS.register("answer_match")
def answer_match() -> RewardFn:
    """1.0 where the extracted answer equals the gold one (`answers`; optional per-sample `options`)."""

    def reward(
        completions: Sequence[str],
        answers: Sequence[str],
        options: Sequence[Sequence[str] | None] | None = None,
        **_: Any,
    ) -> Tensor:
        per_sample_options = options if options is not None else [None] * len(completions)
        return torch.tensor(
            [
                float(_answer_matches(text, gold, opts))
                for text, gold, opts in zip(completions, answers, per_sample_options, strict=True)
            ],
            dtype=torch.float32,
        )

    return reward


@REWARDS.register("format")
def format_reward(tags: Sequence[str] = ("think", "answer")) -> RewardFn:
    """1.0 where the text is exactly the given tags in order, each once (whitespace around is fine)."""
    blocks = r"\s*".join(rf"<{re.escape(tag)}>.*?</{re.escape(tag)}>" for tag in tags)
    pattern = re.compile(rf"\s*{blocks}\s*", re.DOTALL)

    def follows_format(text: str) -> bool:
        once = all(text.count(f"<{tag}>") == 1 and text.count(f"</{tag}>") == 1 for tag in tags)
        return once and pattern.fullmatch(text) is not None

    def reward(completions: Sequence[str], **_: Any) -> Tensor:
        return torch.tensor([float(follows_format(text)) for text in completions], dtype=torch.float32)

    return reward


@REWARDS.register("weighted_sum")
def weighted_sum(
    weights: dict[str, float], reward_kwargs: dict[str, dict[str, Any]] | None = None
) -> RewardFn:
    """Sum of registered rewards times their weights; `reward_kwargs[name]` configures reward `name`."""
    reward_kwargs = reward_kwargs or {}
    unused = sorted(set(reward_kwargs) - set(weights))
    if unused:
        raise ValueError(f"reward_kwargs given for {unused}, which are not in weights {sorted(weights)}")
    parts = [(name, REWARDS.get(name)(**reward_kwargs.get(name, {})), w) for name, w in weights.items()]

    def reward(samples: Sequence, **batch_fields: Any) -> Tensor:
        total = torch.zeros(len(samples), dtype=torch.float32)
        for name, reward_fn, weight in parts:
            total += weight * checked_rewards(reward_fn(samples, **batch_fields), len(samples), name)
        return total

    return reward
