"""Size guards: a config far too big for memory, or with a size far above any sensible value, stops
in one line that names the keys to lower, before anything of that size is allocated; every shipped
recipe passes them."""

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_replicas import REAL_MODEL_RECIPES
from transformers import Qwen2Config

from mmrl.cli import load_plugins, main
from mmrl.config import ConfigError, list_recipes, load_config
from mmrl.resources import GIB, LIMIT_ENV, available_memory, check_memory

REPO = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")
PROCESSES = 16  # the largest shipped launch config (configs/accelerate/fsdp_2node_16gpu.yaml)

load_plugins()


@pytest.fixture(autouse=True)
def memory_limit(monkeypatch):
    """16 GiB stands in for the machine's memory, so that outcomes do not depend on this machine."""
    monkeypatch.setenv(LIMIT_ENV, "16")


# ---------------------------------------------------------------------------------------------
# The guard itself


def test_an_estimate_above_the_limit_is_refused_in_one_line_naming_the_keys():
    with pytest.raises(ConfigError) as info:
        check_memory(32 * GIB, "a batch of 9 x 4 (a.size x b.width)", ["a.size", "b.width", "c.depth"])
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("config error: a batch of 9 x 4 (a.size x b.width) needs about 32.0 GiB;")
    assert f"{LIMIT_ENV} allows 16.0 GiB available: lower a.size, b.width or c.depth" in message
    check_memory(15 * GIB, "a batch", ["a.size"])  # below the limit: no error


@pytest.mark.parametrize("value", ["lots", "0", "-2"])
def test_the_limit_must_be_a_positive_number_of_gib(monkeypatch, value):
    monkeypatch.setenv(LIMIT_ENV, value)
    with pytest.raises(ConfigError, match=f"{LIMIT_ENV} = '{value}' is not a positive number of GiB"):
        check_memory(1, "a batch", ["a.size"])


def test_without_psutil_the_machine_offers_its_physical_memory(monkeypatch):
    monkeypatch.delenv(LIMIT_ENV)
    monkeypatch.setitem(sys.modules, "psutil", None)  # `import psutil` raises ImportError
    have, source = available_memory(CPU)
    assert have == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert source == "this machine has"


def test_a_size_far_above_any_sensible_value_is_refused():
    load_config("core/tiny_grpo", ["rollout.branch_factor=1024"])
    with pytest.raises(ConfigError, match=r"rollout.branch_factor = 1025 is out of range: allowed <= 1024"):
        load_config("core/tiny_grpo", ["rollout.branch_factor=1025"])


# ---------------------------------------------------------------------------------------------
# Through the command line: exit code 2 and one line, before anything big is allocated

TINY = ["model.path=null"]  # no pretrained tiny_lm in a fresh clone
TREE = ["rollout.split_positions=[0,1,2,3]", "train.advantage=tree_depthwise"]


