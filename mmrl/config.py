"""Typed configs: one dataclass per trainer, loaded from YAML, overridden with dotted keys.

A config error must stop the run before any work, in one line that names the key, the bad
value, what is allowed and the closest valid key. Field metadata carries the allowed range:
``min`` / ``max`` (inclusive), ``choices``, or ``registry`` (the name of an mmrl registry whose
entries are the allowed values) with ``kinds`` (the kinds of entries the trainer can call);
``why`` explains a ``max`` in its error (a size far above any sensible value is an extra zero).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

from mmrl.checkpoint import replace_text
from mmrl.registry import ALL_REGISTRIES, TRAINERS, UnknownNameError

C = TypeVar("C", bound="BaseConfig")

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_ROOT = REPO_ROOT / "configs"
SHIPPING_PACKAGES = frozenset({"diffusion_rl", "vlm_rl", "vla_rl"})  # those with assets/ base models
OPTIMIZERS = ("adamw", "adamw_8bit")


class ConfigError(ValueError):
    """A user mistake in a config file or override; the message says how to fix it."""


def option(default: Any, help: str = "", **limits: Any) -> Any:
    """A dataclass field with a help text and limits (min, max, choices, registry)."""
    if isinstance(default, list | dict):
        return dataclasses.field(
            default_factory=lambda: type(default)(default), metadata={"help": help, **limits}
        )
    return dataclasses.field(default=default, metadata={"help": help, **limits})


@dataclasses.dataclass
class WandbConfig:
    """The Weights & Biases run of `tracking: [wandb]` (`mmrl.tracking`)."""

    project: str = option("mmrl", "W&B project")
    name: str | None = option(None, "W&B run name (null: the run directory's name)")
    tags: list[str] = option([], "W&B tags")
    mode: Literal["auto", "online", "offline", "disabled"] = option(
        "auto",
        "online; offline (kept under RUN_DIR/wandb for `wandb sync`); disabled; auto: W&B's own setting "
        "(WANDB_MODE, or online once logged in)",
    )


@dataclasses.dataclass
class BaseConfig:
    """Fields every trainer shares: where the run lives, how long it is, how it checkpoints."""

    trainer: str = option("", "trainer name (see `mmrl list`)", registry="trainer")
    plugins: list[str] = option(
        [],
        "modules (importable names, or paths to .py files) that `mmrl` imports before it checks the "
        "rest of the config, so that it may name their tasks, rewards, advantages (same as --plugin)",
    )
    output_dir: str = option("runs/default", "run directory: config, metrics, checkpoints, samples")
    seed: int = option(0, "run seed: every random draw derives from it", min=0)
    resume: bool = option(False, "continue from the newest good checkpoint in output_dir")
    steps: int = option(100, "training steps", min=1)
    checkpoint_every: int = option(10, "steps between checkpoints", min=1)
    keep_checkpoints: int = option(3, "newest checkpoints kept on disk", min=1)
    eval_every: int = option(
        0, "steps between held-out evaluations logged as eval_<metric> (0: only before and after)", min=0
    )
    discard_corrupt_checkpoints: bool = option(
        False,
        "with resume=true, when every checkpoint is corrupt: move them to checkpoints/corrupt/ "
        "and start at step 0 (otherwise the run refuses)",
    )
    collective_warn_seconds: float = option(
        300.0, "log a line when a process has waited this long for the others (paused or dead rank)", min=1.0
    )
    processes: int | None = option(
        None,
        "the number of processes the recipe's per-process batch sizes are written for (null: any); "
        "another number warns at start, and `mmrl train RECIPE --dry-run --processes N` gives the sizes "
        "that keep the effective batch",
        min=1,
    )
    optimizer: str = option(
        "adamw",
        "adamw (moments in the parameters' dtype) or adamw_8bit (bitsandbytes' AdamW8bit: moments "
        "quantised blockwise to 8 bits, a quarter of the memory; `pip install mmrl[adam8bit]`)",
        choices=OPTIMIZERS,
    )
    tracking: list[str] = option(
        [],
        "where metrics, held-out numbers and samples also go beside metrics.jsonl: tensorboard (event "
        "files in RUN_DIR/tensorboard), wandb (Weights & Biases, set by the wandb keys)",
    )
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)
    progress: bool = option(True, "show progress bars")


# ---------------------------------------------------------------------------------------------
# Loading


def resolve_config_path(name_or_path: str) -> Path:
    """A YAML path, or a recipe name such as ``core/tiny_grpo`` looked up under ``configs/``."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        if path.is_file():
            return path
        raise ConfigError(f"config file {str(path)!r} does not exist; recipes: {', '.join(list_recipes())}")
    recipe = CONFIG_ROOT / f"{name_or_path}.yaml"
    if recipe.is_file():
        return recipe
    recipes = list_recipes()
    hint = difflib.get_close_matches(name_or_path, recipes, n=1)
    did_you_mean = f"; did you mean {hint[0]!r}?" if hint else ""
    raise ConfigError(
        f"no config file or recipe named {name_or_path!r}: give a .yaml path or one of "
        f"{', '.join(recipes)}{did_you_mean}"
    )


