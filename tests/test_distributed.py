"""Two CPU processes through `accelerate launch` (gloo): different rollouts per rank, identical parameters."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A port nothing listens on now: a fixed one can be held by a run that has not let go of it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_process_ddp_run(tmp_path):
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
        "core/tiny_grpo",
        f"output_dir={tmp_path}",
        "model.path=null",
        "model.hidden_size=32",
        "task.train_prompts=256",
        "task.heldout_prompts=16",
        "rollout.prompts_per_step=2",
        "steps=3",
        "progress=false",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        # the ranks run in sessions of their own and hold the output pipes: kill the launcher and every
        # process below it (found before the launcher dies), or a hung rank outlives the test and blocks it
        launcher = psutil.Process(proc.pid)
        for process in [*launcher.children(recursive=True), launcher]:
            process.kill()
        _, stderr = proc.communicate(timeout=30)
        raise AssertionError(f"the two-process run did not finish in 300 s: {stderr[-3000:]}") from None
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
