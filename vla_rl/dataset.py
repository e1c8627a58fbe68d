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

Beyond LeRobot's columns, frames carry `is_intervention` (the scripted expert chose this action) and
`policy_executed` (a learned policy chose it); episodes carry `success`, `num_interventions`
(policy-to-expert takeovers), `intervention_frames` and `source` ("expert", "policy" or "other").
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from PIL import Image, UnidentifiedImageError
from tqdm import tqdm

from mmrl.config import ConfigError

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


def _describe(feature: Mapping[str, Any]) -> str:
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


def _decode_png(data: bytes) -> np.ndarray:
    return np.array(Image.open(io.BytesIO(data)).convert("RGB"))


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
                    f"feature {name!r}: got {value.dtype} {value.shape}, expected {_describe(feature)}"
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


# ----- reading -------------------------------------------------------------------------------------
# Datasets come from users, so every problem with one on disk is a ConfigError that names the file,
# says what is wrong and how to fix it, instead of a traceback from pyarrow, PIL or numpy.

REDO = "restore the file or record the dataset again"
INDEX_FEATURES = ("frame_index", "episode_index", "index", "task_index")
JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean"}


def _one_line(err: BaseException) -> str:
    """A library error's message on one line (pyarrow's span several), cut to a readable length."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:  # ValueError: not JSON, or not UTF-8
        raise ConfigError(f"{path} is not valid JSON ({_one_line(err)}): {REDO}") from None


# what pyarrow raises on a damaged file (text in parquet is not checked to be UTF-8 until decoded)
PARQUET_ERRORS = (pa.ArrowException, OSError, UnicodeDecodeError)


def _unreadable(path: Path, err: BaseException) -> ConfigError:
    return ConfigError(f"{path} is not a readable parquet file ({_one_line(err)}): {REDO}")


def _read_parquet(path: Path, columns: list[str] | None = None) -> pa.Table:
    try:
        table = pq.read_table(path, columns=columns)
        table.validate(full=True)  # offsets, and UTF-8 in string columns
        names = table.column_names
    except PARQUET_ERRORS as err:
        raise _unreadable(path, err) from None
    if len(set(names)) != len(names):
        raise ConfigError(f"{path} has duplicate columns {names}: {REDO}")
    return table


def _check_root(root: Path) -> None:
    """Refuse a path that cannot be a dataset, saying what it is instead."""
    if root.is_file():
        hint = (
            f" (here {root.parent.parent})" if root.name == "info.json" and root.parent.name == "meta" else ""
        )
        raise ConfigError(
            f"{root} is a file, not a dataset directory: give the directory that holds {INFO_PATH}{hint}"
        )
    if not root.is_dir():
        raise ConfigError(
            f"{root} is not a LeRobot dataset: no such directory (give the directory that holds {INFO_PATH})"
        )
    if not (root / INFO_PATH).is_file():
        what = (
            "the directory is empty"
            if not any(root.iterdir())
            else f"it has no {INFO_PATH} (a recording that did not finish has none)"
        )
        raise ConfigError(
            f"{root} is not a LeRobot dataset: {what}; give the directory of a recorded dataset "
            "(`mmrl pretrain vla` records one into OUTPUT_DIR/demos)"
        )


def _check_feature(path: Path, name: str, feature: Any, fix: str) -> None:
    shape = feature.get("shape") if isinstance(feature, dict) else None
    if (
        not isinstance(feature, dict)
        or not isinstance(feature.get("dtype"), str)
        or not isinstance(shape, list)
        or not shape
        or not all(_is_count(s) and s > 0 for s in shape)
    ):
        raise ConfigError(
            f"{path}: feature {name!r} needs a 'dtype' string and a 'shape' list of positive integers, "
            f"got {_short(feature)}: {fix}"
        )
    dtype = feature["dtype"]
    if dtype == "video":
        raise ConfigError(
            f"{path}: feature {name!r} is stored as MP4 video, which this reader cannot decode (no PyAV "
            "here); record with image features (dtype 'image') instead"
        )
    if dtype == "image" and (len(shape) != 3 or shape[2] != 3):
        raise ConfigError(f"{path}: image feature {name!r} has shape {shape}, not [height, width, 3]: {fix}")
    if dtype != "image" and (dtype not in NUMERIC or len(shape) != 1):
        raise ConfigError(
            f"{path}: feature {name!r} has {_describe(feature)}; supported are 1-D {list(NUMERIC)} "
            f"vectors and images: {fix}"
        )


def _load_info(root: Path) -> dict[str, Any]:
    """meta/info.json, checked field by field: everything the reader relies on has the right type."""
    _check_root(root)
    path = root / INFO_PATH
    fix = f"fix {path} or record the dataset again"
    info = _read_json(path)
    if not isinstance(info, dict):
        kind = JSON_TYPES.get(type(info), "null")
        raise ConfigError(f"{path} holds a JSON {kind}, not an object of dataset fields: {fix}")
    if info.get("codebase_version") != CODEBASE_VERSION:
        raise ConfigError(
            f"{path}: codebase_version is {_short(info.get('codebase_version'))}; this reader reads LeRobot "
            f"{CODEBASE_VERSION!r} datasets (LeRobot's convert_dataset_v21_to_v30 converts older ones)"
        )
    missing = [k for k in ("fps", "features", "data_path", "total_episodes", "total_frames") if k not in info]
    if missing:
        raise ConfigError(f"{path} lacks the fields {missing}: {fix}")
    fps = info["fps"]
    if isinstance(fps, bool) or not isinstance(fps, int | float) or not 0 < fps < math.inf:
        raise ConfigError(f"{path}: fps is {_short(fps)}, not a positive number of frames per second: {fix}")
    for key in ("total_episodes", "total_frames"):
        if not _is_count(info[key]):
            raise ConfigError(f"{path}: {key} is {_short(info[key])}, not a whole number >= 0: {fix}")
    template = info["data_path"]
    try:
        usable = isinstance(template, str) and bool(template.format(chunk_index=0, file_index=0))
    except (KeyError, IndexError, ValueError, AttributeError, TypeError):
        usable = False
    if not usable:
        raise ConfigError(
            f"{path}: data_path is {_short(template)}, not a path template like {DATA_PATH!r}: {fix}"
        )
    features = info["features"]
    if not isinstance(features, dict):
        raise ConfigError(
            f"{path}: features is a JSON {JSON_TYPES.get(type(features), 'null')}, not an object that maps "
            f"feature names to their dtype and shape: {fix}"
        )
    for name, feature in features.items():
        _check_feature(path, name, feature, fix)
    absent = [name for name in LEROBOT_FRAME_FEATURES if name not in features]
    if absent:
        raise ConfigError(
            f"{path}: the features {absent} that every LeRobot dataset has are not declared: {fix}"
        )
    for name in LEROBOT_FRAME_FEATURES:
        kinds = ("int64", "int32") if name in INDEX_FEATURES else ("float32", "float64")
        if features[name]["dtype"] not in kinds or features[name]["shape"] != [1]:
            raise ConfigError(
                f"{path}: feature {name!r} has {_describe(features[name])}, but LeRobot's {name} is a "
                f"{' or '.join(kinds)} scalar (shape [1]): {fix}"
            )
    return info


def _load_tasks(root: Path) -> list[str]:
    path = root / TASKS_PATH
    if not path.is_file():
        raise ConfigError(f"task file {path} is missing (it maps task_index to the instruction): {REDO}")
    table = _read_parquet(path)
    text = next((c for c in ("task", "__index_level_0__") if c in table.column_names), None)
    if text is None or "task_index" not in table.column_names:
        raise ConfigError(
            f"{path}: expected columns 'task_index' and 'task' (or a pandas index), "
            f"got {table.column_names}: {REDO}"
        )
    index, strings = table["task_index"], table[text]
    if (
        not pa.types.is_integer(index.type)
        or not (pa.types.is_string(strings.type) or pa.types.is_large_string(strings.type))
        or index.null_count
        or strings.null_count
    ):
        raise ConfigError(
            f"{path}: 'task_index' must hold integers and {text!r} strings, none missing; got {index.type} "
            f"and {strings.type}: {REDO}"
        )
    tasks = dict(zip(index.to_pylist(), strings.to_pylist(), strict=True))
    if len(tasks) != table.num_rows or sorted(tasks) != list(range(len(tasks))):
        raise ConfigError(
            f"{path}: task_index values {_short(sorted(index.to_pylist()))} are not 0..{table.num_rows - 1} "
            f"once each: {REDO}"
        )
    return [tasks[i] for i in range(len(tasks))]


def _load_episodes(root: Path, info: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The episode rows, checked to be episodes 0..n-1 holding consecutive frames 0..total_frames-1."""
    paths = sorted(root.glob("meta/episodes/chunk-*/file-*.parquet"))
    if not paths:
        raise ConfigError(
            f"no episode metadata: {root / EPISODES_PATH.format(chunk_index=0, file_index=0)} is missing: "
            f"{REDO}"
        )
    required = (*EPISODE_REQUIRED, "data/chunk_index", "data/file_index")
    episodes: list[dict[str, Any]] = []
    for path in paths:
        table = _read_parquet(path)
        missing = [c for c in required if c not in table.column_names]
        if missing:
            raise ConfigError(f"{path}: episode columns {missing} are missing: {REDO}")
        bad = [c for c in required if not pa.types.is_integer(table[c].type) or table[c].null_count]
        if "success" in table.column_names:
            success = table["success"]
            bad += ["success"] if not pa.types.is_boolean(success.type) or success.null_count else []
        if bad:
            raise ConfigError(
                f"{path}: episode columns {bad} have the wrong type or missing values (integers, and "
                f"booleans for 'success', are expected): {REDO}"
            )
        table = table.select([c for c in table.column_names if not c.startswith("stats/")])
        episodes += table.to_pylist()
    episodes.sort(key=lambda e: e["episode_index"])
    indices = [e["episode_index"] for e in episodes]
    if not episodes or indices != list(range(len(episodes))) or len(episodes) != info["total_episodes"]:
        raise ConfigError(
            f"{root}: episode metadata holds episodes {indices[:10]}{'...' if len(indices) > 10 else ''}, "
            f"expected 0..{info['total_episodes'] - 1} (total_episodes in {INFO_PATH}), at least one: "
            "record the dataset again"
        )
    start = 0
    for e in episodes:
        if (
            e["length"] < 1
            or e["dataset_from_index"] != start
            or e["dataset_to_index"] != start + e["length"]
        ):
            raise ConfigError(
                f"{root / 'meta/episodes'}: episode {e['episode_index']} has frames "
                f"{e['dataset_from_index']}..{e['dataset_to_index']} and length {e['length']}, but episodes "
                f"hold consecutive frames, so it should start at frame {start} and hold at least one: {REDO}"
            )
        start = e["dataset_to_index"]
    if start != info["total_frames"]:
        raise ConfigError(
            f"{root}: the episodes hold {start} frames, {INFO_PATH} says "
            f"total_frames = {info['total_frames']}: record the dataset again"
        )
    return episodes


