"""Faults of the shared run machinery met through the command line: two runs in one directory, resumes
that cannot continue their checkpoint, non-finite held-out metrics, a bench output that exists, plugins
that exit at import, Ctrl-C, exceptions and a full disk in a started run, `mmrl eval` of a run
directory, and bad --dry-run options.

A mistake found before the run starts exits 2 with one ``error:`` line and writes nothing; a started
run that cannot go on exits 1 (130 for Ctrl-C) with one ``error: run stopped: ...`` line, records
stopped.json and keeps its checkpoints. Every JSON file a run writes is strict JSON."""

import errno
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors import SafetensorError

import mmrl.checkpoint
from mmrl.checkpoint import list_checkpoints, verify_checkpoint
from mmrl.cli import load_plugins, main
from mmrl.examples.tiny_grpo import TinyGRPOTrainer

load_plugins()
TINY = [  # a tiny_grpo run of a few seconds
    "model.path=null",
    "model.hidden_size=32",  # not the recipe's 64: `mmrl eval` must read the run's own config
    "task.train_prompts=64",
    "task.heldout_prompts=8",
    "rollout.prompts_per_step=2",
    "rollout.branch_factor=4",
    "checkpoint_every=1",
    "progress=false",
]


def run(argv: list[str]) -> int:
    """`mmrl ARGV` in this process: its exit code, whether returned or raised (argparse exits)."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)


def train(run_dir: Path, *overrides: str, recipe: str = "core/tiny_grpo") -> int:
    return run(["train", recipe, f"output_dir={run_dir}", *TINY, *overrides])


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def snapshot(root: Path) -> dict[str, str]:
    """Every path under `root` with its content's digest (folders as 'dir')."""
    return {
        str(path.relative_to(root)): "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
    }


def strict(text: str) -> object:
    """JSON as a strict reader takes it: a bare NaN or Infinity fails."""

    def refuse(constant: str) -> None:
        raise AssertionError(f"not strict JSON: a bare {constant}")

    return json.loads(text, parse_constant=refuse)


def all_json_strict(run_dir: Path) -> None:
    for path in run_dir.rglob("*.json"):
        strict(path.read_text())
    for path in run_dir.rglob("*.jsonl"):
        for line in path.read_text().splitlines():
            strict(line)


def stopped(run_dir: Path) -> dict:
    return strict((run_dir / "stopped.json").read_text())


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A two-step tiny_grpo run with a checkpoint after each step."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    assert train(run_dir, "steps=2") == 0
    return run_dir


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(run_dir, target)
    return target


# -- 1: one run per directory ------------------------------------------------------------------


HOLD = (
    "import sys; from pathlib import Path; from mmrl.runlog import lock_run_dir; "
    "lock_run_dir(Path(sys.argv[1])); print('held', flush=True); sys.stdin.read()"
)


