"""MuJoCo tasks for mmrl: a gantry arm with a parallel gripper on a table, gymnasium API.

`import sim` registers `mmrl/Reach-v0`, `mmrl/Push-v0` and `mmrl/PickPlace-v0`; create them with
`gymnasium.make(...)`, `gymnasium.make_vec(...)` or `sim.make(name)` (which also takes "Reach" etc.).
`sim.make` also builds the external tasks of `EXTERNAL_TASKS` by their gymnasium id (e.g.
"FetchReach-v4" from gymnasium-robotics) with the same observations, info and options; code outside
mmrl adds its own with `register_task(ExternalTask(...), expert=...)` (`mmrl --plugin MODULE` imports
such a module before the config names the task). Meta-World's 50 tasks are `metaworld/<task>` (e.g.
"metaworld/pick-place-v3"; `sim.metaworld`), registered the first time a task is named.
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
from sim.external import EXTERNAL_EXPERTS, EXTERNAL_TASKS, ExternalTask  # noqa: E402
from sim.randomization import DomainRandomization  # noqa: E402
from sim.registry import METAWORLD_PREFIX, TASKS, expert_for, make, register_task, task_id  # noqa: E402
from sim.state_parts import StatePart  # noqa: E402
from sim.tasks import PickPlaceEnv, PushEnv, ReachEnv  # noqa: E402

__all__ = [
    "EXTERNAL_EXPERTS",
    "METAWORLD_PREFIX",
    "EXTERNAL_TASKS",
    "TASKS",
    "ArmEnv",
    "DomainRandomization",
    "ExternalTask",
    "PickPlaceEnv",
    "PushEnv",
    "ReachEnv",
    "StatePart",
    "expert_for",
    "make",
    "register_task",
    "task_id",
]
