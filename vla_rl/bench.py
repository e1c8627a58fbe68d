"""`mmrl bench vla`: what the policy in the loop, camera images and vectorising cost per env step.

All variants step the same task, side by side in one run, and count env steps per second against
raw MuJoCo stepping (state observations, random actions, N envs in lockstep through gymnasium's
SyncVectorEnv):

- (a) policy in the loop: rgb observations and one batched `VLAPolicy.act` per lockstep step (chunks
  of `n_action_steps` actions, so the network runs every few steps), against raw stepping with the
  same rgb observations: what the policy costs, target at least 0.5x; and against raw stepping with
  state observations, which adds the camera's cost (reported, no target: the VLA needs images, and
  software rendering on a CPU costs more than the physics);
- (b) rgb observations with random actions: the rendering cost alone, no policy, no target;
- (c) vectorised: SyncVectorEnv of N envs against one plain env (state observations; lockstep on one
  core, so about 1x is expected, no target), and N envs with one batched act against one env with a
  policy call per step (target at least 1x: batching must not lose).

Repeats run the variants in turn and keep the median, so load from other processes hits all alike.
Steps where a vector env auto-resets a finished episode are not counted as steps.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmrl.bench_all import check_counts, print_table
from mmrl.config import ConfigError, check_device
from mmrl.registry import BENCHES
from vla_rl.policy import VLAConfig, VLAPolicy, task_vocabulary

POLICY_TARGET = 0.5  # policy-in-the-loop steps/s over raw stepping with the same observations, at least
BATCHING_TARGET = 1.0  # N envs with batched act over one env, at least


def _vector_runner(
    task: str, num_envs: int, obs_mode: str, image_size: int, policy: VLAPolicy | None
) -> tuple[Callable[[int], int], Callable[[], None]]:
    """A function running `n` lockstep steps of a SyncVectorEnv (random actions, or the policy's),
    returning the env steps taken, and a closer."""
    import gymnasium as gym

    import sim  # noqa: F401  (registers the tasks with gymnasium)

    envs = gym.make_vec(
        task,
        num_envs=num_envs,
        vectorization_mode="sync",
        obs_mode=obs_mode,
        image_size=image_size,
    )
    rng = np.random.default_rng(0)
    obs, info = envs.reset(seed=0)
    state = {"obs": obs, "instructions": list(info["instruction"]), "resetting": np.zeros(num_envs, bool)}
    if policy is not None:
        policy.reset()

    def run(n: int) -> int:
        taken = 0
        for _ in range(n):
            if policy is None:
                actions = rng.uniform(-1, 1, (num_envs, 5)).astype(np.float32)
            else:
                actions = policy.act(state["obs"], state["instructions"], deterministic=True)
            obs, _, terminated, truncated, info = envs.step(actions)
            taken += int(num_envs - state["resetting"].sum())
            if policy is not None and state["resetting"].any():  # new episodes: predict fresh chunks
                policy.reset(np.flatnonzero(state["resetting"]))
            state["obs"], state["instructions"] = obs, list(info["instruction"])
            state["resetting"] = terminated | truncated
        return taken

    return run, envs.close


def _single_runner(
    task: str, obs_mode: str, image_size: int, policy: VLAPolicy | None
) -> tuple[Callable[[int], int], Callable[[], None]]:
    """The same for one plain env (reset by hand when an episode ends)."""
    import sim

    env = sim.make(task, obs_mode=obs_mode, image_size=image_size)
    rng = np.random.default_rng(0)
    obs, info = env.reset(seed=0)
    state = {"obs": obs, "instruction": info["instruction"], "seed": 0}
    if policy is not None:
        policy.reset()

    def run(n: int) -> int:
        for _ in range(n):
            if policy is None:
                action = rng.uniform(-1, 1, 5).astype(np.float32)
            else:
                action = policy.act(state["obs"], state["instruction"], deterministic=True)
            obs, _, terminated, truncated, info = env.step(action)
            if terminated or truncated:
                state["seed"] += 1
                obs, info = env.reset(seed=state["seed"])
                if policy is not None:
                    policy.reset()
            state["obs"], state["instruction"] = obs, info["instruction"]
        return n

    return run, env.close


def _median_rates(runners: dict[str, Callable[[int], int]], steps: int, repeats: int) -> dict[str, float]:
    """Median env steps per second of each runner over `repeats` rounds, runners timed in turn."""
    for run in runners.values():
        run(2)  # warm-up: renderer contexts, first forward
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            start = time.perf_counter()
            taken = run(steps)
            samples[name].append(taken / (time.perf_counter() - start))
    return {name: statistics.median(rates) for name, rates in samples.items()}


def _row(section: str, name: str, rate: float, baseline: str, base: float, target: float | None) -> dict:
    ratio = rate / base
    verdict = "-" if target is None else ("PASS" if ratio >= target else "FAIL")
    return {
        "section": section,
        "name": name,
        "steps_per_s": rate,
        "baseline": baseline,
        "baseline_steps_per_s": base,
        "ratio": ratio,
        "target": target,
        "target_op": ">=",
        "verdict": verdict,
    }


@BENCHES.register("vla")
def bench_vla(
    steps: int = 100,
    num_envs: int = 8,
    repeats: int = 3,
    task: str = "PickPlace",
    image_size: int | None = None,
    model: str | None = None,
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """Env steps per second: raw stepping, policy in the loop, rgb rendering, N envs vs one; print the
    table and return its rows. `steps` lockstep steps per variant and repeat (one-env variants take
    `steps` steps too); `model` a VLAPolicy directory, else an untrained policy of the default
    architecture (the speed does not depend on the weights), run on `device`."""
    import sim

    check_counts(steps=steps, num_envs=num_envs, repeats=repeats)
    device = check_device(device, "device")
    try:
        task = sim.task_id(task)
    except ValueError as err:
        raise ConfigError(f"config error: task = {task!r}: {err}") from None
    torch.manual_seed(0)
    if model:
        if not Path(model).is_dir():
            raise FileNotFoundError(
                f"model={model!r} is not a directory written by VLAPolicy.save_pretrained"
            )
        policy = VLAPolicy.from_pretrained(model)
        name = model
    else:
        policy = VLAPolicy(VLAConfig(vocabulary=task_vocabulary(), image_size=image_size or 96))
        name = "untrained VLAPolicy, default architecture"
    policy.to(device).eval()
    if image_size is not None and image_size != policy.config.image_size:
        raise ConfigError(
            f"config error: image_size = {image_size}, but the policy takes "
            f"{policy.config.image_size}px images"
        )
    size = policy.config.image_size
    # the policy keeps one chunk queue per batch size, so the one-env variant gets its own copy
    single_policy = VLAPolicy(policy.config)
    single_policy.load_state_dict(policy.state_dict())
    single_policy.to(device).eval()

    made = {
        "raw": _vector_runner(task, num_envs, "state", size, None),
        "policy": _vector_runner(task, num_envs, "rgb", size, policy),
        "rgb": _vector_runner(task, num_envs, "rgb", size, None),
        "raw_one": _single_runner(task, "state", size, None),
        "policy_one": _single_runner(task, "rgb", size, single_policy),
    }
    try:
        rates = _median_rates({key: run for key, (run, _) in made.items()}, steps, repeats)
    finally:
        for _, close in made.values():
            close()

    n = num_envs
    raw = f"raw: state obs, random actions, {n} envs"
    rgb = f"raw: rgb {size}px obs, random actions, {n} envs"
    rows = [
        _row(
            "(a)",
            f"policy in the loop, rgb {size}px, {n} envs",
            rates["policy"],
            rgb,
            rates["rgb"],
            POLICY_TARGET,
        ),
        _row("(a)", f"policy in the loop, rgb {size}px, {n} envs", rates["policy"], raw, rates["raw"], None),
        _row(
            "(b)",
            f"rgb {size}px obs, random actions, {n} envs",
            rates["rgb"],
            raw,
            rates["raw"],
            None,
        ),
        _row(
            "(c)",
            f"SyncVectorEnv of {n}, state obs",
            rates["raw"],
            "one env, state obs",
            rates["raw_one"],
            None,
        ),
        _row(
            "(c)",
            f"policy in the loop, {n} envs, batched act",
            rates["policy"],
            "policy in the loop, one env",
            rates["policy_one"],
            BATCHING_TARGET,
        ),
    ]
    where = f"{policy.device}, {torch.get_num_threads()} torch threads, median of {repeats} x {steps} steps"
    print(f"policy: {name}; task {task}; chunks of {policy.config.n_action_steps} actions per policy call")
    print_table(
        f"VLA env steps per second ({where})",
        ["variant", "steps/s", "baseline", "baseline steps/s", "ratio", "target", "verdict"],
        [
            [
                f"{row['section']} {row['name']}",
                f"{row['steps_per_s']:.1f}",
                row["baseline"],
                f"{row['baseline_steps_per_s']:.1f}",
                f"{row['ratio']:.2f}x",
                "-" if row["target"] is None else f">= {row['target']}x",
                row["verdict"],
            ]
            for row in rows
        ],
    )
    return rows
