"""The `reward` section of the diffusion trainers' configs: one registered reward or weighted terms,
and the checks of a reward entry (its name, options, label and weight) that `eval.gold_reward` and
`mmrl eval diffusion`'s rewards share, each refusing a mistake with its config key named."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from mmrl.config import ConfigError, option
from mmrl.registry import REWARDS, closest

DEFAULT_REWARD = "geneval_mini"
TERM_KEYS = ("name", "weight", "options", "label")
# held-out metrics a term label would overwrite (heldout_<label>)
RESERVED_LABELS = ("alignment", "gold", "reward")
REWARD_KEYS = ("name", "options")


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
        "with other options can be a second term; weight 0: logged, not trained)",
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
    if all(term["weight"] == 0 for term in checked):
        raise ConfigError(
            f"config error: reward.terms = {terms!r}: every weight is 0, so nothing would be trained; "
            "give at least one term a non-zero weight"
        )
    return checked


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


def check_weight(weight: Any, key: str) -> float:
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
