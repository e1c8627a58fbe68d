"""The sim task registry: every task mmrl takes by name is an entry of `mmrl.registry.TASKS` (a
`TaskEntry`: the task and its scripted expert), put there by `register_task` alone: mmrl's own tasks
`mmrl/Reach-v0`, `mmrl/Push-v0` and `mmrl/PickPlace-v0` (also registered with gymnasium) and
FetchReach on import, a user's task from a plugin module, and Meta-World's `metaworld/<task>` the first
time one is named (so that `import sim` does not import Meta-World). `task_id`, `make` and
`expert_for` take a task by name. `sim` re-exports all of it.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

import gymnasium as gym

from mmrl.registry import TASKS
from sim.env import ArmEnv
from sim.experts import Expert, FetchReachExpert, PickPlaceExpert, PushExpert, ReachExpert
from sim.external import FETCH_REACH, ExternalTask
from sim.metaworld import PREFIX as METAWORLD_PREFIX
from sim.metaworld import MetaWorldExpert, metaworld_task
from sim.tasks import PickPlaceEnv, PushEnv, ReachEnv


@dataclass(frozen=True)
class TaskEntry:
    """A registered task: what makes it (one of mmrl's `ArmEnv` classes, made by gymnasium, or an
    `ExternalTask`) and its scripted expert (None when it has none)."""

    task: type[ArmEnv] | ExternalTask
    expert: type[Expert] | None


def arm_task_ids() -> list[str]:
    """The ids of the registered tasks that are `ArmEnv` classes (mmrl's own tasks)."""
    return [name for name, entry in TASKS.items() if isinstance(entry.task, type)]


def task_id(name: str) -> str:
    """The full id of a task given as "mmrl/PickPlace-v0", "PickPlace-v0", "PickPlace" or an external
    task's gymnasium id; ValueError says why a name cannot be used and what to do instead."""
    arm_ids = arm_task_ids()
    for full in arm_ids:
        short = full.removeprefix("mmrl/")
        if name in (full, short, short.removesuffix("-v0")):
            return full
    if name.startswith(METAWORLD_PREFIX) and name not in TASKS:
        try:
            register_task(metaworld_task(name), expert=MetaWorldExpert)
        except ImportError as err:
            raise ValueError(str(err)) from None
    if name in TASKS:
        problem = TASKS.get(name).task.missing()
        if problem:
            raise ValueError(problem)
        return name
    external = [known for known in TASKS.names() if known not in arm_ids]
    available = (
        f"available: {', '.join(arm_ids)}; external gymnasium tasks: {', '.join(external)}; "
        f"Meta-World's as {METAWORLD_PREFIX}<task>, e.g. {METAWORLD_PREFIX}pick-place-v3."
    )
    if name in gym.registry:
        raise ValueError(
            f"{name!r} is a gymnasium env, but mmrl has no adapter for it; {available} To add it, "
            "call sim.register_task(sim.ExternalTask(...), expert=...) (instruction, which observations "
            "the policy sees, a scripted expert) in a module that mmrl loads with --plugin MODULE."
        )
    hint = difflib.get_close_matches(name, TASKS.names(), n=1, cutoff=0.4)
    extra = f" Did you mean {hint[0]!r}?" if hint else ""
    raise ValueError(f"unknown sim task {name!r}; {available}{extra}")


def register_task(
    task: ExternalTask | type[ArmEnv], expert: type[Expert] | None = None
) -> ExternalTask | type[ArmEnv]:
    """Make a task usable by its `env_id` everywhere mmrl takes a sim task (configs, `sim.make`,
    `expert_for`): an `ArmEnv` class (registered with gymnasium too, with its `max_episode_steps`) or
    an external gymnasium task (`ExternalTask`), with its scripted expert: a subclass of
    `sim.experts.Expert`, built from the task's `layout()`, that recording demonstrations and expert
    take-overs need."""
    is_arm = isinstance(task, type) and issubclass(task, ArmEnv)
    if not (is_arm or isinstance(task, ExternalTask)):
        raise TypeError(f"register_task takes a sim.ExternalTask or a sim.ArmEnv subclass, not {task!r}")
    if is_arm and not task.env_id:
        raise ValueError(
            f"{task.__name__} has no env_id: set the class attribute, e.g. env_id = 'me/Stack-v0'"
        )
    if task.env_id in TASKS:
        raise ValueError(f"sim task {task.env_id!r} is already registered; give yours another env_id")
    if expert is not None and not (isinstance(expert, type) and issubclass(expert, Expert)):
        raise TypeError(f"expert for {task.env_id} must be a subclass of sim.experts.Expert, not {expert!r}")
    if is_arm and task.env_id not in gym.registry:
        gym.register(
            task.env_id,
            entry_point=f"{task.__module__}:{task.__name__}",
            max_episode_steps=task.max_episode_steps,
        )
    TASKS.register(task.env_id)(TaskEntry(task, expert))
    return task


def make(name: str, **kwargs: Any) -> gym.Env:
    """`gymnasium.make` for our tasks (a short name allowed) and `ExternalTask.make` for external ones,
    with the task list in the error."""
    full = task_id(name)
    task = TASKS.get(full).task
    if isinstance(task, ExternalTask):
        return task.make(**kwargs)
    return gym.make(full, **kwargs)


def expert_for(env: gym.Env | gym.vector.VectorEnv | str) -> Expert:
    """The scripted expert for a task given by id, by a (wrapped) env or by a vector env made from an id."""
    if isinstance(env, gym.vector.VectorEnv):
        if env.spec is None:
            raise ValueError("this vector env has no spec (not made by gymnasium.make_vec); pass the task id")
        if env.spec.id in TASKS and isinstance(TASKS.get(env.spec.id).task, ExternalTask):
            raise ValueError(f"{env.spec.id} is external: pass its id or an env made by sim.make")
        env = env.spec.id
    if isinstance(env, str):
        entry = TASKS.get(task_id(env))
        task = entry.task
    elif isinstance(env.unwrapped, ArmEnv):
        task = type(env.unwrapped)
        by_class = {entry.task: entry for _, entry in TASKS.items() if isinstance(entry.task, type)}
        entry = next((by_class[cls] for cls in task.__mro__ if cls in by_class), None)
        if entry is None:
            raise TypeError(
                f"no scripted expert for {task.__name__}: register it with "
                f"sim.register_task({task.__name__}, expert=...); registered: {', '.join(arm_task_ids())}"
            )
    else:
        spec = env.unwrapped.spec
        name = spec.id if spec is not None else ""
        if name not in TASKS:
            raise TypeError(f"no scripted expert for {env.unwrapped}: not one of mmrl's tasks")
        entry = TASKS.get(name)
        task = entry.task
    if entry.expert is None:
        raise TypeError(
            f"no scripted expert for {task.env_id}: register the task with "
            "sim.register_task(task, expert=YourExpert), YourExpert a subclass of sim.experts.Expert"
        )
    return entry.expert(task)


register_task(ReachEnv, expert=ReachExpert)
register_task(PushEnv, expert=PushExpert)
register_task(PickPlaceEnv, expert=PickPlaceExpert)
register_task(FETCH_REACH, expert=FetchReachExpert)
