"""HABC online fine-tuning: gate and advantage math, clipped weights, intervention-aware credit,
every method end to end on a tiny policy, exact resume, config errors."""

import json
import math

import numpy as np
import pytest
import torch
from pinned_runs import metric_rows

import sim
from mmrl.config import ConfigError, load_config
from vla_rl.curves import episodes_to, plot_success, success_curve
from vla_rl.dataset import RobotDataset
from vla_rl.lerobot_format import IMAGE_KEY, STATE_KEY
from vla_rl.methods.grpo import update_grpo
from vla_rl.methods.habc import (
    Gate,
    Head,
    chunk_advantage,
    efficiency_rewards,
    gate,
    habc_advantages,
    head_rows,
    segment_returns,
    viability_rewards,
)
from vla_rl.methods.weighting import Weighting, advantage_weights, executed_chunks, spread_over_chunks
from vla_rl.online import Transitions
from vla_rl.policy import VLAConfig, VLAPolicy, task_vocabulary
from vla_rl.pretrain import frame_tensors
from vla_rl.recording import record_episodes
from vla_rl.replay_buffer import ReplayBuffer
from vla_rl.trainer import VLAOnlineTrainer

SIZE = 32
TINY = [
    "rollout.task=Reach",
    "rollout.env_steps=30",
    "rollout.num_envs=2",
    "rollout.max_episode_steps=20",
    "steps=2",
    "checkpoint_every=1",
    "progress=false",
    "eval.episodes=2",
    "eval.num_envs=2",
    "train.updates=2",
    "train.batch_size=8",
    "critic.updates=3",
    "critic.batch_size=16",
    "intervention.window=3",
    "intervention.threshold=0.4",
    "intervention.takeover_steps=4",
    "train.demo_episodes=0",  # the recipes record and mix in the base's demonstrations; these tests have none
]


def tiny_config(**overrides) -> VLAConfig:
    """The tests' small policy: two conv layers, 8 keypoints, chunks of 4 with 2 executed."""
    return VLAConfig(vocabulary=task_vocabulary(), image_size=SIZE, channels=[8, 8], keypoints=8,
                     hidden=32, horizon=4, n_action_steps=2, **overrides)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_policy_dir(tmp_path_factory):
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("policy")
    VLAPolicy(tiny_config()).save_pretrained(directory)
    return directory


def run(output_dir, policy_dir, *overrides):
    config = load_config(
        "vla/habc", [f"output_dir={output_dir}", f"model.path={policy_dir}", *TINY, *overrides]
    )
    trainer = VLAOnlineTrainer(config)
    return trainer, trainer.train()


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ----- math ------------------------------------------------------------------------------------


def test_gate_and_habc_advantages_on_hand_made_tensors():
    v, v_next = torch.tensor([0.2, 0.8, 0.5]), torch.tensor([0.3, 0.9, 0.5])
    r_v, done_v = torch.tensor([0.0, 1.0, 0.0]), torch.tensor([False, True, False])
    e, e_next = torch.tensor([-0.5, -0.1, -0.3]), torch.tensor([-0.4, 0.0, -0.3])
    r_e, done_e = torch.full((3,), -0.02), torch.tensor([False, True, False])
    out = habc_advantages(
        Head(r_v, v, v_next, done_v, 0.9), Head(r_e, e, e_next, done_e, 0.98), Gate(10.0, 0.5)
    )
    a_v = torch.tensor([0.9 * 0.3 - 0.2, 1.0 - 0.8, 0.9 * 0.5 - 0.5])
    a_e = torch.tensor([-0.02 + 0.98 * -0.4 + 0.5, -0.02 + 0.1, -0.02 + 0.98 * -0.3 + 0.3])
    g = torch.tensor([1 / (1 + math.exp(3.0)), 1 / (1 + math.exp(-3.0)), 0.5])
    torch.testing.assert_close(out.a_v, a_v)
    torch.testing.assert_close(out.a_e, a_e)
    torch.testing.assert_close(out.gate, g)
    torch.testing.assert_close(out.advantage, (1 - g) * a_v + g * a_e)
    # the gate: viability first while success is uncertain, efficiency once it is likely
    assert gate(torch.tensor([0.0]), 50.0, 0.5) < 1e-6 and gate(torch.tensor([1.0]), 50.0, 0.5) > 1 - 1e-6


