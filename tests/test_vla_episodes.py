"""The robot's episode loop and its supervisor: the take-over rules step by step (evaluation's consecutive
straying steps, training's window mean, the deadline, the release guard), the loop on a toy env (who
drives each step, hand-backs, action noise, waves, dataset order), and on the sim tasks a recording equal
to the loop it replaced and a guarded release handed to the expert."""

import importlib.util

import numpy as np
import pytest
import torch

if importlib.util.find_spec("gymnasium") is None:
    pytest.skip("the robot extra (gymnasium) is not installed", allow_module_level=True)

import gymnasium as gym  # noqa: E402

from vla_rl.dataset import RobotDataset  # noqa: E402
from vla_rl.episodes import Controller, Recorder, run_episodes  # noqa: E402
from vla_rl.lerobot_format import ACTION_KEY, STATE_KEY, DatasetWriter  # noqa: E402
from vla_rl.recording import DatasetFrames  # noqa: E402
from vla_rl.supervisor import Supervisor, TakeoverRule, action_gap  # noqa: E402

AWAY = np.array([1.0, 0, 0, 0, 1.0], np.float32)  # the toy policy's step away from home
TOWARD = np.array([-1.0, 0, 0, 0, 1.0], np.float32)  # the toy expert's step from x >= 1
OPEN = np.array([0, 0, 0, 0, -1.0], np.float32)
STRAY = action_gap(AWAY, TOWARD)  # sqrt(4 / 5)


class Line(gym.Env):
    """A point on a line, x = seed % 5 at reset; action[0] moves it; the episode succeeds (terminates)
    at x == 0 and is cut after `limit` steps."""

    action_space = gym.spaces.Box(-1.0, 1.0, (5,), np.float32)
    observation_space = gym.spaces.Dict({"state": gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)})
    metadata = {"render_fps": 10}

    def __init__(self, limit: int = 6) -> None:
        self.limit = limit

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.x, self.t, self.seed = float(seed % 5), 0, seed
        return {"state": self.get_state()}, {"instruction": f"go home from {seed}"}

    def step(self, action):
        self.x, self.t = self.x + float(action[0]), self.t + 1
        success = abs(self.x) < 1e-6
        info = {"is_success": success, "instruction": f"go home from {self.seed}"}
        return {"state": self.get_state()}, 0.0, success, self.t >= self.limit and not success, info

    def get_state(self) -> np.ndarray:
        return np.array([self.x, self.t], np.float32)


class Home:
    """The toy expert: one step toward x = 0 (gripper closed); a release fails beyond x = 4."""

    def __call__(self, state):
        return np.array([np.clip(-state[0], -1, 1), 0, 0, 0, 1.0], np.float32)

    def act(self, env):
        return self(env.get_wrapper_attr("get_state")())

    def release_fails(self, state) -> bool:
        return bool(state[0] > 4)


class Script(Controller):
    """Proposes actions[t] at step t of the (one) episode, counting hand-backs."""

    def __init__(self, *actions):
        self.actions, self.t, self.hand_backs = list(actions), 0, 0

    def start(self, size):
        self.t = 0

    def propose(self, obs, instructions, rows):
        action = self.actions[min(self.t, len(self.actions) - 1)]
        self.t += 1
        return np.tile(action, (len(obs), 1))

    def hand_back(self, j):
        self.hand_backs += 1


class Steps(Recorder):
    """Every step of every episode, by episode."""

    def __init__(self):
        self.steps = {}

    def step(self, k, env, step):
        self.steps.setdefault(k, []).append(step)


def drivers(controller, rule, seed=3, limit=6):
    """Who drove each step of one Line episode (True: the expert), and its outcome."""
    steps = Steps()
    (outcome,) = run_episodes(
        [Line(limit)], [seed], controller, expert=Home(), takeover=rule, recorders=[steps]
    )
    return [s.by_expert for s in steps.steps[0]], outcome


# ----- the rules, step by step ------------------------------------------------------------------


