"""Adapters give external gymnasium envs our interface (dict obs, is_success, instruction)."""

import dataclasses
import importlib.util
import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import sim
from mmrl.registry import TASKS
from sim.adapters import SuccessAdapter, make_external

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
    # Stop the arm (the sampled action left it moving) and move the target onto its fingertip.
    env.unwrapped.data.qvel[:] = 0.0
    env.unwrapped.data.qpos[2:4] = env.unwrapped.get_body_com("fingertip")[:2]
    _, reward, terminated, _, info = env.step(np.zeros(2, np.float32))
    assert info["is_success"] and reward == 1.0 and terminated
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(different from the unwrapped|Box observation space).*")
        check_env(env, skip_render_check=True)


@needs_gym_mujoco
@pytest.mark.needs_rendering
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
    assert sim.arm_task_ids()  # our own tasks stay registered alongside the external ones


def test_state_keys_and_proprio_dim_are_checked():
    env = SuccessAdapter(gym.make("mmrl/Push-v0"), "push", state_keys=["state"], proprio_dim=9)
    obs, _ = env.reset(seed=0)
    assert env.proprio_dim == 9 and env.state_layout == {"state": slice(0, obs["state"].size)}
    np.testing.assert_array_equal(env.get_state(), obs["state"])
    with pytest.raises(ValueError, match="must name every observation key once"):
        SuccessAdapter(gym.make("mmrl/Push-v0"), "push", state_keys=["state", "goal"])
    with pytest.raises(ValueError, match="proprio_dim = 0; between 1 and the state size"):
        SuccessAdapter(gym.make("mmrl/Push-v0"), "push", proprio_dim=0)


@needs_gym_mujoco
def test_state_keys_need_dict_observations():
    with pytest.raises(ValueError, match="state_keys needs Dict observations, not Box"):
        make_external("Reacher-v5", "reach", success_fn=near_target, state_keys=["x"])


def test_external_task_names_say_what_to_do():
    with pytest.raises(
        ValueError, match="'Ant-v5' is a gymnasium env, but mmrl has no adapter.*sim.register_task.*--plugin"
    ):
        sim.task_id("Ant-v5")
    with pytest.raises(ValueError, match="unknown sim task 'FetchReech-v4'.*Did you mean 'FetchReach-v4'"):
        sim.task_id("FetchReech-v4")


def test_external_task_without_its_package_says_how_to_install_it(monkeypatch):
    fetch = TASKS.get("FetchReach-v4")
    missing = dataclasses.replace(fetch.task, package="mmrl_no_such_package")
    monkeypatch.setitem(TASKS._entries, "FetchReach-v4", dataclasses.replace(fetch, task=missing))
    with pytest.raises(ValueError, match=r"not installed: pip install 'mmrl\[fetch\]'"):
        sim.task_id("FetchReach-v4")
    with pytest.raises(ImportError, match="mmrl_no_such_package, which is not installed"):
        missing.make()


def test_named_slices_split_one_observation_key():
    env = SuccessAdapter(
        gym.make("mmrl/Push-v0"),
        "push",
        state_parts=[("arm", "state", 0, 9), ("cube_xy", "state", 9, 11), ("ee_xyz", "state", 0, 3)],
        proprio_dim=9,
    )
    obs, _ = env.reset(seed=0)
    raw = env.unwrapped.get_state()
    assert env.state_layout == {"arm": slice(0, 9), "cube_xy": slice(9, 11), "ee_xyz": slice(11, 14)}
    np.testing.assert_array_equal(obs["state"], np.concatenate([raw[0:9], raw[9:11], raw[0:3]]))
    assert env.observation_space.contains(obs) and env.observation_space["state"].shape == (14,)


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ([("arm", "state", 0, 9), ("arm", "state", 9, 12)], "name 'arm' is used twice"),
        ([("arm", "state", 5, 999)], r"'arm' \(state\[5:999\]\) is out of range: 'state' has \d+ entries"),
        ([("arm", "joints", 0, 3)], "have no key 'joints'; their keys: state"),
        ([("state", 4)], r"'state' \(all of 'state'\) is given 4 entries, but 'state' has \d+"),
        (
            [("arm", "state", 3)],
            r"give \(key, size\) for a whole observation key, \(name, key, start, stop\)",
        ),
    ],
)
def test_bad_state_parts_are_named(parts, message):
    with pytest.raises(ValueError, match=message):
        SuccessAdapter(gym.make("mmrl/Push-v0"), "push", state_parts=parts)


def test_external_tasks_check_their_parts_and_registration():
    fetch = TASKS.get("FetchReach-v4").task
    with pytest.raises(ValueError, match="task X-v0: state part name.*'grip'.*used twice"):
        sim.ExternalTask(
            env_id="X-v0", instruction="go", proprio=(("grip", "obs", 0, 3),), privileged=(("grip", 2),)
        )
    with pytest.raises(ValueError, match=r"'grip' = obs\[3:3\] is empty: need 0 <= start < stop"):
        sim.ExternalTask(env_id="X-v0", instruction="go", proprio=(("grip", "obs", 3, 3),))
    with pytest.raises(ValueError, match="'FetchReach-v4' is already registered"):
        sim.register_task(fetch)
    with pytest.raises(TypeError, match="must be a subclass of sim.experts.Expert"):
        sim.register_task(dataclasses.replace(fetch, env_id="Other-v0"), expert=len)
    unregistered = sim.ExternalTask(env_id="NoSuchGymEnv-v0", instruction="go", proprio=(("obs", 2),))
    assert "not with gymnasium: call gymnasium.register('NoSuchGymEnv-v0'" in unregistered.missing()


def test_a_task_registered_without_an_expert_says_how_to_add_one(monkeypatch):
    from sim import expert_for

    bare = dataclasses.replace(TASKS.get("FetchReach-v4").task, env_id="FetchReach-v3")
    # as sim.register_task(bare) would, for this test only
    monkeypatch.setitem(TASKS._entries, "FetchReach-v3", sim.TaskEntry(bare, expert=None))
    with pytest.raises(
        TypeError, match=r"no scripted expert for FetchReach-v3: .*sim.register_task\(task, expert="
    ):
        expert_for(bare.env_id)


def test_a_box_observation_is_sliced_as_observation():
    env = SuccessAdapter(gym.make("CartPole-v1"), "balance", state_parts=[("pole", "observation", 2, 4)])
    obs, _ = env.reset(seed=0)
    np.testing.assert_array_equal(obs["state"], env.unwrapped.state[2:4].astype(np.float32))
    assert env.state_layout == {"pole": slice(0, 2)} and env.proprio_dim == 2
    with pytest.raises(ValueError, match="one Box, not a Dict; call it 'observation'"):
        SuccessAdapter(gym.make("CartPole-v1"), "balance", state_parts=[("pole", "obs", 2, 4)])