def test_each_ablation_takes_its_part_out_of_the_mix():
    v, v_next = torch.tensor([0.2, 0.8, 0.5]), torch.tensor([0.3, 0.9, 0.5])
    heads = (
        Head(torch.tensor([0.0, 1.0, 0.0]), v, v_next, torch.tensor([False, True, False]), 0.9),
        Head(
            torch.full((3,), -0.02),
            torch.tensor([-0.5, -0.1, -0.3]),
            torch.tensor([-0.4, 0.0, -0.3]),
            torch.tensor([False, True, False]),
            0.98,
        ),
    )
    full = habc_advantages(*heads, Gate(10.0, 0.5))
    for ablate, expected in (
        ("viability_critic", full.a_e),  # the efficiency advantage alone
        ("efficiency_critic", full.a_v),  # the viability advantage alone
        ("gate", (full.a_v + full.a_e) / 2),  # the same even mix in every state
    ):
        out = habc_advantages(*heads, Gate(10.0, 0.5, frozenset({ablate})))
        torch.testing.assert_close(out.advantage, expected)
        torch.testing.assert_close(out.a_v, full.a_v)
        torch.testing.assert_close(out.a_e, full.a_e)
    assert not torch.allclose(full.advantage, (full.a_v + full.a_e) / 2)  # the gate does vary by state


def test_weights_are_exp_beta_a_clipped_at_w_max():
    a = torch.tensor([-1.0, 0.0, 0.1, 10.0, 1e4])
    w = advantage_weights(a, Weighting(beta=5.0, w_max=20.0))
    torch.testing.assert_close(w, torch.tensor([math.exp(-5.0), 1.0, math.exp(0.5), 20.0, 20.0]))
    assert torch.isfinite(w).all() and w.max() <= 20.0


def toy_transitions() -> Transitions:
    """Episode 0: policy 4 steps, expert 3, policy 2, success. Episode 1: policy 3 steps, time limit
    without success. Episode 2: policy 2 steps, success on its own. The policy executes 3 actions of
    each sampled chunk (fewer when the expert takes over or the episode ends). Rows: ep0's policy
    segments (0-3, 4-5), ep1 (6-8), ep2 (9-10), then ep0's intervention segment (11-13)."""
    buffer, lengths = ReplayBuffer(100), {}
    for flags, success in (([0] * 4 + [1] * 3 + [0] * 2, True), ([0] * 3, False), ([0] * 2, True)):
        steps = len(flags)
        obs = {
            STATE_KEY: np.arange((steps + 1) * 3, dtype=np.float32).reshape(steps + 1, 3),
            IMAGE_KEY: np.zeros((steps + 1, 4, 4, 3), np.uint8),
        }
        chunk_step = {9: [0, 1, 2, 0, -1, -1, -1, 0, 1], 3: [0, 1, 2], 2: [0, 1]}[steps]
        episode = buffer.add_episode(
            obs, np.zeros((steps, 5)), success, "reach", np.array(flags, bool), chunk_step=chunk_step
        )
        lengths[episode] = steps
    return Transitions.from_buffer(buffer, lengths)