def test_consecutive_rule_fires_at_the_patience_th_straying_step_and_drives_it():
    sup = Supervisor(TakeoverRule(threshold=0.5, takeover_steps=2, patience=3), 1)
    assert STRAY > 0.5
    assert not sup.before_policy_step(0, AWAY, TOWARD, False)
    assert not sup.before_policy_step(0, AWAY, TOWARD, False)
    assert not sup.before_policy_step(0, TOWARD, TOWARD, False)  # a good step starts the count afresh
    assert not sup.before_policy_step(0, AWAY, TOWARD, False)
    assert not sup.before_policy_step(0, AWAY, TOWARD, False)
    assert sup.before_policy_step(0, AWAY, TOWARD, False) and sup.expert_drives(0)  # the third in a row
    assert not sup.after_expert_step(0) and sup.after_expert_step(0) and not sup.expert_drives(0)
    assert sup.count[0] == 1
    assert not sup.before_policy_step(0, AWAY, TOWARD, False)  # counting starts afresh after a take-over
    # a gap exactly at the threshold does not stray
    at = Supervisor(TakeoverRule(threshold=STRAY, takeover_steps=2, patience=1), 1)
    assert not at.before_policy_step(0, AWAY, TOWARD, False)
    assert not at.after_policy_step(0, 1, AWAY, TOWARD)  # the window rule is off


def test_window_rule_fires_on_the_mean_gap_from_the_next_step():
    rule = TakeoverRule(threshold=0.5, takeover_steps=2, window=3, max_per_episode=1)
    sup = Supervisor(rule, 1)
    expert = np.zeros(5)
    assert not sup.before_policy_step(0, np.ones(5), expert, False)  # no patience: never before a step
    assert not sup.after_policy_step(0, 1, np.ones(5), expert)  # window not full yet
    assert not sup.after_policy_step(0, 2, np.zeros(5), expert)
    assert sup.after_policy_step(0, 3, np.ones(5), expert)  # mean RMS gap 2/3 > 0.5
    assert sup.expert_drives(0) and not sup.after_expert_step(0) and sup.after_expert_step(0)
    for step in range(4, 10):  # at most one take-over per episode here
        assert not sup.after_policy_step(0, step, np.ones(5), expert)
    sup.reset(0)
    assert sup.count[0] == 0 and not sup.after_policy_step(0, 1, np.ones(5), expert)
    calm = Supervisor(TakeoverRule(threshold=0.5, takeover_steps=2, window=3), 1)
    for step in range(1, 10):  # mean gap 1/3 in every full window
        assert not calm.after_policy_step(0, step, np.ones(5) if step % 3 == 0 else np.zeros(5), expert)


def test_deadline_takes_over_once():
    sup = Supervisor(
        TakeoverRule(threshold=0.5, takeover_steps=1, window=3, deadline=2, max_per_episode=3), 1
    )
    expert = np.zeros(5)
    assert not sup.after_policy_step(0, 1, expert, expert) and sup.after_policy_step(0, 2, expert, expert)
    assert sup.after_expert_step(0)
    assert not sup.after_policy_step(0, 4, expert, expert)  # once per episode


def test_release_guard_vetoes_an_opening_away_from_the_pad():
    closes = np.array([0, 0, 0, 0, 1.0])
    sup = Supervisor(
        TakeoverRule(threshold=10.0, takeover_steps=2, window=8, max_per_episode=1, release_guard=True), 1
    )
    assert not sup.before_policy_step(0, closes, closes, release_fails=True)  # keeps holding
    assert not sup.before_policy_step(0, OPEN, OPEN, release_fails=False)  # a release that does not lose
    assert sup.before_policy_step(0, OPEN, OPEN, release_fails=True) and sup.expert_drives(0)
    assert not sup.after_expert_step(0) and sup.after_expert_step(0)
    assert not sup.before_policy_step(0, OPEN, OPEN, release_fails=True)  # max_per_episode reached
    unguarded = Supervisor(TakeoverRule(threshold=10.0, takeover_steps=2, window=8), 1)
    assert not unguarded.before_policy_step(0, OPEN, OPEN, release_fails=True)
    # the evaluation rule may carry the guard too
    guarded = Supervisor(TakeoverRule(threshold=10.0, takeover_steps=2, patience=3, release_guard=True), 1)
    assert guarded.before_policy_step(0, OPEN, OPEN, release_fails=True)


