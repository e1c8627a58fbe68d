"""Scripted experts solve the tasks, and take over from states a clumsy policy left behind."""

import numpy as np
import pytest

import sim
from sim import expert_for
from sim.experts import cube_yaw


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


def test_pick_place_failures_are_named_by_phase():
    """`failure` reads the phase from the visited states: cut and edited from an expert episode."""
    env = sim.make("PickPlace")
    expert = expert_for(env)
    env.reset(seed=2)
    states = [env.get_wrapper_attr("get_state")()]
    for _ in range(100):
        *_, terminated, truncated, _ = env.step(expert(states[-1]))
        states.append(env.get_wrapper_attr("get_state")())
        if terminated or truncated:
            break
    states = np.stack(states)
    held = np.array([expert.held(expert.parts(s)) for s in states])
    first_held = int(np.argmax(held))
    assert held.any() and not held[0]
    parts = expert.layout

    def edited(state, name, value):
        state = state.copy()
        state[parts[name]] = value
        return state

    assert expert.failure(states[:1]) == "never held the cube"
    assert expert.failure(states[: first_held + 3]) == "still holding the cube"
    dropped = edited(states[first_held + 2], "gripper", 0.04)  # the fingers opened mid-carry
    lost = expert.failure(np.vstack([states[: first_held + 2], dropped]))
    assert lost == "held the cube, lost it off the pad"
    # above the cube, before lowering: the expert has turned the wrist to the cube's faces by then
    s = [expert.parts(x) for x in states[:first_held]]
    above = max(
        t
        for t in range(first_held)
        if s[t]["ee_pos"][2] > s[t]["cube_pos"][2] + 0.04
        and np.linalg.norm(s[t]["ee_pos"][:2] - s[t]["cube_pos"][:2]) < 0.02
    )
    assert expert.failure(states[: above + 1]) == "waits above the cube"
    turned = edited(states[above], "ee_yaw", s[above]["ee_yaw"] + 0.5)
    assert expert.failure(np.vstack([states[:above], turned])) == "waits above the cube, wrist not turned"
    assert expert_for("Reach").failure(states) is None  # tasks without named failure modes
