"""`mmrl bench realsize`: one training iteration of each real-model recipe at the real model's size,
on this machine's CPU, against the `--dry-run` plan of the same run.

The families register their runs (`mmrl.registry.REALSIZE_RUNS`): a recipe, the replicas it reads
and the overrides that shrink its work (small images, short sequences, one step) but not its
model. For each run the bench:

1. writes the replicas' full-size configs (`mmrl replica NAME full=true`) and plans the run from
   them (`Trainer.memory_plan`, one process); a plan that does not fit in this machine's available
   memory is reported as such, with the launch the run would need, and nothing is allocated;
2. otherwise writes random full-size weights in bfloat16 (`full=true weights=true device=cpu`, once:
   the folders are kept in `workdir` for the next run), then launches `mmrl train RECIPE` on them as a
   separate process and reads its peak resident memory from the kernel (VmHWM);
3. compares the plan with that peak less the resident memory of the same command's `--dry-run`
   process (the interpreter and the libraries, which the plan leaves out): target within 20%; and
   gives the seconds of the launch's phases: its setup (the models loaded, prompts cached:
   `setup_seconds` in launches.jsonl), the training step (`step_seconds` in metrics.jsonl) and the
   rest (the interpreter's start, the held-out evaluations, the final save).

The rows go to `output` as JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from mmrl.bench_all import jsonable, print_table
from mmrl.config import ConfigError, check_output_dir, load_config
from mmrl.memory_plan import GIB
from mmrl.registry import BENCHES, REALSIZE_RUNS, REPLICAS, TRAINERS
from mmrl.resources import available_memory
from mmrl.runlog import read_launches, read_metrics

PLAN_TARGET = 0.2  # |plan / measured - 1| at most this
DEFAULT_OUTPUT = "runs/bench/realsize.json"


@dataclass(frozen=True)
class RealSizeRun:
    """A recipe's real-size iteration: the replicas it reads (name -> the override key that takes the
    replica's folder), the overrides that make one short iteration, and the launch that would hold
    it where one process cannot (named when the plan does not fit)."""

    recipe: str
    replicas: dict[str, list[str]]
    overrides: list[str]
    launch: str = ""
    files: dict[str, str] = field(default_factory=dict)  # name -> text, written to workdir/NAME
    full: bool = True  # the replicas at the real size (False: the tiny ones, which the tests run)


@BENCHES.register("realsize")
def bench_realsize(
    runs: list[str] | None = None, workdir: str = "runs/bench/realsize", output: str = DEFAULT_OUTPUT
) -> list[dict[str, Any]]:
    """`runs` picks among the registered real-size runs (default: all); `workdir` keeps the replicas'
    configs and random weights between runs and holds the training runs."""
    known = REALSIZE_RUNS.names()
    chosen = known if runs is None else runs
    for name in chosen:
        if name not in known:
            raise ConfigError(f"config error: runs: unknown run {name!r}; choose from {', '.join(known)}")
    check_output_dir(Path(output).parent, "output (its folder)")
    root = Path(workdir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in chosen:
        print(f"--- {name} ---", flush=True)
        rows.append(measure(name, REALSIZE_RUNS.get(name)(), root / name))
        print("  " + ", ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    print_table(
        "mmrl bench realsize (CPU, random full-size weights)",
        ["run", "plan GiB", "measured GiB", "plan / measured", "setup s", "step s", "rest s", "verdict"],
        [
            [
                r["run"],
                f"{r['plan_gib']:.2f}",
                "-" if r["measured_gib"] is None else f"{r['measured_gib']:.2f}",
                "-" if r["plan_ratio"] is None else f"{r['plan_ratio']:.3f}",
                "-" if r["setup_seconds"] is None else f"{r['setup_seconds']:.0f}",
                "-" if r["step_seconds"] is None else f"{r['step_seconds']:.0f}",
                "-" if r["rest_seconds"] is None else f"{r['rest_seconds']:.0f}",
                r["verdict"],
            ]
            for r in rows
        ],
    )
    for row in rows:
        if "note" in row:
            print(f"{row['run']}: {row['note']}")
    document = {"created": datetime.now(UTC).isoformat(timespec="seconds"), "rows": rows}
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text(json.dumps(jsonable(document), indent=1))
    print(f"wrote {output}")
    return rows


def measure(name: str, run: RealSizeRun, folder: Path) -> dict[str, Any]:
    """One real-size run's row (module docstring)."""
    folder.mkdir(parents=True, exist_ok=True)
    for file, text in run.files.items():
        (folder / file).write_text(text)
    configs = {replica: folder / f"{replica}_configs" for replica in run.replicas}
    for replica, path in configs.items():
        if not path.exists():
            REPLICAS.get(replica)(path, full=run.full, weights=False)
    overrides = [*run.overrides, f"output_dir={folder / 'run'}"]
    overrides = [part.replace("{folder}", str(folder)) for part in overrides]
    plan = plan_bytes(run, overrides, configs)
    have, source = available_memory("cpu")
    row: dict[str, Any] = {
        "run": name,
        "recipe": run.recipe,
        "plan_gib": plan / GIB,
        "measured_gib": None,
        "plan_ratio": None,
        "setup_seconds": None,
        "step_seconds": None,
        "rest_seconds": None,
    }
    if plan > have:
        row["verdict"] = "not run: does not fit"
        row["note"] = (
            f"the plan holds {plan / GIB:.1f} GiB on one process, {source} {have / GIB:.1f} GiB. {run.launch}"
        )
        return row
    weights = {replica: folder / replica for replica in run.replicas}
    for replica, path in weights.items():
        if not (path / ".complete").exists():
            REPLICAS.get(replica)(path, full=run.full, weights=True, device="cpu")
            (path / ".complete").write_text("")
    given = with_replicas(run, overrides, weights)
    shutil.rmtree(folder / "run", ignore_errors=True)  # the bench's own run of the last time
    baseline, _, _ = launch([*given, "--dry-run"], folder / "dry_run.log")
    peak, seconds, code = launch([*given, "steps=1", "progress=false"], folder / "train.log")
    if code != 0:
        row["verdict"] = f"the run failed (exit {code}): see {folder / 'train.log'}"
        return row
    step = read_metrics(folder / "run")[0]["step_seconds"]
    setup = read_launches(folder / "run")[0]["setup_seconds"]
    measured = peak - baseline
    ratio = plan / measured
    row |= {
        "measured_gib": measured / GIB,
        "peak_rss_gib": peak / GIB,
        "baseline_rss_gib": baseline / GIB,
        "plan_ratio": ratio,
        "setup_seconds": setup,
        "step_seconds": step,
        "rest_seconds": seconds - setup - step,
        "launch_seconds": seconds,
        "verdict": "PASS" if abs(ratio - 1) <= PLAN_TARGET else f"FAIL (target within {PLAN_TARGET:.0%})",
    }
    return row


