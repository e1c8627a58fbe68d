"""Two CPU processes through `accelerate launch` (gloo): different rollouts per rank, identical parameters."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from mmrl.cli import main

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A port nothing listens on now: a fixed one can be held by a run that has not let go of it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


TINY = [
    "model.path=null",
    "model.hidden_size=32",
    "task.train_prompts=256",
    "task.heldout_prompts=16",
    "rollout.prompts_per_step=2",
    "progress=false",
]


def launch_two(
    run_dir: Path, *overrides: str, recipe: str = "core/tiny_grpo", base: list[str] = TINY
) -> subprocess.Popen:
    accelerate = Path(sys.executable).parent / "accelerate"
    cmd = [
        str(accelerate),
        "launch",
        "--config_file",
        str(ROOT / "configs/accelerate/cpu_2proc.yaml"),
        "--main_process_port",
        str(free_port()),
        "-m",
        "mmrl",
        "train",
        recipe,
        f"output_dir={run_dir}",
        *base,
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def kill_tree(proc: subprocess.Popen) -> None:
    """The ranks run in sessions of their own and hold the output pipes: kill the launcher and every
    process below it (found before the launcher dies), or a hung rank outlives the test and blocks it."""
    launcher = psutil.Process(proc.pid)
    for process in [*launcher.children(recursive=True), launcher]:
        process.kill()


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        _, stderr = proc.communicate(timeout=30)
        raise AssertionError(f"the two-process run did not finish in {timeout} s: {stderr[-3000:]}") from None
    return stderr


def test_two_process_ddp_run(tmp_path, capsys):
    proc = launch_two(tmp_path, "steps=3")
    stderr = finish(proc)
    assert proc.returncode == 0, stderr[-3000:]
    digests = json.loads((tmp_path / "replicas.json").read_text())["param_sha256_by_rank"]
    assert len(digests) == 2 and digests[0] == digests[1]
    ranks = [
        [
            json.loads(line)
            for line in (tmp_path / "samples" / f"rollouts_rank{r}.jsonl").read_text().splitlines()
        ]
        for r in (0, 1)
    ]
    for step in range(3):
        prompts = [[row["prompt"] for row in rows if row["step"] == step] for rows in ranks]
        assert prompts[0] and prompts[1] and not set(map(tuple, prompts[0])) & set(map(tuple, prompts[1]))
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # only the main process logs
    # its checkpoint holds two processes' data and random streams: one process must not continue it
    assert main(["train", "core/tiny_grpo", f"output_dir={tmp_path}", *TINY, "steps=4", "resume=true"]) == 2
    err = capsys.readouterr().err
    assert "written by 2 process(es)" in err and "this launch has 1" in err and "Traceback" not in err
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
        3,
    ]


@pytest.mark.slow  # the second two-process run; test_two_process_ddp_run is the default one
def test_two_process_vlm_tree_run_scores_shared_prefixes_under_ddp(tmp_path):
    """vlm/tool_grpo_tree calls the DDP-wrapped model twice before each backward (shared branches,
    then the rows on their cache): two gloo processes train it."""
    tiny = [
        "progress=false",
        "data.train_size=16",
        "data.heldout_size=4",
        "eval_modes=[auto]",
        "train.questions_per_step=2",
        "train.group_size=4",
        "checkpoint_every=1",
    ]
    proc = launch_two(tmp_path, "steps=2", recipe="vlm/tool_grpo_tree", base=tiny)
    stderr = finish(proc)
    assert proc.returncode == 0, stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["trained_sequences"] > 0 and row["branch_points"] > 0 for row in rows)


@pytest.mark.slow
def test_a_paused_rank_is_reported_by_the_one_waiting_for_it(tmp_path):
    """SIGSTOP one rank mid-run: the other says, within collective_warn_seconds, that it is waiting
    and where; after SIGCONT the run finishes normally."""
    proc = launch_two(tmp_path, "steps=30", "collective_warn_seconds=2", "checkpoint_every=100")
    try:
        deadline = time.monotonic() + 240
        metrics = tmp_path / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled early"
            time.sleep(0.05)
        ranks = [
            p for p in psutil.Process(proc.pid).children(recursive=True) if "mmrl" in " ".join(p.cmdline())
        ]
        paused = next(p for p in ranks if "LOCAL_RANK" in p.environ() and p.environ()["LOCAL_RANK"] == "1")
        paused.suspend()
        time.sleep(8)
        paused.resume()
        stderr = finish(proc)
    except BaseException:
        kill_tree(proc)
        raise
    assert proc.returncode == 0, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if "has waited" in line]
    assert lines and all("process 0 of 2" in line for line in lines), stderr[-3000:]
    assert "collective_warn_seconds = 2" in lines[0]


def test_an_fsdp_launch_without_cuda_says_it_runs_ddp(tmp_path):
    """Accelerate runs FSDP on CUDA only: a CPU launch with an FSDP config must not pass for a sharded run."""
    code = (
        "from mmrl.cli import load_plugins; from mmrl.config import load_config; "
        "from mmrl.registry import TRAINERS; load_plugins(); "
        f"c = load_config('core/tiny_grpo', {[*TINY, f'output_dir={tmp_path}']!r}); "
        "t = TRAINERS.get(c.trainer)(c); print(t.accelerator.distributed_type)"
    )
    for fsdp, said in (("true", True), ("false", False)):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_FSDP": fsdp}
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        assert run.returncode == 0, run.stderr[-3000:]
        assert ("FSDP, which Accelerate runs on CUDA only" in run.stderr) is said, run.stderr[-1000:]