def _load_stats(root: Path, features: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, np.ndarray]]:
    """stats.json as arrays; the state and action means and stds, which policies normalise with, are
    checked to be finite and shaped like their features."""
    path = root / STATS_PATH
    if not path.is_file():
        raise ConfigError(f"statistics file {path} is missing (policies normalise with it): {REDO}")
    raw = _read_json(path)
    if not isinstance(raw, dict) or not all(isinstance(entry, dict) for entry in raw.values()):
        raise ConfigError(
            f"{path} must map feature names to {{statistic: values}}, got {_short(raw)}: {REDO}"
        )
    stats: dict[str, dict[str, np.ndarray]] = {}
    for name, entry in raw.items():
        try:
            stats[name] = {s: np.asarray(v, dtype=np.float64) for s, v in entry.items()}
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{path}: the statistics of {name!r} are not numbers: {REDO}") from None
    for name in (STATE_KEY, ACTION_KEY):
        if name not in features or features[name]["dtype"] == "image":
            continue
        shape = tuple(features[name]["shape"])
        for s in ("mean", "std"):
            value = stats.get(name, {}).get(s)
            if value is None or value.shape != shape or not np.isfinite(value).all():
                got = None if value is None else value.tolist()
                raise ConfigError(
                    f"{path}: {name!r} needs a finite {s!r} of shape {list(shape)} (policies normalise with "
                    f"it), got {_short(got)}: {REDO}"
                )
    return stats


