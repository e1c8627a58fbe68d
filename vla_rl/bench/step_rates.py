"""Rows (a), (b), (c) and (e) of `mmrl bench vla`: env steps per second of a task stepped N envs in
lockstep (random actions, or one batched policy act per step) or one plain env, each against a
baseline way of stepping; the ratios' targets are judged by `vla_rl.bench`."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from vla_rl.policy import VLAConfig, VLAPolicy, task_vocabulary

POLICY_TARGET = 0.5  # policy-in-the-loop steps/s over raw stepping with the same observations, at least
BATCHING_TARGET = 1.0  # N envs with batched act over one env, at least


def next_actions(
    policy: VLAPolicy | None, rng: np.random.Generator, shape: tuple[int, ...], obs: Any, instructions: Any
) -> np.ndarray:
    """Random actions of `shape`, or the policy's for the observations and instructions."""
    if policy is None:
        return rng.uniform(-1, 1, shape).astype(np.float32)
    return policy.act(obs, instructions)


def vector_runner(
    task: str, num_envs: int, obs_mode: str, image_size: int, policy: VLAPolicy | None, **make_kwargs: Any
) -> tuple[Callable[[int], int], Callable[[], None]]:
    """A function running `n` lockstep steps of a SyncVectorEnv (random actions, or the policy's),
    returning the env steps taken, and a closer; `make_kwargs` go to the task's constructor."""
    import functools

    import gymnasium as gym

    import sim

    make = functools.partial(sim.make, task, obs_mode=obs_mode, image_size=image_size, **make_kwargs)
    envs = gym.vector.SyncVectorEnv([make] * num_envs)
    action_shape = (num_envs, *envs.single_action_space.shape)
    rng = np.random.default_rng(0)
    obs, info = envs.reset(seed=0)
    state = {"obs": obs, "instructions": list(info["instruction"]), "resetting": np.zeros(num_envs, bool)}
    if policy is not None:
        policy.reset()

    def run(n: int) -> int:
        taken = 0
        for _ in range(n):
            actions = next_actions(policy, rng, action_shape, state["obs"], state["instructions"])
            obs, _, terminated, truncated, info = envs.step(actions)
            taken += int(num_envs - state["resetting"].sum())
            if policy is not None and state["resetting"].any():  # new episodes: predict fresh chunks
                policy.reset(np.flatnonzero(state["resetting"]))
            state["obs"], state["instructions"] = obs, list(info["instruction"])
            state["resetting"] = terminated | truncated
        return taken

    return run, envs.close


def single_runner(
    task: str, obs_mode: str, image_size: int, policy: VLAPolicy | None
) -> tuple[Callable[[int], int], Callable[[], None]]:
    """The same for one plain env (reset by hand when an episode ends)."""
    import sim

    env = sim.make(task, obs_mode=obs_mode, image_size=image_size)
    action_shape = env.action_space.shape
    rng = np.random.default_rng(0)
    obs, info = env.reset(seed=0)
    state = {"obs": obs, "instruction": info["instruction"], "seed": 0}
    if policy is not None:
        policy.reset()

    def run(n: int) -> int:
        for _ in range(n):
            action = next_actions(policy, rng, action_shape, state["obs"], state["instruction"])
            obs, _, terminated, truncated, info = env.step(action)
            if terminated or truncated:
                state["seed"] += 1
                obs, info = env.reset(seed=state["seed"])
                if policy is not None:
                    policy.reset()
            state["obs"], state["instruction"] = obs, info["instruction"]
        return n

    return run, env.close


def median_rates(runners: dict[str, Callable[[int], int]], steps: int, repeats: int) -> dict[str, float]:
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


def rate_row(section: str, name: str, rate: float, baseline: str, base: float, target: float | None) -> dict:
    """One row: `name`'s rate against `baseline`'s, their ratio and its target (at least)."""
    return {
        "section": section,
        "name": name,
        "steps_per_s": rate,
        "baseline": baseline,
        "baseline_steps_per_s": base,
        "ratio": rate / base,
        "target": target,
        "target_op": ">=",
    }


def metaworld_rows(
    task: str, num_envs: int, steps: int, repeats: int, size: int, device: torch.device
) -> list[dict[str, Any]]:
    """Rows (e): an untrained policy shaped for the Meta-World task in the loop, against raw stepping."""
    import sim

    env = sim.make(task)
    proprio_dim, action_dim = env.get_wrapper_attr("proprio_dim"), env.action_space.shape[0]
    words = task_vocabulary([env.get_wrapper_attr("instruction")])
    env.close()
    config = VLAConfig(vocabulary=words, proprio_dim=proprio_dim, action_dim=action_dim, image_size=size)
    policy = VLAPolicy(config).to(device).eval()
    made = {
        "raw": vector_runner(task, num_envs, "state", size, None),
        "rgb": vector_runner(task, num_envs, "rgb", size, None),
        "rgb_full": vector_runner(task, num_envs, "rgb", size, None, full_meshes=True),
        "policy": vector_runner(task, num_envs, "rgb", size, policy),
    }
    try:
        rates = median_rates({key: run for key, (run, _) in made.items()}, steps, repeats)
    finally:
        for _, close in made.values():
            close()
    name = f"{task}: policy in the loop, rgb {size}px, {num_envs} envs"
    rgb = f"{task}: rgb {size}px obs, random actions"
    raw = f"{task}: state obs, random actions"
    full = f"{task}: rgb {size}px obs from the full meshes, random actions"
    return [
        rate_row("(e)", name, rates["policy"], rgb, rates["rgb"], POLICY_TARGET),
        rate_row("(e)", name, rates["policy"], raw, rates["raw"], None),
        rate_row("(e)", rgb, rates["rgb"], full, rates["rgb_full"], None),
    ]
