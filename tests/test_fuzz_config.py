"""Fuzzing the readers of run inputs: recipe YAML files and checkpoint manifests.

Random bytes and random mutations of valid files must give a clean error (ConfigError for a
config; a reason, never an exception, from checkpoint verification) or a valid result."""

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from mmrl.checkpoint import save_checkpoint, verify_checkpoint
from mmrl.cli import load_plugins
from mmrl.config import CONFIG_ROOT, BaseConfig, ConfigError, load_config

SEED = 20261124


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One to three random edits of the kinds a broken editor, disk or copy makes."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        kind = rng.randrange(8)
        pos = rng.randrange(len(out) + 1)
        if kind == 0 and out:  # flip a byte
            out[min(pos, len(out) - 1)] ^= 1 << rng.randrange(8)
        elif kind == 1:  # truncate
            del out[pos:]
        elif kind == 2:  # insert YAML / JSON punctuation
            out[pos:pos] = rng.choice(
                [b":", b"-", b"{", b"}", b"[", b"]", b'"', b"'", b"\t", b"\n", b"&a", b"*a"]
            )
        elif kind == 3:  # duplicate a line
            lines = bytes(out).split(b"\n")
            i = rng.randrange(len(lines))
            lines.insert(i, lines[i])
            out = bytearray(b"\n".join(lines))
        elif kind == 4:  # delete a line
            lines = bytes(out).split(b"\n")
            del lines[rng.randrange(len(lines))]
            out = bytearray(b"\n".join(lines))
        elif kind == 5:  # non-UTF-8 bytes
            out[pos:pos] = bytes(rng.randrange(128, 256) for _ in range(rng.randint(1, 4)))
        elif kind == 6:  # a strange value: huge, non-finite, wrong type
            out[pos:pos] = rng.choice(
                [b" 1e999", b" .nan", b" -.inf", b" 99999999999999999999", b" [1, 2]", b" {}"]
            )
        else:  # change indentation
            out[pos:pos] = b"  "
    return bytes(out)


def recipe_files() -> list[Path]:
    return sorted(p for p in CONFIG_ROOT.rglob("*.yaml") if "accelerate" not in p.parts)


def test_recipe_yaml_mutations_load_or_fail_cleanly(tmp_path):
    load_plugins()
    rng = random.Random(SEED)
    sources = [p.read_bytes() for p in recipe_files()]
    outcomes = {"loaded": 0, "refused": 0}
    for case in range(400):
        data = bytes(rng.randrange(256) for _ in range(rng.randint(0, 300))) if case % 5 == 0 else None
        data = data if data is not None else mutate(rng.choice(sources), rng)
        path = tmp_path / f"case{case}.yaml"
        path.write_bytes(data)
        try:
            config = load_config(str(path))
        except ConfigError as err:
            message = str(err)
            assert message and "\n" not in message, (case, data, message)
            outcomes["refused"] += 1
        else:
            assert isinstance(config, BaseConfig)
            outcomes["loaded"] += 1
    # both outcomes occur, so the test exercises acceptance as well as refusal
    assert outcomes["loaded"] >= 20 and outcomes["refused"] >= 100, outcomes


@pytest.mark.parametrize(
    "override", ["train.lr=[", "train=3", "train.lr.x=1", "=1", "steps=1e999", "seed=-.inf"]
)
def test_override_mutations_fail_cleanly(override):
    load_plugins()
    with pytest.raises(ConfigError):
        load_config("core/tiny_grpo", [override])


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    model = torch.nn.Linear(3, 2)
    state = {"optimizer": {"state": {0: {"exp_avg": torch.ones(3)}}, "param_groups": [{"lr": 0.1}]}}
    return save_checkpoint(root, 5, state, model)


def test_manifest_mutations_verify_or_give_a_reason(good_checkpoint, tmp_path):
    rng = random.Random(SEED + 1)
    source = (good_checkpoint / "manifest.json").read_bytes()
    valid_json = json.loads(source)
    variants = [
        {"files": {}},
        {"files": []},
        {"step": 5},
        {"step": 5, "files": None},
        {"step": 5, "files": {"state.json": 1}},
        {"step": 5, "files": {"../state.json": "0" * 64}},
        {"step": "5", "files": valid_json["files"]},
        {"step": 6, "files": valid_json["files"]},
        [],
        "manifest",
        None,
    ]
    outcomes = {"good": 0, "bad": 0}
    for case in range(300):
        folder = tmp_path / f"step_{case:08d}"
        shutil.copytree(good_checkpoint, folder)
        if case < len(variants):
            data = json.dumps(variants[case]).encode()
        elif case % 4 == 0:
            data = bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))
        else:
            data = mutate(source, rng)
        # the folder's own step, so that an unmutated manifest verifies
        (folder / "manifest.json").write_bytes(data.replace(b'"step": 5', f'"step": {case}'.encode()))
        problem = verify_checkpoint(folder)
        if problem is None:
            # accepted only if every file of the folder is covered and matches
            listed = json.loads((folder / "manifest.json").read_text())["files"]
            assert set(listed) == {p.name for p in folder.iterdir()} - {"manifest.json"}
            outcomes["good"] += 1
        else:
            assert isinstance(problem, str) and problem
            outcomes["bad"] += 1
    assert outcomes["bad"] >= 100 and outcomes["good"] >= 1, outcomes
    for case in range(len(variants)):
        assert verify_checkpoint(tmp_path / f"step_{case:08d}") is not None, variants[case]