def test_a_rule_needs_takeover_steps():
    with pytest.raises(ValueError, match="takeover_steps"):
        TakeoverRule(threshold=0.5, takeover_steps=0, patience=3)


# ----- the loop on a toy env --------------------------------------------------------------------


def test_the_consecutive_rule_in_the_loop_replaces_the_straying_step():
    # patience 2: step 2 is the second straying step, and the expert drives it and the next one
    by_expert, outcome = drivers(Script(AWAY), TakeoverRule(threshold=0.5, takeover_steps=2, patience=2))
    assert by_expert == [False, True, True, False, True, True]
    assert (outcome.interventions, outcome.expert_steps, outcome.steps) == (2, 4, 6)
    # patience - 1 straying steps, then a step the expert agrees with, again and again: never
    script = Script(AWAY, TOWARD, AWAY, TOWARD, AWAY, TOWARD)
    by_expert, outcome = drivers(script, TakeoverRule(threshold=0.5, takeover_steps=2, patience=2))
    assert not any(by_expert) and outcome.interventions == 0


def test_the_window_rule_in_the_loop_lets_the_straying_step_run():
    controller = Script(AWAY)
    by_expert, outcome = drivers(controller, TakeoverRule(threshold=0.5, takeover_steps=2, window=2))
    assert by_expert == [False, False, True, True, False, False]
    assert outcome.interventions == 1 and controller.hand_backs == 1  # the policy starts a fresh chunk
    by_expert, _ = drivers(Script(AWAY), None)
    assert not any(by_expert)


def test_the_guard_in_the_loop_stops_the_opening_before_it_runs():
    steps = Steps()
    rule = TakeoverRule(threshold=10.0, takeover_steps=1, window=8, release_guard=True)
    script = Script(AWAY, AWAY, OPEN)  # from x = 3: x = 4, 5, then an opening beyond x = 4
    run_episodes([Line()], [3], script, expert=Home(), takeover=rule, recorders=[steps])
    episode = steps.steps[0]
    assert [s.by_expert for s in episode[:4]] == [False, False, True, False]
    np.testing.assert_array_equal(episode[2].action, TOWARD)  # the expert's step ran, not the opening
    assert episode[2].obs["state"][0] == 5.0 and episode[3].obs["state"][0] == 4.0


def test_without_a_controller_the_expert_drives_every_step():
    steps = Steps()
    (outcome,) = run_episodes([Line()], [3], None, expert=Home(), recorders=[steps])
    assert outcome.success and outcome.steps == outcome.expert_steps == 3 and outcome.interventions == 0
    assert all(s.by_expert and s.chunk_index == -1 for s in steps.steps[0])
    with pytest.raises(ValueError, match="pass expert"):
        run_episodes([Line()], [3], None)


def test_action_noise_perturbs_the_executed_action_and_repeats_per_seed():
    steps = Steps()
    run_episodes([Line(limit=4)], [3], Script(AWAY), action_noise=0.1, recorders=[steps])
    rng = np.random.default_rng(3)  # episode k's noise is drawn from its reset seed
    for step in steps.steps[0]:
        np.testing.assert_array_equal(step.action, AWAY)  # the label stays clean
        expected = np.clip(AWAY + rng.normal(0.0, 0.1, 5), -1, 1).astype(np.float32)
        np.testing.assert_array_equal(step.executed, expected)
        assert step.next_obs["state"][0] == pytest.approx(step.obs["state"][0] + expected[0], abs=1e-5)


def test_waves_keep_the_seeds_order_and_a_dataset_saves_episodes_in_it(tmp_path):
    seeds = [4, 1, 3, 0, 2]  # the expert needs 4, 1, 3, 1, 2 steps: episodes end out of order
    features = {
        STATE_KEY: {"dtype": "float32", "shape": [2], "names": None},
        ACTION_KEY: {"dtype": "float32", "shape": [5], "names": None},
    }
    ended = []

    class Order(Recorder):
        def end(self, k, outcome):
            ended.append(k)

    with DatasetWriter(tmp_path / "toy", 10, features) as writer:
        outcomes = run_episodes(
            [Line(), Line()], seeds, None, expert=Home(), recorders=[DatasetFrames(writer), Order()]
        )
    assert [o.seed for o in outcomes] == seeds and [o.steps for o in outcomes] == [4, 1, 3, 1, 2]
    assert ended == [1, 0, 3, 2, 4]
    dataset = RobotDataset(tmp_path / "toy")
    assert [dataset.episode(i)["task"] for i in range(5)] == [f"go home from {s}" for s in seeds]
    assert [e["length"] for e in dataset.episodes] == [4, 1, 3, 1, 2]
    assert all(e["source"] == "expert" for e in dataset.episodes)


