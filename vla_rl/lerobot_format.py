"""Robot datasets in the LeRobotDataset v3.0 on-disk layout (codebase_version "v3.0", LeRobot >= 0.4).

Demonstrations and online episodes are kept the way LeRobot keeps them, so that LeRobot's tools and
policies read what we record, and LeRobot v3.0 datasets with image features can be read here:

    meta/info.json                            fps, robot_type, features (dtype, shape, names), path
                                              templates, totals, splits
    meta/stats.json                           mean/std/min/max/count per feature (for normalisation)
    meta/tasks.parquet                        task_index <-> task string
    meta/episodes/chunk-000/file-000.parquet  one row per episode: its frame range and data file
    data/chunk-000/file-000.parquet           one row per frame; file-001, ... once a file is full

Images: v3.0 normally encodes cameras as MP4 (videos/<key>/chunk-000/file-000.mp4), but neither
PyAV nor ffmpeg is a dependency of this project, so camera features have dtype "image": every frame
is a PNG embedded in the data parquet as a {"bytes", "path"} struct, with the path named after LeRobot's
images/<key>/episode-XXXXXX/frame-XXXXXX.png layout. That is how LeRobot itself stores image features
(it stages the PNGs there and embeds them), and it keeps a dataset to a few files instead of one per
frame. Datasets with "video" features are refused with a message saying so.

This module holds the layout's names and the writer; `vla_rl.lerobot_checks` checks a dataset on disk
and `vla_rl.dataset.RobotDataset` reads one.

Beyond LeRobot's columns, frames carry `is_intervention` (the scripted expert chose this action) and
`policy_executed` (a learned policy chose it); episodes carry `success`, `num_interventions`
(policy-to-expert takeovers), `intervention_frames` and `source` ("expert", "policy" or "other").
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

CODEBASE_VERSION = "v3.0"
CHUNK_FILE = "chunk-{chunk_index:03d}/file-{file_index:03d}"
DATA_PATH = "data/" + CHUNK_FILE + ".parquet"
EPISODES_PATH = "meta/episodes/" + CHUNK_FILE + ".parquet"
IMAGE_PATH = "images/{image_key}/episode-{episode_index:06d}/frame-{frame_index:06d}.png"
INFO_PATH, STATS_PATH, TASKS_PATH = "meta/info.json", "meta/stats.json", "meta/tasks.parquet"
STATE_KEY, IMAGE_KEY, ACTION_KEY = "observation.state", "observation.image", "action"

NUMERIC = {
    "float32": pa.float32(),
    "float64": pa.float64(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "bool": pa.bool_(),
}
IMAGE_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def _scalar(dtype: str) -> dict[str, Any]:
    return {"dtype": dtype, "shape": [1], "names": None}


LEROBOT_FRAME_FEATURES = {
    "timestamp": _scalar("float32"),
    "frame_index": _scalar("int64"),
    "episode_index": _scalar("int64"),
    "index": _scalar("int64"),
    "task_index": _scalar("int64"),
}
FRAME_FEATURES = {  # what the writer adds to every frame: LeRobot's bookkeeping, then ours
    **LEROBOT_FRAME_FEATURES,
    "next.done": _scalar("bool"),
    "is_intervention": _scalar("bool"),
    "policy_executed": _scalar("bool"),
}
EPISODE_SCHEMA = pa.schema(
    [
        ("episode_index", pa.int64()),
        ("tasks", pa.list_(pa.string())),
        ("length", pa.int64()),
        ("dataset_from_index", pa.int64()),
        ("dataset_to_index", pa.int64()),
        ("data/chunk_index", pa.int64()),
        ("data/file_index", pa.int64()),
        ("meta/episodes/chunk_index", pa.int64()),
        ("meta/episodes/file_index", pa.int64()),
        ("success", pa.bool_()),
        ("num_interventions", pa.int64()),
        ("intervention_frames", pa.int64()),
        ("source", pa.string()),
    ]
)
EPISODE_REQUIRED = ("episode_index", "length", "dataset_from_index", "dataset_to_index")


def arrow_type(feature: Mapping[str, Any]) -> pa.DataType:
    """The parquet column type of a feature: scalars for shape [1], fixed-size lists for vectors."""
    if feature["dtype"] == "image":
        return IMAGE_STRUCT
    value = NUMERIC[feature["dtype"]]
    return value if list(feature["shape"]) == [1] else pa.list_(value, feature["shape"][0])


def describe(feature: Mapping[str, Any]) -> str:
    """A feature's dtype and shape, as error messages name them."""
    return f"dtype {feature['dtype']}, shape {list(feature['shape'])}"


