"""Adapters that give any gymnasium env our task interface, so trainers treat external tasks like ours.

Our interface: dict observations with "state" (a flat float32 vector) and optionally "image"
(HxWx3 uint8 from `env.render()`), a sparse reward of 1 on success, `info["is_success"]`,
`info["instruction"]` and `info["unstable"]`, and the attributes the trainers read from our own tasks:
`instruction`, `proprio_dim` (the leading entries of "state" a policy may see), `state_layout` and
`get_state()`.

"state" is built from `StatePart`s (`sim.state_parts`): named pieces of observation keys (a whole key,
or a slice of one), so that what a policy may see comes first and the privileged rest after it.

What an env returns is checked at every observation, reset included: every number of the keys that
"state" reads must be finite, and a camera frame from `render()` must be HxWx3 of the image space's
size, uint8, or floating point in [0, 1] (converted to uint8 as round(255 * x)). Anything else is an
`ObservationError` naming the env, the observation key, when it happened and the fix.

An external task (`sim.external.ExternalTask`) is made through `make_external`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from sim.state_parts import (
    WHOLE_OBSERVATION,
    PartSpec,
    StatePart,
    check_parts,
    key_space,
    parts_layout,
    whole_keys,
)

SuccessFn = Callable[[Any, dict[str, Any]], bool]
IMAGE_FIX = "return HxWx3 uint8 frames (0-255), or floats in [0, 1]"


class ObservationError(ValueError):
    """An env's observation breaks our interface's contract (see the module docstring); the message
    names the env, the observation key, when (at reset, or the step of the episode) and the fix."""


def rgb_frame(frame: Any, shape: tuple[int, ...] | None) -> np.ndarray:
    """`frame` as an HxWx3 uint8 image: uint8 as it is, floats in [0, 1] as round(255 * x). A frame of
    another dtype, shape (`shape` when given), with NaN or out of [0, 1] is a ValueError saying so."""
    if frame is None:
        raise ValueError("is None (no frame: the env must be made with render_mode='rgb_array')")
    frame = np.asarray(frame)
    if frame.ndim != 3 or frame.shape[2] != 3:
        raise ValueError(f"has shape {frame.shape}, not HxWx3 (RGB): {IMAGE_FIX}")
    if shape is not None and frame.shape != tuple(shape):
        raise ValueError(
            f"has shape {frame.shape}, but the task's images are {tuple(shape)}: draw the frames at the "
            "width and height the env is made with"
        )
    if frame.dtype == np.uint8:
        return frame
    if frame.dtype.kind != "f":
        raise ValueError(f"holds {frame.dtype} values: {IMAGE_FIX}")
    if not np.isfinite(frame).all():
        raise ValueError(f"holds NaN or infinite values: {IMAGE_FIX}")
    low, high = float(frame.min()), float(frame.max())
    if low < 0.0 or high > 1.0:
        raise ValueError(
            f"holds {frame.dtype} values in [{low:.4g}, {high:.4g}], outside [0, 1]: {IMAGE_FIX} "
            "(floats of 0-255 as frame.astype(np.uint8))"
        )
    return np.rint(frame * 255.0).astype(np.uint8)


class SuccessAdapter(gym.Wrapper, gym.utils.RecordConstructorArgs):
    """Wrap `env` so it reports success and an instruction the way the mmrl tasks do.

    Success comes from `success_fn(obs, info)` when given (for envs that do not report it, such as
    gymnasium's Reacher), else from `info[success_key]`. With `sparse_reward` the env's own reward is
    kept in `info["env_reward"]` and the returned reward is 1.0 on success, else 0.0. The image space's
    shape is `image_shape`, or that of a probe render of the unwrapped env (MuJoCo envs render before reset).

    "state" concatenates `state_parts` (named pieces of observation keys), or for Dict observations
    the whole keys in `state_keys` order (each key once; by default gymnasium's own order), so that
    what a policy may see can come first: its first `proprio_dim` entries (default: all of them). The
    rest is privileged state for experts, supervisors and critics. `state_layout` names the parts.
    With `instruction_from_info`, each episode's instruction is the env's own `info["instruction"]`
    (a multi-task env; `instruction` then only lists the words they use).

    Every observation is checked (module docstring): a non-finite number in a key that "state" reads,
    or a frame that is not an image, is an ObservationError naming the env, the key and the step.
    `render()` returns the checked uint8 frame.
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
        state_parts: Sequence[PartSpec] | None = None,
        instruction_from_info: bool = False,
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
            state_parts=state_parts,
            instruction_from_info=instruction_from_info,
        )
        gym.Wrapper.__init__(self, env)
        self.instruction, self.robot_type = instruction, robot_type
        self.instruction_from_info = instruction_from_info
        self.success_fn, self.success_key = success_fn, success_key
        self.image, self.sparse_reward, self.terminate_on_success = image, sparse_reward, terminate_on_success
        space = env.observation_space
        if state_parts is not None and state_keys is not None:
            raise ValueError("give state_keys (whole keys) or state_parts, not both")
        if state_parts is not None:
            self._parts = check_parts(space, [StatePart.of(p) for p in state_parts])
        else:
            self._parts = whole_keys(space, state_keys)
        if self._parts is None:
            box = gym.spaces.flatten_space(space)
            low, high = box.low, box.high
            self.state_layout = {"state": slice(0, len(low))}
        else:
            boxes = [gym.spaces.flatten_space(key_space(space, p)) for p in self._parts]
            low = np.concatenate([b.low[p.start : p.stop] for b, p in zip(boxes, self._parts, strict=True)])
            high = np.concatenate([b.high[p.start : p.stop] for b, p in zip(boxes, self._parts, strict=True)])
            self.state_layout = parts_layout(self._parts)
        size = len(low)
        self.proprio_dim = size if proprio_dim is None else proprio_dim
        if not 1 <= self.proprio_dim <= size:
            raise ValueError(f"proprio_dim = {proprio_dim}; between 1 and the state size {size}")
        low, high = low.astype(np.float32), high.astype(np.float32)
        spaces: dict[str, gym.Space] = {"state": gym.spaces.Box(low, high, low.shape, np.float32)}
        if image:
            if env.render_mode != "rgb_array":
                raise ValueError(
                    f"image=True needs an env made with render_mode='rgb_array', not {env.render_mode!r}"
                )
            spaces["image"] = gym.spaces.Box(0, 255, image_shape or _probe_frame_shape(env), np.uint8)
        self.observation_space = gym.spaces.Dict(spaces)
        self._state = np.zeros(size, np.float32)
        self._seed: int | None = None  # of the latest reset, and the steps since: where a fault shows
        self._steps = 0

    def get_state(self) -> np.ndarray:
        """The state vector of the latest observation (what experts and supervisors act on)."""
        return self._state.copy()

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        obs, info = self.env.reset(seed=seed, options=options)
        self._seed, self._steps = seed, 0
        return self._obs(obs), self._info(info, success=False)

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._steps += 1
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

    def render(self) -> np.ndarray:
        """The env's camera frame, checked and converted to HxWx3 uint8 (`rgb_frame`), or an
        ObservationError naming the env and the step."""
        try:
            frame = self.env.render()
        except Exception as err:  # the user's env may raise anything: one line, naming it
            reason = " ".join(f"{type(err).__name__}: {err}".split())
            raise ObservationError(
                f"env {self._name()}: {self._when()}, render() raised {reason}: the task's camera frames "
                "need an env that renders with render_mode='rgb_array'"
            ) from err
        space = self.observation_space.spaces.get("image")
        try:
            return rgb_frame(frame, space.shape if space is not None else None)
        except ValueError as err:
            raise ObservationError(
                f"env {self._name()}: {self._when()}, observation 'image' (its render() frame) {err}"
            ) from None

    def _name(self) -> str:
        spec = self.env.spec
        return spec.id if spec is not None else type(self.env.unwrapped).__name__

    def _when(self) -> str:
        if self._steps == 0:
            return "at reset" if self._seed is None else f"at reset (seed {self._seed})"
        episode = "" if self._seed is None else f" of the episode reset with seed {self._seed}"
        return f"at step {self._steps}{episode}"

    def _check_finite(self) -> None:
        """An ObservationError naming the observation key and state part of the first non-finite
        entry of the state, if any."""
        bad = np.flatnonzero(~np.isfinite(self._state))
        if not len(bad):
            return
        name, where = next((n, s) for n, s in self.state_layout.items() if s.start <= bad[0] < s.stop)
        part = next((p for p in self._parts or () if p.name == name), None)
        key = part.key if part is not None else WHOLE_OBSERVATION
        offset = int(bad[0] - where.start) + (part.start if part is not None else 0)
        value = "NaN" if np.isnan(self._state[bad[0]]) else "an infinite value"
        raise ObservationError(
            f"env {self._name()}: {self._when()}, observation {key!r} holds {value} (entry {offset}, state "
            f"part {name!r}; {len(bad)} non-finite state entries): an env must return finite observations; "
            "fix the env, or end the episode (terminated) before its state breaks"
        )

    def _obs(self, obs) -> dict[str, np.ndarray]:
        space = self.env.observation_space
        if self._parts is None:
            self._state = gym.spaces.flatten(space, obs).astype(np.float32)
        else:
            flat: dict[str, np.ndarray] = {}  # each key flattened once, however many parts read it
            for part in self._parts:
                if part.key not in flat:
                    whole = isinstance(space, gym.spaces.Dict)
                    value = obs[part.key] if whole else obs
                    flat[part.key] = gym.spaces.flatten(key_space(space, part), value)
            self._state = np.concatenate([flat[p.key][p.start : p.stop] for p in self._parts]).astype(
                np.float32
            )
        self._check_finite()
        out = {"state": self._state.copy()}
        if self.image:
            out["image"] = self.render()
        return out

    def _info(self, info: dict[str, Any], success: bool, **extra: Any) -> dict[str, Any]:
        return {
            **info,
            **extra,
            "is_success": success,
            "instruction": info.get("instruction", self.instruction)
            if self.instruction_from_info
            else self.instruction,
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
    *,
    image_shape: tuple[int, int, int] | None = None,
    state_keys: Sequence[str] | None = None,
    state_parts: Sequence[PartSpec] | None = None,
    proprio_dim: int | None = None,
    robot_type: str | None = None,
    instruction_from_info: bool = False,
    **make_kwargs: Any,
) -> SuccessAdapter:
    """`gymnasium.make(env_id)` wrapped in a SuccessAdapter (rendering on when images are wanted)."""
    if image:
        make_kwargs.setdefault("render_mode", "rgb_array")
    env = gym.make(env_id, **make_kwargs)
    try:
        return SuccessAdapter(
            env,
            instruction,
            success_fn=success_fn,
            success_key=success_key,
            image=image,
            image_shape=image_shape,
            state_keys=state_keys,
            state_parts=state_parts,
            proprio_dim=proprio_dim,
            robot_type=robot_type,
            instruction_from_info=instruction_from_info,
        )
    except ValueError:
        env.close()
        raise