def test_a_run_directory_in_use_is_refused_and_a_killed_holder_leaves_no_lock(finished_run, tmp_path, capsys):
    run_dir = copy_of(finished_run, tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        before = snapshot(tmp_path)
        for extra in (["steps=3", "resume=true"], ["steps=3", "seed=1"]):  # a resume, and a second run
            assert train(run_dir, *extra) == 2
            line = one_error_line(capsys)
            assert f"run directory '{run_dir}' is in use" in line and f"process {holder.pid}" in line
            assert snapshot(tmp_path) == before  # nothing written, not even the lock file
        assert run(["eval", "core/tiny_grpo", f"output_dir={run_dir}"]) == 0  # reading is not blocked
        assert json.loads(capsys.readouterr().out)["step"] == 2
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert train(run_dir, "steps=3", "resume=true") == 0  # the dead holder's lock went with it
    assert strict((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 3


# -- 2: a resume that cannot continue its checkpoint -------------------------------------------


def test_a_resume_with_another_trainer_is_refused_before_anything_is_written(finished_run, tmp_path, capsys):
    run_dir = copy_of(finished_run, tmp_path)
    before = snapshot(tmp_path)
    assert run(["pretrain", "tiny_lm", f"output_dir={run_dir}", "steps=3", "--resume"]) == 2
    line = one_error_line(capsys)
    assert "trained by 'tiny_grpo'" in line and "'tiny_sft'" in line and f"{run_dir}/config.yaml" in line
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("change", ["train.sampler=beta_thompson", "task.train_prompts=32"])
def test_a_resume_whose_changes_break_the_trainer_state_is_refused_before_writing(
    change, finished_run, tmp_path, capsys
):
    run_dir = copy_of(finished_run, tmp_path)
    before = snapshot(tmp_path)
    assert train(run_dir, "steps=3", "resume=true", change) == 2
    line = one_error_line(capsys)
    assert "cannot be continued with this config" in line and change.split("=")[0] in line
    assert f"`mmrl train {run_dir}/config.yaml --resume`" in line
    assert snapshot(tmp_path) == before  # config.yaml is the run's own still


# -- 3: strict JSON ----------------------------------------------------------------------------


def test_a_non_finite_held_out_metric_is_written_as_null_and_named(tmp_path, monkeypatch, capsys):
    evaluate = TinyGRPOTrainer.evaluate

    def nan_reward(self):
        return {**evaluate(self), "heldout_reward": math.nan}

    monkeypatch.setattr(TinyGRPOTrainer, "evaluate", nan_reward)
    assert train(tmp_path / "run", "steps=1") == 0
    out, err = capsys.readouterr()
    assert strict(out)["heldout_reward"] is None
    evals = strict((tmp_path / "run" / "eval.json").read_text())
    for moment in ("before", "after"):
        assert evals[moment]["heldout_reward"] is None and evals[moment]["non_finite"] == ["heldout_reward"]
        assert isinstance(evals[moment]["heldout_exact"], float)
    warnings = [line for line in err.splitlines() if "non-finite" in line]
    assert len(warnings) == 2 and all("heldout_reward = nan" in line for line in warnings), err
    all_json_strict(tmp_path / "run")


# -- 4: bench all never overwrites -------------------------------------------------------------


def test_bench_all_refuses_an_output_file_that_exists(tmp_path, capsys):
    output = tmp_path / "all.json"
    output.write_text('{"earlier": "results"}')
    assert run(["bench", "all", f"output={output}", "only=[core]"]) == 2
    line = one_error_line(capsys)
    assert f"output = '{output}' exists already" in line and "another output=PATH" in line
    assert output.read_text() == '{"earlier": "results"}'


# -- 5: a plugin that ends the process at import -----------------------------------------------


@pytest.mark.parametrize(
    ("name", "code", "said"),
    [
        ("exits_zero", "import sys\nsys.exit(0)\n", "called sys.exit(0)"),
        ("exits_three", "raise SystemExit(3)\n", "called sys.exit(3)"),
        ("interrupted", "raise KeyboardInterrupt\n", "interrupted (KeyboardInterrupt)"),
    ],
)
def test_a_plugin_that_exits_at_import_is_one_line(name, code, said, tmp_path, capsys):
    plugin = tmp_path / f"plugin_{name}.py"
    plugin.write_text(code)
    assert run(["list", "--plugin", str(plugin)]) == 2
    line = one_error_line(capsys)
    assert f"plugin '{plugin}'" in line and said in line


# -- 6 and 7: a started run that stops ---------------------------------------------------------


def raising_at(monkeypatch, index: int, error: BaseException) -> None:
    """tiny_grpo's step `index` (0-based) raises `error`, as a user's reward or a Ctrl-C would."""
    train_step = TinyGRPOTrainer.train_step

    def step(self, step):
        if step == index:
            raise error
        return train_step(self, step)

    monkeypatch.setattr(TinyGRPOTrainer, "train_step", step)


def test_ctrl_c_in_a_step_says_where_and_what_to_resume_from(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    raising_at(monkeypatch, 2, KeyboardInterrupt())
    assert train(run_dir, "steps=4") == 130
    line = one_error_line(capsys)
    assert "interrupted (Ctrl-C) in step 3 of 4" in line and f"{run_dir}/checkpoints/step_00000002" in line
    assert "--resume" in line and "stopped.json" in line
    record = stopped(run_dir)
    assert record["step"] == 3 and record["checkpoint"].endswith("step_00000002")
    monkeypatch.undo()
    assert train(run_dir, "steps=4", "--resume") == 0
    all_json_strict(run_dir)


def test_a_real_sigint_stops_the_run_with_its_record(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mmrl",
            "train",
            "core/tiny_grpo",
            f"output_dir={run_dir}",
            *TINY,
            "steps=100000",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        # a shell's background job inherits SIGINT ignored, and Python then keeps ignoring it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while not list_checkpoints(run_dir / "checkpoints"):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # the interrupt was lost: show what the run said
        proc.kill()
        pytest.fail(f"the run went on after SIGINT; its stderr ends:\n{proc.communicate()[1][-3000:]}")
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and len([x for x in err.splitlines() if x.startswith("error:")]) == 1, err
    assert "error: run stopped: interrupted (Ctrl-C)" in err and "--resume" in err
    record = stopped(run_dir)
    assert (
        record["error"]["type"] == "KeyboardInterrupt"
        and verify_checkpoint(Path(record["checkpoint"])) is None
    )


def test_an_exception_in_a_step_is_recorded_with_its_traceback(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    raising_at(monkeypatch, 1, ValueError("reward exploded\non two lines"))
    assert train(run_dir, "steps=3") == 1
    line = one_error_line(capsys)
    assert line.startswith("error: run stopped: ValueError: reward exploded on two lines in step 2 of 3")
    assert f"{run_dir}/checkpoints/step_00000001" in line and "stopped.json" in line
    record = stopped(run_dir)
    assert record["step"] == 2 and record["checkpoint"].endswith("step_00000001")
    assert record["error"]["type"] == "ValueError" and "raise error" in record["traceback"]
    all_json_strict(run_dir)


def test_an_exception_after_the_steps_is_recorded_too(tmp_path, monkeypatch, capsys):
    """tiny_grpo's own work after the shared loop (it writes replicas.json) failing on a full disk."""

    def disk_full(self):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.run_dir / "replicas.json"))

    monkeypatch.setattr(TinyGRPOTrainer, "check_replicas_agree", disk_full)
    run_dir = tmp_path / "run"
    assert train(run_dir, "steps=1") == 1
    line = one_error_line(capsys)
    assert f"no space left on device (ENOSPC) in {run_dir}, after training" in line
    assert stopped(run_dir)["checkpoint"].endswith("step_00000001")


@pytest.mark.parametrize(
    "error",
    [
        SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on '
            'device" })'
        ),
        OSError(errno.ENOSPC, "No space left on device"),
    ],
    ids=["safetensors", "oserror"],
)
def test_a_full_disk_while_checkpointing_keeps_the_previous_checkpoint(error, tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    save_file = mmrl.checkpoint.save_file

    def fills_the_disk(tensors, filename, *args, **kwargs):
        if Path(filename).parent.name.startswith(".tmp-step_00000002"):
            Path(filename).write_bytes(b"half a file")
            raise error
        return save_file(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(mmrl.checkpoint, "save_file", fills_the_disk)
    assert train(run_dir, "steps=3") == 1
    line = one_error_line(capsys)
    assert f"no space left on device (ENOSPC) in {run_dir}/checkpoints" in line
    assert "while writing the checkpoint of step 2" in line and "free space" in line
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_00000001"]  # no half write
    assert verify_checkpoint(run_dir / "checkpoints" / "step_00000001") is None
    assert stopped(run_dir)["checkpoint"].endswith("step_00000001")
    monkeypatch.undo()
    assert train(run_dir, "steps=3", "--resume") == 0
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")][-1] == "step_00000003"


def test_a_full_disk_while_saving_a_diffusion_result_leaves_no_half_written_final(
    tmp_path, monkeypatch, capsys
):
    from diffusion_rl.models import FlowPipeline
    from diffusion_rl.shapes import vocabulary
    from tests.tiny_flow import SMALL

    model = tmp_path / "model"
    FlowPipeline.tiny(vocabulary(), SMALL).save_pretrained(model)
    save_pretrained = FlowPipeline.save_pretrained

    def fills_the_disk(self, directory):
        save_pretrained(self, directory)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(Path(directory) / "denoiser"))

    monkeypatch.setattr(FlowPipeline, "save_pretrained", fills_the_disk)
    monkeypatch.setattr("diffusion_rl.trainer.evaluate_alignment", lambda *a, **k: {"heldout_alignment": 0.0})
    run_dir = tmp_path / "run"
    argv = ["train", "diffusion/flat_grpo", f"model.path={model}", f"output_dir={run_dir}", "steps=1"]
    argv += ["progress=false", "rollout.prompts_per_step=1", "rollout.steps=4", "rollout.branch_factor=2"]
    assert run(argv) == 1
    assert "no space left on device (ENOSPC)" in one_error_line(capsys)
    assert not (run_dir / "final").exists()
    assert not [p.name for p in run_dir.iterdir() if p.name.startswith(".final")]
    assert stopped(run_dir)["checkpoint"].endswith("step_00000001")


# -- 8 and 12: `mmrl eval` of a run directory --------------------------------------------------


def test_eval_of_a_run_directory_uses_the_runs_own_config(finished_run, capsys):
    """The recipe builds hidden_size 64, the run was trained with 32: its config.yaml is what counts."""
    assert run(["eval", "core/tiny_grpo", f"output_dir={finished_run}"]) == 0
    assert strict(capsys.readouterr().out)["step"] == 2
    assert run(["eval", "pretrain/tiny_lm", f"output_dir={finished_run}"]) == 2
    line = one_error_line(capsys)
    assert "names trainer 'tiny_sft'" in line and "trained by 'tiny_grpo'" in line


def test_eval_of_a_missing_run_directory_says_it_does_not_exist(tmp_path, capsys):
    missing = tmp_path / "does_not_exist"
    assert run(["eval", "core/tiny_grpo", f"output_dir={missing}"]) == 2
    assert f"run directory '{missing}' (output_dir) does not exist" in one_error_line(capsys)
    assert list(tmp_path.iterdir()) == []


# -- 9 and 10: --dry-run options ---------------------------------------------------------------


@pytest.mark.parametrize("processes", ["0", "-2"])
def test_dry_run_refuses_fewer_than_one_process(processes, capsys):
    assert run(["train", "core/tiny_grpo", "--dry-run", "--processes", processes]) == 2
    assert f"--processes {processes}" in one_error_line(capsys)


def test_a_launch_file_whose_wrap_classes_are_not_names_is_one_line(tmp_path, capsys):
    launch = tmp_path / "fsdp.yaml"
    launch.write_text(
        "distributed_type: FSDP\nnum_processes: 2\n"
        "fsdp_config:\n  fsdp_transformer_layer_cls_to_wrap: [1, 2]\n"
    )
    assert run(["train", "core/tiny_grpo", "--dry-run", "--launch", str(launch)]) == 2
    line = one_error_line(capsys)
    assert "fsdp_config.fsdp_transformer_layer_cls_to_wrap = [1, 2]" in line and "block classes" in line


# -- 11: a learning rate past float32 ----------------------------------------------------------


def test_a_learning_rate_that_overflows_adam_stops_without_a_checkpoint(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert train(run_dir, "steps=2", "train.lr=1e38") == 1
    line = one_error_line(capsys)
    assert "the optimizer step failed" in line and "lower train.lr" in line
    assert not list_checkpoints(run_dir / "checkpoints")  # the partly updated weights are never written
    assert stopped(run_dir)["checkpoint"] is None
    all_json_strict(run_dir)
