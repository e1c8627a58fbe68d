"""A config mistake leaves nothing behind. For every command (`mmrl train` with each trainer,
`mmrl pretrain` of every recipe, `mmrl eval` of a run and of models side by side, `mmrl bench`,
`mmrl report`), a mistake found only once the command runs (a missing model or dataset, a bad
reward, an option of the wrong size, an output path that cannot be written) stops it with exit code
2 and one ``error:`` line, and the files are as they were: an output directory that did not exist
still does not, an existing one holds what it held, and the working directory stays empty."""

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from mmrl.cli import load_plugins, main
from mmrl.config import load_config
from mmrl.registry import TRAINERS

load_plugins()
TINY = [  # a tiny_grpo run of a few seconds
    "model.path=null",
    "model.hidden_size=32",
    "task.train_prompts=64",
    "task.heldout_prompts=8",
    "rollout.prompts_per_step=2",
    "rollout.branch_factor=4",
    "progress=false",
]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A one-step tiny_grpo run with its checkpoint, config, metrics and eval.json."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    config = load_config("core/tiny_grpo", [f"output_dir={run_dir}", "steps=1", *TINY])
    TRAINERS.get(config.trainer)(config).train()
    assert (run_dir / "checkpoints" / "step_00000001").is_dir()
    return run_dir


@pytest.fixture(scope="module")
def vla_policy(tmp_path_factory) -> Path:
    """A small saved VLAPolicy of 16-pixel images."""
    from vla_rl.policy import VLAConfig, VLAPolicy, task_vocabulary

    path = tmp_path_factory.mktemp("vla") / "policy"
    VLAPolicy(
        VLAConfig(vocabulary=task_vocabulary(), image_size=16, channels=[4], keypoints=4, hidden=8)
    ).save_pretrained(path)
    return path


# -- what a case finds on disk before it runs (in the test's folder, given the finished run) -------


def output_dir(tmp: Path) -> Path:
    """The output directory every case names: two levels that do not exist unless a case makes them."""
    return tmp / "out" / "run"


def copy_run(tmp: Path, finished: Path) -> None:
    shutil.copytree(finished, output_dir(tmp))


def corrupt_run(tmp: Path, finished: Path) -> None:
    """Every checkpoint of the run damaged: resuming with discard_corrupt_checkpoints sets them aside."""
    copy_run(tmp, finished)
    for model in (output_dir(tmp) / "checkpoints").glob("step_*/model.safetensors"):
        model.write_bytes(b"garbage")


def damaged_demos(tmp: Path, finished: Path) -> None:
    """Demonstrations an earlier `mmrl pretrain vla` recorded in the output directory, damaged since."""
    del finished
    meta = output_dir(tmp) / "demos" / "meta"
    meta.mkdir(parents=True)
    (meta / "info.json").write_text("[]")


def out_under_a_file(tmp: Path, finished: Path) -> None:
    del finished
    output_dir(tmp).parent.write_text("a file, not a folder")


def finished_runs_to_compare(tmp: Path, finished: Path) -> None:
    """Two runs with held-out metric m before and after (what `mmrl report --compare` plots)."""
    del finished
    for name in ("a", "b"):
        run = tmp / "runs" / name
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n")
        (run / "eval.json").write_text(json.dumps({"before": {"m": 0.1}, "after": {"m": 0.2}}))


def empty_policy_dir(tmp: Path, finished: Path) -> None:
    del finished
    (tmp / "empty").mkdir()


@dataclass
class Case:
    """A command line ({out}: the output directory, {missing}: a path that does not exist, {policy}: a
    saved VLAPolicy, {tmp}: the test's folder; train, pretrain and eval also get output_dir={out}),
    the words its error line must hold, what is on disk before it runs, and what it needs."""

    argv: list[str]
    expect: str
    before: Callable[[Path, Path], None] | None = None
    needs: pytest.MarkDecorator | None = None  # the conftest marker of what it needs