def test_intervention_aware_credit_reaches_only_policy_segments():
    tr = toy_transitions()
    # rows: policy segments (ep0 steps 0-3, ep0 steps 7-8, ep1, ep2), then the intervention segment
    assert tr.intervention.tolist() == [False] * 11 + [True] * 3
    r_v, done_v = viability_rewards(tr)
    # the policy segment that handed over gets 0 although its episode succeeded; the final ones get
    # their episode's outcome; the expert's steps get nothing
    assert r_v.tolist() == [0, 0, 0, 0] + [0, 1] + [0, 0, 0] + [0, 1] + [0, 0, 0]
    assert done_v.tolist() == [0, 0, 0, 1] + [0, 1] + [0, 0, 1] + [0, 1] + [0, 0, 0]
    v_rows, e_rows = head_rows(tr)
    assert v_rows.tolist() == list(range(11))  # viability never trains on intervention steps
    assert e_rows.tolist() == [4, 5, 9, 10]  # efficiency: policy segments ending in the policy's success
    values = torch.full((len(tr),), 0.5)
    targets = segment_returns(Head(r_v, values, values, done_v, gamma=0.9), tr, v_rows, lam=1.0)
    torch.testing.assert_close(targets, torch.tensor([0, 0, 0, 0, 0.9, 1, 0, 0, 0, 0.9, 1]))
    r_e, done_e = efficiency_rewards(tr, gamma_e=0.5)
    assert done_e.tolist() == [0] * 5 + [1] + [0] * 4 + [1] + [0] * 3 and (r_e == -0.5).all()
    # action chunks stay inside their segment; from a policy step they hold only the actions executed
    # from the chunk sampled there, and only steps where a chunk was sampled (or the expert acted) train
    assert tr.chunk_step.tolist() == [0, 1, 2, 0, 0, 1, 0, 1, 2, 0, 1, -1, -1, -1]
    assert tr.actor_rows.tolist() == [0, 3, 4, 6, 9, 11, 12, 13]
    chunk, mask = tr.chunk_rows(torch.tensor([0, 2, 4, 11]), horizon=4)
    assert chunk.tolist() == [[0, 1, 2, 3], [2, 3, 3, 3], [4, 5, 5, 5], [11, 12, 13, 13]]
    assert mask.tolist() == [
        [True, True, True, False],  # step 3 starts a new chunk
        [True, False, False, False],
        [True, True, False, False],  # the segment ends
        [True, True, True, False],
    ]
    _, relabelled = tr.chunk_rows(torch.tensor([0, 2, 4, 11]), horizon=4, executed=False)
    assert relabelled.sum(1).tolist() == [4, 2, 2, 3]


def test_without_intervention_aware_credit_the_expert_s_success_reaches_the_policy():
    tr = toy_transitions()
    r_v, done_v = viability_rewards(tr, credit=False)
    # the segment that handed over to the expert now ends with its episode's success
    assert r_v.tolist() == [0, 0, 0, 1] + [0, 1] + [0, 0, 0] + [0, 1] + [0, 0, 0]
    assert done_v.tolist() == viability_rewards(tr)[1].tolist()
    v_rows, e_rows = head_rows(tr, credit=False)
    assert v_rows.tolist() == list(range(11))
    assert e_rows.tolist() == [0, 1, 2, 3, 4, 5, 9, 10]  # every policy segment of a successful episode


def test_a_chunk_is_credited_with_the_discounted_advantages_of_its_executed_steps():
    tr = toy_transitions()
    decisions, rows, executed = executed_chunks(tr.chunk_step, tr.seg_left, horizon=4)
    assert decisions.tolist() == [0, 3, 4, 6, 9]  # never an expert step
    # ep0's first chunk runs 3 steps, its second is cut after 1 by the take-over; the segment after the
    # take-over and the other episodes end their chunks early
    assert [rows[d][executed[d]].tolist() for d in range(5)] == [[0, 1, 2], [3], [4, 5], [6, 7, 8], [9, 10]]
    g = 0.5
    a = chunk_advantage(torch.arange(len(tr), dtype=torch.float32), rows, executed, gamma=g)
    torch.testing.assert_close(
        a, torch.tensor([g + 2 * g**2, 3, 4 + 5 * g, 6 + 7 * g + 8 * g**2, 9 + 10 * g])
    )
    # with consistent values the one-step terms telescope to the chunk's n-step TD error
    v = torch.rand(len(tr) + 1)
    r = torch.rand(len(tr))
    step = r + g * v[1:] - v[:-1]
    n_step = r[6] + g * r[7] + g**2 * r[8] + g**3 * v[9] - v[6]
    torch.testing.assert_close(chunk_advantage(step, rows, executed, gamma=g)[3], n_step)


def test_a_decision_weight_reaches_only_the_steps_executed_from_its_chunk():
    tr = toy_transitions()
    chunks = executed_chunks(tr.chunk_step, tr.seg_left, horizon=4)
    weights = torch.full((len(tr),), -1.0)
    spread_over_chunks(weights, torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), chunks)
    # the expert's steps (11-13) were executed from no chunk and keep their weight
    assert weights.tolist() == [1, 1, 1, 2, 3, 3, 4, 4, 4, 5, 5, -1, -1, -1]