def _data_files(
    root: Path, info: Mapping[str, Any], episodes: list[dict[str, Any]]
) -> list[tuple[Path, list[int]]]:
    """Each data file with the episodes stored in it, in file order."""
    files: dict[tuple[int, int], list[int]] = {}
    for e in episodes:
        files.setdefault((e["data/chunk_index"], e["data/file_index"]), []).append(e["episode_index"])
    return [
        (root / info["data_path"].format(chunk_index=chunk, file_index=file), indices)
        for (chunk, file), indices in sorted(files.items())
    ]


def _type_problem(feature: Mapping[str, Any], actual: pa.DataType) -> str | None:
    """Why a parquet column's type cannot hold a feature, or None if it can."""
    if feature["dtype"] == "image":
        if pa.types.is_struct(actual) and actual.get_field_index("bytes") >= 0:
            data = actual.field("bytes").type
            if pa.types.is_binary(data) or pa.types.is_large_binary(data):
                return None
        return f"has type {actual}; an image feature is a struct of PNG 'bytes' and a 'path'"
    expected, shape = NUMERIC[feature["dtype"]], list(feature["shape"])
    if pa.types.is_list(actual) or pa.types.is_large_list(actual) or pa.types.is_fixed_size_list(actual):
        if actual.value_type != expected:
            return f"holds {actual.value_type} values, but {INFO_PATH} declares {_describe(feature)}"
        if pa.types.is_fixed_size_list(actual) and actual.list_size != shape[0]:
            return (
                f"holds vectors of length {actual.list_size}, but {INFO_PATH} declares {_describe(feature)}"
            )
        return None
    if actual != expected:
        return f"has type {actual}, but {INFO_PATH} declares {_describe(feature)}"
    if shape != [1]:
        return f"holds scalars, but {INFO_PATH} declares {_describe(feature)}"
    return None