CASES = {
    # train: one mistake per trainer, found by its setup (or by the run directory's checks)
    "train-tiny_grpo-model": Case(["train", "core/tiny_grpo", "model.path={missing}"], "model.path"),
    "train-branch_grpo-model": Case(["train", "diffusion/branchgrpo", "model.path={missing}"], "model.path"),
    "train-branch_grpo-prompts": Case(
        ["train", "diffusion/flat_grpo", "prompt_file={missing}"], "prompt_file"
    ),
    "train-tool_grpo-model": Case(["train", "vlm/tool_grpo", "model.path={missing}"], "model.path"),
    "train-vla_online-model": Case(
        ["train", "vla/habc", "model.path={missing}"], "model.path", needs=pytest.mark.needs_robot
    ),
    "train-vla_online-demos": Case(
        [
            "train",
            "vla/habc",
            "model.path={policy}",
            "rollout.task=Reach",
            "rollout.num_envs=1",
            "train.demos={missing}",
            "train.demo_episodes=0",
        ],
        "train.demos",
        needs=pytest.mark.needs_rendering,
    ),
    "train-output-under-a-file": Case(
        ["train", "core/tiny_grpo", *TINY], "which is a file", out_under_a_file
    ),
    "train-resume-bad-model": Case(
        ["train", "core/tiny_grpo", *TINY, "resume=true", "model.path={missing}"], "model.path", copy_run
    ),
    "train-discard-corrupt-bad-model": Case(
        [
            "train",
            "core/tiny_grpo",
            *TINY,
            "resume=true",
            "discard_corrupt_checkpoints=true",
            "model.path={missing}",
        ],
        "model.path",
        corrupt_run,
    ),
    # pretrain: every recipe
    "pretrain-tiny_lm": Case(["pretrain", "tiny_lm", "model.path={missing}"], "model.path"),
    "pretrain-diffusion-patches": Case(
        ["pretrain", "diffusion", "model.backbone=sd3", "model.image_size=30"], "model.image_size"
    ),
    "pretrain-diffusion-checkpoints": Case(["pretrain", "diffusion"], "already has checkpoints", copy_run),
    "pretrain-vla": Case(
        ["pretrain", "vla"], "demonstrations an earlier run recorded", damaged_demos, pytest.mark.needs_robot
    ),
    "pretrain-vla_fetch_reach": Case(
        ["pretrain", "vla_fetch_reach"],
        "demonstrations an earlier run recorded",
        damaged_demos,
        pytest.mark.needs_fetch,
    ),
    "pretrain-vlm-previous-stage": Case(
        ["pretrain", "vlm", "model.path={tmp}/runs/pretrain/vlm_read/model"], "model.path"
    ),
    "pretrain-vlm_answer": Case(["pretrain", "vlm_answer", "model.path={missing}"], "model.path"),
    "pretrain-vlm_read": Case(["pretrain", "vlm_read", "model.path={missing}"], "model.path"),
    "pretrain-vlm_vision": Case(["pretrain", "vlm_vision", "model.path={missing}"], "model.path is set"),
    # eval of a run's checkpoint
    **{
        f"eval-{recipe}-no-checkpoint": Case(["eval", recipe], "no checkpoint")
        for recipe in (
            "core/tiny_grpo",
            "pretrain/tiny_lm",
            "diffusion/flat_grpo",
            "pretrain/diffusion",
            "vlm/tool_grpo",
            "pretrain/vlm_vision",
        )
    },
    "eval-run-bad-model": Case(
        ["eval", "core/tiny_grpo", *TINY, "model.path={missing}"], "model.path", copy_run
    ),
    # eval of models side by side
    "eval-diffusion-model": Case(["eval", "diffusion", "models=[{missing}]"], "models"),
    "eval-diffusion-reward": Case(
        ["eval", "diffusion", "models=[diffusion_rl/assets/tiny_flow]", "rewards=[no_such_reward]"], "rewards"
    ),
    "eval-vlm-benchmark": Case(["eval", "vlm", "benchmark={missing}"], "benchmark"),
    "eval-vla-policy": Case(
        ["eval", "vla", "policies=[{missing}]"], "policies", needs=pytest.mark.needs_robot
    ),
    "eval-vla-second-policy": Case(  # the first policy's episodes and video ran before the second failed
        [
            "eval",
            "vla",
            "policies=[{policy},{tmp}/empty]",
            "task=Reach",
            "episodes=1",
            "num_envs=1",
            "videos=1",
            "progress=false",
        ],
        "has no config.json",
        empty_policy_dir,
        pytest.mark.needs_rendering,
    ),
    # bench: no output directory but bench all's; the working directory must stay empty
    "bench-core-repeats": Case(["bench", "core", "repeats=0", "n_groups=64"], "repeats = 0"),
    "bench-core-device": Case(["bench", "core", "device=cuda:99", "n_groups=64"], "device = 'cuda:99'"),
    "bench-diffusion-iterations": Case(["bench", "diffusion", "iterations=0"], "iterations = 0"),
    "bench-diffusion_gradient-configs": Case(
        ["bench", "diffusion_gradient", "configs=[diffusion/flat_grpo,diffusion/nft]"], "diffusion_nft"
    ),
    "bench-vlm-model": Case(["bench", "vlm", "model={missing}"], "model ="),
    "bench-vlm-rollouts": Case(["bench", "vlm", "rollouts=0"], "rollouts = 0"),
    "bench-vla-model": Case(["bench", "vla", "model={missing}"], "model=", needs=pytest.mark.needs_robot),
    "bench-vla-steps": Case(["bench", "vla", "steps=0"], "steps = 0", needs=pytest.mark.needs_robot),
    "bench-all-section": Case(["bench", "all", "output={out}/all.json", "core.no_such_option=1"], "core."),
    "bench-all-only": Case(["bench", "all", "output={out}/all.json", "only=[no_such_bench]"], "only"),
    # report
    "report-missing-run": Case(["report", "{missing}"], "does not exist"),
    "report-compare-suffix": Case(
        ["report", "{tmp}/runs/a", "{tmp}/runs/b", "--compare", "{out}/plot.txt", "--metric", "m"],
        "--compare",
        finished_runs_to_compare,
    ),
    "report-compare-missing-run": Case(
        ["report", "{tmp}/runs/a", "{missing}", "--compare", "{out}/plot.png", "--metric", "m"],
        "does not exist",
        finished_runs_to_compare,
    ),
}
OUTPUT_COMMANDS = ("train", "pretrain", "eval")  # those that take output_dir=


