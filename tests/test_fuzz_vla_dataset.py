"""Random corruptions of a small LeRobot dataset (written by the project's own writer): the reader either
refuses each with a one-line ConfigError that names the dataset, or reads every frame of it; it never
fails with another exception."""

import io
import json
import random
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from mmrl.config import ConfigError
from vla_rl.dataset import RobotDataset
from vla_rl.lerobot_format import DatasetWriter

FEATURES = {
    "observation.state": {"dtype": "float32", "shape": [3]},
    "action": {"dtype": "float32", "shape": [2]},
    "observation.image": {"dtype": "image", "shape": [4, 5, 3]},
}
DATA_FILE = "data/chunk-000/file-000.parquet"
EPISODES_FILE = "meta/episodes/chunk-000/file-000.parquet"


def write_dataset(root):
    """Two episodes (3 and 2 frames) in two data files."""
    rng = np.random.default_rng(0)
    with DatasetWriter(root, fps=10, features=FEATURES, frames_per_file=3) as writer:
        for length, task in [(3, "pick the cube"), (2, "push the cube")]:
            for _ in range(length):
                writer.add_frame(
                    {
                        "observation.state": rng.normal(size=3).astype(np.float32),
                        "action": rng.uniform(-1, 1, 2).astype(np.float32),
                        "observation.image": rng.integers(0, 256, (4, 5, 3), dtype=np.uint8),
                    }
                )
            writer.save_episode(task, success=True)
    return root


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("fuzz") / "original")


def random_json(rng: random.Random, depth: int = 0):
    kind = rng.choice(
        ["null", "bool", "int", "float", "str", "list", "dict"] if depth < 2 else ["int", "str"]
    )
    if kind == "list":
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(3))]
    if kind == "dict":
        return {
            rng.choice(["dtype", "shape", "x", "features"]): random_json(rng, depth + 1) for _ in range(2)
        }
    return {
        "null": None,
        "bool": rng.random() < 0.5,
        "int": rng.choice([-1, 0, 1, 3, 2**70]),
        "float": rng.choice([0.5, -2.0, float("nan"), float("inf"), 1e308]),
        "str": rng.choice(["", "v3.0", "image", "float32", "{chunk_index}", "{nope}", "x" * 50]),
    }[kind]


def mutate_json(rng: random.Random, data) -> object:
    """Delete one key or replace one value anywhere in the document, or replace the whole document."""
    if rng.random() < 0.1:
        return random_json(rng)
    node = data
    while True:  # walk down to a random container
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            return data
        key = rng.choice(keys)
        child = node[key]
        if isinstance(child, dict | list) and child and rng.random() < 0.7:
            node = child
            continue
        if isinstance(node, dict) and rng.random() < 0.4:
            del node[key]
        else:
            node[key] = random_json(rng)
        return data


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    """Flip a few bytes, truncate, or replace with random bytes."""
    choice = rng.random()
    if choice < 0.5:
        out = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            out[rng.randrange(len(out))] ^= rng.randint(1, 255)
        return bytes(out)
    if choice < 0.8:
        return data[: rng.randrange(len(data))]
    return rng.randbytes(rng.randrange(64))


def corrupt_json(rng, root, name):
    path = root / name
    if rng.random() < 0.6:
        path.write_text(json.dumps(mutate_json(rng, json.loads(path.read_text()))))
    else:
        path.write_bytes(mutate_bytes(rng, path.read_bytes()))


def corrupt_file(rng, root, name):
    path = root / name
    path.write_bytes(mutate_bytes(rng, path.read_bytes()))


def corrupt_png(rng, root, name):
    """Replace one frame's embedded PNG by a mutation of it (or a valid image of another size)."""
    path = root / name
    table = pq.read_table(path)
    images = table["observation.image"].combine_chunks()
    data, paths = images.field("bytes").to_pylist(), images.field("path").to_pylist()
    row = rng.randrange(len(data))
    if rng.random() < 0.1:
        buffer = io.BytesIO()
        Image.new("RGB", (rng.randint(1, 6), rng.randint(1, 6))).save(buffer, format="PNG")
        data[row] = buffer.getvalue()
    else:
        data[row] = mutate_bytes(rng, data[row])
    column = pa.StructArray.from_arrays(
        [pa.array(data, pa.binary()), pa.array(paths, pa.string())], names=["bytes", "path"]
    )
    pq.write_table(
        table.set_column(table.schema.get_field_index("observation.image"), "observation.image", column), path
    )


TARGETS = [  # (corruption, file, cases)
    (corrupt_json, "meta/info.json", 70),
    (corrupt_json, "meta/stats.json", 20),
    (corrupt_file, DATA_FILE, 30),
    (corrupt_file, EPISODES_FILE, 20),
    (corrupt_file, "meta/tasks.parquet", 20),
    (corrupt_png, DATA_FILE, 40),
]


def read_everything(root):
    dataset = RobotDataset(root, action_horizon=3)
    for i in range(len(dataset)):
        dataset[i]
    for e in range(len(dataset.episodes)):
        dataset.episode(e)


def test_corrupted_datasets_are_refused_with_a_config_error_or_read(original, tmp_path):
    read_everything(original)
    rng = random.Random(1234)
    outcomes, unexpected = {"refused": 0, "read": 0}, []
    for corrupt, name, cases in TARGETS:
        for case in range(cases):
            root = tmp_path / f"{corrupt.__name__}-{name.replace('/', '_')}-{case}"
            shutil.copytree(original, root)
            corrupt(rng, root, name)
            try:
                read_everything(root)
            except ConfigError as err:
                message = str(err)
                if str(root) not in message or "\n" in message:
                    unexpected.append(
                        (root.name, f"message does not name the dataset in one line: {message}")
                    )
                outcomes["refused"] += 1
            except Exception as err:  # anything else is what this test is for
                unexpected.append((root.name, f"{type(err).__name__}: {err}"))
            else:
                outcomes["read"] += 1
    assert not unexpected, "\n".join(f"{case}: {what}" for case, what in unexpected)
    assert outcomes["refused"] > 100 and outcomes["read"] > 0, outcomes
