"""Meta-World's 50 Sawyer manipulation tasks as mmrl sim tasks: `metaworld/<task>` (e.g.
`metaworld/pick-place-v3`) wherever mmrl takes a sim task, with the task's scripted policy as the
expert.

Meta-World 3.1.1 pins mujoco 3.3.0, but runs unchanged on the mujoco of mmrl's `robot` extra: install
it with `pip install --no-deps metaworld==3.1.1` after mmrl (README: Robot policies).

Each episode draws a fresh object and goal placement from the reset's seed (Meta-World's own random
ranges), so that training and held-out seeds see different scenes; the goal position is observed. The
policy sees the camera frame (turned upright), the hand position, the gripper opening and the goal
(`proprio`); the object poses are privileged (experts, critics). The instruction is the task's name
in words ("pick place wall"). Episodes end on success or after `MAX_EPISODE_STEPS` steps (Meta-World's
own limit is 500; its experts succeed within about 50-220 steps on the tasks tried).
"""

from __future__ import annotations

import difflib
import importlib.util
import pickle
import warnings

import gymnasium as gym
import numpy as np

from sim import METAWORLD_PREFIX as PREFIX
from sim.adapters import ExternalTask
from sim.experts import Expert
from sim.render import CameraRenderer

INSTALL = "pip install --no-deps metaworld==3.1.1 scipy (it pins mujoco 3.3.0 and runs on ours)"
MAX_EPISODE_STEPS = 200
CAMERA = "corner2"  # sees the table, the arm and the objects of every task
OBSERVATION = "observation"  # Meta-World's observation is one 39-vector; these parts of it:
HAND, OBJECTS, GOAL = (
    slice(0, 4),
    slice(4, 36),
    slice(36, 39),
)  # hand xyz + gripper; 2 object poses x 2 frames


def installed() -> bool:
    return importlib.util.find_spec("metaworld") is not None


def task_names() -> list[str]:
    """Meta-World's task names (e.g. "pick-place-v3")."""
    from metaworld.env_dict import ALL_V3_ENVIRONMENTS

    return list(ALL_V3_ENVIRONMENTS)


def instruction(name: str) -> str:
    """The task's name in words: "pick-place-wall-v3" -> "pick place wall"."""
    return name.rsplit("-v", 1)[0].replace("-", " ")


class MetaWorldEnv(gym.Env):
    """One Meta-World task with a fresh placement per `reset(seed=...)`, the goal in the observation and
    `info["is_success"]`; frames of `width` x `height` from `camera_name`."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 80}

    def __init__(
        self,
        task: str,
        render_mode: str | None = None,
        width: int = 96,
        height: int = 96,
        camera_name: str = CAMERA,
    ) -> None:
        from metaworld.env_dict import ALL_V3_ENVIRONMENTS
        from metaworld.types import Task

        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"render_mode={render_mode!r}: Meta-World tasks render 'rgb_array' or nothing")
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
        self.sawyer, self.render_mode = env, render_mode
        self.camera, self.width, self.height = camera_name, width, height
        self._renderer: CameraRenderer | None = None  # ours, not Meta-World's: headless EGL, closed at exit
        box = env.sawyer_observation_space  # recomputed by set_task for the observed goal
        low, high = box.low.astype(np.float32), box.high.astype(np.float32)
        self.observation_space = gym.spaces.Box(low, high, box.shape, np.float32)
        self.action_space = env.action_space

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.sawyer.seed(int(self.np_random.integers(2**31 - 1)))  # Meta-World's reset ignores its seed
        obs, info = self.sawyer.reset()
        return obs.astype(np.float32), {**info, "is_success": False}

    def step(self, action):
        obs, reward, terminated, truncated, info = self.sawyer.step(np.asarray(action, dtype=np.float64))
        return (
            obs.astype(np.float32),
            float(reward),
            bool(terminated),
            bool(truncated),
            {
                **info,
                "is_success": bool(info["success"]),
            },
        )

    def render(self) -> np.ndarray | None:
        if self.render_mode != "rgb_array":
            return None
        if self._renderer is None:
            self._renderer = CameraRenderer(self.sawyer.model, self.camera, self.height, self.width)
        # Meta-World's cameras are mounted upside down: flip rows, as its own renderer does
        return np.ascontiguousarray(self._renderer.render(self.sawyer.data)[::-1])

    def close(self) -> None:
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None
        self.sawyer.close()


class MetaWorldExpert(Expert):
    """The task's scripted policy from `metaworld.policies`, fed the observation rebuilt from the state."""

    def __init__(self, task: ExternalTask) -> None:
        from metaworld.policies import ENV_POLICY_MAP

        super().__init__(task)
        self.policy = ENV_POLICY_MAP[task.env_id.removeprefix(PREFIX)]()

    def act_on(self, s: dict[str, np.ndarray]) -> np.ndarray:
        obs = np.concatenate([s["hand"], s["objects"], s["goal"]])
        with warnings.catch_warnings():  # the policies warn that their gains exceed the action range
            warnings.simplefilter("ignore", UserWarning)
            action = self.policy.get_action(obs)
        return np.clip(action, -1.0, 1.0).astype(np.float32)


def metaworld_task(env_id: str) -> ExternalTask:
    """The ExternalTask for `metaworld/<name>`, its gymnasium id registered; ValueError for a name
    Meta-World does not have (with the closest one), ImportError without Meta-World."""
    if not installed():
        raise ImportError(f"task {env_id} comes from Meta-World, which is not installed: {INSTALL}")
    name = env_id.removeprefix(PREFIX)
    names = task_names()
    if name not in names:
        hint = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
        extra = f" Did you mean {PREFIX + hint[0]!r}?" if hint else ""
        raise ValueError(
            f"Meta-World has no task {name!r} ({len(names)} tasks, e.g. {PREFIX}{names[0]}).{extra}"
        )
    if env_id not in gym.registry:
        gym.register(
            env_id,
            entry_point=f"{__name__}:MetaWorldEnv",
            kwargs={"task": name},
            max_episode_steps=MAX_EPISODE_STEPS,
            disable_env_checker=True,  # its bounds are infinite for object poses, which the checker warns of
        )
    return ExternalTask(
        env_id=env_id,
        instruction=instruction(name),
        proprio=(("hand", OBSERVATION, HAND.start, HAND.stop), ("goal", OBSERVATION, GOAL.start, GOAL.stop)),
        privileged=(("objects", OBSERVATION, OBJECTS.start, OBJECTS.stop),),
        robot_type="sawyer",
    )