def shipped_path(path: str | Path) -> Path:
    """`path` as given when it exists (relative to the working directory), else, for a path inside one
    of the trainer packages, that file of the installed package, so that recipes name the shipped base
    models (``vlm_rl/assets/tiny_vlm``) from any working directory; otherwise `path` unchanged, for the
    caller's own error (a run's outputs are never looked up in the repository)."""
    given = Path(path)
    if given.exists() or given.is_absolute() or given.parts[0] not in SHIPPING_PACKAGES:
        return given
    return REPO_ROOT / given if (REPO_ROOT / given).exists() else given


def list_recipes() -> list[str]:
    """Recipe names (``configs/<group>/<name>.yaml`` -> ``group/name``), excluding launch configs."""
    if not CONFIG_ROOT.is_dir():
        return []
    return sorted(
        str(p.relative_to(CONFIG_ROOT).with_suffix(""))
        for p in CONFIG_ROOT.rglob("*.yaml")
        if "accelerate" not in p.parts
    )


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe YAML loader that refuses a key written twice in one mapping: PyYAML would keep the
    last value silently, so the first one, which the user may be reading, would not be used."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is written twice in one section", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except UnicodeDecodeError:
        raise ConfigError(
            f"config file {str(path)!r} is not a text file (not UTF-8): give a YAML file"
        ) from None
    except OSError as err:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {err.strerror or err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}".replace("\n", " ")) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of keys, not {type(data).__name__}")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML scalars) to a nested dict."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. train.lr=1e-5)")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


def load_config(name_or_path: str, overrides: list[str] | None = None) -> BaseConfig:
    """Read a recipe, apply overrides and build the trainer's config dataclass, validated."""
    data = apply_overrides(read_yaml(resolve_config_path(name_or_path)), list(overrides or []))
    trainer = data.get("trainer")
    if not trainer:
        raise ConfigError(
            f"config error: {name_or_path!r} has no 'trainer' key; "
            f"choose one of {', '.join(TRAINERS.names())}"
        )
    try:
        trainer_cls = TRAINERS.get(str(trainer))
    except UnknownNameError as err:
        raise ConfigError(f"config error: trainer = {trainer!r}: {err}") from None
    return build(trainer_cls.config_class, data)


def build(cls: type[C], data: dict[str, Any], prefix: str = "", root: type | None = None) -> C:
    """Build dataclass `cls` from a dict, checking keys, types and limits."""
    root = root or cls
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            raise ConfigError(_unknown_key_message(cls, root, prefix, str(key), data[key]))
    kwargs = {}
    for name, value in data.items():
        dotted = f"{prefix}{name}"
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ConfigError(f"config error: {dotted} = {value!r} must be a section (a mapping of keys)")
            kwargs[name] = build(hint, value, prefix=f"{dotted}.", root=root)
        else:
            kwargs[name] = _check_value(dotted, _coerce(dotted, value, hint), fields[name].metadata)
    return cls(**kwargs)


def all_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key a config class accepts."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += all_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


# keys that an earlier version had, with what takes their place
REPLACED_KEYS = {"tensorboard": "tracking=[tensorboard] (beside wandb: tracking=[tensorboard, wandb])"}


