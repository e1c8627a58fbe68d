"""The MuJoCo tasks: gymnasium API, spaces, determinism, instructions, randomisation and faults."""

import re
import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import sim

TASK_IDS = sim.arm_task_ids()


def rollout(env, seed, actions):
    obs, _ = env.reset(seed=seed)
    states = [obs["state"]]
    for action in actions:
        obs, *_ = env.step(action)
        states.append(obs["state"])
    return np.stack(states)


@pytest.mark.needs_rendering  # check_env also renders every mode in the env's metadata
@pytest.mark.parametrize("task", TASK_IDS)
@pytest.mark.parametrize("options", [{}, {"randomize": True, "distractors": 2}])
def test_env_checker_state(task, options):
    env = gym.make(task, **options).unwrapped
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Box observation space (minimum|maximum) value.*")
        check_env(env)
    env.close()


@pytest.mark.needs_rendering
@pytest.mark.parametrize("task", TASK_IDS)
@pytest.mark.parametrize("obs_mode", ["rgb", "state+rgb"])
def test_env_checker_images(task, obs_mode):
    env = gym.make(task, obs_mode=obs_mode, render_mode="rgb_array", image_size=64).unwrapped
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Box observation space (minimum|maximum) value.*")
        check_env(env)
    obs, _ = env.reset(seed=0)
    assert obs["image"].shape == (64, 64, 3) and obs["image"].dtype == np.uint8
    assert obs["image"].std() > 5, "the camera image should show a scene, not a flat colour"
    if obs_mode == "rgb":
        assert set(obs) == {"image", "proprio"} and obs["proprio"].shape == (env.proprio_dim,)
    np.testing.assert_array_equal(env.render(), obs["image"])
    env.close()


@pytest.mark.parametrize("task", TASK_IDS)
def test_spaces_match_what_is_returned(task):
    env = gym.make(task)
    obs, info = env.reset(seed=1)
    assert env.observation_space.contains(obs)
    assert env.action_space.shape == (5,) and (env.action_space.low == -1).all()
    obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
    assert env.observation_space.contains(obs)
    assert reward in (0.0, 1.0) and isinstance(terminated, bool) and isinstance(truncated, bool)
    assert {"is_success", "instruction", "unstable"} <= set(info)
    layout = env.unwrapped.state_layout
    assert list(layout)[:4] == ["ee_pos", "ee_yaw", "ee_vel", "gripper"]
    assert max(part.stop for part in layout.values()) == obs["state"].shape[0]


@pytest.mark.parametrize("task", TASK_IDS)
def test_reset_is_deterministic_per_seed(task):
    env = gym.make(task, distractors=1)
    actions = np.random.default_rng(0).uniform(-1, 1, size=(8, 5))
    first, again = rollout(env, 7, actions), rollout(env, 7, actions)
    np.testing.assert_array_equal(first, again)
    other = rollout(env, 8, actions)
    assert not np.array_equal(first[0], other[0])


def test_instructions_name_the_episode_colours():
    patterns = {
        "mmrl/Reach-v0": r"^move the gripper to the (\w+) ball$",
        "mmrl/Push-v0": r"^push the (\w+) cube onto the (\w+) circle$",
        "mmrl/PickPlace-v0": r"^put the (\w+) cube on the (\w+) pad$",
    }
    for task, pattern in patterns.items():
        env = gym.make(task)
        seen = set()
        for seed in range(12):
            _, info = env.reset(seed=seed)
            match = re.match(pattern, info["instruction"])
            assert match, info["instruction"]
            assert all(colour in sim.env.PALETTE for colour in match.groups())
            assert len(set(match.groups())) == len(match.groups()), "cube and target differ in colour"
            assert env.unwrapped.instruction == info["instruction"]
            _, _, _, _, step_info = env.step(np.zeros(5))
            assert step_info["instruction"] == info["instruction"]
            seen.add(info["instruction"])
        assert len(seen) > 3, "the variant should change from seed to seed"


def test_named_colour_is_the_rendered_colour_of_the_target():
    env = gym.make("mmrl/PickPlace-v0", distractors=2).unwrapped
    env.reset(seed=3)
    cube_colour, pad_colour = env.instruction.split()[2], env.instruction.split()[-2]
    rgba = env.model.geom_rgba
    np.testing.assert_allclose(rgba[env.model.geom("cube0").id, :3], sim.env.PALETTE[cube_colour])
    np.testing.assert_allclose(rgba[env.model.geom("pad0").id, :3], sim.env.PALETTE[pad_colour])


