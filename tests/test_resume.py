"""Exact resume past a corrupt newest checkpoint: the run resumes from the one before and ends
bit-identical to a straight run (a SIGKILL at any moment: tests/test_sigkill_resume.py)."""

import os
import subprocess
import sys

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


def final_weights(run_dir):
    return load_file(run_dir / "checkpoints" / "step_00000012" / "model.safetensors")


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
