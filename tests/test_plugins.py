"""User code plugs into the `mmrl` command: a task of the user's own (outside the repository) with its
expert, an instruction in words the built-in vocabulary lacks, and state split by named slices."""

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

import sim
from mmrl.cli import main
from vla_rl.policy import PAD, UNK, VLAConfig, VLAPolicy, task_vocabulary

MMRL = str(Path(sys.executable).with_name("mmrl"))
TASK = "PointReach-v0"
INSTRUCTION = "steer the dot to the star"
NEW_WORDS = ["dot", "star", "steer"]  # not among the built-in words

# A self-contained gymnasium task: a point moves toward a target on a plane. One "observation" vector
# holds both the point's position (what a policy may see) and the target's (privileged).
USER_MODULE = f'''
import gymnasium as gym
import numpy as np

import sim
from sim.experts import Expert


class PointReach(gym.Env):
    metadata = {{"render_modes": ["rgb_array"], "render_fps": 10}}
    step_size = 0.1

    def __init__(self, render_mode=None, width=32, height=32):
        self.render_mode, self.width, self.height = render_mode, width, height
        box = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
        self.observation_space = gym.spaces.Dict({{"observation": box}})
        self.action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.point = self.target = np.zeros(2)

    def _obs(self):
        return {{"observation": np.concatenate([self.point, self.target]).astype(np.float32)}}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.point, self.target = self.np_random.uniform(-0.8, 0.8, (2, 2))
        return self._obs(), {{}}

    def step(self, action):
        self.point = np.clip(self.point + self.step_size * np.clip(action, -1, 1), -1, 1)
        success = bool(np.linalg.norm(self.point - self.target) < 0.1)
        return self._obs(), float(success), success, False, {{"is_success": success}}

    def render(self):
        frame = np.full((self.height, self.width, 3), 40, np.uint8)
        for pos, colour in ((self.target, (230, 200, 20)), (self.point, (30, 60, 230))):
            x, y = ((pos + 1) / 2 * [self.width - 3, self.height - 3]).astype(int)
            frame[y : y + 3, x : x + 3] = colour
        return frame


class PointExpert(Expert):
    def act_on(self, s):
        return np.clip((s["target_pos"] - s["point_pos"]) / PointReach.step_size, -1, 1).astype(np.float32)


gym.register("{TASK}", entry_point=PointReach, max_episode_steps=30)
sim.register_task(
    sim.ExternalTask(
        env_id="{TASK}",
        instruction="{INSTRUCTION}",
        proprio=(("point_pos", "observation", 0, 2),),
        privileged=(("target_pos", "observation", 2, 4),),
        robot_type="point",
    ),
    expert=PointExpert,
)
'''

TINY = [
    f"data.task={TASK}",
    "data.episodes=3",
    "data.image_size=16",
    "steps=2",
    "checkpoint_every=2",
    "eval.episodes=2",
    "eval.num_envs=2",
    "model.channels=[4]",
    "model.keypoints=4",
    "model.hidden=16",
    "model.horizon=2",
    "train.batch_size=8",
    "train.warmup_steps=0",
    "progress=false",
]


def user_module(directory: Path) -> Path:
    path = directory / "point_tasks.py"
    path.write_text(textwrap.dedent(USER_MODULE))
    return path