def _unknown_key_message(cls: type, root: type, prefix: str, key: str, value: Any) -> str:
    dotted = f"{prefix}{key}"
    here = [f.name for f in dataclasses.fields(cls)]
    everywhere = all_keys(root)
    same_name = [k for k in everywhere if k.rsplit(".", 1)[-1] == key]
    hint = same_name or difflib.get_close_matches(dotted, everywhere, n=1, cutoff=0.6)
    did_you_mean = f"; did you mean '{hint[0]}'?" if hint else ""
    if dotted in REPLACED_KEYS:
        did_you_mean = f"; it is now {REPLACED_KEYS[dotted]}"
    section = f"under '{prefix[:-1]}'" if prefix else "at the top level"
    return (
        f"config error: unknown key '{dotted}' (= {value!r}){did_you_mean} "
        f"valid keys {section}: {', '.join(here)}"
    )


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "null"
    origin = typing.get_origin(hint)
    if origin in (list, tuple):
        args = typing.get_args(hint)
        inner = _type_name(args[0]) if args else "value"
        return f"a list of {inner}"
    if origin is dict:
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(hint, str(hint))


def _coerce(dotted: str, value: Any, hint: Any) -> Any:
    """Return `value` as type `hint`, or raise ConfigError naming what was expected."""
    origin = typing.get_origin(hint)
    bad = ConfigError(f"config error: {dotted} = {value!r} is not {_type_name(hint)}")
    if hint is Any:
        return value
    if isinstance(value, float) and not math.isfinite(value):  # NaN passes every range check, inf most
        raise ConfigError(f"config error: {dotted} = {value!r} is not a finite number")
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(hint):
            try:
                return _coerce(dotted, value, arg)
            except ConfigError:
                continue
        raise bad
    if hint is type(None):
        if value is None:
            return None
        raise bad
    if origin is Literal:
        if value in typing.get_args(hint):
            return value
        allowed = ", ".join(repr(a) for a in typing.get_args(hint))
        hint_name = difflib.get_close_matches(str(value), [str(a) for a in typing.get_args(hint)], n=1)
        did_you_mean = f"; did you mean {hint_name[0]!r}?" if hint_name else ""
        raise ConfigError(
            f"config error: {dotted} = {value!r} is not allowed: choose one of {allowed}{did_you_mean}"
        )
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise bad
        args = typing.get_args(hint)
        inner = args[0] if args else Any
        items = [_coerce(f"{dotted}[{i}]", v, inner) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise bad
        return dict(value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if hint is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise bad
    if hint is float:
        if isinstance(value, bool):
            raise bad
        number = value
        if isinstance(value, str):  # YAML 1.1 reads "1e-5" as a string
            try:
                number = float(value)
            except ValueError:
                raise bad from None
        if not isinstance(number, int | float):
            raise bad
        if not math.isfinite(number):
            raise ConfigError(f"config error: {dotted} = {value!r} is not a finite number")
        return float(number)
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        raise bad
    return value


def _check_value(dotted: str, value: Any, meta: typing.Mapping[str, Any]) -> Any:
    """Check `value` against the field's limits; raise ConfigError naming what is allowed."""
    values = value if isinstance(value, list | tuple) else [value]
    for v in values:
        if v is None:
            continue
        if "min" in meta and v < meta["min"]:
            raise ConfigError(f"config error: {dotted} = {v!r} is out of range: allowed >= {meta['min']}")
        if "max" in meta and v > meta["max"]:
            why = f" ({meta['why']})" if "why" in meta else ""
            raise ConfigError(
                f"config error: {dotted} = {v!r} is out of range: allowed <= {meta['max']}{why}"
            )
        if "choices" in meta and v not in meta["choices"]:
            choices = [str(c) for c in meta["choices"]]
            hint = difflib.get_close_matches(str(v), choices, n=1)
            did_you_mean = f"; did you mean {hint[0]!r}?" if hint else ""
            raise ConfigError(
                f"config error: {dotted} = {v!r} is not allowed: "
                f"choose one of {', '.join(choices)}{did_you_mean}"
            )
        if "registry" in meta:
            registry = ALL_REGISTRIES[meta["registry"]]
            if v not in registry:
                raise ConfigError(f"config error: {dotted} = {v!r}: {registry.unknown_message(str(v))}")
            kind = registry.kind_of(v)
            if "kinds" in meta and (kind is None or kind.name not in meta["kinds"]):
                wanted = " or ".join(registry.kinds[k].describe() for k in meta["kinds"])
                what = kind.describe() if kind is not None else f"a {registry.kind} of no declared kind"
                fits = registry.names_of_kind(meta["kinds"])
                raise ConfigError(
                    f"config error: {dotted} = {v!r} is {what}, but this trainer needs {wanted}: "
                    f"choose one of {', '.join(fits)}"
                )
    return value


def to_dict(config: BaseConfig) -> dict[str, Any]:
    """The config as plain data (tuples become lists) for saving to YAML."""
    return yaml.safe_load(yaml.safe_dump(_plain(dataclasses.asdict(config))))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def save_config(config: BaseConfig, path: Path) -> None:
    """Write `config` as YAML to `path`, whole or not at all (`replace_text`)."""
    replace_text(path, yaml.safe_dump(to_dict(config), sort_keys=False))


# ---------------------------------------------------------------------------------------------
# Checks of paths and devices, run before any work


def check_output_dir(path: str | Path, key: str = "output_dir") -> Path:
    """`path` as a Path once it is shown that the directory can be made and written, or a ConfigError
    naming `key`.

    Called before any work, so that a bad output directory fails in one line instead of after
    training or evaluating. It leaves nothing behind, so that a command refused later (a missing
    model, say) leaves no empty directory either: a missing directory is not made here (its writer
    makes it when it first writes); the nearest existing folder is probed instead, with a temporary
    file that is removed at once."""
    import os
    import tempfile

    if str(path).strip() == "":
        raise ConfigError(f"config error: {key} is empty: give a directory, e.g. {key}=runs/my_run")
    out = Path(path)
    for parent in (out, *out.parents):
        if parent.is_symlink() and not parent.exists():
            raise ConfigError(
                f"config error: {key} = {str(path)!r}: {str(parent)!r} is a broken symbolic link: "
                "remove it or give another directory"
            )
        if parent.exists() and not parent.is_dir():
            what = "is a file" if parent == out else f"is under {str(parent)!r}, which is a file"
            raise ConfigError(f"config error: {key} = {str(path)!r} {what}: give a directory path")
    existing = next(parent for parent in (out, *out.parents, Path.cwd()) if parent.is_dir())
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".mmrl-write-check-"):
            pass
    except OSError as err:
        reason = os.strerror(err.errno) if err.errno else str(err)
        where = "" if existing == out else f": its nearest existing folder {str(existing)!r} is not"
        raise ConfigError(
            f"config error: {key} = {str(path)!r} is not writable{where} ({reason}): choose another "
            "directory or fix its permissions"
        ) from None
    return out


def read_json_object(path: Path, fix: str) -> dict[str, Any]:
    """The JSON object in `path` (a model directory's config.json, say), or a ConfigError naming the
    file, what is wrong with it and `fix`."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{str(path)!r} is not valid JSON ({err}): {fix}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{str(path)!r} holds a {type(data).__name__}, not a JSON object: {fix}")
    return data


def describe_saved_model(saved: dict[str, Any]) -> str:
    """What a saved config.json says its model is, for an error that names the wrong kind."""
    kind = saved.get("model_type") or saved.get("_class_name")
    return f"a {kind!r} model" if kind else "a config.json with no model_type or _class_name"


def check_device(spec: str, key: str = "device") -> str:
    """`spec` ('auto', 'cpu', 'cuda', 'cuda:N', 'mps') resolved to a device this machine has, or a
    ConfigError naming `key` and the devices that exist."""
    import torch

    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        raise ConfigError(
            f"config error: {key} = {spec!r} is not a device: use auto, cpu, cuda or cuda:N"
        ) from None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and (count == 0 or (device.index or 0) >= count):
        have = f"cuda:0 to cuda:{count - 1}" if count else "no CUDA device"
        raise ConfigError(
            f"config error: {key} = {spec!r} does not exist on this machine ({have}): use cpu or auto"
        )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(
            f"config error: {key} = {spec!r}: MPS is not available on this machine; use cpu or auto"
        )
    if device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"config error: {key} = {spec!r}: only cpu, cuda and mps devices are supported")
    return spec
