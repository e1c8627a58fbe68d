"""Faults of the robot stack met through the `mmrl` command, each refused in one line: a LeRobot dataset
whose episodes are not in time order, a user's env whose camera frames are floats (in [0, 1]:
converted; outside, or NaN: refused) or whose observations hold NaN, a user's scripted expert that
raises or returns a non-finite action. A fault found before the run starts is exit 2 with nothing
written; one in a started run is exit 1 with stopped.json naming it.

The user's task is a point on a plane steered to a target (as in tests/test_plugins.py), registered
for each test with `sim.register_task`'s tables; class attributes switch its faults on."""

import functools
import json
import re
import types

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mmrl.cli import main
from mmrl.registry import TASKS

TASK = "MmrlFaultyPoint-v0"
INSTRUCTION = "move the gripper to the red ball"  # built-in words: no vocabulary warnings
EVAL_SEED = 1_000_000  # pretrain vla's first evaluation seed (its demonstrations reset with 0, 1, ...)
DATA_FILE = "data/chunk-000/file-000.parquet"
TINY_PRETRAIN = [
    f"data.task={TASK}",
    "data.episodes=2",
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
TINY_HABC = [
    f"rollout.task={TASK}",
    "rollout.env_steps=24",
    "rollout.num_envs=2",
    "train.demo_episodes=0",
    "train.updates=2",
    "train.batch_size=8",
    "critic.updates=2",
    "critic.batch_size=16",
    "eval.episodes=2",
    "eval.num_envs=2",
    "eval_every=0",
    "steps=2",
    "checkpoint_every=2",
    "progress=false",
]


@functools.cache
def user_classes() -> types.SimpleNamespace:
    """The user's env and expert (built on first use: the robot extra is imported only by tests that
    need it)."""
    import gymnasium as gym

    from sim.experts import Expert

    class FaultyPoint(gym.Env):
        """A point moving toward a target; `image` sets what render() returns ("uint8"; "unit": floats
        in [0, 1]; "255": floats of 0-255; "nan": unit floats with a NaN pixel), `nan_state` puts NaN
        in the point's y; both from step `fault_at` of the episode (0: at reset, None: never) in
        episodes reset with a seed >= `fault_seed`."""

        metadata = {"render_modes": ["rgb_array"], "render_fps": 10}
        step_size = 0.1
        image = "uint8"
        nan_state = False
        fault_at: int | None = None
        fault_seed = 0

        def __init__(self, render_mode=None, width=16, height=16):
            self.render_mode, self.width, self.height = render_mode, width, height
            box = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
            self.observation_space = gym.spaces.Dict({"observation": box})
            self.action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
            self.point = self.target = np.zeros(2)
            self.seed, self.t = 0, 0

        def faulty(self) -> bool:
            return self.fault_at is not None and self.t >= self.fault_at and self.seed >= self.fault_seed

        def _obs(self):
            obs = np.concatenate([self.point, self.target]).astype(np.float32)
            if self.nan_state and self.faulty():
                obs[1] = np.nan
            return {"observation": obs}

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.seed, self.t = seed or 0, 0
            self.point, self.target = self.np_random.uniform(-0.8, 0.8, (2, 2))
            return self._obs(), {}

        def step(self, action):
            self.t += 1
            self.point = np.clip(self.point + self.step_size * np.clip(action, -1, 1), -1, 1)
            success = bool(np.linalg.norm(self.point - self.target) < 0.1)
            return self._obs(), float(success), success, False, {"is_success": success}

        def render(self):
            frame = draw(self.point, self.target, self.width, self.height)
            if self.image == "uint8" or not self.faulty():
                return frame
            if self.image == "255":
                return frame.astype(np.float32)
            unit = unit_frame(frame)
            if self.image == "nan":
                unit[0, 0, 0] = np.nan
            return unit

    class FaultyExpert(Expert):
        """Steers the point to the target; with `fault` ("raise", "nan") its calls after the first
        `after` raise or return NaN; with fault "failure", naming how an episode failed raises."""

        fault: str | None = None
        after = 0
        calls = 0

        def act_on(self, s):
            FaultyExpert.calls += 1
            if self.fault in ("raise", "nan") and FaultyExpert.calls > self.after:
                if self.fault == "raise":
                    raise KeyError("point_pos")
                return np.array([np.nan, 0.0], np.float32)
            return np.clip((s["target_pos"] - s["point_pos"]) / FaultyPoint.step_size, -1, 1)

        def failure(self, states):
            if self.fault == "failure":
                raise ValueError("no phases")
            return None

    return types.SimpleNamespace(env=FaultyPoint, expert=FaultyExpert)


def draw(point: np.ndarray, target: np.ndarray, width: int, height: int) -> np.ndarray:
    """The user's uint8 frame: a gradient background with the target and the point as squares."""
    frame = np.zeros((height, width, 3), np.uint8)
    frame[..., 0] = np.linspace(0, 255, width, dtype=np.uint8)[None, :]
    frame[..., 1] = 77
    for pos, colour in ((target, (230, 200, 20)), (point, (30, 60, 230))):
        x, y = ((np.asarray(pos, np.float64) + 1) / 2 * [width - 3, height - 3]).astype(int)
        frame[y : y + 3, x : x + 3] = colour
    return frame


def unit_frame(frame: np.ndarray) -> np.ndarray:
    """The frame as floats in [0, 1] that are not k/255 (so that truncating them loses a level)."""
    return np.clip((frame.astype(np.float32) + 0.4) / 255.0, 0.0, 1.0)


@pytest.fixture
def user_task(monkeypatch):
    """The user's task, registered as `sim.register_task` does, for this test only."""
    import gymnasium as gym

    import sim

    classes = user_classes()
    if TASK not in gym.registry:
        gym.register(TASK, entry_point=classes.env, max_episode_steps=20)
    task = sim.ExternalTask(
        env_id=TASK,
        instruction=INSTRUCTION,
        proprio=(("point_pos", "observation", 0, 2),),
        privileged=(("target_pos", "observation", 2, 4),),
        robot_type="point",
    )
    monkeypatch.setitem(TASKS._entries, TASK, sim.TaskEntry(task, classes.expert))
    monkeypatch.setattr(classes.expert, "calls", 0)
    return classes


def refused(capsys, argv: list[str], out) -> str:
    """Run `mmrl argv`, expect a refusal before the run (exit 2, one line, nothing in `out`); return it."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert not out.exists() or not any(out.iterdir()), sorted(str(p) for p in out.rglob("*"))
    return lines[0]


def stopped(capsys, argv: list[str], out) -> tuple[str, dict]:
    """Run `mmrl argv`, expect a started run to stop (exit 1, one line); return it and stopped.json."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: run stopped: "), err
    assert "(see stopped.json in the run directory)" in lines[0]
    return lines[0], json.loads((out / "stopped.json").read_text())


