"""Runs grouped into methods: runs whose saved configs are the same but for their seed and
bookkeeping (`NOT_METHOD_KEYS`, and the keys a user names with ``--seed-key``) are seeds of one
method, labelled by their common directory name (`mmrl report --compare`, ``--displacement`` and
`mmrl eval diffusion` group runs so)."""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import re
from pathlib import Path
from typing import Any

from mmrl.config import ConfigError, load_config, to_dict
from mmrl.runlog import check_run_dir

# Config keys (dotted for nested ones) that do not change what a run trains: they may differ between
# seeds of one method. The seed and where the run went, whether it resumed, how often it saved and
# showed progress, and what its evaluations score on the side (the gold reward never trains).
NOT_METHOD_KEYS = (
    "seed",
    "output_dir",
    "resume",
    "checkpoint_every",
    "progress",
    "eval.gold_reward",
    "eval.divergence_margin",
)


def run_config(run: Path) -> dict[str, Any] | None:
    """A run's saved config.yaml, with the defaults of keys added since the run was made (their
    defaults keep what runs did before them); None without one, or for one that is not a mapping."""
    import yaml

    path = run / "config.yaml"
    if not path.is_file():
        return None
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{str(path)!r} is not valid YAML ({err})") from None
    if not isinstance(config, dict):
        return None
    with contextlib.suppress(ConfigError):  # one this version no longer reads: compared as written
        config = to_dict(load_config(str(path)))
    return config


def _method_key(run: Path, config: dict[str, Any] | None, seed_keys: tuple[str, ...]) -> tuple[str, Any]:
    """(what seeds of one method share, the run's seed): its `run_config` without `NOT_METHOD_KEYS`
    and `seed_keys`; a run without a config.yaml is a method of its own."""
    if config is None:
        return f"run {run.resolve()}", None
    method = _without(config, (*NOT_METHOD_KEYS, *seed_keys))
    return json.dumps(method, sort_keys=True, default=str), config.get("seed")


def _dotted_keys(config: dict[str, Any], prefix: str = "") -> list[str]:
    """Every key of a nested config, dotted, sections included ("model" and "model.path")."""
    keys = []
    for key, value in config.items():
        keys.append(f"{prefix}{key}")
        if isinstance(value, dict):
            keys += _dotted_keys(value, f"{prefix}{key}.")
    return keys


def check_seed_keys(seed_keys: tuple[str, ...], configs: list[dict[str, Any] | None]) -> None:
    """Refuse a --seed-key that no run's config has (a misspelt key would leave the seeds apart without
    a word), naming the closest key and the keys where it goes astray."""
    known = {key for config in configs if config is not None for key in _dotted_keys(config)}
    for key in seed_keys:
        if key in known:
            continue
        if not known:
            raise ConfigError(f"--seed-key {key!r}: no run has a config.yaml to find it in; leave it out")
        hint = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
        did_you_mean = f" (did you mean {hint[0]!r}?)" if hint else ""
        parts = key.split(".")
        sections = (".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1))  # deepest first
        section = next((name for name in sections if name in known), "")
        prefix = f"{section}." if section else ""
        inside = (k.removeprefix(prefix) for k in known if k.startswith(prefix))
        here = sorted({name for name in inside if "." not in name})
        where = f"under {section!r}" if section else "at the top level"
        raise ConfigError(
            f"--seed-key {key!r}: no run's config.yaml has this key{did_you_mean}; the keys {where} are: "
            + ", ".join(here)
        )


def _without(config: dict, dotted_keys: tuple[str, ...]) -> dict:
    """A copy of a nested config without the given (dotted) keys."""
    kept = {}
    for key, value in config.items():
        if key in dotted_keys:
            continue
        inner = tuple(k.removeprefix(key + ".") for k in dotted_keys if k.startswith(key + "."))
        kept[key] = _without(value, inner) if inner and isinstance(value, dict) else value
    return kept


def _trim_label(prefix: str) -> str:
    """A common prefix without its trailing separators and a dangling seed marker: "habc_s" (of
    habc_s0, habc_s1) and "runs/a/seed" (of runs/a/seed0, runs/a/seed1) give "habc" and "runs/a"."""
    return re.sub(r"(?:[-_. /=]+(?:seed|s)?)+$", "", prefix)


def method_labels(groups: list[list[Path]]) -> list[str]:
    """A label per method: a lone run's directory name; for seeds, the longest common prefix of their
    directory names, trimmed (`_trim_label`). An empty or repeated label falls back to the common
    prefix of the run paths as given, then to a numbered one."""
    labels = []
    for runs in groups:
        names = [run.resolve().name if run.name in ("", ".", "..") else run.name for run in runs]
        labels.append(names[0] if len(runs) == 1 else _trim_label(os.path.commonprefix(names)))
    first = list(labels)
    for i, runs in enumerate(groups):
        if first[i] and first.count(first[i]) == 1:
            continue
        paths = [str(run) for run in runs]
        full = _trim_label(os.path.commonprefix(paths)) if len(runs) > 1 else paths[0]
        taken = labels[:i] + labels[i + 1 :]
        labels[i] = full if full and full not in taken else f"{first[i] or 'method'} ({i + 1})"
    return labels


def distinct_runs(run_dirs: list[str | Path]) -> list[Path]:
    """The run directories as Paths, refusing one that does not exist or is no run directory
    (`check_run_dir`) and one given twice (it would count as two seeds)."""
    runs = [check_run_dir(run_dir) for run_dir in run_dirs]
    seen: dict[Path, Path] = {}
    for run in runs:
        if run.resolve() in seen:
            raise ConfigError(f"run {str(run)!r} is given twice (as {str(seen[run.resolve()])!r})")
        seen[run.resolve()] = run
    return runs


def group_methods(runs: list[Path], seed_keys: list[str] | None = None) -> tuple[list[list[int]], list[Any]]:
    """The runs' indices grouped into methods (`_method_key`), in the order each method's first run
    is given, and every run's seed; `seed_keys` that no run's config has are refused."""
    configs = [run_config(run) for run in runs]
    check_seed_keys(tuple(seed_keys or ()), configs)
    groups: dict[str, list[int]] = {}
    seeds: list[Any] = []
    for i, (run, config) in enumerate(zip(runs, configs, strict=True)):
        key, seed = _method_key(run, config, tuple(seed_keys or ()))
        groups.setdefault(key, []).append(i)
        seeds.append(seed)
    return list(groups.values()), seeds


def chosen_labels(runs: list[Path], members: list[list[int]], labels: list[str] | None) -> list[str]:
    """`labels` (one per method, checked) or `method_labels`."""
    auto = method_labels([[runs[i] for i in indices] for indices in members])
    if labels:
        if len(labels) != len(members):
            raise ConfigError(
                f"--label is given {len(labels)} times for {len(members)} method(s) ({', '.join(auto)}, in "
                "that order): give one per method, in the order its first run is given"
            )
        return list(labels)
    return auto