def test_success_curve_and_episodes_to_80(tmp_path):
    (tmp_path / "eval.json").write_text(
        json.dumps({"before": {"success_rate": 0.4}, "after": {"success_rate": 0.9}})
    )
    rows = [
        {"step": 1, "env_steps": 800, "episodes": 20},
        {"step": 2, "env_steps": 1600, "episodes": 41, "eval_success_rate": 0.85},
        {"step": 3, "env_steps": 2400, "episodes": 60},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    curve = success_curve(tmp_path, {"env_steps": 2400, "episodes": 60})
    assert curve == [(0, 0, 0.4), (1600, 41, 0.85), (2400, 60, 0.9)]
    assert episodes_to(curve, 0.8) == 41 and episodes_to(curve, 0.4) == 0 and episodes_to(curve, 0.95) is None
    plot_success(curve, 100, "habc", tmp_path / "success.png")
    assert (tmp_path / "success.png").stat().st_size > 1000


# ----- end to end ------------------------------------------------------------------------------


@pytest.mark.needs_rendering
@pytest.mark.parametrize("method", ["awr", "bc", "dagger", "grpo", "habc ablated"])
def test_each_baseline_runs_end_to_end(tmp_path, tiny_policy_dir, method):
    extra = ["rollout.group_size=2"] if method == "grpo" else []
    if method == "habc ablated":
        method, extra = "habc", ["habc.ablate=[gate,intervention_credit]"]
    _, result = run(tmp_path, tiny_policy_dir, f"method={method}", *extra)
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["env_steps"] >= 30 and rows[1]["env_steps"] >= rows[0]["env_steps"] + 30
    assert rows[1]["episodes"] == rows[0]["episodes"] + rows[1]["rollout_episodes"]
    assert {"success_rate", "interventions_per_episode", "actor_updates"} <= rows[1].keys()
    if method != "grpo":
        assert rows[1]["actor_updates"] == 2 and rows[1]["interventions_per_episode"] > 0
    if method == "awr":
        assert {"critic_v_loss", "weight_mean", "weight_max"} <= rows[1].keys()
    if method == "habc":  # the gate taken out: an even mix in every state
        assert rows[1]["gate_mean"] == pytest.approx(0.5)
    evaluation = json.loads((tmp_path / "eval.json").read_text())
    assert set(evaluation) == {"before", "after"} and evaluation["after"] == result
    assert VLAPolicy.from_pretrained(tmp_path / "policy").config.image_size == SIZE
    assert (tmp_path / "success.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    gifs = sorted(p.name for p in (tmp_path / "videos").iterdir())
    assert len(gifs) == 2 and all(g.startswith("seed1000000") or g.startswith("seed1000001") for g in gifs)
    summary = json.loads((tmp_path / "rollouts.json").read_text())
    assert summary["episodes"] == rows[-1]["episodes"] and "episodes_to_80" in summary


@pytest.mark.needs_rendering
def test_failed_without_takeover_counts_the_failures_the_rule_lets_through(tmp_path, tiny_policy_dir):
    # the untrained policy fails Reach: a rule that fires at any gap catches every failure, one that
    # cannot fire catches none
    run(tmp_path / "fires", tiny_policy_dir, "intervention.threshold=0.0", "steps=1")
    row = metrics(tmp_path / "fires")[0]
    assert row["interventions_per_episode"] > 0 and row["failed_without_takeover"] == 0.0
    run(tmp_path / "blind", tiny_policy_dir, "intervention.threshold=100.0", "steps=1")
    row = metrics(tmp_path / "blind")[0]
    assert row["interventions_per_episode"] == 0.0 and row["success_rate"] < 1
    assert row["failed_without_takeover"] == pytest.approx(1.0 - row["success_rate"])
    run(tmp_path / "off", tiny_policy_dir, "intervention.enabled=false", "steps=1")
    assert "failed_without_takeover" not in metrics(tmp_path / "off")[0]


@pytest.fixture(scope="module")
def reach_demos(tmp_path_factory):
    root = tmp_path_factory.mktemp("demos") / "reach"
    record_episodes("Reach", None, 2, 0, root, obs_mode="state+rgb", image_size=SIZE)
    return root


def demo_nll(policy, root):
    data = RobotDataset(root, action_horizon=policy.config.horizon)
    items = [data[i] for i in range(len(data))]
    obs = {"image": np.stack([i[IMAGE_KEY].permute(1, 2, 0).numpy() for i in items]),
           "state": np.stack([i[STATE_KEY].numpy() for i in items])}  # fmt: skip
    batch = policy.prepare(obs, [i["task"] for i in items])
    with torch.no_grad():
        logp = policy.log_prob(batch, torch.stack([i["action_chunk"] for i in items]).float(),
                               torch.stack([i["action_chunk_mask"] for i in items]))  # fmt: skip
    return -float(logp.mean())


@pytest.mark.needs_rendering
def test_per_chunk_habc_with_demonstrations_mixed_in(tmp_path, tiny_policy_dir, reach_demos):
    before = demo_nll(VLAPolicy.from_pretrained(tiny_policy_dir), reach_demos)
    trainer, _ = run(
        tmp_path, tiny_policy_dir, "actor.per_chunk=true", f"train.demos={reach_demos}",
        "train.demo_fraction=1.0", "train.updates=20", "train.lr=1e-3",
    )  # fmt: skip
    rows = metrics(tmp_path)
    assert rows[-1]["actor_updates"] == 20 and math.isfinite(rows[-1]["weight_mean"])
    # every sample came from the demonstrations, so their likelihood rose
    assert demo_nll(trainer.policy, reach_demos) < before - 1.0


@pytest.mark.needs_rendering
def test_actor_updates_keep_training_the_auxiliary_object_positions(tmp_path, reach_demos):
    torch.manual_seed(0)
    policy = VLAPolicy(tiny_config(state_index=[9, 10, 11]))
    frames = frame_tensors(RobotDataset(reach_demos), policy)
    env = sim.make("Reach")  # statistics of many episodes: the two demonstrations have two balls
    states = torch.tensor(np.stack([env.reset(seed=seed)[0]["state"] for seed in range(100)]))
    policy.set_normalization(states.mean(0), states.std(0))
    policy.save_pretrained(tmp_path / "base")

    def state_loss(policy):
        with torch.no_grad():
            return float(policy(frames).state_loss)

    losses = {}
    for weight in (0, 1):
        trainer, _ = run(
            tmp_path / f"w{weight}", tmp_path / "base", f"train.demos={reach_demos}", "train.updates=20",
            "train.lr=1e-3", f"train.state_weight={weight}",
        )  # fmt: skip
        losses[weight] = state_loss(trainer.policy)
    # the Reach ball's position (standardised) is learned only when the loss is in the actor's updates
    assert losses[1] < 0.7 * min(losses[0], state_loss(policy)), (losses, state_loss(policy))


@pytest.mark.needs_rendering
def test_demo_episodes_are_recorded_into_the_run_and_read_back_on_resume(tmp_path, tiny_policy_dir):
    trainer, _ = run(tmp_path, tiny_policy_dir, "train.demo_episodes=2", "train.demo_fraction=1.0")
    demos = RobotDataset(tmp_path / "demos")
    assert len(demos.episodes) == 2 and not (tmp_path / "demos.partial").exists()
    assert len(trainer.demo_frames["actions"]) == len(demos)  # every recorded frame is trained on
    # the expert from reset seeds 0, 1: the same frames as a recording made apart
    record_episodes("Reach", None, 2, 0, tmp_path / "apart", obs_mode="state+rgb", image_size=SIZE)
    assert (tmp_path / "demos/data").exists() and len(RobotDataset(tmp_path / "apart")) == len(demos)
    stamp = (tmp_path / "demos/meta/info.json").stat().st_mtime_ns
    run(
        tmp_path,
        tiny_policy_dir,
        "train.demo_episodes=2",
        "train.demo_fraction=1.0",
        "steps=3",
        "resume=true",
    )
    assert (tmp_path / "demos/meta/info.json").stat().st_mtime_ns == stamp  # read back, not recorded again
    with pytest.raises(ConfigError, match=r"train.demos = .* and train.demo_episodes = 2 both give"):
        load_config("vla/habc", ["train.demos=somewhere", "train.demo_episodes=2"])


@pytest.mark.needs_rendering
def test_demonstrations_that_do_not_fit_the_policy_are_named(tmp_path, tiny_policy_dir):
    root = tmp_path / "demos16"
    record_episodes("Reach", None, 1, 0, root, obs_mode="state+rgb", image_size=16)
    with pytest.raises(
        ConfigError,
        match=r"train.demos = .*demos16.* does not fit .*Reach.*image.* has shape \[16, 16, 3\]",
    ):
        run(tmp_path / "run", tiny_policy_dir, f"train.demos={root}")
    with pytest.raises(ConfigError, match=r"train.demos = .*nowhere.* is not a LeRobot dataset"):
        run(tmp_path / "run2", tiny_policy_dir, f"train.demos={tmp_path / 'nowhere'}")


@pytest.mark.needs_rendering
def test_grpo_updates_on_groups_with_mixed_outcomes(tmp_path):
    torch.manual_seed(0)
    VLAPolicy(tiny_config(state_index=[9, 10, 11])).save_pretrained(tmp_path / "base")
    config = load_config(
        "vla/habc",
        [
            f"output_dir={tmp_path / 'run'}",
            f"model.path={tmp_path / 'base'}",
            *TINY,
            "method=grpo",
            "rollout.group_size=2",
        ],
    )
    trainer = VLAOnlineTrainer(config)
    trainer.setup()
    episodes = trainer.collect(0)
    for episode in episodes:  # every policy step is placed in the chunk it was executed from
        expected = np.full(episode.length, -1)
        for start, executed in episode.decisions:
            expected[start : start + executed] = np.arange(executed)
        assert episode.chunk_step.tolist() == expected.tolist()
        assert ((expected == -1) == episode.is_intervention).all()
    for i, episode in enumerate(episodes):  # one success per group of two
        episode.success = i % 2 == 0
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    out = update_grpo(trainer, episodes, torch.Generator().manual_seed(0))
    assert out["grpo_chunks"] > 0 and out["actor_updates"] == 2 and math.isfinite(out["loss"])
    assert 0 <= out["clip_fraction"] <= 1 and abs(out["approx_kl"]) < 1.0
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters(), strict=True))
    # the auxiliary object-position loss stays in the update, so every parameter (the head's too) has
    # a gradient, as multi-process DDP requires
    assert out["state_loss"] > 0
    assert [n for n, p in trainer.policy.named_parameters() if p.grad is None] == []
    for env in trainer.envs:
        env.close()


