"""Named pieces of a gymnasium env's observations that make up our "state" vector.

A `StatePart` is a whole observation key or a slice of one, so that one observation vector holding
both the robot's and an object's poses can be split into the proprioception a policy sees and the
privileged rest; a non-Dict observation is addressed as the key "observation". The functions here
check parts against an env's observation space and say where each lies in "state".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

import gymnasium as gym
import numpy as np

PartSpec = Union["StatePart", tuple[Any, ...]]  # see StatePart.of
WHOLE_OBSERVATION = "observation"  # the key that names a non-Dict observation in a StatePart


@dataclass(frozen=True)
class StatePart:
    """Entries `start:stop` of observation `key` (flattened), called `name` in the state layout.

    `whole`: the part is all of `key`, which must then have exactly `stop` entries (checked when the
    env is made). A non-Dict observation is addressed as the key "observation"."""

    name: str
    key: str
    start: int
    stop: int
    whole: bool = False

    def __post_init__(self) -> None:
        if not self.name or not self.key:
            raise ValueError(f"state part {self}: give a name and an observation key")
        if not 0 <= self.start < self.stop:
            raise ValueError(
                f"state part {self.name!r} = {self.key}[{self.start}:{self.stop}] is empty: "
                "need 0 <= start < stop"
            )

    @property
    def size(self) -> int:
        return self.stop - self.start

    def describe(self) -> str:
        return (
            f"{self.name!r} (all of {self.key!r})"
            if self.whole
            else f"{self.name!r} ({self.key}[{self.start}:{self.stop}])"
        )

    @classmethod
    def of(cls, spec: PartSpec) -> StatePart:
        """A part from a StatePart, a whole key `(key, size)` or a named slice `(name, key, start, stop)`."""
        if isinstance(spec, StatePart):
            return spec
        if isinstance(spec, Sequence) and not isinstance(spec, str):
            if len(spec) == 2:
                return cls(str(spec[0]), str(spec[0]), 0, int(spec[1]), whole=True)
            if len(spec) == 4:
                return cls(str(spec[0]), str(spec[1]), int(spec[2]), int(spec[3]))
        raise ValueError(
            f"state part {spec!r}: give (key, size) for a whole observation key, (name, key, start, stop) "
            "for a slice of one, or a sim.StatePart"
        )


def parts_layout(parts: Sequence[StatePart]) -> dict[str, slice]:
    """Where each part lies in "state", the parts concatenated in order."""
    ends = np.cumsum([p.size for p in parts]).tolist()
    return {p.name: slice(end - p.size, end) for p, end in zip(parts, ends, strict=True)}


def whole_keys(space: gym.Space, keys: Sequence[str] | None) -> list[StatePart] | None:
    """Parts that are whole observation keys, in `keys` order (each key once; by default gymnasium's
    own order); None for a space that is not a Dict (then flattened whole)."""
    if not isinstance(space, gym.spaces.Dict):
        if keys is not None:
            raise ValueError(f"state_keys needs Dict observations, not {type(space).__name__}")
        return None
    if keys is None:
        keys = list(space.spaces)
    if sorted(keys) != sorted(space.spaces):
        raise ValueError(
            f"state_keys = {list(keys)} must name every observation key once: {list(space.spaces)}"
        )
    return [StatePart(k, k, 0, gym.spaces.flatdim(space[k]), whole=True) for k in keys]


def key_space(space: gym.Space, part: StatePart) -> gym.Space:
    """The observation space of the part's key, or a ValueError naming the keys there are."""
    if isinstance(space, gym.spaces.Dict):
        if part.key not in space.spaces:
            raise ValueError(
                f"state part {part.describe()}: the observations have no key {part.key!r}; "
                f"their keys: {', '.join(space.spaces)}"
            )
        return space[part.key]
    if part.key != WHOLE_OBSERVATION:
        raise ValueError(
            f"state part {part.describe()}: the observations are one {type(space).__name__}, not a Dict; "
            f"call it {WHOLE_OBSERVATION!r}"
        )
    return space


def check_parts(space: gym.Space, parts: Sequence[StatePart]) -> list[StatePart]:
    """`parts` checked against the env's observation space: names used once, keys that exist, slices
    inside their key, whole keys of their stated size."""
    if not parts:
        raise ValueError("state_parts is empty: name at least one part of the observations")
    seen: set[str] = set()
    for part in parts:
        if part.name in seen:
            raise ValueError(f"state part name {part.name!r} is used twice; give each part its own name")
        seen.add(part.name)
        size = gym.spaces.flatdim(key_space(space, part))
        if part.whole and part.stop != size:
            raise ValueError(
                f"state part {part.describe()} is given {part.stop} entries, but {part.key!r} has {size}"
            )
        if part.stop > size:
            raise ValueError(f"state part {part.describe()} is out of range: {part.key!r} has {size} entries")
    return list(parts)
