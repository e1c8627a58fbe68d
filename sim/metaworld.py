"""Meta-World's 50 Sawyer manipulation tasks as mmrl sim tasks: `metaworld/<task>` (e.g.
`metaworld/pick-place-v3`) wherever mmrl takes a sim task, with the task's scripted policy as the
expert; and its multi-task suites `metaworld/MT10` and `metaworld/MT50`, one task per episode.

Meta-World 3.1.1 pins mujoco 3.3.0, but runs unchanged on the mujoco of mmrl's `robot` extra: install
it with `pip install --no-deps metaworld==3.1.1` after mmrl (docs/robot.md: Meta-World).

Each episode draws a fresh object and goal placement from the reset's seed (Meta-World's own random
ranges), so that training and held-out seeds see different scenes; the goal position is observed. The
policy sees the camera frame (turned upright), the hand position, the gripper opening and the goal
(`proprio`); the object poses are privileged (experts, critics), unless the task is named with
`.object` (`metaworld/pick-place-v3.object`), where the policy also sees the first object's position,
as state-based Meta-World agents do. The instruction is the task's name in words ("pick place
wall"). Episodes end on success or after `MAX_EPISODE_STEPS` steps (Meta-World's own limit is 500;
its experts succeed within about 50-220 steps on the tasks tried).

Frames are drawn from a copy of the model whose meshes are simplified to about a pixel's footprint
(`sim.render.coarse_meshes`, a grid of `MESH_CELL_96` metres at 96 px, finer for larger frames): the
Sawyer's meshes hold about 67k faces, which software rendering pays for in every frame, and at 96 px
the simplified frame differs from the full one in well under 1% of its pixels. Physics uses the
original model; `full_meshes=True` renders it as it is.
"""

from __future__ import annotations

import difflib
import importlib.util
import pickle
import warnings

import gymnasium as gym
import numpy as np

from sim.experts import Expert
from sim.external import ExternalTask
from sim.render import CameraRenderer, coarse_meshes

PREFIX = "metaworld/"  # Meta-World's tasks by name, registered when first named (sim.registry.task_id)

INSTALL = "pip install --no-deps metaworld==3.1.1 scipy (it pins mujoco 3.3.0 and runs on ours)"
MAX_EPISODE_STEPS = 200
CAMERA = "corner2"  # sees the table, the arm and the objects of every task
OBSERVATION = "observation"  # Meta-World's observation is one 39-vector; these parts of it:
HAND, OBJECTS, GOAL = slice(0, 4), slice(4, 36), slice(36, 39)  # hand + gripper; 2 object poses, 2 frames
FIRST_OBJECT = slice(4, 7)  # the first object's position
SEES_OBJECT = ".object"  # a task name ending so gives the policy FIRST_OBJECT among its inputs
SUITES = ("MT10", "MT50")  # multi-task sets: one task per episode, drawn from the reset's seed
MESH_CELL_96 = 0.01  # m: the mesh clustering grid for 96 px frames (about a pixel at the table)
# tasks whose scripted policy grasps the first object and lifts it on the way to the goal: their failed
# episodes are named by how far that object got (`MetaWorldExpert.failure`)
CARRY_TASKS = frozenset(
    {
        "pick-place-v3",
        "pick-place-wall-v3",
        "bin-picking-v3",
        "assembly-v3",
        "peg-insert-side-v3",
        "pick-out-of-hole-v3",
        "basketball-v3",
    }
)
MOVED = LIFTED = 0.02  # m: the object moved from where it started / rose above its start
REACHED = 0.05  # m: the hand came this close to the object (about 0.035 above it when it grasps)


def installed() -> bool:
    return importlib.util.find_spec("metaworld") is not None


def task_names() -> list[str]:
    """Meta-World's task names (e.g. "pick-place-v3")."""
    from metaworld.env_dict import ALL_V3_ENVIRONMENTS

    return list(ALL_V3_ENVIRONMENTS)


def suite_tasks(name: str) -> list[str]:
    """The tasks of a suite ("MT10": Meta-World's MT10 set, in its order), or [name] for one task."""
    if name in SUITES:
        from metaworld import env_dict

        return list(getattr(env_dict, f"{name}_V3"))
    return [name]


def split_name(env_id: str) -> tuple[str, bool]:
    """Meta-World's task (or suite) name in a task id, and whether the policy sees the first object:
    "metaworld/pick-place-v3.object" -> ("pick-place-v3", True)."""
    name = env_id.removeprefix(PREFIX)
    return name.removesuffix(SEES_OBJECT), name.endswith(SEES_OBJECT)


