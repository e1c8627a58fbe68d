"""External gymnasium tasks: what mmrl needs to know of a task from outside it (`ExternalTask`: its
instruction, which parts of the observations a policy sees, the package that registers it with
gymnasium), and gymnasium-robotics' FetchReach (`FETCH_REACH`). `sim.register_task` makes such a task
usable by its id; `ExternalTask.make` builds it through the adapter of `sim.adapters`.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np

from sim.adapters import SuccessAdapter, make_external
from sim.env import OBS_MODES
from sim.state_parts import PartSpec, StatePart, parts_layout


@dataclass(frozen=True, kw_only=True)
class ExternalTask:
    """A gymnasium task from outside mmrl that the trainers accept by its id, once registered with
    `sim.register_task`: its instruction, the parts of the observations a policy may see (`proprio`,
    first in "state") and those only experts and critics read (`privileged`), the module whose import
    registers `env_id` with gymnasium (`package`; empty when the registering code has already run,
    as in a plugin module) and extra `gymnasium.make` arguments.

    A part is a whole observation key `(key, size)`, a named slice `(name, key, start, stop)` (e.g.
    `("grip_pos", "observation", 0, 3)`) or a `StatePart`. With images the env is made with
    render_mode="rgb_array", width and height."""

    env_id: str
    instruction: str
    proprio: tuple[PartSpec, ...]  # StateParts once made
    privileged: tuple[PartSpec, ...] = ()
    robot_type: str | None = None
    package: str = ""
    install: str = ""  # how to install `package`
    make_kwargs: Mapping[str, Any] = field(default_factory=dict)
    instruction_from_info: bool = False  # each episode's instruction from the env's info (multi-task)

    def __post_init__(self) -> None:
        try:
            proprio = tuple(StatePart.of(p) for p in self.proprio)
            privileged = tuple(StatePart.of(p) for p in self.privileged)
        except ValueError as err:
            raise ValueError(f"task {self.env_id}: {err}") from None
        if not proprio:
            raise ValueError(f"task {self.env_id}: proprio is empty; name the part(s) a policy sees")
        names = [p.name for p in proprio + privileged]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(
                f"task {self.env_id}: state part name(s) {', '.join(map(repr, twice))} used twice; "
                "give each part its own name"
            )
        object.__setattr__(self, "proprio", proprio)
        object.__setattr__(self, "privileged", privileged)

    def layout(self) -> dict[str, slice]:
        """Where each named part lies in "state" (experts are built from this, before any env)."""
        return parts_layout(self.proprio + self.privileged)

    @property
    def proprio_dim(self) -> int:
        return sum(p.size for p in self.proprio)

    def missing(self) -> str | None:
        """Why this task cannot be made here (its package is not installed, or no code registered its
        gymnasium id), or None."""
        if self.package:
            if importlib.util.find_spec(self.package) is None:
                return f"task {self.env_id} comes from {self.package}, which is not installed: {self.install}"
        elif self.env_id not in gym.registry:
            return (
                f"task {self.env_id} is registered with mmrl but not with gymnasium: call "
                f"gymnasium.register({self.env_id!r}, ...) where the task is registered, or set its package"
            )
        return None

    def make(self, obs_mode: str = "state", image_size: int = 96, **kwargs: Any) -> SuccessAdapter:
        """The task in our interface. obs_mode as for our tasks, except that "rgb" keeps "state" (a
        policy reads only its first proprio_dim entries); images are image_size pixels square."""
        if obs_mode not in OBS_MODES:
            raise ValueError(f"obs_mode={obs_mode!r}; choose one of {OBS_MODES}")
        problem = self.missing()
        if problem:
            raise ImportError(problem)
        if self.package:
            gym.register_envs(importlib.import_module(self.package))
        image = "rgb" in obs_mode
        if image:
            kwargs = {"width": image_size, "height": image_size, **kwargs}
        try:
            return make_external(
                self.env_id,
                self.instruction,
                image=image,
                image_shape=(image_size, image_size, 3) if image else None,  # some render only after reset
                state_parts=self.proprio + self.privileged,
                proprio_dim=self.proprio_dim,
                robot_type=self.robot_type,
                instruction_from_info=self.instruction_from_info,
                **{**self.make_kwargs, **kwargs},
            )
        except ValueError as err:
            raise ValueError(f"task {self.env_id}: {err}; fix its sim.register_task call") from None
        except TypeError as err:  # the env's constructor refused the arguments it was made with
            reason = " ".join(f"{type(err).__name__}: {err}".split())
            camera = ", with camera frames it takes render_mode, width and height" if image else ""
            raise ValueError(
                f"task {self.env_id}: gymnasium.make({self.env_id!r}, ...) failed ({reason}): the env is "
                f"made with the task's make_kwargs{camera}; fix the env or its sim.register_task call"
            ) from None


FETCH_REACH = ExternalTask(
    env_id="FetchReach-v4",
    package="gymnasium_robotics",
    install="pip install 'mmrl[fetch]' (gymnasium-robotics)",
    # the target is a red sphere, and these words are in the policy's vocabulary
    instruction="move the gripper to the red ball",
    # The goal is given as an input, as FetchReach intends (it is goal-conditioned): the target floats
    # without a shadow and can hide behind the arm or inside the table, so one camera cannot locate it.
    proprio=(("observation", 10), ("desired_goal", 3)),
    privileged=(("achieved_goal", 3),),
    robot_type="fetch",
    # closer than the package's default view, whose 96-pixel frames show the target as one pixel
    make_kwargs={
        "default_camera_config": {
            "distance": 1.4,
            "azimuth": 150.0,
            "elevation": -30.0,
            "lookat": np.array([1.34, 0.75, 0.53]),
        }
    },
)