@pytest.mark.needs_rendering
@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_habc_resume_repeats_the_next_iteration_exactly(tmp_path, tiny_policy_dir, schedule):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    trainer, _ = run(straight, tiny_policy_dir, f"train.lr_schedule={schedule}")
    rows = metrics(straight)
    # cosine: 2 iterations, the second at half the learning rate
    assert rows[1]["lr"] == pytest.approx(rows[0]["lr"] * (0.5 if schedule == "cosine" else 1.0))
    assert {"critic_v_loss", "gate_mean", "weight_mean", "weight_clip_fraction", "env_steps"} <= rows[
        1
    ].keys()
    assert rows[1]["buffer_intervention"] > 0 and rows[1]["buffer_policy"] > 0
    assert json.loads((straight / "rollouts.json").read_text())["env_steps"] == rows[1]["env_steps"]
    run(stopped, tiny_policy_dir, "steps=1", f"train.lr_schedule={schedule}")
    with pytest.warns(UserWarning, match="config changes"):
        run(stopped, tiny_policy_dir, "resume=true", f"train.lr_schedule={schedule}")
    assert metric_rows(stopped)[1] == metric_rows(straight)[1]
    a, b = VLAPolicy.from_pretrained(straight / "policy"), VLAPolicy.from_pretrained(stopped / "policy")
    assert all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