def test_success_terminates_with_reward_one():
    env = gym.make("mmrl/Reach-v0")
    obs, _ = env.reset(seed=0)
    env.unwrapped.marker("target0")[:] = env.unwrapped.ee_pos  # put the goal at the gripper
    obs, reward, terminated, truncated, info = env.step(np.zeros(5))
    assert info["is_success"] and reward == 1.0 and terminated and not truncated


def test_episode_length_limit_truncates():
    env = gym.make("mmrl/Reach-v0")
    env.reset(seed=0)
    env.unwrapped.marker("target0")[:] = (0.2, -0.15, 0.05)
    for _ in range(sim.ReachEnv.max_episode_steps):
        *_, terminated, truncated, info = env.step(np.array([-1.0, 1.0, 1.0, 0.0, 0.0]))
    assert truncated and not terminated and not info["is_success"]


def test_domain_randomisation_is_deterministic_per_seed():
    def params(env, seed):
        env.reset(seed=seed)
        m = env.unwrapped.model
        return np.concatenate(
            [
                m.geom_friction[:, 0],
                m.body_mass,
                m.geom_rgba.ravel(),
                m.cam_pos.ravel(),
                m.cam_quat.ravel(),
                m.light_diffuse.ravel(),
            ]
        )

    plain = gym.make("mmrl/PickPlace-v0")
    randomized = gym.make("mmrl/PickPlace-v0", randomize=True)
    nominal = params(plain, 0)
    first = params(randomized, 0)
    assert not np.allclose(first, nominal)
    np.testing.assert_array_equal(first, params(randomized, 0))
    assert not np.allclose(first, params(randomized, 1))
    m = randomized.unwrapped.model
    assert abs(m.body_mass[m.body("cube0").id] - 0.05) <= 0.05 * 0.3 + 1e-9
    np.testing.assert_array_equal(params(plain, 1)[: m.ngeom], nominal[: m.ngeom])  # off: nominal friction


@pytest.mark.parametrize("inject", ["nan", "huge"])
def test_unstable_simulation_ends_episode_as_failure(inject, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # MuJoCo logs its own warning to ./MUJOCO_LOG.TXT
    env = gym.make("mmrl/PickPlace-v0")
    env.reset(seed=0)
    data = env.unwrapped.data
    cube_dof = env.unwrapped._cube_v
    data.qvel[cube_dof] = np.nan if inject == "nan" else 1e4
    with pytest.warns(RuntimeWarning, match="unstable"):
        obs, reward, terminated, truncated, info = env.step(np.zeros(5))
    assert info["unstable"] and terminated and reward == 0.0 and not info["is_success"]
    assert np.isfinite(obs["state"]).all()
    obs, info = env.reset(seed=1)  # the run goes on
    assert not info["unstable"] and np.isfinite(obs["state"]).all()


def test_unknown_task_and_missing_mjcf_have_clear_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unknown sim task 'PickPlase'.*mmrl/PickPlace-v0.*Did you mean"):
        sim.make("PickPlase")
    with pytest.raises(gym.error.Error, match="mmrl/Stack-v0|Stack"):
        gym.make("mmrl/Stack-v0")
    with pytest.raises(FileNotFoundError, match="MJCF file not found: .*nowhere.xml"):
        sim.make("Push", scene_xml=tmp_path / "nowhere.xml")
    broken = tmp_path / "broken.xml"
    broken.write_text("<mujoco><worldbody><geom type='nonsense'/></worldbody></mujoco>")
    with pytest.raises(ValueError, match="could not compile MJCF .*broken.xml"):
        sim.make("Push", scene_xml=broken)
    with pytest.raises(ValueError, match="obs_mode='pixels'"):
        sim.make("Push", obs_mode="pixels")


def test_short_names_resolve():
    assert sim.task_id("PickPlace") == "mmrl/PickPlace-v0"
    assert sim.task_id("Reach-v0") == "mmrl/Reach-v0"
    assert sim.make("Push").spec.id == "mmrl/Push-v0"
