"""The `mmrl` command line: every subcommand has --help; `mmrl list` shows recipes and all registries."""

import pytest

from mmrl.cli import main
from mmrl.registry import ALL_REGISTRIES


@pytest.mark.parametrize("command", ["train", "pretrain", "eval", "bench", "report", "list"])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    assert "usage: mmrl " + command in capsys.readouterr().out


def test_list_shows_recipes_and_every_registry(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "core/tiny_grpo" in out and "pretrain/tiny_lm" in out
    assert "accelerate" not in out  # launch configs are not recipes
    for kind in ("advantage", "sampler", "loss", "precision", "reward", "trainer", "bench"):
        assert f"{kind} (" in out
        assert len(ALL_REGISTRIES[kind]) > 0
    for name in (
        "grpo",
        "grpo_global_std",
        "mc_grpo",
        "rloo",
        "tree_depthwise",
        "treepo",
        "tree_value",
        "gae",
        "uniform",
        "dynamic_filter",
        "beta_thompson",
        "ppo_clip",
        "nvfp4-emulated",
        "bf16",
        "fp8",
        "tiny_grpo",
        "tiny_sft",
        "core",
        "answer_match",
    ):
        assert f"  {name}\n" in out or f"  {name}  (" in out
    # entries of registries with kinds say what they are called with, and where they come from
    assert "  gae  (a temporal advantage (rewards, values, dones); GAE)\n" in out
    assert "  tree_depthwise  (a tree advantage (node_rewards, parents, depths); BranchGRPO's code)\n" in out
    assert "  tree_depthwise_population_std  (a tree advantage (node_rewards, parents, depths); vari" in out
    assert "  ppo_clip  (a policy loss (logp, old_logp, advantages, mask); PPO" in out


def test_unknown_bench_is_a_clear_error(capsys):
    assert main(["bench", "cor"]) == 2
    assert "did you mean 'core'" in capsys.readouterr().err