def _check_columns(path: Path, episodes: list[int], features: Mapping[str, Mapping[str, Any]]) -> None:
    """A data file exists, is parquet, and has a column of the right type for every declared feature."""
    if not path.is_file():
        raise ConfigError(f"data file {path} is missing (episodes {episodes} are stored in it): {REDO}")
    try:
        schema = pq.read_schema(path)
        names = schema.names  # decoding them fails if they are not UTF-8
    except PARQUET_ERRORS as err:
        raise _unreadable(path, err) from None
    for name, feature in features.items():
        found = names.count(name)
        if found != 1:
            what = "has no such column" if not found else f"has {found} such columns"
            raise ConfigError(
                f"{path}: feature {name!r} ({_describe(feature)}) is declared in {INFO_PATH} but the file "
                f"{what}; its columns are {names}: rename the column back, or fix {INFO_PATH}"
            )
        problem = _type_problem(feature, schema.field(name).type)
        if problem:
            raise ConfigError(f"{path}: column {name!r} {problem}: {REDO}")


def _decode_image(data: bytes, shape: list[int], where: str) -> np.ndarray:
    """An embedded image as (H, W, 3) uint8, or a ConfigError saying where it is and what is wrong."""
    try:
        image = _decode_png(data)
    except UnidentifiedImageError:
        raise ConfigError(f"{where} is not a readable PNG (not an image format PIL knows): {REDO}") from None
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as err:
        raise ConfigError(f"{where} is not a readable PNG ({_one_line(err)}): {REDO}") from None
    if list(image.shape) != shape:
        raise ConfigError(f"{where} is {list(image.shape)}, {INFO_PATH} declares {shape}: {REDO}")
    return image


