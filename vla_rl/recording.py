"""Recording robot episodes as LeRobot v3.0 datasets (`vla_rl.lerobot_format`): the scripted expert's
demonstrations that behaviour cloning starts from, or a policy's episodes, through the shared episode
loop (`vla_rl.episodes`) with a recorder that writes its frames."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from mmrl.config import ConfigError
from vla_rl.dataset import RobotDataset
from vla_rl.episodes import Controller, Outcome, Progress, Recorder, Step, run_episodes
from vla_rl.lerobot_format import ACTION_KEY, IMAGE_KEY, STATE_KEY, DatasetWriter
from vla_rl.supervisor import TakeoverRule


def env_attribute(env: Any, name: str) -> Any:
    """An attribute of the env or of any of its wrappers (our tasks and SuccessAdapter set the same
    ones), or None."""
    return env.get_wrapper_attr(name) if env.has_wrapper_attr(name) else None


def env_features(env: Any) -> dict[str, dict[str, Any]]:
    """Dataset features for a sim env's "state" (and "image") observations and its actions."""
    spaces = env.observation_space.spaces
    if "state" not in spaces:
        raise ValueError(
            f"recording needs a 'state' observation (obs_mode 'state' or 'state+rgb'), got {list(spaces)}"
        )
    layout = env_attribute(env, "state_layout")
    names = [f"{part}.{i}" for part, s in layout.items() for i in range(s.stop - s.start)] if layout else None
    features = {
        STATE_KEY: {"dtype": "float32", "shape": [spaces["state"].shape[0]], "names": names},
        ACTION_KEY: {"dtype": "float32", "shape": list(env.action_space.shape), "names": None},
    }
    if "image" in spaces:
        features[IMAGE_KEY] = {"dtype": "image", "shape": list(spaces["image"].shape), "names": None}
    return features


class DatasetFrames(Recorder):
    """Each step as a dataset frame: the observation the action was chosen at and the chosen action (the
    clean one under action noise), marked by who chose it. Episodes are saved in episode order, however
    the envs' episodes interleave."""

    def __init__(self, writer: DatasetWriter) -> None:
        self.writer = writer
        self.frames: dict[int, list[tuple[dict[str, np.ndarray], bool]]] = {}
        self.ended: dict[int, Outcome] = {}
        self.next = 0  # the next episode to save

    def step(self, k: int, env: Any, step: Step) -> None:
        frame = {STATE_KEY: step.obs["state"], ACTION_KEY: step.action}
        if IMAGE_KEY in self.writer.user_features:
            frame[IMAGE_KEY] = step.obs["image"]
        self.frames.setdefault(k, []).append((frame, step.by_expert))

    def end(self, k: int, outcome: Outcome) -> None:
        self.ended[k] = outcome
        while self.next in self.ended:
            for frame, by_expert in self.frames.pop(self.next):
                self.writer.add_frame(frame, is_intervention=by_expert, policy_executed=not by_expert)
            done = self.ended.pop(self.next)
            self.writer.save_episode(done.instruction, success=done.success)
            self.next += 1


def record_episodes(
    env: Any,
    controller: Controller | None,
    n: int,
    seed: int,
    root: str | Path,
    *,
    obs_mode: str = "state",
    image_size: int = 96,
    robot_type: str | None = None,
    frames_per_file: int = 10_000,
    action_noise: float = 0.0,
    takeover: TakeoverRule | None = None,
) -> RobotDataset:
    """Run `n` episodes (reset seeds seed, seed+1, ...) through the episode loop (`vla_rl.episodes`) and
    write them as a dataset: the demonstrations behaviour cloning starts from.

    `env` is a sim task name ("PickPlace" or an external id such as "FetchReach-v4", made with `obs_mode`
    and `image_size`) or an env (used as it is and not closed); `robot_type` None takes the env's.
    `controller` None means the task's scripted expert, which acts on the privileged state; its frames
    are marked is_intervention. A controller (e.g. `PolicyActs(policy)`) proposes a policy's actions,
    marked policy_executed; with `takeover` the scripted expert supervises it, and the frames it drove
    are marked is_intervention.

    `action_noise` > 0 executes the action plus Gaussian noise of that standard deviation (clipped to
    the action space) but records the clean action (DART): the demonstrations then show how the actor
    recovers from the small errors a cloned policy makes, instead of only the actor's own perfect path.
    The noise of episode k is drawn from seed + k, so a dataset is reproducible.
    """
    import sim  # the robot extra: only recording needs it
    from sim import expert_for

    own_env = isinstance(env, str)
    if own_env:
        env = sim.make(env, obs_mode=obs_mode, image_size=image_size)
    try:
        features = env_features(env)
        if not env.metadata.get("render_fps"):
            raise ValueError("the env's metadata has no 'render_fps': a dataset needs the control rate (fps)")
        robot_type = robot_type or env_attribute(env, "robot_type")
        expert = expert_for(env) if controller is None or takeover is not None else None
        with (
            DatasetWriter(
                root, env.metadata["render_fps"], features, robot_type, frames_per_file=frames_per_file
            ) as writer,
            tqdm(total=n, desc=f"recording {Path(root).name}", disable=None) as bar,
        ):
            run_episodes(
                [env],
                [seed + k for k in range(n)],
                controller,
                expert=expert,
                takeover=takeover,
                action_noise=action_noise,
                recorders=[DatasetFrames(writer), Progress(bar)],
            )
    finally:
        if own_env:
            env.close()
    return RobotDataset(root)


def expert_demonstrations(
    root: str | Path,
    task: str,
    episodes: int,
    seed: int,
    required: Mapping[str, tuple[int, ...]],
    *,
    key: str,
    image_size: int = 96,
    action_noise: float = 0.0,
) -> RobotDataset:
    """The scripted expert's `episodes` demonstrations of `task` (reset seeds seed, seed+1, ...) in
    `root`: read when an earlier run recorded them there, else recorded now. They are recorded beside
    `root` and renamed into place, so a killed run never leaves half a dataset; a dataset that does
    not fit `required` or holds another number of episodes is a ConfigError naming `key`."""
    root = Path(root)
    if (root / "meta" / "info.json").is_file():
        try:
            dataset = RobotDataset(root)
            dataset.check_features(required)
        except ConfigError as err:
            raise ConfigError(
                f"config error: the demonstrations an earlier run recorded in {str(root)!r} cannot be used "
                f"({err}): delete that folder to record them again"
            ) from None
        if len(dataset.episodes) != episodes:
            raise ConfigError(
                f"config error: {str(root)!r} holds {len(dataset.episodes)} demonstrations, {key} = "
                f"{episodes}: use a new output_dir"
            )
        return dataset
    partial = root.with_name(root.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    record_episodes(
        task,
        None,
        episodes,
        seed,
        partial,
        obs_mode="state+rgb",
        image_size=image_size,
        action_noise=action_noise,
    )
    os.replace(partial, root)
    return RobotDataset(root)