def run_mmrl(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.run([MMRL, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_pretrain_runs_a_user_task_loaded_with_plugin(tmp_path):
    user_module(tmp_path)
    run = tmp_path / "run"
    # the module by name, found in the working directory, with the option after the recipe's name
    done = run_mmrl(["pretrain", "vla", "--plugin", "point_tasks", *TINY, f"output_dir={run}"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    evaluation = json.loads((run / "eval.json").read_text())
    assert 0.0 <= evaluation["after"]["success_rate"] <= 1.0
    policy = VLAPolicy.from_pretrained(run / "policy")
    assert set(NEW_WORDS) <= set(policy.config.vocabulary)
    tokens = policy.tokenize([INSTRUCTION])[0].tolist()
    assert policy.config.vocabulary.index(UNK) not in tokens and len([t for t in tokens if t]) == 6
    assert policy.config.proprio_dim == 2  # the point_pos slice only: the target is privileged
    assert policy.config.state_index == [2, 3]  # the auxiliary head reads target_pos


def test_the_plugins_key_of_a_config_file_loads_the_module_first(tmp_path):
    (tmp_path / "code").mkdir()
    path = user_module(tmp_path / "code")  # by its path, away from the working directory
    bare, keyed = tmp_path / "bare.yaml", tmp_path / "keyed.yaml"
    bare.write_text(f"trainer: vla_bc\ndata:\n  task: {TASK}\n")
    keyed.write_text(f"trainer: vla_bc\nplugins: [{path}]\ndata:\n  task: {TASK}\n")
    script = f"""
from mmrl.cli import load_checked_config, load_plugins
from mmrl.config import ConfigError
load_plugins()
try:
    load_checked_config({str(bare)!r}, [])
except ConfigError as err:
    print("refused:", err)
config = load_checked_config({str(keyed)!r}, [])
print("task:", config.data.task, config.plugins)
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    refused, loaded = done.stdout.splitlines()
    assert f"unknown sim task {TASK!r}" in refused  # without the key, the config cannot name the task
    assert loaded == f"task: {TASK} {[str(path)]}"


def test_a_bad_plugin_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["list", "--plugin", "no_such_plugin_module"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "plugin 'no_such_plugin_module' (--plugin) failed to import" in err
    assert "ModuleNotFoundError" in err and "a path to a .py file" in err
    assert main(["list", "--plugin", str(tmp_path / "missing.py")]) == 2
    assert "no such file" in capsys.readouterr().err
    taken = "answer_match"  # registered by mmrl.rewards, which every command imports before a plugin
    twice = tmp_path / "twice_reward.py"
    twice.write_text(f"from mmrl.registry import REWARDS\nREWARDS.register({taken!r})(len)\n")
    assert main(["list", "--plugin", str(twice)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"reward registry already has an entry named {taken!r}" in err
    assert "twice_reward" not in sys.modules  # a failed plugin leaves nothing half imported


def test_a_policy_meeting_new_words_warns_once_and_add_words_keeps_its_actions():
    tiny = {"image_size": 16, "channels": [4], "keypoints": 4, "hidden": 16}
    policy = VLAPolicy(VLAConfig(vocabulary=task_vocabulary(), proprio_dim=2, action_dim=2, **tiny))
    with pytest.warns(UserWarning, match="lacks 'dot', 'star', 'steer': read as <unk>") as caught:
        tokens = policy.tokenize([INSTRUCTION, "steer the red dot"])
    assert len(caught) == 1 and (tokens == policy.config.vocabulary.index(UNK)).sum() == 5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        policy.tokenize([INSTRUCTION])  # reported already: no second warning
    batch = {
        "image": np.zeros((1, 16, 16, 3), np.uint8),
        "state": np.zeros((1, 2), np.float32),
    }
    before = policy(policy.prepare(batch, [INSTRUCTION])).mean
    assert policy.add_words(["steer", "dot", "star", "the"]) == NEW_WORDS
    assert policy.config.vocabulary[-3:] == NEW_WORDS and policy.embed.num_embeddings == len(
        policy.config.vocabulary
    )
    assert policy.config.vocabulary.index(UNK) not in policy.tokenize([INSTRUCTION])[0].tolist()
    after = policy(policy.prepare(batch, [INSTRUCTION])).mean
    np.testing.assert_allclose(after.detach().numpy(), before.detach().numpy(), atol=1e-6)
    # a new policy for the task: the built-in words and the instruction's, whatever their case
    assert task_vocabulary([INSTRUCTION.upper()]) == [PAD, UNK, *sorted({*task_vocabulary()[2:], *NEW_WORDS})]


@pytest.mark.needs_fetch  # FetchReach
def test_named_slices_on_a_real_env():
    task = sim.ExternalTask(
        env_id="FetchReach-v4",
        package="gymnasium_robotics",
        instruction="move the gripper to the red ball",
        # FetchReach's observation: gripper position (0:3), finger state (3:5), velocities (5:10)
        proprio=(("grip_pos", "observation", 0, 3), ("fingers", "observation", 3, 5), ("desired_goal", 3)),
        privileged=(("achieved_goal", 3),),
    )
    assert task.layout() == {
        "grip_pos": slice(0, 3),
        "fingers": slice(3, 5),
        "desired_goal": slice(5, 8),
        "achieved_goal": slice(8, 11),
    }
    env = task.make()
    obs, _ = env.reset(seed=0)
    raw = env.unwrapped._get_obs()
    state = obs["state"]
    assert state.shape == (11,) and env.get_wrapper_attr("proprio_dim") == 8
    assert env.get_wrapper_attr("state_layout") == task.layout() and env.observation_space.contains(obs)
    np.testing.assert_allclose(state[0:5], raw["observation"][0:5], rtol=1e-6)
    np.testing.assert_allclose(state[5:8], raw["desired_goal"], rtol=1e-6)
    np.testing.assert_allclose(
        state[8:11], state[0:3], rtol=1e-6
    )  # FetchReach's achieved goal is the gripper
    env.close()


@pytest.mark.needs_fetch  # FetchReach
@pytest.mark.needs_rendering
def test_fine_tuning_adds_the_task_words_the_policy_lacks(tmp_path, capsys):
    from mmrl.config import load_config
    from vla_rl.trainer import VLAOnlineTrainer

    lacking = [w for w in task_vocabulary() if w not in ("gripper", "ball")]
    tiny = {
        "image_size": 16,
        "channels": [4],
        "keypoints": 4,
        "hidden": 16,
        "horizon": 2,
        "n_action_steps": 1,
    }
    VLAPolicy(VLAConfig(vocabulary=lacking, proprio_dim=13, action_dim=4, **tiny)).save_pretrained(
        tmp_path / "base"
    )
    overrides = [
        f"output_dir={tmp_path / 'run'}",
        f"model.path={tmp_path / 'base'}",
        "rollout.task=FetchReach-v4",
    ]
    trainer = VLAOnlineTrainer(
        load_config("vla/habc", [*overrides, "rollout.num_envs=1", "train.demos=null"])
    )
    trainer.setup()
    policy = trainer.policy
    assert policy.config.vocabulary == [*lacking, "ball", "gripper"]
    assert "added the words ball, gripper of task FetchReach-v4" in capsys.readouterr().out
    held = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert any(p is policy.embed.weight for p in held)  # the optimizer trains the grown embedding
    assert policy.config.vocabulary.index(UNK) not in policy.tokenize(["move the gripper to the red ball"])[0]
    for env in trainer.envs:
        env.close()
