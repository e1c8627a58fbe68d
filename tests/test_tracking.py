"""Tracking beside metrics.jsonl: a W&B run in offline mode holds every logged metric, the held-out
evaluations, the config and the samples, and a resumed run continues the same W&B run; bad `tracking`
lists are one clear error."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmrl.cli import load_plugins
from mmrl.config import ConfigError, WandbConfig, load_config
from mmrl.examples.tiny_grpo import TinyGRPOTrainer
from mmrl.runlog import MetricsLog
from mmrl.tracking import WANDB_ID_FILE, WandbTracker

load_plugins()

TINY = ["model.path=null", "model.hidden_size=32", "task.train_prompts=64", "task.heldout_prompts=8"]
TINY += ["rollout.prompts_per_step=4", "progress=false", "tracking=[wandb]", "wandb.mode=offline"]
BLOCK = 32768  # the W&B transaction log's block size (a LevelDB-style log of protobuf records)


@pytest.fixture(autouse=True)
def wandb_home(tmp_path, monkeypatch):
    """W&B's own settings and caches in the test's folder, and no console output."""
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_SILENT", "true")


def wandb_records(log: Path) -> list[tuple[str, object]]:
    """The (kind, record) of every record in an offline run's ``run-ID.wandb`` file."""
    from wandb.proto import wandb_internal_pb2

    data, position, pending, records = log.read_bytes(), 7, b"", []  # after the 7-byte file header
    while position + 7 <= len(data):
        left = BLOCK - position % BLOCK
        if left < 7:  # a block's tail too short for a chunk header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if length == 0 and kind == 0:
            position += left
            continue
        chunk, position = data[position + 7 : position + 7 + length], position + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk  # full, first | middle, last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append((record.WhichOneof("record_type"), record))
    return records


def history(records: list[tuple[str, object]]) -> list[dict[str, object]]:
    rows = []
    for kind, record in records:
        if kind == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows


def summary(records: list[tuple[str, object]]) -> dict[str, object]:
    values = {}
    for kind, record in records:
        if kind == "summary":
            values |= {
                item.key or "/".join(item.nested_key): item.value_json for item in record.summary.update
            }
    return values


def offline_runs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def test_an_offline_wandb_run_holds_every_metric_and_a_resume_continues_it(tmp_path):
    run_dir = tmp_path / "run"
    config = load_config("core/tiny_grpo", [*TINY, f"output_dir={run_dir}", "steps=2", "checkpoint_every=1"])
    TinyGRPOTrainer(config).train()
    run_id = (run_dir / WANDB_ID_FILE).read_text().strip()
    (first,) = offline_runs(run_dir)
    assert first.name == f"run-{run_id}.wandb"
    records = wandb_records(first)
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = history(records)
    assert [row["_step"] for row in rows] == [1, 2]
    for row, metrics in zip(rows, logged, strict=True):
        assert {k: v for k, v in metrics.items() if k != "step"}.items() <= row.items()
    after = json.loads((run_dir / "eval.json").read_text())["after"]
    held = summary(records)
    assert json.loads(held["eval_after/heldout_reward"]) == pytest.approx(after["heldout_reward"])
    assert "eval_before/heldout_reward" in held
    (run,) = [record.run for kind, record in records if kind == "run"]
    config_seen = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config_seen["seed"] == config.seed and config_seen["trainer"] == "tiny_grpo"

    resumed = load_config("core/tiny_grpo", [*TINY, f"output_dir={run_dir}", "steps=4", "resume=true"])
    with pytest.warns(UserWarning, match="config changes"):
        TinyGRPOTrainer(resumed).train()
    second = [path for path in offline_runs(run_dir) if path != first]
    assert [path.name for path in second] == [f"run-{run_id}.wandb"]  # the same W&B run, continued
    assert [row["_step"] for row in history(wandb_records(second[0]))] == [3, 4]


def test_samples_written_to_the_run_go_to_wandb_once(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "samples").mkdir(parents=True)
    tracker = WandbTracker(run_dir, WandbConfig(mode="offline"), {"seed": 0})
    log = MetricsLog(run_dir, [tracker])
    Image.fromarray(np.full((8, 8, 3), 200, dtype=np.uint8)).save(run_dir / "samples" / "step_000000.png")
    log.log(1, {"reward": 0.5})
    log.log(2, {"reward": 0.6})  # nothing new in samples/
    log.close()
    rows = history(wandb_records(offline_runs(run_dir)[0]))
    images = [row for row in rows if "samples/step_000000/_type" in row]
    assert len(images) == 1 and images[0]["_step"] == 1
    assert images[0]["samples/step_000000/_type"] == "image-file"


def test_wandb_online_without_a_login_is_refused_before_the_run_starts(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))
    config = load_config("core/tiny_grpo", [*TINY[:-1], f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"wandb is online but not logged in.*wandb.mode=offline"):
        TinyGRPOTrainer(config)
    assert not (tmp_path / "run").exists()
    monkeypatch.setenv("WANDB_MODE", "offline")  # W&B's own setting, which wandb.mode=auto follows
    TinyGRPOTrainer(config)


def test_the_old_tensorboard_key_names_its_replacement():
    with pytest.raises(ConfigError, match=r"unknown key 'tensorboard'.*it is now tracking=\[tensorboard\]"):
        load_config("core/tiny_grpo", ["tensorboard=true"])


@pytest.mark.parametrize(
    ("tracking", "message"),
    [
        ("[wandbb]", r"unknown tracker 'wandbb' \(did you mean 'wandb'\?\)"),
        ("[wandb, wandb]", r"names a tracker twice"),
    ],
)
def test_a_bad_tracking_list_is_one_clear_error(tmp_path, tracking, message):
    config = load_config("core/tiny_grpo", [*TINY[:-2], f"output_dir={tmp_path}", f"tracking={tracking}"])
    with pytest.raises(ConfigError, match=message):
        TinyGRPOTrainer(config)
    assert not (tmp_path / "config.yaml").exists()
