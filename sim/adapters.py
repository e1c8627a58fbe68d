"""Adapters that give any gymnasium env our task interface, so trainers treat external tasks like ours.

Our interface: dict observations with "state" (a flat float32 vector) and optionally "image"
(HxWx3 uint8 from `env.render()`), a sparse reward of 1 on success, `info["is_success"]`,
`info["instruction"]` and `info["unstable"]`, and the attributes the trainers read from our own tasks:
`instruction`, `proprio_dim` (the leading entries of "state" a policy may see), `state_layout` and
`get_state()`.

`EXTERNAL_TASKS` lists the external tasks the trainers accept by their gymnasium id (their scripted
experts are in `sim.experts`); `sim.make` builds them through `make_external`.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np

from sim.env import OBS_MODES

SuccessFn = Callable[[Any, dict[str, Any]], bool]


class SuccessAdapter(gym.Wrapper, gym.utils.RecordConstructorArgs):
    """Wrap `env` so it reports success and an instruction the way the mmrl tasks do.

    Success comes from `success_fn(obs, info)` when given (for envs that do not report it, such as
    gymnasium's Reacher), else from `info[success_key]`. With `sparse_reward` the env's own reward is
    kept in `info["env_reward"]` and the returned reward is 1.0 on success, else 0.0. The image space's
    shape is `image_shape`, or that of a probe render of the unwrapped env (MuJoCo envs render before reset).

    For Dict observations, "state" concatenates the keys in `state_keys` order (each key once; by default
    gymnasium's own order), so that what a policy may see can come first: its first `proprio_dim`
    entries (default: all of them). The rest is privileged state for experts, supervisors and critics.
    """

    def __init__(
        self,
        env: gym.Env,
        instruction: str,
        success_fn: SuccessFn | None = None,
        success_key: str = "is_success",
        image: bool = False,
        image_shape: tuple[int, int, int] | None = None,
        sparse_reward: bool = True,
        terminate_on_success: bool = True,
        state_keys: Sequence[str] | None = None,
        proprio_dim: int | None = None,
        robot_type: str | None = None,
    ) -> None:
        gym.utils.RecordConstructorArgs.__init__(
            self,
            instruction=instruction,
            success_fn=success_fn,
            success_key=success_key,
            image=image,
            image_shape=image_shape,
            sparse_reward=sparse_reward,
            terminate_on_success=terminate_on_success,
            state_keys=state_keys,
            proprio_dim=proprio_dim,
            robot_type=robot_type,
        )
        gym.Wrapper.__init__(self, env)
        self.instruction, self.robot_type = instruction, robot_type
        self.success_fn, self.success_key = success_fn, success_key
        self.image, self.sparse_reward, self.terminate_on_success = image, sparse_reward, terminate_on_success
        space = env.observation_space
        self._keys = _state_keys(space, state_keys)
        parts = [space] if self._keys is None else [space[k] for k in self._keys]
        sizes = [gym.spaces.flatdim(part) for part in parts]
        ends = np.cumsum(sizes).tolist()
        self.state_layout = {
            name: slice(end - size, end)
            for name, size, end in zip(self._keys or ["state"], sizes, ends, strict=True)
        }
        self.proprio_dim = ends[-1] if proprio_dim is None else proprio_dim
        if not 1 <= self.proprio_dim <= ends[-1]:
            raise ValueError(f"proprio_dim = {proprio_dim}; between 1 and the state size {ends[-1]}")
        flat = [gym.spaces.flatten_space(part) for part in parts]
        low = np.concatenate([f.low for f in flat]).astype(np.float32)
        high = np.concatenate([f.high for f in flat]).astype(np.float32)
        spaces: dict[str, gym.Space] = {"state": gym.spaces.Box(low, high, low.shape, np.float32)}
        if image:
            if env.render_mode != "rgb_array":
                raise ValueError(
                    f"image=True needs an env made with render_mode='rgb_array', not {env.render_mode!r}"
                )
            spaces["image"] = gym.spaces.Box(0, 255, image_shape or _probe_frame_shape(env), np.uint8)
        self.observation_space = gym.spaces.Dict(spaces)
        self._state = np.zeros(ends[-1], np.float32)

    def get_state(self) -> np.ndarray:
        """The state vector of the latest observation (what experts and supervisors act on)."""
        return self._state.copy()

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        obs, info = self.env.reset(seed=seed, options=options)
        return self._obs(obs), self._info(info, success=False)

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        success = self._success(obs, info)
        info = self._info(info, success, env_reward=float(reward))
        if self.sparse_reward:
            reward = float(success)
        terminated = bool(terminated or (success and self.terminate_on_success))
        return self._obs(obs), reward, terminated, truncated, info

    def _success(self, obs, info: dict[str, Any]) -> bool:
        if self.success_fn is not None:
            return bool(self.success_fn(obs, info))
        if self.success_key not in info:
            raise KeyError(
                f"{type(self.env.unwrapped).__name__} does not put {self.success_key!r} in info "
                f"(it has {sorted(info)}); pass success_key=... or success_fn=..."
            )
        return bool(info[self.success_key])

    def _obs(self, obs) -> dict[str, np.ndarray]:
        space = self.env.observation_space
        if self._keys is None:
            self._state = gym.spaces.flatten(space, obs).astype(np.float32)
        else:
            self._state = np.concatenate([gym.spaces.flatten(space[k], obs[k]) for k in self._keys])
            self._state = self._state.astype(np.float32)
        out = {"state": self._state.copy()}
        if self.image:
            out["image"] = np.asarray(self.env.render(), dtype=np.uint8)
        return out

    def _info(self, info: dict[str, Any], success: bool, **extra: Any) -> dict[str, Any]:
        return {
            **info,
            **extra,
            "is_success": success,
            "instruction": self.instruction,
            "unstable": bool(info.get("unstable", False)),
        }


def _state_keys(space: gym.Space, state_keys: Sequence[str] | None) -> list[str] | None:
    """The Dict keys in "state" order (None: a space that is not a Dict, flattened whole)."""
    if not isinstance(space, gym.spaces.Dict):
        if state_keys is not None:
            raise ValueError(f"state_keys needs Dict observations, not {type(space).__name__}")
        return None
    if state_keys is None:
        return list(space.spaces)
    if sorted(state_keys) != sorted(space.spaces):
        raise ValueError(
            f"state_keys = {list(state_keys)} must name every observation key once: {list(space.spaces)}"
        )
    return list(state_keys)


def _probe_frame_shape(env: gym.Env) -> tuple[int, ...]:
    try:
        frame = env.unwrapped.render()
    except Exception as err:
        raise ValueError(
            f"could not render {env.unwrapped} before reset to size its images ({err}); "
            "pass image_shape=(H, W, 3)"
        ) from err
    if frame is None or np.ndim(frame) != 3:
        raise ValueError(f"{env.unwrapped}.render() gave no HxWx3 image; pass an env that renders RGB")
    return np.shape(frame)


def make_external(
    env_id: str,
    instruction: str,
    success_fn: SuccessFn | None = None,
    success_key: str = "is_success",
    image: bool = False,
    *,
    image_shape: tuple[int, int, int] | None = None,
    state_keys: Sequence[str] | None = None,
    proprio_dim: int | None = None,
    robot_type: str | None = None,
    **make_kwargs: Any,
) -> SuccessAdapter:
    """`gymnasium.make(env_id)` wrapped in a SuccessAdapter (rendering on when images are wanted)."""
    if image:
        make_kwargs.setdefault("render_mode", "rgb_array")
    env = gym.make(env_id, **make_kwargs)
    return SuccessAdapter(
        env,
        instruction,
        success_fn=success_fn,
        success_key=success_key,
        image=image,
        image_shape=image_shape,
        state_keys=state_keys,
        proprio_dim=proprio_dim,
        robot_type=robot_type,
    )


@dataclass(frozen=True)
class ExternalTask:
    """A gymnasium task from another package that the trainers accept by its id: the package that
    registers it, the instruction, which observation keys a policy may see (`proprio`, first in "state")
    and which only experts and critics read (`privileged`), and extra `gymnasium.make` arguments."""

    env_id: str
    package: str  # the module whose import registers env_id
    install: str  # how to install that package
    instruction: str
    proprio: tuple[tuple[str, int], ...]
    privileged: tuple[tuple[str, int], ...]
    robot_type: str
    make_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def layout(self) -> dict[str, slice]:
        """Where each observation key lies in "state" (experts are built from this, before any env)."""
        names = self.proprio + self.privileged
        ends = np.cumsum([size for _, size in names]).tolist()
        return {name: slice(end - size, end) for (name, size), end in zip(names, ends, strict=True)}

    @property
    def proprio_dim(self) -> int:
        return sum(size for _, size in self.proprio)

    def missing(self) -> str | None:
        """Why this task cannot be made here (its package is not installed), or None."""
        if importlib.util.find_spec(self.package) is None:
            return f"task {self.env_id} comes from {self.package}, which is not installed: {self.install}"
        return None

    def make(self, obs_mode: str = "state", image_size: int = 96, **kwargs: Any) -> SuccessAdapter:
        """The task in our interface. obs_mode as for our tasks, except that "rgb" keeps "state" (a
        policy reads only its first proprio_dim entries); images are image_size pixels square."""
        if obs_mode not in OBS_MODES:
            raise ValueError(f"obs_mode={obs_mode!r}; choose one of {OBS_MODES}")
        problem = self.missing()
        if problem:
            raise ImportError(problem)
        gym.register_envs(importlib.import_module(self.package))
        image = "rgb" in obs_mode
        if image:
            kwargs = {"width": image_size, "height": image_size, **kwargs}
        env = make_external(
            self.env_id,
            self.instruction,
            image=image,
            image_shape=(image_size, image_size, 3) if image else None,  # some envs render only after reset
            state_keys=list(self.layout()),
            proprio_dim=self.proprio_dim,
            robot_type=self.robot_type,
            **{**self.make_kwargs, **kwargs},
        )
        if env.state_layout != self.layout():
            env.close()
            raise ValueError(
                f"{self.env_id} from {self.package} gives state parts {env.state_layout}, mmrl expects "
                f"{self.layout()}: update its entry in sim.adapters.EXTERNAL_TASKS"
            )
        return env


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
EXTERNAL_TASKS: dict[str, ExternalTask] = {task.env_id: task for task in (FETCH_REACH,)}