def _column_values(path: Path, name: str, feature: Mapping[str, Any], column: pa.ChunkedArray) -> Any:
    """A column as (rows, n) / (rows,) numbers, or a list of PNG bytes for images."""
    array = column.combine_chunks()
    shape = list(feature["shape"])
    nested = isinstance(array, pa.ListArray | pa.LargeListArray | pa.FixedSizeListArray)
    if array.null_count or (nested and array.flatten().null_count):
        raise ConfigError(f"{path}: column {name!r} has missing values: {REDO}")
    if feature["dtype"] == "image":
        images = array.field("bytes")
        if images.null_count:
            raise ConfigError(f"{path}: column {name!r} has images without embedded PNG bytes: {REDO}")
        if len(images):
            _decode_image(images[0].as_py(), shape, f"{path}: the first image in {name!r}")
        return images.to_pylist()
    if nested:
        lengths = set(pc.list_value_length(array).to_pylist())
        if lengths - {shape[0]}:
            raise ConfigError(
                f"{path}: column {name!r} has rows of length {sorted(lengths)}, "
                f"{INFO_PATH} declares {shape}: {REDO}"
            )
        values = array.flatten().to_numpy(zero_copy_only=False).reshape(len(array), shape[0])
        values = values.reshape(-1) if shape == [1] else values
    else:
        values = array.to_numpy(zero_copy_only=False)
    if values.dtype.kind == "f" and not np.isfinite(values).all():
        rows = int((~np.isfinite(values.reshape(len(values), -1))).any(1).sum())
        raise ConfigError(f"{path}: column {name!r} has NaN or infinite values in {rows} rows: {REDO}")
    return values


@contextlib.contextmanager
def _config_key(key: str, path: str | Path) -> Iterator[None]:
    """Re-raise a dataset's ConfigError naming the config key that pointed at it."""
    if str(path).strip() == "":
        raise ConfigError(f"config error: {key} is empty: give the directory of a LeRobot dataset")
    try:
        yield
    except ConfigError as err:
        raise ConfigError(f"config error: {key} = {str(path)!r}: {err}") from None


def check_dataset(path: str | Path, key: str, required: Mapping[str, tuple[int, ...]] | None = None) -> None:
    """Check a dataset's metadata, its data files' columns and (with `required`, as for `check_features`)
    that it fits a policy, reading no frame: cheap enough to run while a config is loaded, so that a bad
    dataset stops a run before anything is written. Problems are ConfigErrors naming config `key`."""
    with _config_key(key, path):
        root = Path(path)
        info = _load_info(root)
        _load_tasks(root)
        for file, episodes in _data_files(root, info, _load_episodes(root, info)):
            _check_columns(file, episodes, info["features"])
        _load_stats(root, info["features"])
        if required:
            _check_fit(root, info["features"], required)


def open_dataset(
    path: str | Path, key: str, required: Mapping[str, tuple[int, ...]] | None = None
) -> RobotDataset:
    """RobotDataset(path), checked to fit a policy with `required`; problems are ConfigErrors naming `key`."""
    with _config_key(key, path):
        dataset = RobotDataset(path)
        if required:
            dataset.check_features(required)
    return dataset


def _check_fit(
    root: Path, features: Mapping[str, Mapping[str, Any]], required: Mapping[str, tuple[int, ...]]
) -> None:
    problems = []
    for name, shape in required.items():
        feature = features.get(name)
        if feature is None:
            problems.append(f"{name!r} is missing (the policy needs shape {list(shape)})")
        elif list(feature["shape"]) != list(shape):
            problems.append(f"{name!r} has shape {list(feature['shape'])}, the policy needs {list(shape)}")
        elif len(shape) == 1 and feature["dtype"] not in ("float32", "float64"):
            problems.append(f"{name!r} has dtype {feature['dtype']}, the policy needs float32 or float64")
    if problems:
        raise ConfigError(
            f"dataset {root} does not fit the policy: {'; '.join(problems)}. The dataset's features are "
            f"{sorted(features)}: use a dataset recorded for this task and image size"
        )