# ----- datasets whose episodes are not in time order ----------------------------------------------


def user_dataset(root):
    """A LeRobot dataset for the user's task at image size 16: episodes of 4, 3 and 5 frames."""
    from vla_rl.lerobot_format import ACTION_KEY, IMAGE_KEY, STATE_KEY, DatasetWriter

    features = {
        STATE_KEY: {"dtype": "float32", "shape": [4], "names": None},
        ACTION_KEY: {"dtype": "float32", "shape": [2], "names": None},
        IMAGE_KEY: {"dtype": "image", "shape": [16, 16, 3], "names": None},
    }
    rng = np.random.default_rng(0)
    with DatasetWriter(root, fps=10, features=features, robot_type="point") as writer:
        for length in (4, 3, 5):
            for _ in range(length):
                state = rng.uniform(-0.8, 0.8, 4).astype(np.float32)
                writer.add_frame(
                    {
                        STATE_KEY: state,
                        ACTION_KEY: rng.uniform(-1, 1, 2).astype(np.float32),
                        IMAGE_KEY: draw(state[:2], state[2:], 16, 16),
                    }
                )
            writer.save_episode(INSTRUCTION, True)
    return root


def reverse_episode_1(table: pa.Table) -> pa.Table:
    """Episode 1's rows (4..6) in reverse time order, the 'index' column still counting rows."""
    order = [0, 1, 2, 3, 6, 5, 4, *range(7, table.num_rows)]
    taken = table.take(order)
    column = taken.schema.get_field_index("index")
    return taken.set_column(column, "index", table["index"])


def shift_a_timestamp(table: pa.Table) -> pa.Table:
    """Frame 3 of episode 2 (row 10) half a frame late."""
    timestamps = table["timestamp"].to_numpy().copy()
    timestamps[10] += 0.05
    column = table.schema.get_field_index("timestamp")
    return table.set_column(column, pa.field("timestamp", table.schema.field("timestamp").type), [timestamps])


@pytest.mark.needs_robot
@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (
            reverse_episode_1,
            r"file-000.parquet: episode 1, row 4 has frame_index 2, expected 0: an episode's rows hold its "
            r"frames in time order",
        ),
        (
            shift_a_timestamp,
            r"file-000.parquet: episode 2, row 10 \(frame 3\) has timestamp 0.35 s, 0.15 s after the "
            r"frame before; at fps 10 \(meta/info.json\) frames are 0.1 s apart",
        ),
    ],
    ids=["frame_index_reversed", "timestamp_off"],
)
def test_pretrain_refuses_a_dataset_out_of_time_order(user_task, tmp_path, capsys, corrupt, message):
    root = user_dataset(tmp_path / "ds")
    pq.write_table(corrupt(pq.read_table(root / DATA_FILE)), root / DATA_FILE)
    out = tmp_path / "run"
    line = refused(capsys, ["pretrain", "vla", *TINY_PRETRAIN, f"data.path={root}", f"output_dir={out}"], out)
    assert line.startswith(f"error: config error: data.path = '{root}': {root / DATA_FILE}"), line
    assert re.search(message, line), line