def snapshot(root: Path) -> dict[str, str]:
    """Every path under `root` with its content's digest (folders as 'dir')."""
    return {
        str(path.relative_to(root)): "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
    }


def run(argv: list[str]) -> int:
    """`mmrl ARGV` in this process: its exit code, whether returned or raised (argparse exits)."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("name", [pytest.param(name, marks=case.needs or ()) for name, case in CASES.items()])
def test_a_refused_command_leaves_the_files_as_they_were(
    name, tmp_path, monkeypatch, capsys, finished_run, request
):
    case = CASES[name]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # what a bench or a relative path might write lands here
    out = output_dir(tmp_path)
    if case.before is not None:
        case.before(tmp_path, finished_run)
    names = {"out": out, "missing": tmp_path / "missing", "tmp": tmp_path}
    if any("{policy}" in arg for arg in case.argv):
        names["policy"] = request.getfixturevalue("vla_policy")
    argv = [arg.format(**names) for arg in case.argv]
    if argv[0] in OUTPUT_COMMANDS:
        argv.append(f"output_dir={out}")
    before = snapshot(tmp_path)

    assert run(argv) == 2
    assert case.expect in one_error_line(capsys)
    assert snapshot(tmp_path) == before
    if case.before is None:
        assert not out.exists() and not out.parent.exists()


def test_an_existing_empty_output_dir_stays_empty(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    assert run(["pretrain", "vlm", f"output_dir={out}", f"model.path={tmp_path / 'missing'}"]) == 2
    assert "model.path" in one_error_line(capsys)
    assert list(out.iterdir()) == []


def test_output_dir_check_makes_nothing_and_probes_the_nearest_existing_folder(tmp_path):
    from mmrl.config import ConfigError, check_output_dir

    out = tmp_path / "a" / "b" / "run"
    assert check_output_dir(out) == out
    assert list(tmp_path.iterdir()) == []  # neither the folders nor the probe file are left
    (tmp_path / "a").write_text("")
    with pytest.raises(ConfigError, match=r"is under '.*/a', which is a file"):
        check_output_dir(out)
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    with pytest.raises(ConfigError, match="broken symbolic link"):
        check_output_dir(tmp_path / "link" / "run")
