"""Adapters that give any gymnasium env our task interface, so trainers treat external tasks like ours.

Our interface: dict observations with "state" (a flat float32 vector) and optionally "image"
(HxWx3 uint8 from `env.render()`), a sparse reward of 1 on success, `info["is_success"]`,
`info["instruction"]` and `info["unstable"]`, and an `instruction` attribute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

SuccessFn = Callable[[Any, dict[str, Any]], bool]


class SuccessAdapter(gym.Wrapper, gym.utils.RecordConstructorArgs):
    """Wrap `env` so it reports success and an instruction the way the mmrl tasks do.

    Success comes from `success_fn(obs, info)` when given (for envs that do not report it, such as
    gymnasium's Reacher), else from `info[success_key]`. With `sparse_reward` the env's own reward is
    kept in `info["env_reward"]` and the returned reward is 1.0 on success, else 0.0. The image space's
    shape is `image_shape`, or that of a probe render of the unwrapped env (MuJoCo envs render before reset).
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
        )
        gym.Wrapper.__init__(self, env)
        self.instruction = instruction
        self.success_fn, self.success_key = success_fn, success_key
        self.image, self.sparse_reward, self.terminate_on_success = image, sparse_reward, terminate_on_success
        flat = gym.spaces.flatten_space(env.observation_space)
        low, high = flat.low.astype(np.float32), flat.high.astype(np.float32)
        spaces: dict[str, gym.Space] = {"state": gym.spaces.Box(low, high, flat.shape, np.float32)}
        if image:
            if env.render_mode != "rgb_array":
                raise ValueError(
                    f"image=True needs an env made with render_mode='rgb_array', not {env.render_mode!r}"
                )
            spaces["image"] = gym.spaces.Box(0, 255, image_shape or _probe_frame_shape(env), np.uint8)
        self.observation_space = gym.spaces.Dict(spaces)

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
        out = {"state": gym.spaces.flatten(self.env.observation_space, obs).astype(np.float32)}
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
    **make_kwargs: Any,
) -> SuccessAdapter:
    """`gymnasium.make(env_id)` wrapped in a SuccessAdapter (rendering on when images are wanted)."""
    if image:
        make_kwargs.setdefault("render_mode", "rgb_array")
    env = gym.make(env_id, **make_kwargs)
    return SuccessAdapter(env, instruction, success_fn=success_fn, success_key=success_key, image=image)
