"""The `reward` section of the diffusion trainers' configs: one registered reward or weighted terms,
and the checks of a reward entry (its name, options, label and weight) that `eval.gold_reward` and
`mmrl eval diffusion`'s rewards share, each refusing a mistake with its config key named."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Literal

from mmrl.config import ConfigError, option
from mmrl.registry import REWARDS, closest

DEFAULT_REWARD = "geneval_mini"
TERM_KEYS = ("name", "weight", "options", "label")
# held-out metrics a term label would overwrite (heldout_<label>)
RESERVED_LABELS = ("alignment", "gold", "reward")
REWARD_KEYS = ("name", "options")
SCHEDULE_KEYS = ("steps", "values", "interpolate")


@dataclass
class RewardConfig:
    """One reward (`name`, `options`) or a weighted sum of several (`terms`), which the trainer
    computes on every leaf; `normalize: group` z-scores each term within each prompt's group (its
    tree) before weighting, so that terms on different scales weigh what their weights say."""

    name: str | None = option(
        None, f"reward (see `mmrl list`); null: {DEFAULT_REWARD}, or the rewards of terms", registry="reward"
    )
    options: dict = option({}, "keyword options of the reward factory")
    terms: list | None = option(
        None,
        "instead of name: rewards trained together, their weighted sum the trained reward, e.g. "
        "[{name: geneval_mini, weight: 1.0}, {name: jpeg_incompressibility, weight: 0.1, options: {}}]; "
        "each term's mean is logged as reward_<label> (label: the name unless given, so the same reward "
        "with other options can be a second term; weight 0: logged, not trained); a weight may change with "
        "the step: {steps: [0, 100], values: [0.0, 1.0], interpolate: linear} (or step: each value held "
        "until the next listed step), logged as reward_weight_<label>",
    )
    normalize: Literal["none", "group"] = option(
        "none", "none: raw rewards; group: each term z-scored within each prompt's group before weighting"
    )

    def __post_init__(self) -> None:
        if self.terms is None:
            if self.name is None:
                self.name = DEFAULT_REWARD
            return
        if self.name is not None:
            raise ConfigError(
                f"config error: reward.name = {self.name!r} and reward.terms are both given: train one "
                "reward with name (and options) or several with terms, and set the other to null "
                "(e.g. reward.name=null beside reward.terms=[...])"
            )
        if self.options:
            raise ConfigError(
                f"config error: reward.options = {self.options!r} is given with reward.terms: give each "
                "term its own options (reward.terms[i].options) and set reward.options={}"
            )
        self.terms = check_reward_terms(self.terms)


def check_reward_terms(terms: Any) -> list[dict[str, Any]]:
    """`reward.terms` as a list of {name, weight, options} (weight 1 and options {} where left out),
    or a ConfigError naming the first bad key."""
    if not isinstance(terms, list | tuple):
        raise ConfigError(
            f"config error: reward.terms = {terms!r} is not a list: give [{{name: ..., weight: ...}}, ...]"
        )
    if not terms:
        raise ConfigError(
            "config error: reward.terms is an empty list: give at least one {name: ..., weight: ...}, "
            "or set reward.terms=null and reward.name=..."
        )
    checked, seen = [], {}
    for i, term in enumerate(terms):
        key = f"reward.terms[{i}]"
        term = reward_mapping(
            term, key, TERM_KEYS, "{name: ..., weight: ..., options: ..., label: ...}", "valid keys of a term"
        )
        name = check_reward_name(term.get("name"), f"{key}.name")
        label = check_term_label(term["label"], f"{key}.label") if "label" in term else name
        if label in seen:
            raise ConfigError(
                f"config error: {key} is logged as {label!r} like reward.terms[{seen[label]}] (its mean is "
                f"reward_{label}): merge their weights, or, for the same reward with other options, give "
                f"one of them another label ({key}.label)"
            )
        seen[label] = i
        checked.append(
            {
                "name": name,
                "weight": check_weight(term.get("weight", 1.0), f"{key}.weight"),
                "options": check_options(term.get("options", {}), f"{key}.options"),
                "label": label,
            }
        )
    if all(weight_values(term["weight"]) == [0.0] for term in checked):
        raise ConfigError(
            f"config error: reward.terms = {terms!r}: every weight is 0, so nothing would be trained; "
            "give at least one term a non-zero weight"
        )
    return checked


def weight_values(weight: float | dict[str, Any]) -> list[float]:
    """The distinct values a checked weight takes."""
    return sorted(set(weight["values"])) if isinstance(weight, dict) else [weight]


def weight_at(weight: float | dict[str, Any], step: int) -> float:
    """A checked term weight at training step `step` (the step metrics.jsonl logs, 1 for the first): a
    number is constant; a schedule gives its first value up to its first step, its last value from its
    last step on, and between two listed steps the earlier value (interpolate: step) or the straight
    line between the two (interpolate: linear)."""
    if not isinstance(weight, dict):
        return weight
    points = list(zip(weight["steps"], weight["values"], strict=True))
    if step <= points[0][0]:
        return points[0][1]
    for (start, low), (end, high) in pairwise(points):
        if step < end:
            if weight["interpolate"] == "step":
                return low
            return low + (high - low) * (step - start) / (end - start)
    return points[-1][1]


def reward_mapping(value: Any, key: str, allowed: Sequence[str], give: str, valid: str) -> dict[str, Any]:
    """A reward entry at config `key` as a mapping ({name: value} for a bare name) whose keys are all in
    `allowed`; a ConfigError saying what to `give`, or naming an unknown key with the `valid` ones."""
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, dict):
        raise ConfigError(f"config error: {key} = {value!r} is not a mapping: give {give}")
    for extra in value:
        if extra not in allowed:
            hint = closest(str(extra), list(allowed))
            did_you_mean = f"; did you mean '{key}.{hint}'?" if hint else ""
            raise ConfigError(
                f"config error: unknown key '{key}.{extra}'{did_you_mean} {valid}: {', '.join(allowed)}"
            )
    return value


def check_reward_name(name: Any, key: str) -> str:
    if name is None:
        raise ConfigError(f"config error: {key} is missing: name a reward (see `mmrl list`)")
    if not isinstance(name, str):
        raise ConfigError(f"config error: {key} = {name!r} is not a string: name a reward (see `mmrl list`)")
    if name not in REWARDS:
        raise ConfigError(f"config error: {key} = {name!r}: {REWARDS.unknown_message(name)}")
    return name


def check_term_label(label: Any, key: str) -> str:
    """A term's label: the suffix of its metrics (reward_<label>, heldout_<label>)."""
    if not isinstance(label, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", label):
        raise ConfigError(
            f"config error: {key} = {label!r} is not a label of lower-case letters, digits and "
            "underscores (it names the term's metrics, reward_<label>): e.g. shapes_identity"
        )
    if label in RESERVED_LABELS:
        raise ConfigError(
            f"config error: {key} = {label!r} would overwrite the metric heldout_{label}: "
            "choose another label"
        )
    return label


def check_weight(weight: Any, key: str) -> float | dict[str, Any]:
    """A term's weight: a finite number, or a schedule (`weight_at`) checked by `check_schedule`."""
    if isinstance(weight, dict):
        return check_schedule(weight, key)
    return check_number(weight, key)


def check_schedule(schedule: dict[str, Any], key: str) -> dict[str, Any]:
    """{steps, values, interpolate} with as many values as steps, the steps increasing integers >= 0,
    interpolate step (the default) or linear; a ConfigError naming the bad key."""
    give = "{steps: [...], values: [...], interpolate: step}"
    schedule = reward_mapping(schedule, key, SCHEDULE_KEYS, give, "valid keys of a schedule")
    steps, values = schedule.get("steps"), schedule.get("values")
    example = "e.g. {steps: [0, 100], values: [0.0, 1.0], interpolate: linear}"
    if not isinstance(steps, list) or not steps or not isinstance(values, list) or len(values) != len(steps):
        raise ConfigError(
            f"config error: {key} = {schedule!r}: a schedule needs steps and values, two lists of one "
            f"length; {example}"
        )
    for i, step in enumerate(steps):
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"config error: {key}.steps[{i}] = {step!r} is not a step (an integer >= 0)")
    if any(a >= b for a, b in pairwise(steps)):
        raise ConfigError(f"config error: {key}.steps = {steps!r}: the steps must increase; {example}")
    interpolate = schedule.get("interpolate", "step")
    if interpolate not in ("step", "linear"):
        raise ConfigError(
            f"config error: {key}.interpolate = {interpolate!r}: step (each value held until the next "
            "listed step) or linear (a straight line between them)"
        )
    checked = [check_number(value, f"{key}.values[{i}]") for i, value in enumerate(values)]
    return {"steps": list(steps), "values": checked, "interpolate": interpolate}


def check_number(weight: Any, key: str) -> float:
    number = weight
    if isinstance(weight, str):  # YAML 1.1 reads "1e-1" as a string
        try:
            number = float(weight)
        except ValueError:
            number = None
    if isinstance(number, bool) or not isinstance(number, int | float):
        raise ConfigError(f"config error: {key} = {weight!r} is not a number")
    if not math.isfinite(number):
        raise ConfigError(f"config error: {key} = {weight!r} is not a finite number")
    return float(number)


def check_options(options: Any, key: str) -> dict[str, Any]:
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ConfigError(
            f"config error: {key} = {options!r} is not a mapping: give the reward factory's keyword "
            "options, e.g. {quality: 90}"
        )
    return dict(options)
