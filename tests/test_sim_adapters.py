"""Adapters give external gymnasium envs our interface (dict obs, is_success, instruction)."""

import importlib.util
import warnings

import numpy as np
import pytest

if importlib.util.find_spec("mujoco") is None or importlib.util.find_spec("gymnasium") is None:
    pytest.skip("the robot extra (mujoco, gymnasium) is not installed", allow_module_level=True)

import gymnasium as gym  # noqa: E402
from gymnasium.utils.env_checker import check_env  # noqa: E402

import sim  # noqa: E402
from sim.adapters import SuccessAdapter, make_external  # noqa: E402
from sim.render import headless_rendering_error  # noqa: E402

needs_gym_mujoco = pytest.mark.skipif(
    importlib.util.find_spec("imageio") is None,
    reason="gymnasium's MuJoCo envs need gymnasium[mujoco] (imageio)",
)


def near_target(obs, info):
    """Reacher reports no success: call it reached within 2 cm of the target."""
    return -info["reward_dist"] < 0.02


@needs_gym_mujoco
def test_reacher_with_a_success_function():
    env = make_external("Reacher-v5", "touch the red target", success_fn=near_target)
    obs, info = env.reset(seed=0)
    assert obs["state"].shape == (10,) and obs["state"].dtype == np.float32
    assert info == {"is_success": False, "instruction": "touch the red target", "unstable": False}
    _, reward, terminated, _, info = env.step(env.action_space.sample())
    assert reward == float(info["is_success"]) and "env_reward" in info and not terminated
    env.unwrapped.data.qpos[2:4] = env.unwrapped.get_body_com("fingertip")[:2]  # move the target onto it
    _, reward, terminated, _, info = env.step(np.zeros(2, np.float32))
    assert info["is_success"] and reward == 1.0 and terminated
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(different from the unwrapped|Box observation space).*")
        check_env(env, skip_render_check=True)


@needs_gym_mujoco
@pytest.mark.skipif(headless_rendering_error() is not None, reason="no headless rendering here")
def test_reacher_images_through_render():
    env = make_external("Reacher-v5", "reach", success_fn=near_target, image=True, width=48, height=48)
    obs, _ = env.reset(seed=0)
    assert obs["image"].shape == (48, 48, 3) and obs["image"].dtype == np.uint8
    assert env.observation_space.contains(obs)
    env.close()


def test_success_key_from_info_and_clear_error_without_it():
    env = SuccessAdapter(gym.make("mmrl/Push-v0"), "push the cube")
    obs, info = env.reset(seed=0)
    assert env.observation_space.contains(obs) and info["instruction"] == "push the cube"
    _, _, _, _, info = env.step(np.zeros(5, np.float32))
    assert info["is_success"] is False
    bad = SuccessAdapter(gym.make("mmrl/Push-v0"), "push", success_key="solved")
    bad.reset(seed=0)
    with pytest.raises(KeyError, match="'solved'.*success_fn"):
        bad.step(np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="render_mode='rgb_array'"):
        SuccessAdapter(gym.make("mmrl/Push-v0"), "push", image=True)
    assert sim.TASKS  # our own tasks stay registered alongside the external ones
