"""LeRobot v3.0 datasets: written and read back exactly, malformed ones refused with the problem named;
the replay buffer's kinds, eviction, sampling and resume; expert demonstrations recorded in sim."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from mmrl.config import ConfigError
from vla_rl.dataset import RobotDataset, open_dataset
from vla_rl.episodes import Controller
from vla_rl.lerobot_checks import check_dataset
from vla_rl.lerobot_format import DatasetWriter
from vla_rl.recording import record_episodes
from vla_rl.replay_buffer import KINDS, ReplayBuffer

FEATURES = {
    "observation.state": {"dtype": "float32", "shape": [3], "names": ["x", "y", "z"]},
    "action": {"dtype": "float32", "shape": [2], "names": None},
    "observation.image": {"dtype": "image", "shape": [6, 5, 3]},
}
EPISODES = [(4, "pick the red cube", True), (3, "push the blue cube", False), (5, "pick the red cube", True)]
DATA_FILE = "data/chunk-000/file-000.parquet"


def make_episodes(seed=0):
    """(frames, is_intervention, task, success) per episode; the expert acts at step 1 only."""
    rng = np.random.default_rng(seed)
    episodes = []
    for length, task, success in EPISODES:
        frames = [
            {
                "observation.state": rng.normal(size=3).astype(np.float32),
                "action": rng.uniform(-1, 1, 2).astype(np.float32),
                "observation.image": rng.integers(0, 256, (6, 5, 3), dtype=np.uint8),
            }
            for _ in range(length)
        ]
        episodes.append((frames, np.arange(length) == 1, task, success))
    return episodes


def write(root, episodes, **kwargs):
    with DatasetWriter(root, fps=10, features=FEATURES, robot_type="toy_arm", **kwargs) as writer:
        for frames, flags, task, success in episodes:
            for frame, flag in zip(frames, flags, strict=True):
                writer.add_frame(frame, is_intervention=flag, policy_executed=not flag)
            writer.save_episode(task, success)
    return root


@pytest.fixture
def episodes():
    return make_episodes()


@pytest.fixture
def root(tmp_path, episodes):
    return write(tmp_path / "ds", episodes)


# ----- writing and reading ------------------------------------------------------------------------


def test_round_trip_is_exact(root, episodes):
    ds = RobotDataset(root)
    assert len(ds) == 12 and ds.tasks == ["pick the red cube", "push the blue cube"]
    i = 0
    for e, (frames, flags, task, success) in enumerate(episodes):
        for t, frame in enumerate(frames):
            item = ds[i]
            assert torch.equal(item["observation.state"], torch.from_numpy(frame["observation.state"]))
            assert torch.equal(item["action"], torch.from_numpy(frame["action"]))
            image = torch.from_numpy(frame["observation.image"]).permute(2, 0, 1)
            assert item["observation.image"].dtype == torch.uint8 and torch.equal(
                item["observation.image"], image
            )
            assert item["task"] == task and item["episode_index"] == e and item["frame_index"] == t
            assert item["index"] == i and item["timestamp"] == pytest.approx(t / 10)
            assert item["is_intervention"] == flags[t] and item["policy_executed"] == (not flags[t])
            assert item["next.done"] == (t == len(frames) - 1) and item["episode_success"] == success
            i += 1
    whole = ds.episode(2)
    assert whole["observation.image"].shape == (5, 3, 6, 5) and whole["task"] == "pick the red cube"
    np.testing.assert_array_equal(whole["action"].numpy(), np.stack([f["action"] for f in episodes[2][0]]))
    assert ds[-1]["index"] == 11
    assert ds.episodes[1] == {
        "episode_index": 1,
        "tasks": ["push the blue cube"],
        "length": 3,
        "dataset_from_index": 4,
        "dataset_to_index": 7,
        "data/chunk_index": 0,
        "data/file_index": 0,
        "meta/episodes/chunk_index": 0,
        "meta/episodes/file_index": 0,
        "success": False,
        "num_interventions": 1,
        "intervention_frames": 1,
        "source": "policy",
    }


def test_layout_info_and_tasks_follow_lerobot_v3(root):
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert files == [
        DATA_FILE,
        "meta/episodes/chunk-000/file-000.parquet",
        "meta/info.json",
        "meta/stats.json",
        "meta/tasks.parquet",
    ]
    info = json.loads((root / "meta/info.json").read_text())
    assert {k: info[k] for k in ("codebase_version", "fps", "robot_type", "chunks_size", "splits")} == {
        "codebase_version": "v3.0",
        "fps": 10,
        "robot_type": "toy_arm",
        "chunks_size": 1000,
        "splits": {"train": "0:3"},
    }
    assert (info["total_episodes"], info["total_frames"], info["total_tasks"]) == (3, 12, 2)
    assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    assert info["video_path"] is None
    assert list(info["features"]) == [
        *FEATURES,
        *("timestamp", "frame_index", "episode_index", "index", "task_index"),
        *("next.done", "is_intervention", "policy_executed"),
    ]
    assert info["features"]["observation.image"] == {
        "dtype": "image",
        "shape": [6, 5, 3],
        "names": ["height", "width", "channels"],
    }
    assert info["features"]["observation.state"]["names"] == ["x", "y", "z"]
    assert info["features"]["index"] == {"dtype": "int64", "shape": [1], "names": None}

    tasks = pq.read_table(root / "meta/tasks.parquet")
    assert tasks.to_pydict() == {"task_index": [0, 1], "task": ["pick the red cube", "push the blue cube"]}
    assert tasks.schema.pandas_metadata["index_columns"] == ["task"]  # pandas (LeRobot) indexes by task
    schema = pq.read_schema(root / DATA_FILE)
    assert schema.field("observation.state").type == pa.list_(pa.float32(), 3)
    assert schema.field("next.done").type == pa.bool_()
    images = pq.read_table(root / DATA_FILE)["observation.image"].combine_chunks()
    assert images.field("path")[5].as_py() == "images/observation.image/episode-000001/frame-000001.png"
    assert images.field("bytes")[0].as_py()[:4] == b"\x89PNG"


def test_stats_match_numpy(root, episodes):
    stats = RobotDataset(root).stats
    frames = [frame for episode in episodes for frame in episode[0]]
    for key in ("observation.state", "action"):
        values = np.stack([f[key] for f in frames]).astype(np.float64)
        for name, expected in {"mean": values.mean(0), "std": values.std(0), "min": values.min(0)}.items():
            np.testing.assert_allclose(stats[key][name], expected, rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(stats[key]["max"], values.max(0))
        assert stats[key]["count"].tolist() == [12]
    pixels = np.stack([f["observation.image"] for f in frames]).reshape(-1, 3) / 255.0
    np.testing.assert_allclose(stats["observation.image"]["mean"], pixels.mean(0).reshape(3, 1, 1), rtol=1e-9)
    np.testing.assert_allclose(stats["observation.image"]["std"], pixels.std(0).reshape(3, 1, 1), rtol=1e-9)
    np.testing.assert_allclose(stats["observation.image"]["min"], pixels.min(0).reshape(3, 1, 1))
    np.testing.assert_allclose(stats["observation.image"]["max"], pixels.max(0).reshape(3, 1, 1))
    assert stats["index"]["mean"].tolist() == [5.5] and stats["is_intervention"]["mean"].tolist() == [0.25]


def test_action_chunks_pad_with_the_episode_s_last_action(root, episodes):
    ds = RobotDataset(root, action_horizon=4)
    actions = np.stack([f["action"] for f in episodes[1][0]])  # episode 1 is frames 4..6
    chunk, mask = ds.chunk(5, 4)
    np.testing.assert_array_equal(chunk.numpy(), actions[[1, 2, 2, 2]])
    assert mask.tolist() == [True, True, False, False]
    assert ds.chunk(7, 4)[1].all()  # episode 2 has 5 frames
    item = ds[6]
    np.testing.assert_array_equal(item["action_chunk"].numpy(), actions[[2, 2, 2, 2]])
    assert item["action_chunk_mask"].tolist() == [True, False, False, False]
    assert ds.chunk(-1, 2)[1].tolist() == [True, False]


def test_data_files_roll_over_at_the_frame_limit(tmp_path, episodes):
    root = write(tmp_path / "ds", episodes, frames_per_file=7)  # episodes 0 + 1 fill file-000 exactly
    assert sorted(p.name for p in (root / "data/chunk-000").iterdir()) == [
        "file-000.parquet",
        "file-001.parquet",
    ]
    assert pq.read_metadata(root / "data/chunk-000/file-001.parquet").num_rows == 5
    ds = RobotDataset(root)
    assert [(e["data/chunk_index"], e["data/file_index"]) for e in ds.episodes] == [(0, 0), (0, 0), (0, 1)]
    assert torch.equal(ds[11]["action"], torch.from_numpy(episodes[2][0][4]["action"]))

    root = write(
        tmp_path / "one_per_file", episodes, frames_per_file=1, chunks_size=2
    )  # never splits episodes
    files = sorted(str(p.relative_to(root / "data")) for p in (root / "data").rglob("*.parquet"))
    assert files == ["chunk-000/file-000.parquet", "chunk-000/file-001.parquet", "chunk-001/file-000.parquet"]
    assert len(RobotDataset(root)) == 12


# ----- bad input -----------------------------------------------------------------------------------


def test_a_path_that_is_not_a_dataset(tmp_path, root):
    with pytest.raises(ConfigError, match="nowhere is not a LeRobot dataset: no such directory"):
        RobotDataset(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="empty is not a LeRobot dataset: the directory is empty"):
        RobotDataset(tmp_path / "empty")
    (tmp_path / "empty" / "notes.txt").write_text("")
    with pytest.raises(ConfigError, match="empty is not a LeRobot dataset: it has no meta/info.json"):
        RobotDataset(tmp_path / "empty")
    with pytest.raises(ConfigError, match=r"info.json is a file, not a dataset directory: .* \(here .*ds\)"):
        RobotDataset(root / "meta/info.json")


def edit_info(root, edit):
    path = root / "meta/info.json"
    info = json.loads(path.read_text())
    edit(info)
    path.write_text(json.dumps(info))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda info: info.update(codebase_version="v2.1"), "codebase_version is 'v2.1'"),
        (
            lambda info: info["features"]["observation.state"].update(shape=[4]),
            r"column 'observation.state' holds vectors of length 3, but meta/info.json declares dtype "
            r"float32, shape \[4\]",
        ),
        (
            lambda info: info["features"]["observation.image"].update(shape=[8, 8, 3]),
            r"the first image in 'observation.image' is \[6, 5, 3\], meta/info.json declares \[8, 8, 3\]",
        ),
        (
            lambda info: info["features"].update(wrist={"dtype": "image", "shape": [6, 5, 3]}),
            r"file-000.parquet: feature 'wrist' \(dtype image, shape \[6, 5, 3\]\) is declared in "
            r"meta/info.json but the file has no such column",
        ),
        (
            lambda info: info["features"]["observation.image"].update(dtype="video"),
            "feature 'observation.image' is stored as MP4 video",
        ),
        (lambda info: info["features"].pop("index"), r"the features \['index'\] that every LeRobot dataset"),
        (
            lambda info: info.update(total_frames=13),
            "episodes hold 12 frames, meta/info.json says total_frames = 13",
        ),
    ],
)
def test_info_that_does_not_match_the_data(root, edit, message):
    edit_info(root, edit)
    with pytest.raises(ConfigError, match=message):
        RobotDataset(root)


def retype(table, name, arrow_type):
    return table.set_column(table.schema.get_field_index(name), name, table[name].cast(arrow_type))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda t: t.rename_columns(["actions" if c == "action" else c for c in t.column_names]),
            r"feature 'action' \(dtype float32, shape \[2\]\) is declared in meta/info.json but the file has "
            r"no such column; its columns are \[.*'actions'.*\]: rename the column back",
        ),
        (
            lambda t: t.drop_columns(["observation.image"]),
            r"feature 'observation.image' \(dtype image, shape \[6, 5, 3\]\) is declared in meta/info.json "
            r"but the file has no such column",
        ),
        (
            lambda t: retype(t, "action", pa.list_(pa.float64(), 2)),
            r"column 'action' holds double values, but meta/info.json declares dtype float32, shape \[2\]",
        ),
        (
            lambda t: retype(t, "next.done", pa.int64()),
            r"column 'next.done' has type int64, but meta/info.json declares dtype bool, shape \[1\]",
        ),
    ],
)
def test_data_columns_that_do_not_match_info(root, change, message):
    path = root / DATA_FILE
    pq.write_table(change(pq.read_table(path)), path)
    with pytest.raises(ConfigError, match=message):
        RobotDataset(root)


@pytest.mark.parametrize(
    ("missing", "message"),
    [
        (DATA_FILE, r"data file .*file-000.parquet is missing \(episodes \[0, 1, 2\]"),
        ("meta/episodes", "no episode metadata"),
        ("meta/tasks.parquet", "task file .*tasks.parquet is missing"),
        ("meta/stats.json", "statistics file .*stats.json is missing"),
    ],
)
def test_missing_files_are_named(root, missing, message):
    path = root / missing
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    with pytest.raises(ConfigError, match=message):
        RobotDataset(root)


def test_check_features_names_every_problem(root):
    ds = RobotDataset(root)
    ds.check_features({"observation.state": (3,), "observation.image": (6, 5, 3), "action": (2,)})
    with pytest.raises(ConfigError) as err:
        ds.check_features({"observation.state": (9,), "observation.images.wrist": (6, 5, 3), "action": (2,)})
    message = str(err.value)
    assert "'observation.state' has shape [3], the policy needs [9]" in message
    assert "'observation.images.wrist' is missing" in message and "'action' has" not in message


def test_writer_refuses_bad_frames_and_features(tmp_path, root):
    frame = make_episodes()[0][0][0]
    writer = DatasetWriter(tmp_path / "new", 10, FEATURES)
    with pytest.raises(ValueError, match=r"missing features \['observation.image'\], unexpected \['obs'\]"):
        writer.add_frame(
            {"observation.state": frame["observation.state"], "action": frame["action"], "obs": 1}
        )
    with pytest.raises(ValueError, match=r"'observation.state': got float64 \(4,\), expected dtype float32"):
        writer.add_frame(frame | {"observation.state": np.zeros(4)})
    with pytest.raises(ValueError, match=r"'observation.image': got float32 \(6, 5, 3\), expected uint8"):
        writer.add_frame(frame | {"observation.image": np.zeros((6, 5, 3), np.float32)})
    with pytest.raises(ValueError, match="no frames were added"):
        writer.save_episode("task", True)
    with pytest.raises(ValueError, match="no episodes were saved"):
        writer.finalize()
    with pytest.raises(FileExistsError, match="not empty"):
        DatasetWriter(root, 10, FEATURES)
    with pytest.raises(ValueError, match="'index' is reserved"):
        DatasetWriter(tmp_path / "other", 10, {"index": {"dtype": "int64", "shape": [1]}})

    crashed = tmp_path / "crashed"  # an exception inside the writer leaves no info.json behind
    with pytest.raises(RuntimeError, match="robot fell over"), DatasetWriter(crashed, 10, FEATURES) as writer:
        writer.add_frame(frame)
        writer.save_episode("task", True)
        raise RuntimeError("robot fell over")
    with pytest.raises(ValueError, match="not a LeRobot dataset"):
        RobotDataset(crashed)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"codebase_version": "v3.0", ', r"info.json is not valid JSON \(Expecting"),
        (b"\xff\xfe{}", r"info.json is not valid JSON \('utf-8' codec can't decode"),
        (b"[1, 2]", "info.json holds a JSON array, not an object of dataset fields"),
        (b"3", "info.json holds a JSON number, not an object of dataset fields"),
        (
            b'{"codebase_version": "v3.0", "fps": 10, "features": [], "data_path": "d", "total_episodes": 1, '
            b'"total_frames": 1}',
            "features is a JSON array, not an object",
        ),  # fmt: skip
    ],
)
def test_info_json_that_is_not_an_object_of_fields(root, content, message):
    (root / "meta/info.json").write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        RobotDataset(root)


@pytest.mark.parametrize(
    "name", [DATA_FILE, "meta/episodes/chunk-000/file-000.parquet", "meta/tasks.parquet"]
)
def test_a_garbage_parquet_file_is_named(root, name):
    (root / name).write_bytes(b"PAR1 this is not parquet PAR1")
    with pytest.raises(ConfigError, match=f"{name} is not a readable parquet file .*: restore the file"):
        RobotDataset(root)


def replace_image(root, row, data):
    table = pq.read_table(root / DATA_FILE)
    images = table["observation.image"].combine_chunks()
    png = images.field("bytes").to_pylist()
    png[row] = data
    column = pa.StructArray.from_arrays([pa.array(png, pa.binary()), images.field("path")], ["bytes", "path"])
    index = table.column_names.index("observation.image")
    pq.write_table(table.set_column(index, "observation.image", column), root / DATA_FILE)


def test_an_undecodable_png_names_the_file_episode_and_frame(root):
    replace_image(root, 5, b"\x89PNG but not really")  # episode 1, frame 1
    ds = RobotDataset(root)  # only the first image is decoded on opening
    where = r"file-000.parquet: 'observation.image' of episode 1, frame 1 is not a readable PNG"
    with pytest.raises(ConfigError, match=where):
        ds[5]
    with pytest.raises(ConfigError, match=where):
        ds.episode(1)
    assert ds[4]["observation.image"].shape == (3, 6, 5)
    replace_image(root, 0, ds._columns["observation.image"][0][:40])  # a truncated first image
    with pytest.raises(ConfigError, match=r"the first image in 'observation.image' is not a readable PNG"):
        RobotDataset(root)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda root: edit_info(
                root, lambda info: info["features"]["episode_index"].update(dtype="float32")
            ),
            r"feature 'episode_index' has dtype float32, shape \[1\], but LeRobot's episode_index is a int64",
        ),
        (
            lambda root: edit_info(root, lambda info: info.update(data_path="data/{chunk}.parquet")),
            "data_path is 'data/{chunk}.parquet', not a path template",
        ),
        (
            lambda root: (root / "meta/stats.json").write_text(
                json.dumps({"observation.state": {"mean": [0, float("nan"), 0], "std": [1, 1, 1]}})
            ),
            r"'observation.state' needs a finite 'mean' of shape \[3\]",
        ),
        (
            lambda root: pq.write_table(
                retype(pq.read_table(root / DATA_FILE), "action", pa.list_(pa.float32(), 2)).set_column(
                    1, "action", pa.array([[np.nan, 0.0]] + [[0.0, 0.0]] * 11, pa.list_(pa.float32(), 2))
                ),
                root / DATA_FILE,
            ),
            "column 'action' has NaN or infinite values in 1 rows",
        ),
        (
            lambda root: pq.write_table(
                pq.read_table(root / "meta/episodes/chunk-000/file-000.parquet").set_column(
                    2, "length", pa.array([4, 2, 5], pa.int64())
                ),
                root / "meta/episodes/chunk-000/file-000.parquet",
            ),
            r"episode 1 has frames 4..7 and length 2, but episodes hold consecutive frames",
        ),
    ],
)
def test_inconsistent_metadata_and_values_are_named(root, edit, message):
    edit(root)
    with pytest.raises(ConfigError, match=message):
        RobotDataset(root)


FITS = {"observation.state": (3,), "observation.image": (6, 5, 3), "action": (2,)}


def test_config_keys_name_the_dataset_that_does_not_fit(root, tmp_path):
    check_dataset(root, "data.path", FITS)  # reads no frame
    assert len(open_dataset(root, "data.path", FITS)) == 12
    with pytest.raises(ConfigError, match=r"^config error: data.path = '.*ds': dataset .*ds does not fit the "
                       r"policy: 'action' has shape \[2\], the policy needs \[3\]"):  # fmt: skip
        check_dataset(root, "data.path", FITS | {"action": (3,)})
    with pytest.raises(ConfigError, match=r"^config error: train.demos = .* 'action' has shape \[2\]"):
        open_dataset(root, "train.demos", FITS | {"action": (3,)})
    with pytest.raises(ConfigError, match="^config error: data.path is empty"):
        check_dataset("", "data.path")
    with pytest.raises(
        ConfigError, match=r"^config error: data.path = '.*info.json': .* is a file, not a data"
    ):
        check_dataset(root / "meta/info.json", "data.path")
    with pytest.raises(
        ConfigError, match=r"^config error: data.path = .*: .*tasks.parquet is not a readable"
    ):
        (root / "meta/tasks.parquet").write_bytes(b"")
        check_dataset(root, "data.path")

    renamed = tmp_path / "renamed"  # a consistent dataset whose action feature has another name
    features = {("actions" if k == "action" else k): v for k, v in FEATURES.items()}
    with DatasetWriter(renamed, fps=10, features=features) as writer:
        frame = make_episodes()[0][0][0]
        writer.add_frame({("actions" if k == "action" else k): v for k, v in frame.items()})
        writer.save_episode("task", True)
    with pytest.raises(ConfigError, match=r"'action' is missing \(the policy needs shape \[2\]\).*'actions'"):
        check_dataset(renamed, "data.path", FITS)

    integers = tmp_path / "integers"  # integer actions, where the policy predicts real numbers
    with DatasetWriter(
        integers, fps=10, features=FEATURES | {"action": {"dtype": "int64", "shape": [2]}}
    ) as writer:
        writer.add_frame(frame | {"action": np.array([1, 0])})
        writer.save_episode("task", True)
    with pytest.raises(ConfigError, match="'action' has dtype int64, the policy needs float32 or float64"):
        open_dataset(integers, "data.path", FITS)


@pytest.mark.needs_robot
def test_pretrain_refuses_a_bad_data_path_before_writing_anything(root, tmp_path):
    from mmrl.config import load_config
    from vla_rl.pretrain import VLABCConfig, demonstrations

    out = tmp_path / "run"
    (tmp_path / "empty").mkdir()
    cases = {
        root / "meta/info.json": "info.json is a file, not a dataset directory",
        tmp_path / "empty": "empty is not a LeRobot dataset: the directory is empty",
        root: r"does not fit the policy: 'observation.image' has shape \[6, 5, 3\], the policy needs \[96",
    }
    for path, message in cases.items():
        with pytest.raises(ConfigError, match=f"^config error: data.path = '{path}': .*{message}") as err:
            load_config("pretrain/vla", [f"data.path={path}", f"output_dir={out}"])
        assert "\n" not in str(err.value)
    assert isinstance(load_config("pretrain/vla", [f"output_dir={out}"]), VLABCConfig)  # null: record demos

    (root / DATA_FILE).write_bytes(
        b"garbage"
    )  # through the command line: exit code 2, one line, no traceback
    result = subprocess.run(
        [sys.executable, "-m", "mmrl", "pretrain", "vla", f"data.path={root}", f"output_dir={out}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: config error: data.path = '{root}': "), lines
    assert f"{root / DATA_FILE} is not a readable parquet file" in lines[0]
    assert not out.exists()

    shutil.copytree(root, out / "demos")  # demonstrations an earlier run recorded, damaged since
    message = (
        r"recorded in '.*demos' cannot be used \(.*file-000.parquet is not a readable parquet file .*\): "
        "delete that folder"
    )
    with pytest.raises(ConfigError, match=message):
        demonstrations(load_config("pretrain/vla", [f"output_dir={out}"]), out)


@pytest.mark.needs_rendering  # HABC renders camera frames
def test_habc_names_train_demos_that_are_not_a_dataset(root, tmp_path):
    from mmrl.config import load_config
    from vla_rl.policy import VLAConfig, VLAPolicy, task_vocabulary
    from vla_rl.trainer import VLAOnlineTrainer

    policy = VLAConfig(vocabulary=task_vocabulary(), image_size=16, channels=[4], keypoints=4, hidden=8)
    VLAPolicy(policy).save_pretrained(tmp_path / "policy")
    (root / "meta/info.json").write_text("[]")
    overrides = [f"model.path={tmp_path / 'policy'}", "rollout.task=Reach", "rollout.num_envs=1"]
    demos = [f"train.demos={root}", "train.demo_episodes=0"]  # the recipe records its own by default
    config = load_config("vla/habc", [f"output_dir={tmp_path / 'run'}", *overrides, *demos])
    message = (
        f"^config error: train.demos = '{root}': {root}/meta/info.json holds a JSON array, not an object"
    )
    with pytest.raises(ConfigError, match=message):
        VLAOnlineTrainer(config).train()
    assert not (tmp_path / "run" / "config.yaml").exists()  # refused before the run directory is written


# ----- replay buffer -------------------------------------------------------------------------------


def episode_data(rng, steps):
    obs = {
        "observation.state": rng.normal(size=(steps + 1, 3)).astype(np.float32),
        "observation.image": rng.integers(0, 256, (steps + 1, 6, 5, 3), dtype=np.uint8),
    }
    return obs, rng.uniform(-1, 1, (steps, 2)).astype(np.float32)


def filled_buffer(capacity=100):
    """Episode 0 succeeds (expert at steps 2-3 of 6); episode 1 fails (expert at steps 3-4 of 5)."""
    rng = np.random.default_rng(1)
    buffer, data = ReplayBuffer(capacity), []
    for steps, flags, success in [(6, [0, 0, 1, 1, 0, 0], True), (5, [0, 0, 0, 1, 1], False)]:
        obs, action = episode_data(rng, steps)
        buffer.add_episode(obs, action, success, f"task {len(data)}", is_intervention=flags)
        data.append((obs, action, np.array(flags, bool), success))
    return buffer, data


def test_buffer_keeps_the_three_kinds_apart():
    buffer, data = filled_buffer()
    assert buffer.sizes() == {"policy": 4 + 3, "intervention": 2 + 2, "failure": 5}
    assert [(s.episode, s.start, s.length) for s in buffer.segments["policy"]] == [
        (0, 0, 2),
        (0, 4, 2),
        (1, 0, 3),
    ]
    assert [(s.episode, s.start, s.length) for s in buffer.segments["intervention"]] == [(0, 2, 2), (1, 3, 2)]
    takeover = buffer.segments["intervention"][0]
    np.testing.assert_array_equal(takeover.obs["observation.state"], data[0][0]["observation.state"][2:5])
    assert takeover.is_intervention.all() and takeover.outcome and not takeover.done
    assert buffer.segments["policy"][1].done  # the success ended episode 0
    assert not buffer.segments["intervention"][1].done  # episode 1 ran out of time: bootstrap from s'
    assert buffer.segments["failure"][0].is_intervention.tolist() == data[1][2].tolist()


def test_buffer_sampling_follows_the_mix_and_the_generator():
    buffer, data = filled_buffer()
    mix = {"policy": 2, "intervention": 1, "failure": 1}
    batch = buffer.sample(10, mix, torch.Generator().manual_seed(0))
    assert batch["kind"].tolist() == [0] * 5 + [1] * 3 + [2] * 2
    assert batch["obs"]["observation.image"].shape == (10, 3, 6, 5)
    assert not batch["is_intervention"][:5].any() and batch["is_intervention"][5:8].all()
    for b in range(10):  # every transition is (s_t, a_t, r_t, s_t+1) of its episode
        obs, action, flags, success = data[int(batch["episode"][b])]
        t = int(np.flatnonzero((action == batch["action"][b].numpy()).all(1))[0])
        assert torch.equal(
            batch["obs"]["observation.state"][b], torch.from_numpy(obs["observation.state"][t])
        )
        image = torch.from_numpy(obs["observation.image"][t + 1]).permute(2, 0, 1)
        assert torch.equal(batch["next_obs"]["observation.image"][b], image)
        assert batch["is_intervention"][b] == flags[t] and batch["outcome"][b] == float(success)
        last = t == len(action) - 1
        assert batch["reward"][b] == float(success and last) and batch["done"][b] == (success and last)
        assert batch["task"][b] == f"task {int(batch['episode'][b])}"

    again = buffer.sample(10, mix, torch.Generator().manual_seed(0))
    assert torch.equal(again["action"], batch["action"]) and torch.equal(again["episode"], batch["episode"])
    other = buffer.sample(10, mix, torch.Generator().manual_seed(1))
    assert not torch.equal(other["action"], batch["action"])
    with pytest.raises(ValueError, match="asks for 'failure' transitions but the buffer has none"):
        ReplayBuffer(10).sample(4, {"failure": 1}, torch.Generator())
    with pytest.raises(ValueError, match="over the kinds"):
        buffer.sample(4, {"demos": 1}, torch.Generator())


def test_buffer_evicts_oldest_segments_per_kind():
    rng = np.random.default_rng(2)
    buffer = ReplayBuffer({"policy": 7, "intervention": 100, "failure": 3})
    for _ in range(3):
        buffer.add_episode(*episode_data(rng, 3), success=False, task="t")
    assert [s.episode for s in buffer.segments["policy"]] == [1, 2]  # 9 > 7: episode 0 went first
    assert [s.episode for s in buffer.segments["failure"]] == [2]
    assert buffer.sizes() == {"policy": 6, "intervention": 0, "failure": 3}


def test_buffer_save_and_load_resume_exactly(tmp_path):
    buffer, _ = filled_buffer(capacity={"policy": 50, "intervention": 40, "failure": 30})
    buffer.save(tmp_path / "buffer")
    assert sorted(p.name for p in (tmp_path / "buffer").iterdir()) == ["buffer.json", "buffer.safetensors"]
    loaded = ReplayBuffer.load(tmp_path / "buffer")
    assert loaded.sizes() == buffer.sizes() and loaded.capacity == buffer.capacity
    mix = dict.fromkeys(KINDS, 1.0)
    a = buffer.sample(16, mix, torch.Generator().manual_seed(5))
    b = loaded.sample(16, mix, torch.Generator().manual_seed(5))
    for key in ("action", "reward", "done", "outcome", "is_intervention", "episode", "kind"):
        assert torch.equal(a[key], b[key]), key
    for key in a["obs"]:
        assert torch.equal(a["obs"][key], b["obs"][key]) and torch.equal(
            a["next_obs"][key], b["next_obs"][key]
        )
    assert a["task"] == b["task"]
    new = episode_data(np.random.default_rng(3), 2)
    assert (
        loaded.add_episode(*new, success=True, task="t")
        == buffer.add_episode(*new, success=True, task="t")
        == 2
    )
    with pytest.raises(FileNotFoundError, match="buffer.json is missing"):
        ReplayBuffer.load(tmp_path / "nothing")


def test_buffer_exports_whole_episodes(tmp_path):
    buffer, data = filled_buffer()
    with DatasetWriter(tmp_path / "online", 10, FEATURES) as writer:
        assert buffer.export(writer) == 2
    ds = RobotDataset(tmp_path / "online")
    assert [(e["length"], e["success"], e["num_interventions"]) for e in ds.episodes] == [
        (6, True, 1),
        (5, False, 1),
    ]
    for e, (obs, action, flags, _) in enumerate(data):
        episode = ds.episode(e)
        np.testing.assert_array_equal(episode["observation.state"].numpy(), obs["observation.state"][:-1])
        np.testing.assert_array_equal(episode["action"].numpy(), action)
        assert episode["is_intervention"].tolist() == flags.tolist()
        assert episode["policy_executed"].tolist() == (~flags).tolist()


# ----- recording in sim ----------------------------------------------------------------------------


@pytest.mark.needs_robot
def test_record_expert_demonstrations_on_reach(tmp_path):
    import sim

    ds = record_episodes("Reach", None, n=2, seed=0, root=tmp_path / "reach")
    assert ds.info["total_episodes"] == 2 and ds.fps == 10 and ds.info["robot_type"] == "mmrl_gantry_arm"
    assert all(e["success"] and e["source"] == "expert" for e in ds.episodes)
    assert ds.tasks[0].startswith("move the gripper to the") and "observation.image" not in ds.features
    assert ds.features["observation.state"]["names"][:2] == ["ee_pos.0", "ee_pos.1"]
    assert ds[0]["is_intervention"] and not ds[0]["policy_executed"]
    env = sim.make("Reach")  # replaying the recorded actions from the same seed revisits the recorded states
    obs, _ = env.reset(seed=1)
    episode = ds.episode(1)
    for state, action in zip(episode["observation.state"], episode["action"], strict=True):
        np.testing.assert_allclose(obs["state"], state.numpy(), atol=1e-6)
        obs, *_ = env.step(action.numpy())


@pytest.mark.needs_robot
def test_record_with_images_and_with_a_policy(tmp_path):
    import sim

    ds = record_episodes(
        "Reach", None, n=1, seed=3, root=tmp_path / "rgb", obs_mode="state+rgb", image_size=32
    )
    assert ds.features["observation.image"]["shape"] == [32, 32, 3]
    env = sim.make("Reach", obs_mode="state+rgb", image_size=32)
    obs, _ = env.reset(seed=3)
    assert torch.equal(ds[0]["observation.image"], torch.from_numpy(obs["image"]).permute(2, 0, 1))
    env.close()

    class Still(Controller):
        def propose(self, obs, instructions, rows):
            assert all(text.startswith("move the gripper") for text in instructions)
            return np.zeros((len(obs), 5), np.float32)

    ds = record_episodes("Reach", Still(), n=1, seed=0, root=tmp_path / "policy")
    assert len(ds) == 50 and ds.episodes[0]["source"] == "policy" and not ds.episodes[0]["success"]
    assert ds[0]["policy_executed"] and not ds[0]["is_intervention"]


@pytest.mark.needs_robot
def test_noisy_execution_records_the_clean_expert_actions(tmp_path):
    """DART: the executed actions are perturbed, the recorded labels are the expert's own actions at the
    states the perturbed run visited; the noise changes the path, and a second recording repeats it."""
    import sim
    from sim import expert_for

    clean = record_episodes("Push", None, n=1, seed=5, root=tmp_path / "clean")
    noisy = record_episodes("Push", None, n=1, seed=5, root=tmp_path / "noisy", action_noise=0.3)
    again = record_episodes("Push", None, n=1, seed=5, root=tmp_path / "again", action_noise=0.3)
    env = sim.make("Push")
    expert = expert_for(env)
    episode = noisy.episode(0)
    for state, action in zip(episode["observation.state"], episode["action"], strict=True):
        np.testing.assert_allclose(expert(state.numpy()), action.numpy(), atol=1e-5)
    env.close()
    states = [ds.episode(0)["observation.state"] for ds in (clean, noisy, again)]
    assert not torch.equal(states[0][:5], states[1][:5])
    assert torch.equal(states[1], states[2])