# ----- on the sim tasks -------------------------------------------------------------------------


@pytest.mark.needs_robot
def test_a_recording_equals_the_loop_it_replaced(tmp_path):
    """The old recording loop, written out: one env, reset with seed + k, the expert's action recorded,
    the action plus noise from default_rng(seed + k) executed."""
    import sim
    from sim import expert_for
    from vla_rl.recording import record_episodes

    dataset = record_episodes("PickPlace", None, 2, 5, tmp_path / "demos", action_noise=0.1)
    env = sim.make("PickPlace")
    expert = expert_for(env)
    for k in range(2):
        obs, _ = env.reset(seed=5 + k)
        noise = np.random.default_rng(5 + k)
        states, actions, done = [], [], False
        while not done:
            action = expert.act(env)
            states.append(obs["state"])
            actions.append(action)
            action = np.clip(action + noise.normal(0.0, 0.1, np.shape(action)), -1, 1).astype(np.float32)
            obs, _, terminated, truncated, info = env.step(action)
            done = terminated or truncated
        episode = dataset.episode(k)
        np.testing.assert_array_equal(episode[STATE_KEY].numpy(), np.stack(states))
        np.testing.assert_array_equal(episode[ACTION_KEY].numpy(), np.stack(actions))
        assert dataset.episodes[k]["success"] == bool(info["is_success"])
    env.close()


@pytest.mark.needs_rendering
def test_training_rollouts_hand_a_guarded_release_to_the_expert_before_it_runs(monkeypatch):
    """A policy step that would open the gripper where a release fails is never executed: the expert
    drives from that step on. Every release is made to fail here, so the first sampled opening (about
    half of a random policy's gripper entries) is where each take-over starts."""
    import sim
    from sim import expert_for
    from sim.experts import PickPlaceExpert
    from vla_rl.online import rollouts
    from vla_rl.policy import VLAConfig, VLAPolicy, task_vocabulary

    monkeypatch.setattr(PickPlaceExpert, "release_fails", lambda self, state: True)
    torch.manual_seed(0)
    config = VLAConfig(vocabulary=task_vocabulary(), image_size=32, channels=[8, 8], keypoints=8, hidden=32,
                       horizon=4, n_action_steps=2)  # fmt: skip
    policy, expert = VLAPolicy(config).eval(), expert_for("PickPlace")
    envs = [
        sim.make("PickPlace", obs_mode="state+rgb", image_size=32, max_episode_steps=16) for _ in range(3)
    ]

    def run(release_guard):
        rule = TakeoverRule(100.0, 3, window=8, max_per_episode=1, release_guard=release_guard)
        return rollouts(policy, envs, expert, [0, 1, 2], [0, 1, 2], rule, torch.Generator().manual_seed(0))

    unguarded = run(False)
    assert not any(e.is_intervention.any() for e in unguarded)  # never strays at threshold 100
    assert all(e.chunk_step.tolist() == [0, 1] * 8 for e in unguarded)  # 2 of every 4-action chunk
    for episode in run(True):
        flags = episode.is_intervention
        start = int(np.argmax(flags))
        assert flags[start] and flags[start : start + 3].all() and flags.sum() == 3  # one take-over
        assert (episode.chunk_step[flags] == -1).all() and episode.interventions == 1
        assert (episode.actions[:start, -1] >= 0).all()  # no opening ran before it
        np.testing.assert_allclose(episode.actions[start], expert(episode.states[start]), atol=1e-6)
        if start + 3 < episode.length:  # back to the policy with a fresh chunk
            assert episode.chunk_step[start + 3] == 0
    for env in envs:
        env.close()
