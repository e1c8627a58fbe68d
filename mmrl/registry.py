"""Named registries: advantage estimators, samplers, losses, rewards, precisions, trainers, benches.

Every pluggable piece of mmrl is looked up by name from a config, so each kind gets one
`Registry`. Unknown names fail with the list of valid ones and the closest match.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import importlib.util
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError):
    """A name that is not in a registry; the message names the valid entries."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0])


def closest(name: str, choices: list[str]) -> str | None:
    """The valid choice that looks most like `name`, if any looks close."""
    found = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return found[0] if found else None


@dataclass(frozen=True)
class EntryKind:
    """What an entry of one kind is called with: the names of its leading parameters, in order, and
    the noun of its registry for messages ("a group advantage (rewards, group_ids)"). A registry with
    kinds refuses an entry whose signature does not start with its kind's parameters, so a mismatch
    fails at import, not at the first step."""

    name: str
    parameters: tuple[str, ...]
    noun: str

    def describe(self) -> str:
        return f"a {self.name} {self.noun} ({', '.join(self.parameters)})"


class Registry(Generic[T]):
    """A name -> object table with a decorator to fill it and helpful lookup errors.

    With `kinds`, every entry declares one of them at registration; config options name the kinds a
    trainer can use (``option(..., registry="advantage", kinds=("group",))``) and validation accepts
    only those entries."""

    def __init__(self, kind: str, doc: str, kinds: tuple[EntryKind, ...] = ()) -> None:
        self.kind = kind
        self.doc = doc
        self.kinds = {k.name: k for k in kinds}
        self._entries: dict[str, T] = {}
        self._entry_kinds: dict[str, str] = {}
        self._tags: dict[str, dict[str, str]] = {}
        self._providers: dict[str, str] = {}  # name -> the module that registers it (`provide`)
        self._fillers: list[str] = []  # modules that register entries they name at import (`fill_from`)
        self._fill_errors: list[str] = []
        ALL_REGISTRIES[kind] = self

    def fill_from(self, module: str) -> None:
        """Declare that importing `module` registers entries whose names it computes (sim's tasks, named
        by their classes' gymnasium ids): it is imported when this registry is first listed or asked
        for an entry it lacks. A module that cannot be imported leaves its entries out, and a lookup
        of a missing entry says why."""
        self._fillers.append(module)

    def _fill(self) -> None:
        while self._fillers:
            module = self._fillers.pop(0)  # before importing: the module may list this registry itself
            try:
                importlib.import_module(module)
            except ImportError as err:
                self._fill_errors.append(
                    f"{module}, which registers {self.kind} entries, cannot be imported: {err}"
                )

    def _declare(self, module: str, name: str) -> None:
        """Record that importing `module` registers `name` (see `provide`)."""
        # the module may have been imported (and registered the name) already
        registered_by = getattr(self._entries.get(name), "__module__", None)
        if name in self._providers or (name in self._entries and registered_by != module):
            raise ValueError(f"{self.kind} registry already has an entry named {name!r}")
        self._providers[name] = module

    def _load(self, name: str) -> None:
        """Import the module that provides `name`, if it is declared and not yet registered."""
        module = self._providers.get(name)
        if module is None or name in self._entries:
            return
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise UnknownNameError(
                f"{self.kind} {name!r} comes from {module}, which cannot be imported here: {err}"
            ) from err
        if name not in self._entries:
            raise RuntimeError(f"{module} is declared to register {self.kind} {name!r} but did not")

    def register(self, name: str, kind: str | None = None, **tags: str) -> Callable[[T], T]:
        """Decorator adding an entry of `kind` (required, and checked against the entry's signature,
        when the registry has kinds); `tags` describe it further for config checks (e.g. mc_grpo's
        ``group_size="odd"``)."""
        if self.kinds and kind not in self.kinds:
            raise ValueError(
                f"{self.kind} {name!r}: register it with kind= one of {', '.join(self.kinds)} (got {kind!r})"
            )
        if not self.kinds and kind is not None:
            raise ValueError(f"{self.kind} {name!r}: the {self.kind} registry has no kinds; drop kind=")

        def add(obj: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} registry already has an entry named {name!r}")
            declared, module = self._providers.get(name), getattr(obj, "__module__", None)
            if declared not in (None, module):
                raise ValueError(f"{self.kind} {name!r} is declared to come from {declared}, not {module}")
            if kind is not None:
                _check_signature(self.kind, name, obj, self.kinds[kind])
                self._entry_kinds[name] = kind
            self._entries[name] = obj
            self._tags[name] = dict(tags)
            return obj

        return add

    def tag(self, name: str, key: str) -> str | None:
        """The entry's tag `key`, or None when it has none."""
        self._load(name)
        return self._tags.get(name, {}).get(key)

    def kind_of(self, name: str) -> EntryKind | None:
        """The declared kind of entry `name` (None in a registry without kinds)."""
        if not self.kinds:
            return None
        self._load(name)
        kind = self._entry_kinds.get(name)
        return self.kinds[kind] if kind is not None else None

    def has_kind(self, name: str, kind: str) -> bool:
        """Whether entry `name` was registered as `kind` (e.g. a tree advantage scores every node of a
        tree, a group one only the leaves of flat groups)."""
        self._load(name)
        return self._entry_kinds.get(name) == kind

    def names_of_kind(self, kinds: tuple[str, ...]) -> list[str]:
        """Entries of any of `kinds`."""
        return [n for n in self.names() if any(self.has_kind(n, kind) for kind in kinds)]

    def get(self, name: str) -> T:
        self._load(name)
        if name not in self._entries:
            self._fill()
        if name not in self._entries:
            raise UnknownNameError(self.unknown_message(name))
        return self._entries[name]

    def unknown_message(self, name: str) -> str:
        names = self.names()
        hint = closest(str(name), names)
        did_you_mean = f"; did you mean {hint!r}?" if hint else ""
        missing = "".join(f" ({error})" for error in self._fill_errors)
        return f"unknown {self.kind} {name!r}: choose one of {', '.join(names)}{did_you_mean}{missing}"

    def names(self) -> list[str]:
        """Every entry, registered or declared by a plugin (`provide`, `fill_from`)."""
        self._fill()
        return sorted({*self._entries, *self._providers})

    def items(self) -> Iterator[tuple[str, T]]:
        """Every entry with its object (importing the modules that provide them)."""
        return iter([(name, self.get(name)) for name in self.names()])

    def __contains__(self, name: object) -> bool:
        if name not in self._entries and name not in self._providers:
            self._fill()
        return name in self._entries or name in self._providers

    def __len__(self) -> int:
        return len(self.names())


