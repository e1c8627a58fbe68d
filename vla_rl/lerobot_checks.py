"""Checks of a LeRobot v3.0 dataset on disk (the layout of `vla_rl.lerobot_format`).

Datasets come from users, so every problem with one on disk is a ConfigError that names the file,
says what is wrong and how to fix it, instead of a traceback from pyarrow, PIL or numpy. The `load_*`
functions read and check one part of the metadata each; `RobotDataset` (vla_rl.dataset) reads through
them, and `check_dataset` runs them all without reading a frame.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from PIL import Image, UnidentifiedImageError

from mmrl.config import ConfigError
from vla_rl.lerobot_format import (
    ACTION_KEY,
    CODEBASE_VERSION,
    DATA_PATH,
    EPISODE_REQUIRED,
    EPISODES_PATH,
    INFO_PATH,
    LEROBOT_FRAME_FEATURES,
    NUMERIC,
    STATE_KEY,
    STATS_PATH,
    TASKS_PATH,
    describe,
)

REDO = "restore the file or record the dataset again"
TIMESTAMP_TOLERANCE_S = 1e-4  # LeRobot's: consecutive frames of an episode are 1/fps apart to within this


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


def read_parquet(path: Path, columns: list[str] | None = None) -> pa.Table:
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
            f"{path}: feature {name!r} has {describe(feature)}; supported are 1-D {list(NUMERIC)} "
            f"vectors and images: {fix}"
        )


def load_info(root: Path) -> dict[str, Any]:
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
                f"{path}: feature {name!r} has {describe(features[name])}, but LeRobot's {name} is a "
                f"{' or '.join(kinds)} scalar (shape [1]): {fix}"
            )
    return info


def load_tasks(root: Path) -> list[str]:
    path = root / TASKS_PATH
    if not path.is_file():
        raise ConfigError(f"task file {path} is missing (it maps task_index to the instruction): {REDO}")
    table = read_parquet(path)
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


def load_episodes(root: Path, info: Mapping[str, Any]) -> list[dict[str, Any]]:
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
        table = read_parquet(path)
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


def load_stats(root: Path, features: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, np.ndarray]]:
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


def data_files(
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
            return f"holds {actual.value_type} values, but {INFO_PATH} declares {describe(feature)}"
        if pa.types.is_fixed_size_list(actual) and actual.list_size != shape[0]:
            return f"holds vectors of length {actual.list_size}, but {INFO_PATH} declares {describe(feature)}"
        return None
    if actual != expected:
        return f"has type {actual}, but {INFO_PATH} declares {describe(feature)}"
    if shape != [1]:
        return f"holds scalars, but {INFO_PATH} declares {describe(feature)}"
    return None


def check_columns(path: Path, episodes: list[int], features: Mapping[str, Mapping[str, Any]]) -> None:
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
                f"{path}: feature {name!r} ({describe(feature)}) is declared in {INFO_PATH} but the file "
                f"{what}; its columns are {names}: rename the column back, or fix {INFO_PATH}"
            )
        problem = _type_problem(feature, schema.field(name).type)
        if problem:
            raise ConfigError(f"{path}: column {name!r} {problem}: {REDO}")


def _decode_png(data: bytes) -> np.ndarray:
    return np.array(Image.open(io.BytesIO(data)).convert("RGB"))


def decode_image(data: bytes, shape: list[int], where: str) -> np.ndarray:
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


def column_values(path: Path, name: str, feature: Mapping[str, Any], column: pa.ChunkedArray) -> Any:
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
            decode_image(images[0].as_py(), shape, f"{path}: the first image in {name!r}")
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
def config_key(key: str, path: str | Path) -> Iterator[None]:
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
    with config_key(key, path):
        root = Path(path)
        info = load_info(root)
        load_tasks(root)
        for file, episodes in data_files(root, info, load_episodes(root, info)):
            check_columns(file, episodes, info["features"])
        load_stats(root, info["features"])
        if required:
            check_fit(root, info["features"], required)


def check_fit(
    root: Path, features: Mapping[str, Mapping[str, Any]], required: Mapping[str, tuple[int, ...]]
) -> None:
    """A ConfigError naming every feature in `required` (name -> shape) that `features` lacks, shapes
    differently or does not hold as floats."""
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
