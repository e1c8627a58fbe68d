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
import difflib
import os

# EGL only where its library exists: mujoco's import fails outright when MUJOCO_GL=egl and libEGL is
# missing, which would take state-only use down with it; rendering then says what to install
if ctypes.util.find_library("EGL"):
    os.environ.setdefault("MUJOCO_GL", "egl")

import gymnasium as gym  # noqa: E402

from sim.adapters import EXTERNAL_EXPERTS, EXTERNAL_TASKS, FETCH_REACH, ExternalTask, StatePart  # noqa: E402
from sim.env import ArmEnv  # noqa: E402
from sim.randomization import DomainRandomization  # noqa: E402
from sim.tasks import PickPlaceEnv, PushEnv, ReachEnv  # noqa: E402

METAWORLD_PREFIX = "metaworld/"  # Meta-World's tasks by name, registered when first named (sim.metaworld)

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
    """The full id of a task given as "mmrl/PickPlace-v0", "PickPlace-v0", "PickPlace" or an external
    task's gymnasium id; ValueError says why a name cannot be used and what to do instead."""
    for full in TASKS:
        if name in (full, full.removeprefix("mmrl/"), full.removeprefix("mmrl/").removesuffix("-v0")):
            return full
    if name.startswith(METAWORLD_PREFIX) and name not in EXTERNAL_TASKS:
        from sim.metaworld import MetaWorldExpert, metaworld_task

        try:
            register_task(metaworld_task(name), expert=MetaWorldExpert)
        except ImportError as err:
            raise ValueError(str(err)) from None
    external = EXTERNAL_TASKS.get(name)
    if external is not None:
        problem = external.missing()
        if problem:
            raise ValueError(problem)
        return name
    available = (
        f"available: {', '.join(TASKS)}; external gymnasium tasks: {', '.join(EXTERNAL_TASKS)}; "
        f"Meta-World's as {METAWORLD_PREFIX}<task>, e.g. {METAWORLD_PREFIX}pick-place-v3."
    )
    if name in gym.registry:
        raise ValueError(
            f"{name!r} is a gymnasium env, but mmrl has no adapter for it; {available} To add it, "
            "call sim.register_task(sim.ExternalTask(...), expert=...) (instruction, which observations "
            "the policy sees, a scripted expert) in a module that mmrl loads with --plugin MODULE."
        )
    hint = difflib.get_close_matches(name, [*TASKS, *EXTERNAL_TASKS], n=1, cutoff=0.4)
    extra = f" Did you mean {hint[0]!r}?" if hint else ""
    raise ValueError(f"unknown sim task {name!r}; {available}{extra}")


def register_task(task: ExternalTask, expert: type | None = None) -> ExternalTask:
    """Make an external gymnasium task usable by its id everywhere mmrl takes a sim task (configs,
    `sim.make`, `expert_for`), with its scripted expert: a subclass of `sim.experts.Expert`, built
    from the task's `layout()`, that recording demonstrations and expert take-overs need."""
    from sim.experts import Expert

    if not isinstance(task, ExternalTask):
        raise TypeError(f"register_task takes a sim.ExternalTask, not {type(task).__name__}")
    if task.env_id in EXTERNAL_TASKS or task.env_id in TASKS:
        raise ValueError(f"sim task {task.env_id!r} is already registered; give yours another env_id")
    if expert is not None and not (isinstance(expert, type) and issubclass(expert, Expert)):
        raise TypeError(f"expert for {task.env_id} must be a subclass of sim.experts.Expert, not {expert!r}")
    EXTERNAL_TASKS[task.env_id] = task
    if expert is not None:
        EXTERNAL_EXPERTS[task.env_id] = expert
    return task


def make(name: str, **kwargs) -> gym.Env:
    """`gymnasium.make` for our tasks (a short name allowed) and `ExternalTask.make` for external ones,
    with the task list in the error."""
    full = task_id(name)
    if full in EXTERNAL_TASKS:
        return EXTERNAL_TASKS[full].make(**kwargs)
    return gym.make(full, **kwargs)


from sim.experts import FetchReachExpert  # noqa: E402  (sim.experts reads the names above)

register_task(FETCH_REACH, expert=FetchReachExpert)

__all__ = [
    "EXTERNAL_EXPERTS",
    "EXTERNAL_TASKS",
    "TASKS",
    "ArmEnv",
    "DomainRandomization",
    "ExternalTask",
    "PickPlaceEnv",
    "PushEnv",
    "ReachEnv",
    "StatePart",
    "make",
    "register_task",
    "task_id",
]