def _check_writer_features(features: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Validated copies of the caller's features, in the form info.json stores them."""
    checked: dict[str, dict[str, Any]] = {}
    for name, feature in features.items():
        if "/" in name or name in FRAME_FEATURES:
            raise ValueError(
                f"feature name {name!r} is reserved or contains '/'; the writer adds {list(FRAME_FEATURES)}"
            )
        dtype, shape = feature.get("dtype"), [int(s) for s in feature.get("shape", ())]
        if dtype == "image" and (len(shape) != 3 or shape[2] != 3):
            raise ValueError(f"image feature {name!r}: shape {shape}, expected [height, width, 3]")
        if dtype in NUMERIC and len(shape) != 1:
            raise ValueError(f"feature {name!r}: shape {shape}; numeric features are 1-D vectors")
        if dtype != "image" and dtype not in NUMERIC:
            raise ValueError(f"feature {name!r}: dtype {dtype!r}; supported: {[*NUMERIC, 'image']}")
        default_names = ["height", "width", "channels"] if dtype == "image" else None
        checked[name] = {"dtype": dtype, "shape": shape, "names": feature.get("names") or default_names}
    return checked


class _Moments:
    """Running mean/variance/min/max over episodes (Chan et al.'s pairwise merge), so stats need no
    second pass over the data."""

    def __init__(self) -> None:
        self.n, self.frames = 0, 0
        self.mean = self.m2 = self.min = self.max = np.zeros(0)

    def update(self, values: np.ndarray, image: bool) -> None:
        """Merge one episode's values: (T, d) numbers, or (T, H, W, C) uint8 images taken per channel
        in [0, 1] (through a histogram: exact, and far cheaper than float arithmetic on every pixel)."""
        if image:
            levels = np.arange(256) / 255.0
            hist = np.stack(
                [np.bincount(values[..., c].ravel(), minlength=256) for c in range(values.shape[-1])]
            )
            m = int(hist[0].sum())
            mean = hist @ levels / m
            m2 = (hist * (levels - mean[:, None]) ** 2).sum(1)
            seen = hist > 0
            lo, hi = levels[seen.argmax(1)], levels[255 - seen[:, ::-1].argmax(1)]
        else:
            rows = values.reshape(len(values), -1).astype(np.float64)
            m, mean, lo, hi = len(rows), rows.mean(0), rows.min(0), rows.max(0)
            m2 = ((rows - mean) ** 2).sum(0)
        if self.n == 0:
            self.mean, self.m2, self.min, self.max = mean, m2, lo, hi
        else:
            delta, total = mean - self.mean, self.n + m
            self.mean = self.mean + delta * m / total
            self.m2 = self.m2 + m2 + delta**2 * self.n * m / total
            self.min, self.max = np.minimum(self.min, lo), np.maximum(self.max, hi)
        self.n, self.frames = self.n + m, self.frames + len(values)

    def result(self, image: bool) -> dict[str, list]:
        """LeRobot's stats.json entry: per dimension, or per channel as [C, 1, 1] in [0, 1] for images."""
        shape = (-1, 1, 1) if image else (-1,)
        stats = {"min": self.min, "max": self.max, "mean": self.mean, "std": np.sqrt(self.m2 / self.n)}
        return {k: np.reshape(v, shape).tolist() for k, v in stats.items()} | {"count": [self.frames]}


def _write_json(data: Any, path: Path) -> None:
    """Write through a temporary file, so a reader never sees half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=4))
    os.replace(tmp, path)


def _write_tasks(path: Path, tasks: list[str]) -> None:
    """tasks.parquet with pandas metadata that makes the task string the index, as LeRobot reads it
    (`tasks.iloc[task_index].name`), without needing pandas here."""
    table = pa.table(
        {"task_index": pa.array(range(len(tasks)), pa.int64()), "task": pa.array(tasks, pa.string())}
    )
    column = {"field_name": None, "metadata": None}
    pandas_meta = {
        "index_columns": ["task"],
        "column_indexes": [
            {
                "name": None,
                "field_name": None,
                "pandas_type": "unicode",
                "numpy_type": "object",
                "metadata": {"encoding": "UTF-8"},
            },
        ],
        "columns": [
            column
            | {
                "name": "task_index",
                "field_name": "task_index",
                "pandas_type": "int64",
                "numpy_type": "int64",
            },
            column | {"name": "task", "field_name": "task", "pandas_type": "unicode", "numpy_type": "object"},
        ],
        "attributes": {},
        "creator": {"library": "pyarrow", "version": pa.__version__},
        "pandas_version": "2.2.3",
    }
    pq.write_table(table.replace_schema_metadata({"pandas": json.dumps(pandas_meta)}), path)


def _png(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG", compress_level=1)  # level 1: fast, nearly as small
    return buffer.getvalue()


class DatasetWriter:
    """Writes episodes, frame by frame, into a new LeRobot v3.0 dataset directory.

    `features` maps names to {"dtype", "shape", "names"}: numeric vectors ("float32", ...) and images
    (dtype "image", shape [H, W, 3], uint8 frames). The bookkeeping columns in FRAME_FEATURES are added.
    `save_episode` appends an episode to the current data file as one parquet row group, starting a new
    file first if the file would pass `frames_per_file` (LeRobot's own limit is in MB; episodes never
    straddle files), and `finalize` writes the metadata. Until then the directory has no meta/info.json,
    so a crashed recording is never mistaken for a dataset. As a context manager it finalizes on exit.
    """

    def __init__(
        self,
        root: str | Path,
        fps: float,
        features: Mapping[str, Mapping[str, Any]],
        robot_type: str | None = None,
        *,
        frames_per_file: int = 10_000,
        chunks_size: int = 1000,
    ) -> None:
        self.root = Path(root)
        if self.root.exists() and any(self.root.iterdir()):
            raise FileExistsError(
                f"{self.root} exists and is not empty; a dataset is written into a new directory"
            )
        if fps <= 0 or frames_per_file < 1 or chunks_size < 1:
            raise ValueError(
                f"fps={fps}, frames_per_file={frames_per_file}, chunks_size={chunks_size}: need > 0"
            )
        self.fps, self.robot_type = fps, robot_type
        self.frames_per_file, self.chunks_size = frames_per_file, chunks_size
        self.user_features = _check_writer_features(features)
        self.features = {**self.user_features, **FRAME_FEATURES}
        self._schema = pa.schema([(name, arrow_type(f)) for name, f in self.features.items()])
        self._frames: list[dict[str, Any]] = []
        self._episodes: list[dict[str, Any]] = []
        self._tasks: dict[str, int] = {}
        self._moments = {name: _Moments() for name in self.features}
        self._parquet: pq.ParquetWriter | None = None
        self._chunk = self._file = self._file_frames = self._total_frames = 0
        self._finalized = False

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None and not self._finalized:
            self.finalize()
        elif self._parquet is not None:  # leave the partial data, without metadata, for inspection
            self._parquet.close()
            self._parquet = None

    def add_frame(
        self, frame: Mapping[str, Any], *, is_intervention: bool = False, policy_executed: bool = False
    ) -> None:
        """Buffer one frame: the observation features and the action taken from it (values are copied)."""
        self._check_open()
        missing = sorted(set(self.user_features) - set(frame))
        extra = sorted(set(frame) - set(self.user_features))
        if missing or extra:
            raise ValueError(
                f"frame {len(self._frames)}: missing features {missing}, unexpected {extra}; "
                f"this dataset's features are {sorted(self.user_features)}"
            )
        row: dict[str, Any] = {
            "is_intervention": bool(is_intervention),
            "policy_executed": bool(policy_executed),
        }
        for name, feature in self.user_features.items():
            value, shape = np.asarray(frame[name]), tuple(feature["shape"])
            if feature["dtype"] == "image":
                if value.dtype != np.uint8 or value.shape != shape:
                    raise ValueError(
                        f"feature {name!r}: got {value.dtype} {value.shape}, expected uint8 {shape}"
                    )
                row[name] = value.copy()
            elif value.size != shape[0] or not np.can_cast(value.dtype, feature["dtype"], "same_kind"):
                raise ValueError(
                    f"feature {name!r}: got {value.dtype} {value.shape}, expected {describe(feature)}"
                )
            else:
                row[name] = value.astype(feature["dtype"]).reshape(shape)
        self._frames.append(row)

    def save_episode(self, task: str, success: bool, source: str | None = None) -> int:
        """Write the buffered frames as one episode and return its index.

        `task` is the instruction; `source` defaults to "policy" if a policy acted in any frame,
        "expert" if the expert acted in all of them, else "other".
        """
        self._check_open()
        if not self._frames:
            raise ValueError("save_episode: no frames were added since the last episode")
        if not isinstance(task, str) or not task:
            raise ValueError(f"save_episode: task must be a non-empty instruction string, got {task!r}")
        length = len(self._frames)
        if self._file_frames and self._file_frames + length > self.frames_per_file:
            self._next_file()
        episode, start = len(self._episodes), self._total_frames
        steps = np.arange(length, dtype=np.int64)
        columns = {name: np.stack([f[name] for f in self._frames]) for name in self.user_features}
        columns |= {
            "timestamp": (steps / self.fps).astype(np.float32),
            "frame_index": steps,
            "episode_index": np.full(length, episode, np.int64),
            "index": start + steps,
            "task_index": np.full(length, self._tasks.setdefault(task, len(self._tasks)), np.int64),
            "next.done": steps == length - 1,
            "is_intervention": np.array([f["is_intervention"] for f in self._frames]),
            "policy_executed": np.array([f["policy_executed"] for f in self._frames]),
        }
        arrays = [self._to_arrow(name, columns[name], episode) for name in self.features]
        if self._parquet is None:
            path = self.root / DATA_PATH.format(chunk_index=self._chunk, file_index=self._file)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._parquet = pq.ParquetWriter(path, self._schema)
        self._parquet.write_table(pa.Table.from_arrays(arrays, schema=self._schema))
        for name, values in columns.items():
            self._moments[name].update(values, image=self.features[name]["dtype"] == "image")

        intervention, executed = columns["is_intervention"], columns["policy_executed"]
        if source is None:
            source = "policy" if executed.any() else "expert" if intervention.all() else "other"
        self._episodes.append(
            {
                "episode_index": episode,
                "tasks": [task],
                "length": length,
                "dataset_from_index": start,
                "dataset_to_index": start + length,
                "data/chunk_index": self._chunk,
                "data/file_index": self._file,
                "meta/episodes/chunk_index": 0,
                "meta/episodes/file_index": 0,
                "success": bool(success),
                "num_interventions": int(np.sum(intervention[1:] & executed[:-1])),
                "intervention_frames": int(intervention.sum()),
                "source": source,
            }
        )
        self._file_frames += length
        self._total_frames += length
        self._frames = []
        return episode

    def finalize(self) -> Path:
        """Close the data file and write episodes, tasks, stats and (last) info.json."""
        self._check_open()
        if self._frames:
            raise RuntimeError(
                f"{len(self._frames)} frames were added after the last save_episode; save them first"
            )
        if not self._episodes:
            raise ValueError("no episodes were saved; LeRobot datasets cannot be empty")
        assert self._parquet is not None
        self._parquet.close()
        self._parquet = None
        episodes_path = self.root / EPISODES_PATH.format(chunk_index=0, file_index=0)
        episodes_path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(self._episodes, schema=EPISODE_SCHEMA), episodes_path)
        _write_tasks(self.root / TASKS_PATH, list(self._tasks))
        stats = {name: m.result(self.features[name]["dtype"] == "image") for name, m in self._moments.items()}
        _write_json(stats, self.root / STATS_PATH)
        info = {
            "codebase_version": CODEBASE_VERSION,
            "robot_type": self.robot_type,
            "total_episodes": len(self._episodes),
            "total_frames": self._total_frames,
            "total_tasks": len(self._tasks),
            "chunks_size": self.chunks_size,
            "data_files_size_in_mb": 100,  # LeRobot's defaults, used if LeRobot appends to this dataset
            "video_files_size_in_mb": 500,
            "fps": self.fps,
            "splits": {"train": f"0:{len(self._episodes)}"},
            "data_path": DATA_PATH,
            "video_path": None,
            "features": self.features,
        }
        _write_json(info, self.root / INFO_PATH)
        self._finalized = True
        return self.root

    def _check_open(self) -> None:
        if self._finalized:
            raise RuntimeError(f"the dataset at {self.root} is finalized; open a new DatasetWriter")

    def _next_file(self) -> None:
        assert self._parquet is not None
        self._parquet.close()
        self._parquet = None
        self._file, self._file_frames = self._file + 1, 0
        if self._file == self.chunks_size:
            self._chunk, self._file = self._chunk + 1, 0

    def _to_arrow(self, name: str, values: np.ndarray, episode: int) -> pa.Array:
        feature = self.features[name]
        if feature["dtype"] == "image":
            paths = [
                IMAGE_PATH.format(image_key=name, episode_index=episode, frame_index=t)
                for t in range(len(values))
            ]
            data = pa.array([_png(v) for v in values], pa.binary())
            return pa.StructArray.from_arrays([data, pa.array(paths, pa.string())], fields=list(IMAGE_STRUCT))
        flat = pa.array(values.reshape(-1), NUMERIC[feature["dtype"]])
        return (
            flat if feature["shape"] == [1] else pa.FixedSizeListArray.from_arrays(flat, feature["shape"][0])
        )
