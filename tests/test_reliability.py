"""A careless or unlucky user meets a clean error or a correct result, never a silent wrong one:
non-finite numbers, NaN weights, mismatched estimators, unwritable output directories, corrupt or
foreign checkpoints, and a process that waits for a paused one."""

import copy
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mmrl.checkpoint import load_checkpoint, save_checkpoint
from mmrl.cli import load_plugins, main
from mmrl.config import ConfigError, load_config
from mmrl.examples.digits import TinyModelConfig, build_model
from mmrl.registry import TRAINERS
from mmrl.run_stops import TrainingStopped
from mmrl.runlog import read_launches
from mmrl.watch import CollectiveWatch

TINY = [
    "model.path=null",
    "model.hidden_size=32",
    "task.train_prompts=64",
    "task.heldout_prompts=8",
    "rollout.prompts_per_step=2",
    "rollout.branch_factor=4",
    "checkpoint_every=1",
    "progress=false",
]


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def tiny_trainer(tmp_path, *overrides: str):
    load_plugins()  # registers the example trainers, as the CLI does before it reads a recipe
    config = load_config("core/tiny_grpo", [f"output_dir={tmp_path}", *TINY, *overrides])
    return TRAINERS.get(config.trainer)(config)


def all_checkpoints_finite(run_dir: Path) -> bool:
    files = sorted((run_dir / "checkpoints").glob("step_*/*.safetensors"))
    assert files
    return all(torch.isfinite(t).all() for f in files for t in load_file(f).values() if t.is_floating_point())


# -- non-finite numbers ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override", ["train.lr=.nan", "train.lr=.inf", "rollout.temperature=.nan", "train.lr=nan"]
)
def test_non_finite_config_numbers_are_refused(override, tmp_path, capsys):
    assert main(["train", "core/tiny_grpo", override, f"output_dir={tmp_path}/run"]) == 2
    line = one_error_line(capsys)
    assert override.split("=")[0] in line and "not a finite number" in line
    assert not (tmp_path / "run").exists()  # nothing written before validation


@pytest.mark.parametrize(
    ("content", "named"),
    [
        (bytes(range(256)) * 4, "not UTF-8"),
        (b"trainer: tiny_grpo\ntrain:\n  lr: 1.0e-3\n  lr: 1.0e-2\n", "key 'lr' is written twice"),
        (b"trainer: tiny_grpo\nsteps: 3\nsteps: 4\n", "key 'steps' is written twice"),
        (b"- trainer\n- tiny_grpo\n", "must hold a mapping"),
    ],
)
def test_unreadable_or_ambiguous_yaml_is_refused(content, named, tmp_path, capsys):
    path = tmp_path / "recipe.yaml"
    path.write_bytes(content)
    assert main(["train", str(path), f"output_dir={tmp_path}/run"]) == 2
    line = one_error_line(capsys)
    assert str(path) in line and named in line


@pytest.mark.parametrize(
    ("recipe", "override", "named"),
    [
        ("core/tiny_grpo", "train.advantage=awr", "unknown advantage 'awr'"),
        ("core/tiny_grpo", "train.advantage=gae", "is a temporal advantage (rewards, values, dones)"),
        ("core/tiny_grpo", "train.advantage=td1", "is a temporal advantage (rewards, values, dones)"),
        ("core/tiny_grpo", "train.advantage=mc_grpo", "odd number"),
        ("core/tiny_branch_grpo", "train.advantage=mc_grpo", "odd number of leaves per tree"),
        ("diffusion/branchgrpo_quick", "train.advantage=gae", "is a temporal advantage"),
        ("diffusion/branchgrpo_quick", "train.advantage=mc_grpo", "odd number of leaves per tree"),
    ],
)
def test_an_estimator_the_trainer_cannot_feed_is_refused(recipe, override, named, capsys):
    assert main(["train", recipe, override]) == 2
    line = one_error_line(capsys)
    assert "train.advantage" in line or "branch_factor" in line
    assert named in line


def test_an_odd_group_makes_mc_grpo_usable():
    config = load_config("core/tiny_grpo", ["train.advantage=mc_grpo", "rollout.branch_factor=5"])
    assert config.train.advantage == "mc_grpo"


