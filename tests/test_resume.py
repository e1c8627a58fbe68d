"""Exact resume: a run SIGKILLed between checkpoints, then resumed, ends bit-identical to a straight run."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

ARGS = [
    "model.path=null",
    "model.hidden_size=32",
    "task.train_prompts=256",
    "task.heldout_prompts=16",
    "rollout.prompts_per_step=4",
    "steps=12",
    "checkpoint_every=4",
    "progress=false",
    "train.sampler=beta_thompson",
    "train.kl_coef=0.01",
    "train.warmup_steps=6",
]


def mmrl(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "mmrl", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def logged_steps(run_dir) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return json.loads(lines[-1])["step"] if lines else 0


def final_weights(run_dir):
    return load_file(run_dir / "checkpoints" / "step_00000012" / "model.safetensors")


def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    reference = mmrl("train", "core/tiny_grpo", f"output_dir={straight}", *ARGS)

    victim = mmrl("train", "core/tiny_grpo", f"output_dir={killed}", *ARGS)
    deadline = time.monotonic() + 300
    while logged_steps(killed) < 6:  # past the step-4 checkpoint, before the step-8 one
        assert victim.poll() is None, victim.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert victim.returncode == -signal.SIGKILL
    newest = sorted(p.name for p in (killed / "checkpoints").iterdir() if p.name.startswith("step_"))[-1]
    assert newest in ("step_00000004", "step_00000008")
    assert logged_steps(killed) > int(newest[5:])  # the kill really fell between checkpoints

    resumed = mmrl("train", "core/tiny_grpo", f"output_dir={killed}", *ARGS, "--resume")
    for proc in (reference, resumed):
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()[-2000:]

    a, b = final_weights(straight), final_weights(killed)
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] == b[name]).all(), f"{name} differs after resume"
    steps = [json.loads(line)["step"] for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))  # rows past the checkpoint were replaced, not duplicated
    rows_a = (straight / "metrics.jsonl").read_text().splitlines()
    rows_b = (killed / "metrics.jsonl").read_text().splitlines()
    assert rows_a == rows_b


@pytest.mark.slow  # three runs; corrupt checkpoints in one process: tests/test_reliability.py
@pytest.mark.parametrize("damage", ["truncate"])
def test_resume_skips_corrupt_newest_checkpoint(tmp_path, damage):
    run_dir, straight = tmp_path / "run", tmp_path / "straight"
    reference = mmrl(
        "train", "core/tiny_grpo", f"output_dir={straight}", *ARGS
    )  # alongside, on the other core
    first = mmrl("train", "core/tiny_grpo", f"output_dir={run_dir}", *ARGS, "steps=8")
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err.decode()
    weights = run_dir / "checkpoints" / "step_00000008" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    again = mmrl("train", "core/tiny_grpo", f"output_dir={run_dir}", *ARGS, "resume=true")
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0, err.decode()
    assert "skipping checkpoint" in err.decode() and "step_00000008" in err.decode()
    _, err = reference.communicate(timeout=300)
    assert reference.returncode == 0, err.decode()
    a, b = final_weights(straight), final_weights(run_dir)
    assert all((a[k] == b[k]).all() for k in a)