@pytest.mark.parametrize(
    ("recipe", "overrides", "expected"),
    [
        (
            "core/tiny_grpo",
            ["rollout.prompts_per_step=100000"],
            ["rollout.prompts_per_step = 100000 x 1 process(es) is more than task.train_prompts = 4096"],
        ),
        (
            "core/tiny_grpo",
            ["rollout.prompts_per_step=500", "task.train_prompts=100"],
            ["rollout.prompts_per_step = 500 x 1 process(es) is more than task.train_prompts = 100"],
        ),
        (
            "core/tiny_grpo",
            ["task.digits=6", "task.train_prompts=100000", "rollout.prompts_per_step=100000"],
            [
                "a rollout batch of 100000 prompts x 16 leaves",
                "lower rollout.prompts_per_step or rollout.branch",
            ],
        ),
        (
            "core/tiny_grpo",
            ["rollout.branch_factor=1000000"],
            ["rollout.branch_factor = 1000000 is out of range: allowed <= 1024"],
        ),
        (
            "core/tiny_grpo",
            [*TREE, "rollout.branch_factor=64"],
            [
                "a rollout batch of 8 prompts x 16777216 leaves",
                "lower rollout.prompts_per_step or rollout.branch",
            ],
        ),
        (
            "core/tiny_grpo",
            ["task.train_prompts=100000000"],
            ["task.train_prompts + task.heldout_prompts = 100000256 distinct prompts", "task.digits = 4"],
        ),
        (
            "core/tiny_grpo",
            ["task.digits=12", "task.train_prompts=100000000"],
            ["the prompt set of 100000256 prompts", "lower task.train_prompts or task.heldout_prompts"],
        ),
        (
            "core/tiny_grpo",
            ["task.digits=7", "task.train_prompts=9999700"],
            ["drawing task.train_prompts = 9999700 distinct prompts", "or raise task.digits"],
        ),
        (
            "diffusion/branchgrpo_quick",
            ["rollout.image_size=100000"],
            ["rollout.image_size = 100000 is out of range: allowed <= 4096"],
        ),
        (
            "diffusion/branchgrpo_quick",
            ["rollout.image_size=2048"],
            [
                "rollout trees of 8 prompts x 16 leaves of 2048x2048 px",
                "rollout.image_size or train.micro_batch",
            ],
        ),
        (
            "diffusion/branchgrpo_quick",
            ["rollout.prompts_per_step=1000"],
            ["rollout.prompts_per_step = 1000 x 1 process(es) is more than the 540 built-in prompts"],
        ),
        (
            "diffusion/branchgrpo_quick",
            ["explore.enabled=true", "explore.branch_factor=12"],
            ["8 prompts x 20736 leaves", "lower rollout.prompts_per_step, explore.branch_factor"],
        ),
        ("vlm/tool_grpo", ["train.group_size=100000"], ["train.group_size = 100000 is out of range"]),
        ("vlm/tool_grpo", ["data.canvas_size=100000"], ["data.canvas_size = 100000 is out of range"]),
        ("vla/habc", ["rollout.num_envs=100000"], ["rollout.num_envs = 100000 is out of range"]),
    ],
)
def test_too_big_is_exit_code_2_in_one_line(recipe, overrides, expected, tmp_path, capsys):
    extra = TINY if recipe.startswith("core/") else []
    assert main(["train", recipe, f"output_dir={tmp_path}", "progress=false", *extra, *overrides]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == [err.strip().splitlines()[-1]]  # one error line, the last one
    for text in expected:
        assert text in errors[0]


def test_exit_code_of_the_command(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "mmrl", "train", "core/tiny_grpo", "rollout.branch_factor=1000000"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "error: config error: rollout.branch_factor = 1000000 is out of range: allowed <= 1024 "
        "(groups hold 4 to 256)"
    )


# ---------------------------------------------------------------------------------------------
# The checks that need a model, called with a tiny one


@functools.cache
def tiny_vlm_config():
    """The config of the tiny VLM that `mmrl pretrain vlm` starts from."""
    from vlm_rl.data import DataConfig, task_vocabulary
    from vlm_rl.models import VLMAdapter

    return VLMAdapter.tiny(task_vocabulary(DataConfig(), samples=20)).model.config


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["train.questions_per_step=30000"], "train.questions_per_step = 30000 x 1 process(es) is more than"),
        (["train.questions_per_step=512", "train.group_size=512"], "rollouts of 512 questions x 512"),
    ],
)
def test_vlm_rollouts_too_big(overrides, expected):
    from vlm_rl.config import check_rollout_size

    config = load_config("vlm/tool_grpo", overrides)
    with pytest.raises(ConfigError, match=re.escape(expected)):
        check_rollout_size(config, tiny_vlm_config(), (20000, 256), 1, CPU)


@pytest.mark.needs_robot
def test_vla_environments_too_many():
    from vla_rl.config import check_env_size

    config = load_config("vla/habc", ["rollout.num_envs=1000", "rollout.env_steps=8000"])
    with pytest.raises(ConfigError, match=r"1008 environments \(rollout.num_envs \+ eval.num_envs\)"):
        check_env_size(config, 96)


# ---------------------------------------------------------------------------------------------
# Every shipped recipe passes, at its largest shipped launch, in 8 GiB


@functools.cache
def shipped_pipeline(path):
    from diffusion_rl.inputs import resolve_model_path
    from diffusion_rl.loading import load

    return load(resolve_model_path(path))


def setup_time_check(config):
    """The trainer's own setup-time size check, with the model its recipe starts from (or the tiny
    one its pretraining recipe builds); False for trainers that have none."""
    if config.trainer == "tiny_grpo":
        from mmrl.examples.tiny_grpo import check_rollout_size

        model = Qwen2Config(hidden_size=config.model.hidden_size, num_hidden_layers=config.model.layers)
        check_rollout_size(config, model, PROCESSES, CPU)
    elif config.trainer == "branch_grpo":
        from diffusion_rl.branch_grpo import check_rollout_size
        from diffusion_rl.inputs import load_prompts

        pipe = shipped_pipeline(config.model.path)
        check_rollout_size(config, pipe, len(load_prompts(config.prompt_file)), PROCESSES, CPU)
    elif config.trainer == "diffusion_nft":
        from diffusion_rl.inputs import load_prompts
        from diffusion_rl.nft import check_nft_size

        pipe = shipped_pipeline(config.model.path)
        check_nft_size(config, pipe, len(load_prompts(config.prompt_file)), PROCESSES, CPU)
    elif config.trainer == "tool_grpo":
        from vlm_rl.config import check_rollout_size

        sizes = (config.data.train_size, config.data.heldout_size)
        check_rollout_size(config, tiny_vlm_config(), sizes, PROCESSES, CPU)
    elif config.trainer == "vla_online":
        from vla_rl.config import check_env_size

        check_env_size(config, load_config("pretrain/vla").data.image_size)
    else:
        return False
    return True


def test_every_shipped_recipe_passes(monkeypatch):
    monkeypatch.setenv(LIMIT_ENV, "8")
    # the real-model recipes' weights are a local path of the user's (tests/test_replicas.py runs them)
    configs = [load_config(name) for name in list_recipes() if name not in REAL_MODEL_RECIPES]
    checked = {config.trainer for config in configs if setup_time_check(config)}
    assert checked == {"tiny_grpo", "branch_grpo", "diffusion_nft", "tool_grpo", "vla_online"}
