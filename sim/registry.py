"""The sim task registry: mmrl's own tasks (`mmrl/Reach-v0`, `mmrl/Push-v0`, `mmrl/PickPlace-v0`,
registered with gymnasium on import), the external tasks added by `register_task` (FetchReach here;
Meta-World's `metaworld/<task>` the first time one is named), and what takes a task by name:
`task_id`, `make` and `expert_for`. `sim` re-exports all of it.
"""

from __future__ import annotations

import difflib

import gymnasium as gym

from sim.env import ArmEnv
from sim.experts import EXPERTS, Expert, FetchReachExpert
from sim.external import EXTERNAL_EXPERTS, EXTERNAL_TASKS, FETCH_REACH, ExternalTask
from sim.metaworld import PREFIX as METAWORLD_PREFIX
from sim.metaworld import MetaWorldExpert, metaworld_task
from sim.tasks import PickPlaceEnv, PushEnv, ReachEnv

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


def expert_for(env: gym.Env | gym.vector.VectorEnv | str) -> Expert:
    """The scripted expert for a task given by id, by a (wrapped) env or by a vector env made from an id."""
    if isinstance(env, gym.vector.VectorEnv):
        if env.spec is None:
            raise ValueError("this vector env has no spec (not made by gymnasium.make_vec); pass the task id")
        if env.spec.id in EXTERNAL_TASKS:
            raise ValueError(f"{env.spec.id} is external: pass its id or an env made by sim.make")
        env = env.spec.id
    if isinstance(env, str):
        name = task_id(env)
        task = EXTERNAL_TASKS[name] if name in EXTERNAL_TASKS else TASKS[name]
    elif isinstance(env.unwrapped, ArmEnv):
        task = type(env.unwrapped)
    else:
        spec = env.unwrapped.spec
        task = EXTERNAL_TASKS.get(spec.id if spec is not None else "")
        if task is None:
            raise TypeError(f"no scripted expert for {env.unwrapped}: not one of mmrl's tasks")
    if isinstance(task, ExternalTask):
        if task.env_id in EXTERNAL_EXPERTS:
            return EXTERNAL_EXPERTS[task.env_id](task)
        raise TypeError(
            f"no scripted expert for {task.env_id}: register the task with "
            "sim.register_task(task, expert=YourExpert), YourExpert a subclass of sim.experts.Expert"
        )
    for cls, expert in EXPERTS.items():
        if issubclass(task, cls):
            return expert(task)
    raise TypeError(
        f"no scripted expert for {task.__name__}; experts exist for {', '.join(c.__name__ for c in EXPERTS)}"
    )


register_task(FETCH_REACH, expert=FetchReachExpert)