# ----- a user's camera frames ---------------------------------------------------------------------


@pytest.mark.needs_robot
def test_float_frames_in_0_1_are_recorded_as_round_255x(user_task, tmp_path, capsys, monkeypatch):
    from vla_rl.dataset import RobotDataset

    monkeypatch.setattr(user_task.env, "image", "unit")
    monkeypatch.setattr(user_task.env, "fault_at", 0)
    out = tmp_path / "run"
    assert main(["pretrain", "vla", *TINY_PRETRAIN, f"output_dir={out}"]) == 0, capsys.readouterr().err
    demos = RobotDataset(out / "demos")
    assert len(demos) > 0
    for i in range(len(demos)):
        item = demos[i]
        state = item["observation.state"].numpy()
        expected = np.rint(255.0 * unit_frame(draw(state[:2], state[2:], 16, 16))).astype(np.uint8)
        np.testing.assert_array_equal(item["observation.image"].permute(1, 2, 0).numpy(), expected)


@pytest.mark.needs_robot
def test_float_frames_of_0_255_are_refused_at_the_first_reset(user_task, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(user_task.env, "image", "255")
    monkeypatch.setattr(user_task.env, "fault_at", 0)
    out = tmp_path / "run"
    line = refused(capsys, ["pretrain", "vla", *TINY_PRETRAIN, f"output_dir={out}"], out)
    assert line.startswith(
        f"error: config error: data.task = '{TASK}': env {TASK}: at reset (seed 0), observation 'image' "
        "(its render() frame) holds float32 values in ["
    ), line
    assert "outside [0, 1]: return HxWx3 uint8 frames (0-255), or floats in [0, 1]" in line


@pytest.mark.needs_robot
def test_a_nan_frame_mid_run_stops_it(user_task, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(user_task.env, "image", "nan")
    monkeypatch.setattr(user_task.env, "fault_at", 3)
    monkeypatch.setattr(user_task.env, "fault_seed", EVAL_SEED)  # the held-out evaluation's episodes
    out = tmp_path / "run"
    line, record = stopped(capsys, ["pretrain", "vla", *TINY_PRETRAIN, f"output_dir={out}"], out)
    what = f"env {TASK}: at step 3 of the episode reset with seed {EVAL_SEED}"
    assert f"{what}, observation 'image' (its render() frame) holds NaN or infinite values" in line, line
    assert what in record["reason"] and record["step"] == 0, record


# ----- NaN observations ---------------------------------------------------------------------------


@pytest.mark.needs_robot
@pytest.mark.parametrize("command", ["pretrain", "habc"])
def test_nan_state_at_the_first_reset_is_refused_naming_the_env(
    user_task, tmp_path, capsys, monkeypatch, command
):
    monkeypatch.setattr(user_task.env, "nan_state", True)
    monkeypatch.setattr(user_task.env, "fault_at", 0)
    out = tmp_path / "run"
    if command == "pretrain":  # its first reset: the first demonstration's
        argv, start = (
            ["pretrain", "vla", *TINY_PRETRAIN],
            f"data.task = '{TASK}': env {TASK}: at reset (seed 0)",
        )
    else:  # its first reset: the held-out evaluation's
        argv = ["train", "vla/habc", *TINY_HABC, f"model.path={user_policy(tmp_path / 'policy')}"]
        start = f"rollout.task = '{TASK}': env {TASK}: at reset (seed {EVAL_SEED})"
    line = refused(capsys, [*argv, f"output_dir={out}"], out)
    assert line.startswith(
        f"error: config error: {start}, observation 'observation' holds NaN (entry 1, state part "
        "'point_pos'; 1 non-finite state entries): an env must return finite observations"
    ), line
    assert "partial" not in line and "demos" not in line


@pytest.mark.needs_robot
def test_nan_state_mid_run_stops_it_naming_the_env(user_task, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(user_task.env, "nan_state", True)
    monkeypatch.setattr(user_task.env, "fault_at", 3)
    monkeypatch.setattr(user_task.env, "fault_seed", EVAL_SEED)
    out = tmp_path / "run"
    line, record = stopped(capsys, ["pretrain", "vla", *TINY_PRETRAIN, f"output_dir={out}"], out)
    what = f"env {TASK}: at step 3 of the episode reset with seed {EVAL_SEED}, observation 'observation'"
    what += " holds NaN (entry 1, state part 'point_pos'"
    assert what in line and what in record["reason"], (line, record)
    assert "partial" not in line


# ----- a user's scripted expert -------------------------------------------------------------------


def user_policy(directory):
    from vla_rl.policy import VLAConfig, VLAPolicy, task_vocabulary

    config = VLAConfig(
        vocabulary=task_vocabulary([INSTRUCTION]),
        proprio_dim=2,
        action_dim=2,
        image_size=16,
        channels=[4],
        keypoints=4,
        hidden=16,
        horizon=2,
        n_action_steps=1,
    )
    VLAPolicy(config).save_pretrained(directory)
    return directory


@pytest.mark.needs_robot
@pytest.mark.parametrize(
    ("fault", "words"),
    [("raise", "raised KeyError: 'point_pos'"), ("nan", "returned the non-finite action [nan, 0.0]")],
    ids=["raises", "nan_action"],
)
def test_an_expert_failing_mid_run_stops_it(user_task, tmp_path, capsys, monkeypatch, fault, words):
    monkeypatch.setattr(user_task.expert, "fault", fault)
    monkeypatch.setattr(user_task.expert, "after", 5)  # the setup's check of its first action passes
    out = tmp_path / "run"
    argv = ["train", "vla/habc", *TINY_HABC, f"model.path={user_policy(tmp_path / 'policy')}"]
    line, record = stopped(capsys, [*argv, f"output_dir={out}"], out)
    expert = f"the scripted expert {__name__}.user_classes.<locals>.FaultyExpert of task {TASK}"
    at_a_step = re.escape(f"{expert} {words}") + r" at step \d+ of the episode reset with seed \d+: "
    assert re.search(at_a_step, line), line
    assert line.count("fix the expert (the class given to sim.register_task(..., expert=...))") == 1
    assert expert in record["reason"] and record["step"] == 0, record  # no step completed


@pytest.mark.needs_robot
def test_an_expert_failing_to_name_a_failure_stops_the_run(user_task, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(user_task.expert, "fault", "failure")
    out = tmp_path / "run"
    line, record = stopped(capsys, ["pretrain", "vla", *TINY_PRETRAIN, f"output_dir={out}"], out)
    expert = f"the scripted expert {__name__}.user_classes.<locals>.FaultyExpert of task {TASK}"
    what = f"{expert} raised ValueError: no phases in failure(), naming how the episode reset with seed"
    assert what in line and what in record["reason"], (line, record)


@pytest.mark.needs_robot
@pytest.mark.parametrize(
    ("fault", "words"),
    [
        (
            "nan_state",
            f"env {TASK}: at step 10 of the episode reset with seed 3, observation 'observation' holds NaN",
        ),
        ("expert", f"FaultyExpert of task {TASK} raised KeyError: 'point_pos' at step "),
    ],
    ids=["nan_state", "expert_raises"],
)
def test_a_fault_while_pretrain_records_demonstrations_is_refused(
    user_task, tmp_path, capsys, monkeypatch, fault, words
):
    if fault == "nan_state":  # in the last demonstration: the first ones are saved by then
        monkeypatch.setattr(user_task.env, "nan_state", True)
        monkeypatch.setattr(user_task.env, "fault_at", 10)
        monkeypatch.setattr(user_task.env, "fault_seed", 3)
    else:
        monkeypatch.setattr(user_task.expert, "fault", "raise")
        monkeypatch.setattr(user_task.expert, "after", 5)
    out = tmp_path / "run"
    # refused() checks that nothing is left in output_dir, not even the partial recording
    line = refused(capsys, ["pretrain", "vla", *TINY_PRETRAIN, "data.episodes=4", f"output_dir={out}"], out)
    assert line.startswith(f"error: config error: data.task = '{TASK}': "), line
    assert words in line and line.endswith("(while recording its demonstrations)"), line


@pytest.mark.needs_robot
def test_an_expert_failing_while_habc_records_demonstrations_stops_the_run(
    user_task, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(user_task.expert, "fault", "raise")
    monkeypatch.setattr(user_task.expert, "after", 5)
    out = tmp_path / "run"
    argv = ["train", "vla/habc", *TINY_HABC, "train.demo_episodes=2"]
    line, record = stopped(
        capsys, [*argv, f"model.path={user_policy(tmp_path / 'policy')}", f"output_dir={out}"], out
    )
    what = rf"FaultyExpert of task {TASK} raised KeyError: 'point_pos' at step \d+ of the episode reset with"
    what += " seed 0"
    assert re.search(what, line) and re.search(what, record["reason"]), (line, record)
    assert not (out / "demos").exists()