# ----- config errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("method=ppo", "method = 'ppo' is not allowed"),
        ("rollout.task=Stack", "rollout.task = 'Stack': unknown sim task"),
        ("rollout.group_size=3", "rollout.group_size = 3 must divide"),
        ("method=grpo", "rollout.group_size = 1: method grpo"),
        ("eval.seed=100000", "eval.seed = 100000 makes evaluation seeds"),
        ("critic.gamma_e=1.0", "critic.gamma_e = 1.0 is out of range"),
        ("actor.beta=0", "actor.beta = 0.0 is out of range"),
        ("intervention.takeover_steps=0", "intervention.takeover_steps = 0 is out of range"),
        ("habc.gate_tau=2", "habc.gate_tau = 2.0 is out of range"),
        ("habc.ablate=[gait]", "unknown part(s)"),
        ("habc.ablate=[viability_critic,efficiency_critic]", "takes out both critics"),
    ],
)
def test_bad_config_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config("vla/habc", [override])


def test_a_missing_policy_names_the_directories_that_hold_one(tmp_path):
    """Training and its plan alike, for our policies and LeRobot's (vla/smolvla_habc)."""
    hint = r"holds no policy.*`mmrl pretrain vla`.*`mmrl replica smolvla`"
    for recipe in ("vla/habc", "vla/smolvla_habc"):
        config = load_config(recipe, [f"model.path={tmp_path / 'nothing'}", f"output_dir={tmp_path / 'run'}"])
        for make in (VLAOnlineTrainer, lambda c, r=recipe: VLAOnlineTrainer.memory_plan(c, r, 1)):
            with pytest.raises(ConfigError, match=hint):
                make(config)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("recipe", ["habc", "awr", "bc", "dagger", "grpo"])
