"""Named registries: advantage estimators, samplers, losses, rewards, precisions, trainers, benches.

Every pluggable piece of mmrl is looked up by name from a config, so each kind gets one
`Registry`. Unknown names fail with the list of valid ones and the closest match.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError):
    """A name that is not in a registry; the message names the valid entries."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0])


def closest(name: str, choices: list[str]) -> str | None:
    """The valid choice that looks most like `name`, if any looks close."""
    found = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return found[0] if found else None


class Registry(Generic[T]):
    """A name -> object table with a decorator to fill it and helpful lookup errors."""

    def __init__(self, kind: str, doc: str) -> None:
        self.kind = kind
        self.doc = doc
        self._entries: dict[str, T] = {}
        self._tags: dict[str, dict[str, str]] = {}
        ALL_REGISTRIES[kind] = self

    def register(self, name: str, **tags: str) -> Callable[[T], T]:
        """Decorator adding an entry; `tags` describe it for config checks (e.g. an advantage
        estimator's ``inputs``, so that a trainer can refuse one that needs other inputs)."""

        def add(obj: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} registry already has an entry named {name!r}")
            self._entries[name] = obj
            self._tags[name] = dict(tags)
            return obj

        return add

    def tag(self, name: str, key: str) -> str | None:
        """The entry's tag `key`, or None when it has none."""
        return self._tags.get(name, {}).get(key)

    def names_tagged(self, key: str, values: tuple[str, ...]) -> list[str]:
        """Entries whose tag `key` is one of `values`."""
        return [n for n in self.names() if self.tag(n, key) in values]

    def get(self, name: str) -> T:
        if name not in self._entries:
            raise UnknownNameError(self.unknown_message(name))
        return self._entries[name]

    def unknown_message(self, name: str) -> str:
        names = self.names()
        hint = closest(str(name), names)
        did_you_mean = f"; did you mean {hint!r}?" if hint else ""
        return f"unknown {self.kind} {name!r}: choose one of {', '.join(names)}{did_you_mean}"

    def names(self) -> list[str]:
        return sorted(self._entries)

    def items(self) -> Iterator[tuple[str, T]]:
        return iter(sorted(self._entries.items()))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)


ALL_REGISTRIES: dict[str, Registry] = {}

ADVANTAGES: Registry[Callable] = Registry("advantage", "advantage estimators (pure functions on tensors)")
SAMPLERS: Registry[type] = Registry("sampler", "prompt/question samplers")
LOSSES: Registry[Callable] = Registry("loss", "policy losses (pure functions on tensors)")
PRECISIONS: Registry[Callable] = Registry("precision", "weight precisions for exploration rollouts")
REWARDS: Registry[Callable] = Registry("reward", "reward functions")
TRAINERS: Registry[type] = Registry("trainer", "trainers, each with its config dataclass")
BENCHES: Registry[Callable] = Registry("bench", "benchmarks run by `mmrl bench NAME`")
EVALUATORS: Registry[Callable] = Registry(
    "evaluator", "model evaluations run by `mmrl eval NAME key=value ...`"
)
