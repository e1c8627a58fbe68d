"""The vla trainers on an external task the project did not write: gymnasium-robotics' FetchReach-v4,
through sim.adapters (the config's task, the scripted expert, behaviour cloning and HABC end to end)."""

import json

import numpy as np
import pytest

import sim
from mmrl.config import load_config
from sim import expert_for
from vla_rl.policy import UNK, VLAConfig, VLAPolicy, task_vocabulary
from vla_rl.pretrain import VLABCTrainer
from vla_rl.trainer import VLAOnlineTrainer

pytestmark = pytest.mark.needs_fetch
TASK = "FetchReach-v4"
SIZE = 32
TINY_MODEL = ["model.channels=[8,8]", "model.keypoints=8", "model.hidden=32", "model.horizon=4"]
TINY_MODEL += ["model.n_action_steps=2"]


def test_the_recipe_builds_the_external_task():
    config = load_config("pretrain/vla_fetch_reach", [])
    assert config.data.task == TASK
    env = sim.make(config.data.task, obs_mode="state")
    obs, info = env.reset(seed=0)
    assert obs["state"].shape == (16,) and env.observation_space.contains(obs)
    assert env.get_wrapper_attr("proprio_dim") == 13 and env.get_wrapper_attr("robot_type") == "fetch"
    layout = env.get_wrapper_attr("state_layout")
    assert list(layout) == ["observation", "desired_goal", "achieved_goal"]
    np.testing.assert_array_equal(env.get_wrapper_attr("get_state")(), obs["state"])
    policy = VLAPolicy(VLAConfig(vocabulary=task_vocabulary(), proprio_dim=13, action_dim=4))
    assert UNK not in policy.tokenize([info["instruction"]]).tolist()[0][:7]  # every word is known
    env.close()


@pytest.mark.needs_rendering
def test_camera_frames_at_the_configured_size():
    env = sim.make(TASK, obs_mode="rgb", image_size=SIZE)
    obs, _ = env.reset(seed=0)
    assert obs["image"].shape == (SIZE, SIZE, 3) and obs["image"].dtype == np.uint8
    assert env.observation_space.contains(obs) and obs["image"].std() > 0
    env.close()


def test_the_expert_reaches_every_goal_and_takes_over_from_a_stray_state():
    env = sim.make(TASK)
    expert = expert_for(TASK)
    assert type(expert_for(env)) is type(expert)
    rng = np.random.default_rng(0)
    for seed in range(5):
        env.reset(seed=seed)
        for t in range(50):
            action = rng.uniform(-1, 1, 4) if seed % 2 and t < 5 else expert.act(env)  # odd seeds stray
            _, reward, terminated, truncated, info = env.step(action)
            if terminated or truncated:
                break
        assert info["is_success"] and reward == 1.0 and terminated, (seed, t)
        assert t < (10 if seed % 2 else 5)
    env.close()


@pytest.mark.needs_rendering
def test_behaviour_cloning_end_to_end(tmp_path):
    overrides = [f"output_dir={tmp_path}", "steps=30", "checkpoint_every=30", "progress=false"]
    overrides += ["data.episodes=8", f"data.image_size={SIZE}", "eval.episodes=1", "eval.num_envs=1"]
    overrides += ["train.batch_size=16", "train.warmup_steps=1", *TINY_MODEL]
    VLABCTrainer(load_config("pretrain/vla_fetch_reach", overrides)).train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert np.mean(losses[-5:]) < np.mean(losses[:5])  # it learns from the demonstrations
    info = json.loads((tmp_path / "demos" / "meta" / "info.json").read_text())
    assert info["robot_type"] == "fetch" and info["features"]["action"]["shape"] == [4]
    assert info["features"]["observation.state"]["names"][-1] == "achieved_goal.2"
    policy = VLAPolicy.from_pretrained(tmp_path / "policy")
    assert (policy.config.proprio_dim, policy.config.action_dim) == (13, 4)


@pytest.mark.slow
@pytest.mark.needs_rendering
def test_habc_end_to_end(tmp_path):
    tiny = {"image_size": SIZE, "channels": [8, 8], "keypoints": 8, "hidden": 32, "horizon": 4}
    config = VLAConfig(vocabulary=task_vocabulary(), proprio_dim=13, action_dim=4, n_action_steps=2, **tiny)
    VLAPolicy(config).save_pretrained(tmp_path / "base")
    overrides = [f"output_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'base'}", f"rollout.task={TASK}"]
    overrides += ["rollout.env_steps=10", "rollout.num_envs=1", "rollout.max_episode_steps=10", "steps=1"]
    overrides += ["checkpoint_every=1", "progress=false", "eval.episodes=1", "eval.num_envs=1"]
    overrides += ["eval.videos=1", "train.updates=2", "train.batch_size=8", "critic.updates=3"]
    overrides += ["critic.batch_size=16", "intervention.window=3", "intervention.threshold=0.4"]
    overrides += ["intervention.takeover_steps=4", "train.demos=null"]
    result = VLAOnlineTrainer(load_config("vla/habc", overrides)).train()
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["env_steps"] >= 10 and row["interventions_per_episode"] > 0 and row["actor_updates"] == 2
    assert 0 <= result["success_rate"] <= 1
    assert len(list((tmp_path / "run" / "videos").glob("*.gif"))) == 1
