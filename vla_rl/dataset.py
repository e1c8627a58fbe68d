"""A LeRobot v3.0 dataset (`vla_rl.lerobot_format`) read into memory as a torch Dataset.

Behaviour cloning and the demonstration rows of online training read datasets through `RobotDataset`;
`open_dataset` opens one that a config names, with problems reported against that config key.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmrl.config import ConfigError
from vla_rl.lerobot_checks import (
    REDO,
    TIMESTAMP_TOLERANCE_S,
    check_columns,
    check_fit,
    column_values,
    config_key,
    data_files,
    decode_image,
    load_episodes,
    load_info,
    load_stats,
    load_tasks,
    read_parquet,
)
from vla_rl.lerobot_format import ACTION_KEY, INFO_PATH, TASKS_PATH


def open_dataset(
    path: str | Path, key: str, required: Mapping[str, tuple[int, ...]] | None = None
) -> RobotDataset:
    """RobotDataset(path), checked to fit a policy with `required`; problems are ConfigErrors naming `key`."""
    with config_key(key, path):
        dataset = RobotDataset(path)
        if required:
            dataset.check_features(required)
    return dataset


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
        self.info = load_info(self.root)
        self.features: dict[str, dict[str, Any]] = self.info["features"]
        self.fps = self.info["fps"]
        self.tasks = load_tasks(self.root)
        self.episodes = load_episodes(self.root, self.info)
        self._columns = self._load_frames()
        self.stats = load_stats(self.root, self.features)
        self.action_horizon = action_horizon
        self._episode_end = np.repeat(
            [e["dataset_to_index"] for e in self.episodes], [e["length"] for e in self.episodes]
        )

    def _load_frames(self) -> dict[str, Any]:
        parts: dict[str, list] = {name: [] for name in self.features}
        for path, episodes in data_files(self.root, self.info, self.episodes):
            check_columns(path, episodes, self.features)
            table = read_parquet(path, columns=list(self.features))
            for name, feature in self.features.items():
                parts[name].append(column_values(path, name, feature, table[name]))
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
        self._check_time_order(columns["frame_index"], columns["timestamp"])
        return columns

    def _check_time_order(self, frame_index: np.ndarray, timestamp: np.ndarray) -> None:
        """Within each episode, frame_index runs 0, 1, 2, ... in row order and each timestamp is 1/fps
        after the one before, within LeRobot's tolerance (TIMESTAMP_TOLERANCE_S), as LeRobot checks
        when it loads a dataset; a ConfigError names the data file, the episode, the row and what was
        expected."""
        lengths = [e["length"] for e in self.episodes]
        position = np.arange(len(frame_index)) - np.repeat(
            [e["dataset_from_index"] for e in self.episodes], lengths
        )
        bad = np.flatnonzero(frame_index != position)
        if len(bad):
            i = int(bad[0])
            raise ConfigError(
                f"{self._row(i)} has frame_index {frame_index[i]}, expected {position[i]}: an episode's rows "
                f"hold its frames in time order, frame_index 0, 1, 2, ...: {REDO}"
            )
        period = 1.0 / self.fps
        gaps = np.diff(timestamp.astype(np.float64))
        wrong = np.flatnonzero((position[1:] > 0) & ~(np.abs(gaps - period) <= TIMESTAMP_TOLERANCE_S))
        if len(wrong):
            i = int(wrong[0]) + 1
            raise ConfigError(
                f"{self._row(i)} (frame {position[i]}) has timestamp {timestamp[i]:.6g} s, "
                f"{gaps[i - 1]:.6g} s after the frame before; at fps {self.fps} ({INFO_PATH}) frames are "
                f"{period:.6g} s apart (to within {TIMESTAMP_TOLERANCE_S:g} s): {REDO}, "
                f"or fix fps in {INFO_PATH}"
            )

    def _row(self, i: int) -> str:
        """Frame i of the dataset by data file, episode and row in that file, for error messages."""
        episode = next(e for e in self.episodes if e["dataset_from_index"] <= i < e["dataset_to_index"])
        place = (episode["data/chunk_index"], episode["data/file_index"])
        first = min(
            e["dataset_from_index"]
            for e in self.episodes
            if (e["data/chunk_index"], e["data/file_index"]) == place
        )
        path = self.root / self.info["data_path"].format(chunk_index=place[0], file_index=place[1])
        return f"{path}: episode {episode['episode_index']}, row {i - first}"

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
            image = decode_image(self._columns[name][i], feature["shape"], self._where(name, i))
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
        check_fit(self.root, self.features, required)