def test_recipes_share_the_budget(recipe):
    config, reference = load_config(f"vla/{recipe}"), load_config("vla/habc")
    assert config.method == recipe
    assert (config.steps, config.rollout.env_steps, config.rollout.task) == (
        reference.steps,
        reference.rollout.env_steps,
        reference.rollout.task,
    )
    assert (config.eval.episodes, config.eval.seed) == (reference.eval.episodes, reference.eval.seed)
    assert config.train.batch_size == reference.train.batch_size
    if recipe == "grpo":
        assert config.train.demos is None and config.train.demo_episodes == 0  # pure RL on its own rollouts
        # GRPO's updates are PPO epochs over one iteration's episodes, not draws from the replay buffer:
        # more of them push the ratios out of the clip range (docs/results.md), so it takes fewer
        assert config.train.updates <= reference.train.updates
    else:
        assert config.train.updates == reference.train.updates
        assert config.intervention == reference.intervention  # the same supervisor, release guard included
        assert (config.train.demos, config.train.demo_episodes, config.train.demo_fraction) == (
            reference.train.demos,
            reference.train.demo_episodes,
            reference.train.demo_fraction,
        )


# ----- the plan before a run ---------------------------------------------------------------------


def test_the_dry_run_plans_the_replay_buffer_a_run_fills(tmp_path, tiny_policy_dir):
    """The plan's replay buffer against the arrays a run stores, with every kind full: 100 policy and
    100 failed-episode transitions of the 240 steps collected (no take-overs)."""
    sizes = [
        "intervention.enabled=false",
        "rollout.env_steps=120",
        "train.buffer_capacity=100",
        "train.failure_capacity=100",
    ]
    config = load_config(
        "vla/habc", [f"output_dir={tmp_path / 'plan'}", f"model.path={tiny_policy_dir}", *TINY, *sizes]
    )
    plan = VLAOnlineTrainer.memory_plan(config, "vla/habc", 1)
    trainer, _ = run(tmp_path / "run", tiny_policy_dir, *sizes)
    stored = [s for kind in trainer.buffer.segments.values() for s in kind]
    assert {kind: len(segments) > 0 for kind, segments in trainer.buffer.segments.items()} == {
        "policy": True,
        "intervention": False,
        "failure": True,  # fmt: skip
    }
    real = sum(
        array.nbytes
        for s in stored
        for array in (*s.obs.values(), s.action, s.reward, s.is_intervention, s.chunk_step)
    )
    assert abs(plan.held["replay buffer"] / real - 1) < 0.2, (plan.held["replay buffer"], real)
    assert plan.trainable == sum(p.numel() for p in trainer.policy.parameters()) + sum(
        p.numel() for p in trainer.critics.parameters()
    )


def test_the_dry_run_of_a_robot_recipe_prints_its_plan_and_writes_nothing(tmp_path, tiny_policy_dir, capsys):
    from mmrl.cli import main

    out = tmp_path / "run"
    args = ["train", "vla/habc", f"output_dir={out}", f"model.path={tiny_policy_dir}", *TINY, "--dry-run"]
    assert main([*args, "--processes", "2"]) == 0
    text = capsys.readouterr().out
    for line in ("replay buffer", "demonstrations", "environments", "expected peak"):
        assert line in text
    assert "env steps: at least 30 (rollout.env_steps)" in text
    assert "warning: the vla_online trainer runs in one process" in text
    assert not out.exists()