def test_nan_weights_stop_the_run_and_are_never_checkpointed(tmp_path, monkeypatch):
    trainer = tiny_trainer(tmp_path, "steps=4")
    real_step = trainer.train_step

    def poisoned_step(step):
        metrics = real_step(step)
        if step == 2:  # the update of the third step leaves a NaN weight, with a finite loss
            with torch.no_grad():
                next(trainer.accelerator.unwrap_model(trainer.model).parameters()).view(-1)[0] = float("nan")
        return metrics

    monkeypatch.setattr(trainer, "train_step", poisoned_step)
    with pytest.raises(TrainingStopped) as info:
        trainer.train()
    message = str(info.value)
    assert "not finite" in message and "step 3" in message and "step_00000002" in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]
    assert all_checkpoints_finite(tmp_path)
    stopped = json.loads((tmp_path / "stopped.json").read_text())
    assert stopped["step"] == 3 and stopped["checkpoint"].endswith("step_00000002")


def test_a_diverging_run_exits_non_zero_without_nan_checkpoints(tmp_path):
    """Through the command line: a learning rate that blows the weights up ends with exit 1 and a
    reason, every checkpoint on disk finite."""
    proc = subprocess.run(
        [sys.executable, "-m", "mmrl", "train", "core/tiny_grpo", f"output_dir={tmp_path}", *TINY]
        + ["steps=5", "train.lr=1e30", "train.nan_patience=2"],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "error: run stopped: non-finite" in proc.stderr
    assert all_checkpoints_finite(tmp_path)


# -- output directories ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["file", "under a file", "empty"])
def test_bad_output_dir_fails_before_any_work(kind, tmp_path, capsys):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    output_dir = {"file": str(blocker), "under a file": str(blocker / "run"), "empty": ""}[kind]
    assert main(["train", "core/tiny_grpo", *TINY, f"output_dir={output_dir}"]) == 2
    line = one_error_line(capsys)
    assert "output_dir" in line
    assert blocker.read_text() == "not a directory"


@pytest.mark.parametrize(
    ("command", "key"),
    [
        (["eval", "diffusion", "models=[diffusion_rl/assets/tiny_flow]", "output_dir={file}"], "output_dir"),
        (["eval", "vla", "policies=[missing]", "output_dir={file}/sub"], "output_dir"),
        (["eval", "vlm", "benchmark=missing.jsonl", "output_dir={file}"], "output_dir"),
        (["bench", "all", "output={file}/all.json"], "output"),
    ],
)
def test_evaluations_and_benches_check_their_output_first(command, key, tmp_path, capsys):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    assert main([part.format(file=blocker) for part in command]) == 2
    line = one_error_line(capsys)
    assert f"{key}" in line and "file" in line


def run_without_override(args: list[str]) -> subprocess.CompletedProcess:
    """The CLI with file permissions enforced: root ignores them unless it drops the capability to."""
    drop = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--inh-caps"]
    prefix = [*drop, "-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
    return subprocess.run(
        [*prefix, sys.executable, "-m", "mmrl", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )


@pytest.mark.parametrize("read_only", ["output_dir", "checkpoints"])
def test_read_only_output_fails_before_training(read_only, tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    locked = run_dir if read_only == "output_dir" else run_dir / "checkpoints"
    locked.chmod(0o555)
    try:
        proc = run_without_override(["train", "core/tiny_grpo", *TINY, "steps=2", f"output_dir={run_dir}"])
    finally:
        locked.chmod(0o755)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "not writable" in proc.stderr and "output_dir" in proc.stderr
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "config.yaml").exists()


# -- checkpoints -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A three-step run with a checkpoint after every step; tests copy it before damaging it."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    tiny_trainer(run_dir, "steps=3", "keep_checkpoints=3").train()
    return run_dir


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(run_dir, target)
    return target


def resume(run_dir: Path, *overrides: str) -> int:
    return main(
        ["train", "core/tiny_grpo", f"output_dir={run_dir}", *TINY, "steps=4", "resume=true", *overrides]
    )


@pytest.mark.parametrize("manifest_files", [{}, [], {"state.json": "0" * 64}])
def test_a_manifest_that_omits_files_does_not_vouch_for_them(manifest_files, finished_run, tmp_path):
    run_dir = copy_of(finished_run, tmp_path)
    newest = run_dir / "checkpoints" / "step_00000003"
    model = newest / "model.safetensors"
    model.write_bytes(model.read_bytes()[:64])
    (newest / "manifest.json").write_text(json.dumps({"step": 3, "files": manifest_files}))
    with pytest.warns(UserWarning, match="skipping checkpoint .*step_00000003"):
        assert resume(run_dir) == 0
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 4
    # resumed from step 2: step 3 was trained again and re-saved
    assert (run_dir / "checkpoints" / "step_00000004").is_dir()


def test_every_checkpoint_corrupt_is_refused_then_set_aside_on_request(finished_run, tmp_path, capsys):
    run_dir = copy_of(finished_run, tmp_path)
    for model in (run_dir / "checkpoints").glob("step_*/model.safetensors"):
        model.write_bytes(b"garbage")
    assert resume(run_dir) == 2
    line = one_error_line(capsys)
    assert "every checkpoint" in line and "corrupt" in line and "discard_corrupt_checkpoints=true" in line
    assert resume(run_dir, "discard_corrupt_checkpoints=true") == 0
    aside = sorted(p.name for p in (run_dir / "checkpoints" / "corrupt").iterdir())
    assert aside == ["step_00000001", "step_00000002", "step_00000003"]
    assert (run_dir / "checkpoints" / "step_00000004").is_dir()


def test_unfinished_writes_are_removed_at_start(finished_run, tmp_path):
    run_dir = copy_of(finished_run, tmp_path)
    leftover = run_dir / "checkpoints" / ".tmp-step_00000004-12345"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half")
    assert resume(run_dir) == 0
    assert not leftover.exists()


def test_a_checkpoint_of_two_processes_is_not_resumed_by_one(finished_run, tmp_path, capsys):
    run_dir = copy_of(finished_run, tmp_path)
    path = run_dir / "checkpoints" / "step_00000003"
    checkpoint = load_checkpoint(path)
    state = checkpoint.state
    state["rng"] = {
        "0": state["rng"]["0"],
        "1": copy.deepcopy(state["rng"]["0"]),
    }  # as a 2-process run writes it
    model = build_model(TinyModelConfig(hidden_size=32), digits=4)
    model.load_state_dict(load_file(path / "model.safetensors"))
    save_checkpoint(run_dir / "checkpoints", 3, state, model, keep=3)
    assert resume(run_dir) == 2
    line = one_error_line(capsys)
    assert "written by 2 process(es)" in line and "this launch has 1" in line
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 3


def test_a_checkpoint_of_another_model_is_a_config_error(finished_run, tmp_path, capsys):
    run_dir = copy_of(finished_run, tmp_path)
    assert (
        main(
            ["train", "core/tiny_grpo", f"output_dir={run_dir}", *TINY, "model.hidden_size=16"]
            + ["steps=4", "resume=true"]
        )
        == 2
    )
    line = one_error_line(capsys)
    assert "another model" in line and "config.yaml" in line


# -- collectives -------------------------------------------------------------------------------


def test_the_watch_reports_a_long_wait_and_stays_quiet_otherwise(capfd):
    watch = CollectiveWatch(warn_after=1.0, rank=1, world=2)
    with watch.phase("the quick gather"):
        pass
    with watch.phase("the gather of rewards"):
        time.sleep(2.6)
    time.sleep(0.3)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "has waited" in line]
    assert len(lines) == 2, err  # after 1 s and after 2 s of the same wait
    assert all("process 1 of 2" in line and "the gather of rewards" in line for line in lines)
    assert "quick gather" not in err


def test_a_single_process_watch_never_reports(capfd):
    watch = CollectiveWatch(warn_after=1.0, rank=0, world=1)
    with watch.phase("nothing to wait for"):
        time.sleep(1.5)
    assert "has waited" not in capfd.readouterr().err


def test_config_rejects_a_zero_wait_threshold():
    with pytest.raises(ConfigError, match="collective_warn_seconds"):
        load_config("core/tiny_grpo", ["collective_warn_seconds=0"])


def test_every_launch_records_what_the_run_was_made_with(finished_run, tmp_path):
    run_dir = copy_of(finished_run, tmp_path)
    (first,) = read_launches(run_dir)
    assert first["from_step"] == 0 and first["processes"] == 1 and first["device"] == "cpu"
    assert first["cpu_threads"] == torch.get_num_threads() and first["torch"] == torch.__version__
    assert first["setup_seconds"] > 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(row["step_seconds"] > 0 for row in rows)  # timed by the shared loop, for every trainer
    assert resume(run_dir) == 0
    assert [launch["from_step"] for launch in read_launches(run_dir)] == [0, 3]


def test_a_resume_with_another_cpu_thread_count_says_how_to_match_it(finished_run, tmp_path, monkeypatch):
    run_dir = copy_of(finished_run, tmp_path)
    written_with = load_checkpoint(run_dir / "checkpoints" / "step_00000003").state["cpu_threads"]
    assert written_with == torch.get_num_threads()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resume(copy_of(finished_run, tmp_path / "same")) == 0
    assert not [w for w in caught if "CPU thread" in str(w.message)]  # the same count: no warning
    monkeypatch.setattr(torch, "get_num_threads", lambda: written_with + 1)
    with pytest.warns(
        UserWarning, match=f"written with {written_with} CPU thread.*OMP_NUM_THREADS={written_with}"
    ):
        assert resume(run_dir) == 0
