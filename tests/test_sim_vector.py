"""Vectorised stepping through gymnasium's make_vec."""

import gymnasium as gym
import numpy as np
import pytest

import sim  # noqa: F401  (registers the tasks)
from sim import expert_for


def test_make_vec_sync_shapes_and_expert_batch():
    envs = gym.make_vec("mmrl/PickPlace-v0", num_envs=4, vectorization_mode="sync")
    obs, info = envs.reset(seed=0)
    assert obs["state"].shape == (4, 22) and obs["state"].dtype == np.float32
    assert info["instruction"].shape == (4,)
    expert = expert_for(envs)
    successes = np.zeros(4, dtype=bool)
    for _ in range(60):
        obs, reward, terminated, truncated, info = envs.step(expert(obs["state"]))
        assert reward.shape == terminated.shape == truncated.shape == (4,)
        successes |= info["is_success"]
    assert successes.all()
    envs.close()


@pytest.mark.needs_rendering
def test_make_vec_images():
    envs = gym.make_vec("mmrl/Reach-v0", num_envs=2, vectorization_mode="sync", obs_mode="rgb", image_size=32)
    obs, _ = envs.reset(seed=0)
    assert obs["image"].shape == (2, 32, 32, 3) and obs["image"].dtype == np.uint8
    assert obs["proprio"].shape == (2, 9)
    obs, *_ = envs.step(np.zeros((2, 5), np.float32))
    assert envs.observation_space.contains(obs)
    envs.close()