def instruction(name: str) -> str:
    """The task's name in words: "pick-place-wall-v3" -> "pick place wall"."""
    return name.rsplit("-v", 1)[0].replace("-", " ")


def _sawyer(task: str):
    """Meta-World's env for `task`, usable at once: the goal observed, a fresh placement per seed."""
    from metaworld.env_dict import ALL_V3_ENVIRONMENTS
    from metaworld.types import Task

    env = ALL_V3_ENVIRONMENTS[task]()
    # Meta-World's public way to make an env usable is set_task; this one observes the goal and
    # then draws every placement afresh from the env's seeded generator instead of a frozen one
    placement = np.zeros(env._random_reset_space.low.size)
    data = {"env_cls": type(env), "rand_vec": placement, "partially_observable": False}
    env.set_task(Task(task, pickle.dumps(data)))
    env._freeze_rand_vec, env.seeded_rand_vec = False, True
    # as in mmrl's own scene: no shadows, reflections or anti-aliasing (10x faster in software EGL)
    env.model.light_castshadow[:] = 0
    env.model.mat_reflectance[:] = 0
    env.model.vis.quality.offsamples = 0
    return env


class MetaWorldEnv(gym.Env):
    """One Meta-World task, or a suite of them (`tasks` a list: each reset picks one from its seed and
    the observation gains the task's one-hot), with a fresh placement per `reset(seed=...)`, the goal in
    the observation, `info["is_success"]` and the episode's `info["instruction"]`; frames of `width` x
    `height` from `camera_name`, drawn with simplified meshes unless `full_meshes`."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 80}

    def __init__(
        self,
        task: str | list[str],
        render_mode: str | None = None,
        width: int = 96,
        height: int = 96,
        camera_name: str = CAMERA,
        full_meshes: bool = False,
    ) -> None:
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"render_mode={render_mode!r}: Meta-World tasks render 'rgb_array' or nothing")
        self.tasks = [task] if isinstance(task, str) else list(task)
        self.sawyers = [_sawyer(name) for name in self.tasks]
        self.active = 0
        self.render_mode, self.camera, self.width, self.height = render_mode, camera_name, width, height
        self.full_meshes = full_meshes
        # ours, not Meta-World's: headless EGL, closed at exit
        self._renderers: dict[int, CameraRenderer] = {}
        # in a suite the observation ends with the task's one-hot: made once, not at every step
        self._one_hots = np.eye(len(self.tasks), dtype=np.float32) if len(self.tasks) > 1 else None
        box = self.sawyers[0].sawyer_observation_space  # recomputed by set_task for the observed goal
        low, high = box.low, box.high
        if self._one_hots is not None:
            low, high = np.append(low, np.zeros(len(self.tasks))), np.append(high, np.ones(len(self.tasks)))
        self.observation_space = gym.spaces.Box(
            low.astype(np.float32), high.astype(np.float32), dtype=np.float32
        )
        self.action_space = self.sawyers[0].action_space

    @property
    def sawyer(self):
        """The env of the episode's task."""
        return self.sawyers[self.active]

    def _observation(self, obs: np.ndarray) -> np.ndarray:
        if self._one_hots is not None:
            obs = np.append(obs, self._one_hots[self.active])
        return obs.astype(np.float32)

    def _info(self, info: dict, success: bool) -> dict:
        return {**info, "is_success": success, "instruction": instruction(self.tasks[self.active])}

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.active = int(self.np_random.integers(len(self.tasks)))
        self.sawyer.seed(int(self.np_random.integers(2**31 - 1)))  # Meta-World's reset ignores its seed
        obs, info = self.sawyer.reset()
        return self._observation(obs), self._info(info, False)

    def step(self, action):
        obs, reward, terminated, truncated, info = self.sawyer.step(np.asarray(action, dtype=np.float64))
        success = bool(info["success"])
        return (
            self._observation(obs),
            float(reward),
            bool(terminated),
            bool(truncated),
            self._info(info, success),
        )

    def render(self) -> np.ndarray | None:
        if self.render_mode != "rgb_array":
            return None
        if self.active not in self._renderers:
            model = self.sawyer.model
            if not self.full_meshes:
                model = coarse_meshes(model, MESH_CELL_96 * 96 / max(self.width, self.height))
            self._renderers[self.active] = CameraRenderer(model, self.camera, self.height, self.width)
        # Meta-World's cameras are mounted upside down: flip rows, as its own renderer does
        return np.ascontiguousarray(self._renderers[self.active].render(self.sawyer.data)[::-1])

    def close(self) -> None:
        for renderer in self._renderers.values():
            renderer.close()
        self._renderers.clear()
        for sawyer in self.sawyers:
            sawyer.close()