def _check_signature(registry: str, name: str, obj: Any, kind: EntryKind) -> None:
    """Raise TypeError unless `obj` is called with `kind`'s parameters first, in that order."""
    try:
        parameters = list(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        parameters = []
    if tuple(parameters[: len(kind.parameters)]) != kind.parameters:
        raise TypeError(
            f"{registry} {name!r} is registered as {kind.describe()}, so its first parameters must be "
            f"({', '.join(kind.parameters)}); it takes ({', '.join(parameters)})"
        )


ALL_REGISTRIES: dict[str, Registry] = {}

ADVANTAGES: Registry[Callable] = Registry(
    "advantage",
    "advantage estimators (pure functions on tensors, each returning `mmrl.advantages.Advantages`)",
    kinds=(
        EntryKind("group", ("rewards", "group_ids"), "advantage"),  # one reward per rollout, in groups
        EntryKind("tree", ("node_rewards", "parents", "depths"), "advantage"),  # fused node rewards, a forest
        EntryKind("temporal", ("rewards", "values", "dones"), "advantage"),  # per-step rewards, values
    ),
)
SAMPLERS: Registry[type] = Registry("sampler", "prompt/question samplers")
LOSSES: Registry[Callable] = Registry(
    "loss",
    "losses: policy losses on log-probs and forward-process losses on velocities (pure functions on "
    "tensors, each returning `mmrl.losses.LossOutput`)",
    kinds=(
        # log-probs of the sampled actions now and at sampling, their advantages, a mask
        EntryKind("policy", ("logp", "old_logp", "advantages", "mask"), "loss"),
        # velocities of the trained and the old policy at noised clean samples x_t of x0 at noise
        # level t, and each sample's optimality in [0, 1]
        EntryKind("forward_process", ("velocity", "old_velocity", "x_t", "x0", "t", "optimality"), "loss"),
    ),
)
PRECISIONS: Registry[Callable] = Registry("precision", "weight precisions for exploration rollouts")
REWARDS: Registry[Callable] = Registry("reward", "reward functions")
TRAINERS: Registry[type] = Registry("trainer", "trainers, each with its config dataclass")
BENCHES: Registry[Callable] = Registry("bench", "benchmarks run by `mmrl bench NAME`")
GPU_BENCH_SECTIONS: Registry[Callable] = Registry(
    "gpu_bench_section",
    "sections of `mmrl bench gpu`, each called as section(options, device, workdir) for its rows",
)
REALSIZE_RUNS: Registry[Callable] = Registry(
    "realsize_run",
    "real-size runs of `mmrl bench realsize`, each called with no argument for its `RealSizeRun`",
)
REPLICAS: Registry[Callable] = Registry(
    "replica", "tiny replicas of real models, saved by `mmrl replica NAME` (directory, seed, full)"
)
EVALUATORS: Registry[Callable] = Registry(
    "evaluator", "model evaluations run by `mmrl eval NAME key=value ...`"
)
TASKS: Registry[Any] = Registry(
    "task",
    "robot tasks by gymnasium id, each with its scripted expert (filled by `sim.register_task` when "
    "sim is imported)",
)


def provide(*modules: str) -> None:
    """Declare the entries that importing each of `modules` registers, read from the module's source
    without importing it: every ``@<REGISTRY>.register("name", ...)`` in it, `<REGISTRY>` being one of
    this module's registries by its name here (``REWARDS``, ``TRAINERS``, ...). The entries are listed
    and accepted at once, and a module is imported when one of its entries is first used, so a plugin's
    register module names only its modules, each entry is named once (where it is registered), and a
    command imports only the plugin code it runs (not every model library)."""
    for module in modules:
        found = registered_names(module)
        if not found:
            raise ValueError(
                f"plugin module {module} registers no entry that can be read from its source: register "
                'each entry with a decorator such as @REWARDS.register("name") and a literal name'
            )
        for registry, name in found:
            registry._declare(module, name)


def registered_names(module: str) -> list[tuple[Registry, str]]:
    """The (registry, name) of every literal ``<REGISTRY>.register("name", ...)`` call in `module`'s
    source, in order; ValueError when the module's source cannot be found or a name is not a literal."""
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        spec = None
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise ValueError(f"plugin module {module} is declared but no source file of it can be found")
    registries = {name: obj for name, obj in globals().items() if isinstance(obj, Registry)}
    with open(spec.origin, encoding="utf-8") as source:
        tree = ast.parse(source.read(), filename=spec.origin)
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value
        if node.func.attr != "register" or not isinstance(owner, ast.Name) or owner.id not in registries:
            continue
        first = node.args[0] if node.args else None
        if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
            raise ValueError(
                f"{spec.origin}:{node.lineno}: {owner.id}.register needs the entry's name as a string "
                "literal, so that the plugin can declare it without importing the module"
            )
        found.append((registries[owner.id], first.value))
    return found
