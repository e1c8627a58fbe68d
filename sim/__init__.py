"""MuJoCo tasks for mmrl: a gantry arm with a parallel gripper on a table, gymnasium API.

Every task mmrl takes by name is registered with `register_task` in `mmrl.registry.TASKS`
(`sim.registry`). `import sim` registers `mmrl/Reach-v0`, `mmrl/Push-v0` and `mmrl/PickPlace-v0`
(with gymnasium too: create them with `gymnasium.make(...)`, `gymnasium.make_vec(...)` or
`sim.make(name)`, which also takes "Reach" etc.) and gymnasium-robotics' "FetchReach-v4", an external
task that `sim.make` builds by its gymnasium id with the same observations, info and options. Code
outside mmrl adds its own with `register_task(ExternalTask(...), expert=...)` (`mmrl --plugin MODULE`
imports such a module before the config names the task). Meta-World's 50 tasks are
`metaworld/<task>` (e.g. "metaworld/pick-place-v3"; `sim.metaworld`), registered the first time a
task is named.
Headless rendering defaults to EGL where libEGL is installed: set MUJOCO_GL before importing sim (or
mujoco) to choose another.
"""

from __future__ import annotations

import ctypes.util
import os

# EGL only where its library exists: mujoco's import fails outright when MUJOCO_GL=egl and libEGL is
# missing, which would take state-only use down with it; rendering then says what to install
if ctypes.util.find_library("EGL"):
    os.environ.setdefault("MUJOCO_GL", "egl")

from sim.env import ArmEnv  # noqa: E402
from sim.external import ExternalTask  # noqa: E402
from sim.randomization import DomainRandomization  # noqa: E402
from sim.registry import (  # noqa: E402
    METAWORLD_PREFIX,
    TaskEntry,
    arm_task_ids,
    expert_for,
    make,
    register_task,
    task_id,
)
from sim.state_parts import StatePart  # noqa: E402
from sim.tasks import PickPlaceEnv, PushEnv, ReachEnv  # noqa: E402

__all__ = [
    "METAWORLD_PREFIX",
    "ArmEnv",
    "DomainRandomization",
    "ExternalTask",
    "PickPlaceEnv",
    "PushEnv",
    "ReachEnv",
    "StatePart",
    "TaskEntry",
    "arm_task_ids",
    "expert_for",
    "make",
    "register_task",
    "task_id",
]