class MetaWorldExpert(Expert):
    """The task's scripted policy from `metaworld.policies`, fed the observation rebuilt from the state
    (in a suite, the policy of the task the one-hot names)."""

    def __init__(self, task: ExternalTask) -> None:
        from metaworld.policies import ENV_POLICY_MAP

        super().__init__(task)
        self.tasks = suite_tasks(split_name(task.env_id)[0])
        self.policies = [ENV_POLICY_MAP[name]() for name in self.tasks]

    def act_on(self, s: dict[str, np.ndarray]) -> np.ndarray:
        obs = np.concatenate([s["hand"], s["objects"], s["goal"]])
        policy = self.policies[int(np.argmax(s["task"]))] if "task" in s else self.policies[0]
        with warnings.catch_warnings():  # the policies warn that their gains exceed the action range
            warnings.simplefilter("ignore", UserWarning)
            action = policy.get_action(obs)
        return np.clip(action, -1.0, 1.0).astype(np.float32)

    def failure(self, states: np.ndarray) -> str | None:
        """In a task of `CARRY_TASKS`, how far the object got: never reached by the hand, reached but
        never moved, moved but never lifted, lifted and dropped, or still up at the end (the goal not
        reached); None in other tasks."""
        states, layout = np.asarray(states, dtype=np.float64), self.layout
        task = self.tasks[int(np.argmax(states[0, layout["task"]]))] if "task" in layout else self.tasks[0]
        if task not in CARRY_TASKS:
            return None
        path = states[:, layout["objects"]][:, :3]  # the first object's position
        rise = path[:, 2] - path[0, 2]
        if np.linalg.norm(path - path[0], axis=1).max() < MOVED:
            hand = states[:, layout["hand"]][:, :3]
            if np.linalg.norm(hand - path, axis=1).min() > REACHED:
                return "never reached the object"
            return "reached the object, never moved it"
        if rise.max() < LIFTED:
            return "moved the object, never lifted it"
        if rise[-1] >= LIFTED:
            return "lifted the object, still up short of the goal"
        return "lifted and dropped the object"


def metaworld_task(env_id: str) -> ExternalTask:
    """The ExternalTask for `metaworld/<task>` or a suite `metaworld/MT10` (`metaworld/MT50`), either
    with `.object` appended for a policy that sees the first object's position, its gymnasium id
    registered; ValueError for a name Meta-World does not have (with the closest one), ImportError
    without Meta-World."""
    if not installed():
        raise ImportError(f"task {env_id} comes from Meta-World, which is not installed: {INSTALL}")
    name, sees_object = split_name(env_id)
    names = [*task_names(), *SUITES]
    if name not in names:
        hint = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
        extra = f" Did you mean {PREFIX + hint[0]!r}?" if hint else ""
        raise ValueError(
            f"Meta-World has no task {name!r} ({len(names) - len(SUITES)} tasks, e.g. {PREFIX}{names[0]}, "
            f"and the suites {', '.join(PREFIX + suite for suite in SUITES)}).{extra}"
        )
    tasks = suite_tasks(name)
    if env_id not in gym.registry:
        gym.register(
            env_id,
            entry_point=f"{__name__}:MetaWorldEnv",
            kwargs={"task": tasks if name in SUITES else name},
            max_episode_steps=MAX_EPISODE_STEPS,
            disable_env_checker=True,  # its bounds are infinite for object poses, which the checker warns of
        )
    proprio = [("hand", OBSERVATION, HAND.start, HAND.stop), ("goal", OBSERVATION, GOAL.start, GOAL.stop)]
    if sees_object:
        proprio.append(("object", OBSERVATION, FIRST_OBJECT.start, FIRST_OBJECT.stop))
    privileged = [("objects", OBSERVATION, OBJECTS.start, OBJECTS.stop)]
    if name in SUITES:  # which task the episode is: the expert's to know, the policy reads the instruction
        privileged.append(("task", OBSERVATION, GOAL.stop, GOAL.stop + len(tasks)))
    # a suite's instruction holds every word its episodes' instructions use (the policy's vocabulary);
    # each episode's own is in info["instruction"]
    words = dict.fromkeys(word for task in tasks for word in instruction(task).split())
    return ExternalTask(
        env_id=env_id,
        instruction=" ".join(words),
        proprio=tuple(proprio),
        privileged=tuple(privileged),
        robot_type="sawyer",
        instruction_from_info=True,
    )