class RobotDataset(torch.utils.data.Dataset):
    """A LeRobot v3.0 dataset held in memory: numbers as arrays, images as PNG bytes decoded on access.

    Item i holds every feature as a tensor (vectors (n,), scalars 0-d, images uint8 (C, H, W) left
    unscaled so batches stay 4x smaller until the policy converts them on its device), "task" (the
    instruction) and, for datasets written here, "episode_success". With `action_horizon` it also holds
    "action_chunk" and "action_chunk_mask" (see `chunk`). A malformed dataset is a ConfigError naming
    the file and what is wrong: on opening, or, for an image that does not decode, when it is read.
    """

    def __init__(self, root: str | Path, action_horizon: int | None = None) -> None:
        self.root = Path(root)
        self.info = _load_info(self.root)
        self.features: dict[str, dict[str, Any]] = self.info["features"]
        self.fps = self.info["fps"]
        self.tasks = _load_tasks(self.root)
        self.episodes = _load_episodes(self.root, self.info)
        self._columns = self._load_frames()
        self.stats = _load_stats(self.root, self.features)
        self.action_horizon = action_horizon
        self._episode_end = np.repeat(
            [e["dataset_to_index"] for e in self.episodes], [e["length"] for e in self.episodes]
        )

    def _load_frames(self) -> dict[str, Any]:
        parts: dict[str, list] = {name: [] for name in self.features}
        for path, episodes in _data_files(self.root, self.info, self.episodes):
            _check_columns(path, episodes, self.features)
            table = _read_parquet(path, columns=list(self.features))
            for name, feature in self.features.items():
                parts[name].append(_column_values(path, name, feature, table[name]))
        columns = {
            name: sum(chunks, []) if self.features[name]["dtype"] == "image" else np.concatenate(chunks)
            for name, chunks in parts.items()
        }
        total = len(columns["index"])
        if total != self.info["total_frames"]:
            raise ConfigError(
                f"{self.root}: the data files hold {total} frames, {INFO_PATH} says total_frames = "
                f"{self.info['total_frames']}: record the dataset again"
            )
        if not np.array_equal(columns["index"], np.arange(total)):
            raise ConfigError(
                f"{self.root}: the frames' 'index' column is not 0..{total - 1} in file order: "
                "record the dataset again"
            )
        expected = np.repeat(np.arange(len(self.episodes)), [e["length"] for e in self.episodes])
        if not np.array_equal(columns["episode_index"], expected):
            raise ConfigError(
                f"{self.root}: frames' episode_index does not match the episode metadata's frame ranges: "
                "record the dataset again"
            )
        tasks = columns["task_index"]
        if tasks.min() < 0 or tasks.max() >= len(self.tasks):
            raise ConfigError(
                f"{self.root}: frames have task_index values {tasks.min()}..{tasks.max()}, but {TASKS_PATH} "
                f"holds {len(self.tasks)} tasks: record the dataset again"
            )
        return columns

    def __len__(self) -> int:
        return len(self._columns["index"])

    def __getitem__(self, i: int) -> dict[str, Any]:
        i = range(len(self))[i]
        item: dict[str, Any] = {name: self._value(name, i) for name in self.features}
        item["task"] = self.tasks[int(item["task_index"])]
        episode = self.episodes[int(item["episode_index"])]
        if "success" in episode:
            item["episode_success"] = torch.tensor(bool(episode["success"]))
        if self.action_horizon:
            item["action_chunk"], item["action_chunk_mask"] = self.chunk(i, self.action_horizon)
        return item

    def _value(self, name: str, i: int) -> torch.Tensor:
        feature = self.features[name]
        if feature["dtype"] == "image":
            image = _decode_image(self._columns[name][i], feature["shape"], self._where(name, i))
            return torch.from_numpy(image).permute(2, 0, 1).contiguous()
        return torch.tensor(self._columns[name][i])

    def _where(self, name: str, i: int) -> str:
        """Frame i's feature `name` by data file, episode and frame, for error messages."""
        episode = self.episodes[int(self._columns["episode_index"][i])]
        path = self.root / self.info["data_path"].format(
            chunk_index=episode["data/chunk_index"], file_index=episode["data/file_index"]
        )
        frame = i - episode["dataset_from_index"]
        return f"{path}: {name!r} of episode {episode['episode_index']}, frame {frame}"

    def episode(self, index: int) -> dict[str, Any]:
        """All frames of one episode, stacked (images (T, C, H, W) uint8), and its "task"."""
        meta = self.episodes[index]
        frames = range(meta["dataset_from_index"], meta["dataset_to_index"])
        out: dict[str, Any] = {}
        for name, feature in self.features.items():
            if feature["dtype"] == "image":
                out[name] = torch.stack([self._value(name, i) for i in frames])
            else:
                out[name] = torch.tensor(self._columns[name][frames.start : frames.stop])
        out["task"] = self.tasks[int(out["task_index"][0])]
        return out

    def chunk(self, i: int, horizon: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Actions i .. i+horizon-1 of frame i's episode, padded past its end with the episode's last action,
        and a mask that is False on the padding (policies predict action chunks; the loss skips padding)."""
        if ACTION_KEY not in self.features:
            raise ConfigError(
                f"{self.root} has no {ACTION_KEY!r} feature; its features are {sorted(self.features)}: "
                "use a dataset of actions"
            )
        i = range(len(self))[i]
        end = int(self._episode_end[i])
        steps = np.arange(i, i + horizon)
        return torch.tensor(self._columns[ACTION_KEY][np.minimum(steps, end - 1)]), torch.from_numpy(
            steps < end
        )

    def check_features(self, required: Mapping[str, tuple[int, ...]]) -> None:
        """Raise a ConfigError naming every feature a policy needs that is missing, shaped differently
        or not float (shapes as info.json has them: images are (H, W, C))."""
        _check_fit(self.root, self.features, required)


def env_attribute(env: Any, name: str) -> Any:
    """An attribute of the env or of any of its wrappers (our tasks and SuccessAdapter set the same
    ones), or None."""
    return env.get_wrapper_attr(name) if env.has_wrapper_attr(name) else None


def env_features(env: Any) -> dict[str, dict[str, Any]]:
    """Dataset features for a sim env's "state" (and "image") observations and its actions."""
    spaces = env.observation_space.spaces
    if "state" not in spaces:
        raise ValueError(
            f"recording needs a 'state' observation (obs_mode 'state' or 'state+rgb'), got {list(spaces)}"
        )
    layout = env_attribute(env, "state_layout")
    names = [f"{part}.{i}" for part, s in layout.items() for i in range(s.stop - s.start)] if layout else None
    features = {
        STATE_KEY: {"dtype": "float32", "shape": [spaces["state"].shape[0]], "names": names},
        ACTION_KEY: {"dtype": "float32", "shape": list(env.action_space.shape), "names": None},
    }
    if "image" in spaces:
        features[IMAGE_KEY] = {"dtype": "image", "shape": list(spaces["image"].shape), "names": None}
    return features


def record_episodes(
    env: Any,
    actor: Callable[[dict[str, np.ndarray], str], np.ndarray] | None,
    n: int,
    seed: int,
    root: str | Path,
    *,
    obs_mode: str = "state",
    image_size: int = 96,
    robot_type: str | None = None,
    frames_per_file: int = 10_000,
    action_noise: float = 0.0,
) -> RobotDataset:
    """Roll out `actor` for `n` episodes (reset seeds seed, seed+1, ...) and write them as a dataset:
    the demonstrations behaviour cloning starts from.

    `env` is a sim task name ("PickPlace" or an external id such as "FetchReach-v4", made with `obs_mode`
    and `image_size`) or an env (used as it is and not closed); `robot_type` None takes the env's.
    `actor` None means the task's scripted expert, which acts on the privileged state; its frames are
    marked is_intervention. Any other actor is a policy called as actor(obs, instruction) -> action, and
    its frames are marked policy_executed.

    `action_noise` > 0 executes the action plus Gaussian noise of that standard deviation (clipped to
    the action space) but records the clean action (DART): the demonstrations then show how the actor
    recovers from the small errors a cloned policy makes, instead of only the actor's own perfect path.
    The noise of episode k is drawn from seed + k, so a dataset is reproducible.
    """
    import sim  # the robot extra: only recording needs it
    from sim.experts import Expert, expert_for

    own_env = isinstance(env, str)
    if own_env:
        env = sim.make(env, obs_mode=obs_mode, image_size=image_size)
    try:
        actor = actor if actor is not None else expert_for(env)
        expert = actor if isinstance(actor, Expert) else None
        features = env_features(env)
        if not env.metadata.get("render_fps"):
            raise ValueError("the env's metadata has no 'render_fps': a dataset needs the control rate (fps)")
        robot_type = robot_type or env_attribute(env, "robot_type")
        with DatasetWriter(
            root, env.metadata["render_fps"], features, robot_type, frames_per_file=frames_per_file
        ) as writer:
            for k in tqdm(range(n), desc=f"recording {Path(root).name}", disable=None):
                obs, info = env.reset(seed=seed + k)
                noise = np.random.default_rng(seed + k)
                done = False
                while not done:
                    action = expert.act(env) if expert is not None else actor(obs, info["instruction"])
                    frame = {STATE_KEY: obs["state"], ACTION_KEY: action}
                    if IMAGE_KEY in features:
                        frame[IMAGE_KEY] = obs["image"]
                    writer.add_frame(
                        frame, is_intervention=expert is not None, policy_executed=expert is None
                    )
                    if action_noise > 0:
                        action = action + noise.normal(0.0, action_noise, np.shape(action))
                        action = np.clip(action, env.action_space.low, env.action_space.high)
                        action = action.astype(np.float32)
                    obs, _, terminated, truncated, info = env.step(action)
                    done = terminated or truncated
                writer.save_episode(info["instruction"], success=bool(info["is_success"]))
    finally:
        if own_env:
            env.close()
    return RobotDataset(root)


def expert_demonstrations(
    root: str | Path,
    task: str,
    episodes: int,
    seed: int,
    required: Mapping[str, tuple[int, ...]],
    *,
    key: str,
    image_size: int = 96,
    action_noise: float = 0.0,
) -> RobotDataset:
    """The scripted expert's `episodes` demonstrations of `task` (reset seeds seed, seed+1, ...) in
    `root`: read when an earlier run recorded them there, else recorded now. They are recorded beside
    `root` and renamed into place, so a killed run never leaves half a dataset; a dataset that does
    not fit `required` or holds another number of episodes is a ConfigError naming `key`."""
    root = Path(root)
    if (root / "meta" / "info.json").is_file():
        try:
            dataset = RobotDataset(root)
            dataset.check_features(required)
        except ConfigError as err:
            raise ConfigError(
                f"config error: the demonstrations an earlier run recorded in {str(root)!r} cannot be used "
                f"({err}): delete that folder to record them again"
            ) from None
        if len(dataset.episodes) != episodes:
            raise ConfigError(
                f"config error: {str(root)!r} holds {len(dataset.episodes)} demonstrations, {key} = "
                f"{episodes}: use a new output_dir"
            )
        return dataset
    partial = root.with_name(root.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    record_episodes(
        task,
        None,
        episodes,
        seed,
        partial,
        obs_mode="state+rgb",
        image_size=image_size,
        action_noise=action_noise,
    )
    os.replace(partial, root)
    return RobotDataset(root)
