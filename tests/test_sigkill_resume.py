"""Exact resume after SIGKILL, for every trainer and mode: a run killed at any moment and continued with
--resume ends with the same checkpoint (every tensor of every safetensors file, and ``state.json``:
optimizer, schedule, trainer state, RNGs), the same saved result and the same metrics rows (timings
aside) as a run that never stopped, bit for bit on CPU with one thread.

Each case launches three `mmrl train` processes side by side (one thread each): a straight run; one
SIGKILLed from outside at a step between checkpoints, as soon as metrics.jsonl shows that step; and
one that SIGKILLs itself inside a checkpoint write (tests/kill_in_write.py: after the first or
second safetensors file, after the manifest before the rename, or after the rename before old
checkpoints are pruned). Both killed runs are then resumed to the end and compared with the straight
one. The steps and write points are drawn from a seeded generator; the seed is printed (and named in
every failure): ``MMRL_SIGKILL_SEED=N pytest -m slow tests/test_sigkill_resume.py`` replays it.

What a kill can break is the shared run directory's code (checkpoint writes, their manifest and rename,
the metrics and evaluation files), which every trainer goes through the same way; each trainer's own
state is held exact across a resume by its in-process resume test. So the default run holds the
fastest recipe, core/tiny_branch_grpo (the sampler and the tree), and pretrain/tiny_lm (the data
generator, which has no in-process resume test), each with both kinds of kill, and the kills inside
the run's other files below; the other cases (diffusion/nft: sampler, EMA and the old policy;
vlm/tool_grpo with partial rollouts: carried conversations; vla/habc: critics, their optimizer, the
replay buffer; and the rest) are `slow`: ``pytest -m slow tests/test_sigkill_resume.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from pinned_runs import TINY_CORE, TINY_DIFFUSION, TINY_VLA, TINY_VLM, _numbers
from safetensors.torch import load_file

PLUGIN = Path(__file__).parent / "kill_in_write.py"
SEED = int(os.environ.get("MMRL_SIGKILL_SEED") or random.SystemRandom().randrange(10**6))
CUT_POINTS = ("1", "2", "manifest", "renamed")  # see tests/kill_in_write.py
TIMEOUT = 600  # seconds a launch may take before the test gives up


@dataclass(frozen=True)
class Case:
    """A recipe with the overrides that make it take seconds, `steps` steps, a checkpoint every
    `checkpoint_every`."""

    recipe: str
    overrides: tuple[str, ...]
    steps: int = 4
    checkpoint_every: int = 2
    robot: bool = False  # needs the robot extra (the simulator)


EVAL = ("eval_every=3",)  # an evaluation between checkpoints too (3 is none of the checkpoint steps)
TINY_PARTIAL = ("rollout.partial.enabled=true", "rollout.partial.over_provision=1.0")
# a replay buffer that evicts within the run
TINY_BUFFER = ("train.buffer_capacity=64", "train.failure_capacity=32", *EVAL)
CASES: dict[str, Case] = {
    "core/tiny_branch_grpo": Case(
        "core/tiny_branch_grpo", (*TINY_CORE, "train.sampler=beta_thompson", *EVAL)
    ),
    "core/tiny_grpo": Case("core/tiny_grpo", (*TINY_CORE, "train.sampler=dynamic_filter", *EVAL)),
    "diffusion/branchgrpo": Case(
        "diffusion/branchgrpo",
        (*TINY_DIFFUSION, "rollout.split_steps=[0,2]", "train.ema_decay=0.9", "train.kl_coef=0.01")
        + ("train.sampler=beta_thompson", "train.minibatches=2", *EVAL),
    ),
    "diffusion/branchgrpo_flat_credit": Case(
        "diffusion/branchgrpo_flat_credit", (*TINY_DIFFUSION, "train.sampler=dynamic_filter", *EVAL)
    ),
    "diffusion/flat_grpo_lora": Case(
        "diffusion/flat_grpo", (*TINY_DIFFUSION, "rollout.branch_factor=4", "model.lora_rank=4", *EVAL)
    ),
    "diffusion/nft": Case(
        "diffusion/nft", (*TINY_DIFFUSION, "rollout.group_size=4", "train.ema_decay=0.9", *EVAL)
    ),
    "diffusion/sol_rl": Case(
        "diffusion/sol_rl",
        (*TINY_DIFFUSION, "rollout.group_size=4", "explore.pool=8", "explore.steps=3", *EVAL),
    ),
    "vlm/tool_grpo": Case("vlm/tool_grpo", (*TINY_VLM, *EVAL)),
    "vlm/tool_grpo_tree": Case("vlm/tool_grpo_tree", (*TINY_VLM, "rollout.tree.branching=[2,2]", *EVAL)),
    "vlm/tool_grpo_partial": Case("vlm/tool_grpo", (*TINY_VLM, *TINY_PARTIAL, *EVAL)),
    "vlm/tool_grpo_partial_mid_turn": Case(  # carried mid-turn, stale groups dropped and relaunched
        "vlm/tool_grpo",
        (*TINY_VLM, "rollout.partial.enabled=true", "rollout.partial.over_provision=2.0")
        + ("rollout.partial.segment_tokens=8", "rollout.partial.max_staleness=1"),
    ),
    "vlm/tool_grpo_tree_segments": Case(
        "vlm/tool_grpo_tree", (*TINY_VLM, "rollout.tree.branching=[2,2]", "rollout.tree.segment_tokens=8")
    ),
    "vla/habc": Case("vla/habc", (*TINY_VLA, *TINY_BUFFER), robot=True),
    "vla/awr": Case("vla/awr", (*TINY_VLA, *TINY_BUFFER), robot=True),
    "vla/bc": Case("vla/bc", (*TINY_VLA, *TINY_BUFFER), robot=True),
    "vla/dagger": Case("vla/dagger", (*TINY_VLA, *TINY_BUFFER), robot=True),
    "vla/grpo": Case(
        "vla/grpo",
        (*TINY_VLA, "rollout.group_size=2", "rollout.task_variants=4", "rollout.sampler=beta_thompson")
        + TINY_BUFFER,
        robot=True,
    ),
    "vla/grpo_tree": Case(  # groups grown as trees from simulator snapshots
        "vla/grpo",
        (
            *TINY_VLA,
            "rollout.num_envs=4",
            "rollout.group_size=4",
            "grpo.branch_every=4",
            "grpo.branching=[2,2]",
            *EVAL,
        ),
        robot=True,
    ),
    "pretrain/diffusion": Case(
        "pretrain/diffusion",
        ("model.image_size=16", "model.unet_channels=[8,16]", "train.batch_size=4", "train.warmup_steps=2")
        + ("eval.prompts=2", "eval.steps=2", *EVAL),
    ),
    "pretrain/vla": Case(
        "pretrain/vla",
        ("data.episodes=2", "data.image_size=32", "train.batch_size=16", "train.warmup_steps=2")
        + ("model.channels=[8,8]", "model.keypoints=8", "model.hidden=32", "model.horizon=4")
        + ("eval.episodes=1", "eval.num_envs=1", *EVAL),
        robot=True,
    ),
    "pretrain/vlm": Case(
        "pretrain/vlm",
        ("model.path=null", "model.hidden=32", "model.layers=1", "model.vision_width=16")
        + ("model.vision_depth=1", "data.heldout_size=2", "train.batch_size=4", "train.warmup_steps=2")
        + ("eval_modes=[auto]", *EVAL),
    ),
    "pretrain/vlm_vision": Case(
        "pretrain/vlm_vision",
        ("model.hidden=32", "model.layers=1", "model.vision_width=16", "model.vision_depth=1")
        + ("data.heldout_size=4", "train.batch_size=4", "train.warmup_steps=2", *EVAL),
    ),
    "pretrain/tiny_lm": Case(
        "pretrain/tiny_lm",
        (
            "model.hidden_size=32",
            "task.train_prompts=64",
            "task.heldout_prompts=8",
            "train.batch_size=16",
            *EVAL,
        ),
    ),
}
DEFAULT = {"core/tiny_branch_grpo", "pretrain/tiny_lm"}


def launch(case: Case, run_dir: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`mmrl train` of `case` into `run_dir` on one thread; its output goes to run_dir's sibling
    ``<name>.log`` (a pipe nobody reads while the test polls could fill and stall it)."""
    args = [f"steps={case.steps}", f"checkpoint_every={case.checkpoint_every}", "progress=false"]
    log = run_dir.with_name(f"{run_dir.name}.log").open("a")
    return subprocess.Popen(
        [sys.executable, "-m", "mmrl", "train", case.recipe, f"output_dir={run_dir}", *case.overrides]
        + [*args, *extra],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def finish(proc: subprocess.Popen, run_dir: Path) -> None:
    """Wait for `proc`; fail with the end of its log unless it succeeded."""
    proc.wait(timeout=TIMEOUT)
    log = run_dir.with_name(f"{run_dir.name}.log").read_text()
    assert proc.returncode == 0, f"{run_dir.name} exited with {proc.returncode}:\n{log[-3000:]}"


def last_logged(run_dir: Path) -> int:
    """The newest step metrics.jsonl holds in full (0 before the first)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    for line in reversed(path.read_text().splitlines()):
        try:
            return json.loads(line)["step"]
        except json.JSONDecodeError:  # a row being written
            continue
    return 0


def checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))


def tensors_digest(files: list[Path], root: Path) -> dict[str, str]:
    """sha256 of each safetensors file's tensors (names, dtypes, shapes and bytes, in name order),
    keyed by the file's path under `root`: equal digests are equal tensors, whatever the file layout."""
    digests = {}
    for file in sorted(files):
        digest = hashlib.sha256()
        tensors = load_file(file)
        for name in sorted(tensors):
            t = tensors[name].contiguous()
            digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        digests[str(file.relative_to(root))] = digest.hexdigest()
    return digests


APART = ("metrics.jsonl", "eval.json", "launches.jsonl")  # compared without timings; one row per launch


def records(run_dir: Path) -> dict[str, Any]:
    """The other JSON and JSON-lines files a run wrote outside checkpoints/ (samples, summaries, the
    saved results' configs), parsed and keyed by their path under `run_dir`."""
    found = {}
    for file in sorted([*run_dir.rglob("*.json"), *run_dir.rglob("*.jsonl")]):
        where = file.relative_to(run_dir)
        if where.parts[0] == "checkpoints" or str(where) in APART:
            continue
        text = file.read_text()
        rows = (
            [json.loads(line) for line in text.splitlines()] if file.suffix == ".jsonl" else json.loads(text)
        )
        found[str(where)] = rows
    return found


def outcome(run_dir: Path, steps: int) -> dict[str, Any]:
    """What a finished run computed: its final checkpoint (tensors and state.json), the results it
    saved outside checkpoints (final/, model/, policy/, ...) and its other records, metrics rows and
    held-out numbers without timings."""
    final = run_dir / "checkpoints" / f"step_{steps:08d}"
    results = [p for p in run_dir.rglob("*.safetensors") if "checkpoints" not in p.relative_to(run_dir).parts]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluation = json.loads((run_dir / "eval.json").read_text())
    return {
        "checkpoint tensors": tensors_digest(list(final.glob("*.safetensors")), final),
        "checkpoint state.json": json.loads((final / "state.json").read_text()),
        "saved results": tensors_digest(results, run_dir),
        "records": records(run_dir),
        "metrics": [_numbers(row) for row in rows],
        "eval": {key: _numbers(value) for key, value in evaluation.items()},
    }


def differences(expected: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """Where `got` differs from `expected`, one line each (the first few)."""
    lines = []
    for part, want in expected.items():
        have = got[part]
        if part == "metrics":
            if len(want) != len(have):
                lines.append(f"metrics: {len(have)} rows, not {len(want)}")
            for a, b in zip(want, have, strict=False):
                changed = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
                if changed:
                    lines.append(f"metrics step {a.get('step')}: {', '.join(changed)} differ")
        elif isinstance(want, dict):
            changed = sorted(k for k in want.keys() | have.keys() if want.get(k) != have.get(k))
            if changed:
                lines.append(f"{part}: {', '.join(changed)} differ")
        elif want != have:
            lines.append(f"{part} differs")
    return lines[:8]


def marks(name: str) -> list[pytest.MarkDecorator]:
    return [
        mark
        for mark, on in (
            (pytest.mark.slow, name not in DEFAULT),
            (pytest.mark.needs_robot, CASES[name].robot),
        )
        if on
    ]


@pytest.mark.parametrize("name", [pytest.param(name, marks=marks(name)) for name in CASES])
def test_sigkilled_runs_resume_to_the_straight_run(name, tmp_path):
    case = CASES[name]
    draw = random.Random(f"{SEED}:{name}")
    every, steps = case.checkpoint_every, case.steps
    between = draw.choice([s for s in range(every + 1, steps) if s % every])  # a checkpoint to resume
    cut_step = draw.choice(range(2 * every, steps + 1, every))  # one written before it
    cut_after = draw.choice(CUT_POINTS)
    replay = (
        f"MMRL_SIGKILL_SEED={SEED} ({name}: killed after step {between}; "
        f"the write of step {cut_step} cut at {cut_after})"
    )
    print(replay)

    straight_dir, killed_dir, cut_dir = tmp_path / "straight", tmp_path / "killed", tmp_path / "cut"
    straight = launch(case, straight_dir)
    killed = launch(case, killed_dir)
    cut = launch(
        case,
        cut_dir,
        "--plugin",
        str(PLUGIN),
        env={"MMRL_TEST_KILL_CHECKPOINT_STEP": str(cut_step), "MMRL_TEST_KILL_CHECKPOINT_AFTER": cut_after},
    )

    deadline = time.monotonic() + TIMEOUT
    while last_logged(killed_dir) < between:
        assert killed.poll() is None, f"{replay}: the run ended before the kill"
        assert time.monotonic() < deadline, f"{replay}: step {between} never came"
        time.sleep(0.002)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert killed.returncode == -signal.SIGKILL, f"{replay}: the run ended before the kill"
    resumed_killed = launch(case, killed_dir, "--resume")

    cut.wait(timeout=TIMEOUT)
    assert cut.returncode == -signal.SIGKILL, f"{replay}: the write was not cut ({cut.returncode})"
    assert last_logged(cut_dir) == cut_step
    newest = checkpoints(cut_dir)[-1]
    assert newest == f"step_{cut_step if cut_after == 'renamed' else cut_step - every:08d}", replay
    resumed_cut = launch(case, cut_dir, "--resume")

    for proc, run_dir in ((straight, straight_dir), (resumed_killed, killed_dir), (resumed_cut, cut_dir)):
        finish(proc, run_dir)
    expected = outcome(straight_dir, steps)
    for run_dir in (killed_dir, cut_dir):
        launches = [json.loads(line) for line in (run_dir / "launches.jsonl").read_text().splitlines()]
        assert len(launches) == 2 and launches[1]["from_step"] > 0, f"{replay}: {launches}"
        assert not list((run_dir / "checkpoints").glob(".tmp-*")), f"{replay}: an unfinished write is left"
        wrong = differences(expected, outcome(run_dir, steps))
        assert not wrong, f"{replay}: {run_dir.name} (resumed from step {launches[1]['from_step']}): " + (
            "; ".join(wrong)
        )


def checkpoint_cut(step: int, after: str) -> dict[str, str]:
    """The plugin's environment that cuts the checkpoint write of `step` at `after`."""
    return {"MMRL_TEST_KILL_CHECKPOINT_STEP": str(step), "MMRL_TEST_KILL_CHECKPOINT_AFTER": after}


def file_cut(name: str, nth: int = 1) -> dict[str, str]:
    """The plugin's environment that cuts the `nth` write of the run file `name` half way."""
    return {"MMRL_TEST_KILL_FILE": name, "MMRL_TEST_KILL_FILE_NTH": str(nth)}


@dataclass(frozen=True)
class FileCut:
    """Launches of CASES[`case`] that each die inside a write (`kills`: the plugin's environment of each;
    the first starts the run, the others resume it), then a resume to the end."""

    case: str
    kills: tuple[dict[str, str], ...]


FILE_CUTS: dict[str, FileCut] = {
    "eval.json before training": FileCut("core/tiny_grpo", (file_cut("eval.json"),)),
    "eval.json after training": FileCut("core/tiny_grpo", (file_cut("eval.json", 2),)),
    "config.yaml": FileCut("core/tiny_grpo", (file_cut("config.yaml"),)),
    "metrics.jsonl rewritten at a resume": FileCut(
        "core/tiny_grpo",
        (checkpoint_cut(4, "1"), file_cut("metrics.jsonl")),
    ),
    "heldout_scores.json after training": FileCut("diffusion/nft", (file_cut("heldout_scores.json", 2),)),
}
DEFAULT_FILE_CUTS = {"eval.json after training", "metrics.jsonl rewritten at a resume"}


@pytest.mark.parametrize(
    "name",
    [pytest.param(name, marks=[] if name in DEFAULT_FILE_CUTS else [pytest.mark.slow]) for name in FILE_CUTS],
)
def test_runs_killed_inside_a_run_file_write_resume_to_the_straight_run(name, tmp_path):
    cut = FILE_CUTS[name]
    case = CASES[cut.case]
    straight_dir, run_dir = tmp_path / "straight", tmp_path / "run"
    straight = launch(case, straight_dir)
    for number, env in enumerate(cut.kills):
        resume = ["--resume"] if number else []
        victim = launch(case, run_dir, *resume, "--plugin", str(PLUGIN), env=env)
        victim.wait(timeout=TIMEOUT)
        assert victim.returncode == -signal.SIGKILL, (
            f"launch {number + 1} was not killed ({victim.returncode})"
        )
    resumed = launch(case, run_dir, "--resume")
    finish(straight, straight_dir)
    finish(resumed, run_dir)
    wrong = differences(outcome(straight_dir, case.steps), outcome(run_dir, case.steps))
    assert not wrong, "; ".join(wrong)
