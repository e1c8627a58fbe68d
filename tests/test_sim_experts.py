"""Scripted experts solve the tasks, and take over from states a clumsy policy left behind."""

import numpy as np
import pytest

import sim
from sim.experts import cube_yaw, expert_for


def run_expert(env, seed, random_steps=0):
    """`random_steps` random actions (a straying policy), then the expert to the end: (success, length)."""
    expert = expert_for(env)
    rng = np.random.default_rng(seed)
    env.reset(seed=seed)
    for t in range(1, 1000):
        action = rng.uniform(-1, 1, 5) if t <= random_steps else expert.act(env)
        _, _, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            return info["is_success"], t
    raise AssertionError("the time limit should have ended the episode")


@pytest.mark.parametrize(("task", "needed"), [("Reach", 10), ("Push", 9), ("PickPlace", 8)])
def test_expert_solves_seeded_episodes(task, needed):
    env = sim.make(task)
    results = [run_expert(env, seed) for seed in range(10)]
    assert sum(ok for ok, _ in results) >= needed, results


@pytest.mark.parametrize("task", ["Push", "PickPlace"])
def test_expert_takes_over_mid_episode(task):
    env = sim.make(task, distractors=1, randomize=True)
    results = [run_expert(env, seed, random_steps=15) for seed in range(5)]
    assert sum(ok for ok, _ in results) >= 4, results


def test_expert_is_a_function_of_the_state():
    env = sim.make("PickPlace")
    obs, _ = env.reset(seed=4)
    expert = expert_for("mmrl/PickPlace-v0")
    single = expert(obs["state"])
    assert single.shape == (5,) and single.dtype == np.float32 and np.abs(single).max() <= 1
    np.testing.assert_array_equal(expert(obs["state"]), single)
    batch = expert(np.stack([obs["state"]] * 3))
    assert batch.shape == (3, 5) and np.array_equal(batch[1], single)


def test_release_fails_while_the_cube_is_carried_away_from_the_pad():
    env = sim.make("PickPlace")
    expert = expert_for(env)
    env.reset(seed=2)
    fails, commands = [], []
    for _ in range(100):
        state = env.get_wrapper_attr("get_state")()
        fails.append(expert.release_fails(state))
        action = expert(state)
        commands.append(action[-1])
        *_, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            break
    assert info["is_success"]
    fails, commands = np.array(fails), np.array(commands)
    # false before the grasp and once the cube is over the pad; true through the carry in between
    assert not fails[0] and not fails[-1] and fails.sum() >= 5
    carry = np.flatnonzero(fails)
    assert np.all(np.diff(carry) == 1), "one carry phase"
    assert np.all(commands[fails] > 0), "the expert itself never opens where a release fails"


def test_cube_yaw_folds_to_a_quarter_turn():
    for yaw in (0.3, 0.3 + np.pi / 2, 0.3 - np.pi, -0.7):
        quat = np.array([np.cos(yaw / 2), 0, 0, np.sin(yaw / 2)])
        folded = cube_yaw(quat)
        assert -np.pi / 4 <= folded <= np.pi / 4
        assert np.isclose(np.cos(4 * folded), np.cos(4 * yaw))


def test_no_expert_for_unknown_task():
    with pytest.raises(ValueError, match="unknown sim task"):
        expert_for("Stack")
