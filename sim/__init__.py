"""MuJoCo tasks for mmrl: a gantry arm with a parallel gripper on a table, gymnasium API.

`import sim` registers `mmrl/Reach-v0`, `mmrl/Push-v0` and `mmrl/PickPlace-v0`; create them with
`gymnasium.make(...)`, `gymnasium.make_vec(...)` or `sim.make(name)` (which also takes "Reach" etc.).
Headless rendering defaults to EGL: set MUJOCO_GL before importing sim (or mujoco) to choose another.
"""

from __future__ import annotations

import difflib
import os

os.environ.setdefault("MUJOCO_GL", "egl")

import gymnasium as gym  # noqa: E402

from sim.env import ArmEnv  # noqa: E402
from sim.randomization import DomainRandomization  # noqa: E402
from sim.tasks import PickPlaceEnv, PushEnv, ReachEnv  # noqa: E402

TASKS: dict[str, type[ArmEnv]] = {
    "mmrl/Reach-v0": ReachEnv,
    "mmrl/Push-v0": PushEnv,
    "mmrl/PickPlace-v0": PickPlaceEnv,
}

for _task_id, _cls in TASKS.items():
    if _task_id not in gym.registry:
        gym.register(
            _task_id,
            entry_point=f"{_cls.__module__}:{_cls.__name__}",
            max_episode_steps=_cls.max_episode_steps,
        )


def task_id(name: str) -> str:
    """The full id of a task given as "mmrl/PickPlace-v0", "PickPlace-v0" or "PickPlace"."""
    for full in TASKS:
        if name in (full, full.removeprefix("mmrl/"), full.removeprefix("mmrl/").removesuffix("-v0")):
            return full
    hint = difflib.get_close_matches(name, list(TASKS), n=1, cutoff=0.4)
    extra = f" Did you mean {hint[0]!r}?" if hint else ""
    raise ValueError(f"unknown sim task {name!r}; available: {', '.join(TASKS)}.{extra}")


def make(name: str, **kwargs) -> gym.Env:
    """`gymnasium.make` for our tasks, with a short name allowed and the task list in the error."""
    return gym.make(task_id(name), **kwargs)


__all__ = ["TASKS", "ArmEnv", "DomainRandomization", "PickPlaceEnv", "PushEnv", "ReachEnv", "make", "task_id"]