def with_replicas(run: RealSizeRun, overrides: list[str], folders: dict[str, Path]) -> list[str]:
    """The run's command-line arguments with each replica's folder under its keys."""
    keys = [f"{key}={folders[replica]}" for replica, given in run.replicas.items() for key in given]
    return [run.recipe, *keys, *overrides]


def plan_bytes(run: RealSizeRun, overrides: list[str], configs: dict[str, Path]) -> int:
    """The plan's expected peak for one process, made from the replicas' configs."""
    config = load_config(run.recipe, with_replicas(run, overrides, configs)[1:])
    return TRAINERS.get(config.trainer).memory_plan(config, run.recipe, 1).peak_bytes


def launch(arguments: list[str], log: Path) -> tuple[int, float, int]:
    """`mmrl train ARGUMENTS` as a child process using every core: (its peak resident bytes, its
    seconds, its exit code); its output goes to `log`. The peak is the kernel's high-water mark of the
    child's own memory (VmHWM in /proc/PID/status, read until it exits): its rusage would also count
    the memory of this process, which it was forked from."""
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
    status = Path("/proc")
    if not status.is_dir():
        raise ConfigError("mmrl bench realsize reads peak memory from /proc: it runs on Linux")
    start = time.perf_counter()
    peak = 0
    with log.open("w") as out:
        child = subprocess.Popen(
            [sys.executable, "-m", "mmrl", "train", *arguments], stdout=out, stderr=subprocess.STDOUT, env=env
        )
        while child.poll() is None:
            peak = max(peak, high_water_mark(child.pid))
            time.sleep(0.05)
    return peak, time.perf_counter() - start, child.returncode


def high_water_mark(pid: int) -> int:
    """The peak resident bytes of process `pid` so far (0 once it is gone)."""
    try:
        text = (Path("/proc") / str(pid) / "status").read_text()
    except OSError:
        return 0
    line = next((line for line in text.splitlines() if line.startswith("VmHWM:")), None)
    return 0 if line is None else int(line.split()[1]) * 1024
