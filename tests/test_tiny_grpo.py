"""The shared core end to end on the tiny digit-reversal task: run directory, trees, loading, errors."""

import json

import pytest
import torch

from mmrl.cli import load_plugins, main
from mmrl.config import ConfigError, load_config
from mmrl.credit import assign_credit
from mmrl.examples.digits import build_model
from mmrl.examples.tiny_grpo import TinyGRPOTrainer, TinyRolloutConfig, sample_trees
from mmrl.losses import LossOutput
from mmrl.noise import NoiseKey
from mmrl.registry import ADVANTAGES, LOSSES

load_plugins()

TINY = [
    "model.path=null",
    "model.hidden_size=32",
    "task.train_prompts=256",
    "task.heldout_prompts=32",
    "rollout.prompts_per_step=4",
    "progress=false",
]


def run(tmp_path, *overrides, recipe="core/tiny_grpo"):
    config = load_config(recipe, [*TINY, f"output_dir={tmp_path}", *overrides])
    return config, TinyGRPOTrainer(config).train()


def test_run_directory_layout(tmp_path):
    config, result = run(tmp_path, "steps=3", "checkpoint_every=2")
    assert set(result) == {"heldout_reward", "heldout_exact"}
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("reward", "loss", "grad_norm", "clip_fraction", "approx_kl"):
        assert isinstance(rows[0][key], float)
    assert (tmp_path / "config.yaml").is_file()
    saved = load_config(str(tmp_path / "config.yaml"))
    assert saved == config
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002", "step_00000003"]
    evals = json.loads((tmp_path / "eval.json").read_text())
    assert set(evals) == {"before", "after"}
    assert (tmp_path / "samples" / "rollouts_rank0.jsonl").is_file()


def test_tensorboard_events(tmp_path):
    run(tmp_path, "steps=1", "tracking=[tensorboard]")
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_existing_run_needs_resume(tmp_path):
    run(tmp_path, "steps=1")
    with pytest.raises(ConfigError, match="resume=true"):
        run(tmp_path, "steps=1")


def test_tree_rollouts_share_prefixes_and_regenerate_from_keys():
    model = build_model(load_config("core/tiny_grpo", TINY).model, digits=4)
    prompts = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    rollout = TinyRolloutConfig(split_positions=[0, 1, 2, 3], branch_factor=2)
    trees = sample_trees(model, prompts, [7, 9], rollout, seed=0, step=3)
    for tree in trees:
        assert len(tree.leaves()) == 16
        assert [len([n for n in tree.nodes if n.depth == d]) for d in range(5)] == [1, 2, 4, 8, 16]
        for leaf in tree.leaves():  # each edge holds one token and its log-prob
            for _, child in tree.path_to(leaf):
                assert len(tree.nodes[child].action) == 1 and tree.nodes[child].old_logp.shape == (1,)
    again = sample_trees(model, prompts, [7, 9], rollout, seed=0, step=3)
    other = sample_trees(model, prompts, [7, 9], rollout, seed=0, step=4)
    answers = [[t.nodes[n].state["tokens"] for n in t.leaves()] for t in trees]
    assert answers == [[t.nodes[n].state["tokens"] for n in t.leaves()] for t in again]
    assert answers != [[t.nodes[n].state["tokens"] for n in t.leaves()] for t in other]
    assert NoiseKey(0, 3, 7, 1, 0) != NoiseKey(0, 3, 9, 1, 0)


def test_branch_recipe_trains(tmp_path):
    _, result = run(tmp_path, "steps=2", recipe="core/tiny_branch_grpo")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["leaves_per_prompt"] == 16
    assert 0 <= result["heldout_reward"] <= 1


def test_pretrained_model_loads_from_local_directory(tmp_path):
    pre = tmp_path / "pre"
    assert (
        main(
            [
                "pretrain",
                "tiny_lm",
                f"output_dir={pre}",
                "steps=2",
                "model.hidden_size=32",
                "task.train_prompts=256",
                "task.heldout_prompts=32",
                "progress=false",
            ]
        )
        == 0
    )
    config = load_config("core/tiny_grpo", [*TINY, f"model.path={pre / 'model'}"])
    loaded = build_model(config.model, digits=4)
    from safetensors.torch import load_file

    weights = load_file(pre / "model" / "model.safetensors")
    for name, tensor in loaded.state_dict().items():
        if name in weights:
            assert torch.equal(tensor, weights[name])


def test_missing_model_path_is_a_clear_error(tmp_path):
    config = load_config(
        "core/tiny_grpo", [*TINY, f"output_dir={tmp_path}", f"model.path={tmp_path / 'nope'}"]
    )
    with pytest.raises(ConfigError, match="mmrl pretrain tiny_lm"):
        TinyGRPOTrainer(config).train()


def test_eval_and_report_commands(tmp_path, capsys):
    run(tmp_path, "steps=2")
    overrides = [*TINY, f"output_dir={tmp_path}"]
    assert main(["eval", "core/tiny_grpo", *overrides]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["step"] == 2 and 0 <= out["heldout_reward"] <= 1
    assert main(["report", str(tmp_path)]) == 0
    page = (tmp_path / "report.html").read_text()
    assert "<img" in page and "heldout_reward" in page and "Held-out evaluation" in page
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert main(["eval", "core/tiny_grpo", *TINY, f"output_dir={tmp_path / 'empty'}"]) == 2


def test_tree_estimators_are_recognised_by_their_kind():
    assert ADVANTAGES.has_kind("tree_depthwise", "tree") and not ADVANTAGES.has_kind("grpo", "tree")
    assert load_config("core/tiny_branch_grpo", ["train.advantage=rloo"]).train.advantage == "rloo"
    with pytest.raises(ConfigError, match="odd number of leaves per tree.*gives 16"):
        load_config("core/tiny_branch_grpo", ["train.advantage=mc_grpo"])


def test_flat_credit_on_a_tree_trains_every_leaf_whole_answer_with_its_group_advantage(tmp_path):
    """A group estimator on a branching tree: each tree's 16 leaves are one group, and every token of
    a leaf's answer (shared prefix included) carries that leaf's advantage, counted once per leaf."""
    config = load_config("core/tiny_branch_grpo", [*TINY, f"output_dir={tmp_path}", "train.advantage=grpo"])
    trainer = TinyGRPOTrainer(config)
    trainer.prepare_run_dir()
    trainer.seed_everything()
    trainer.setup()
    prompts = trainer.train_prompts[:2]
    trees = sample_trees(trainer.model, prompts, [0, 1], config.rollout, seed=0, step=0)
    owners = [(t, leaf) for t, tree in enumerate(trees) for leaf in tree.leaves()]
    for t, leaf in owners:  # distinct rewards, so every advantage differs from its neighbours'
        trees[t].set_leaf_reward(leaf, float(leaf % 7) + t)
    credit = assign_credit(trees, "grpo")
    assert credit.per_leaf and set(credit.leaves) == set(owners)
    rewards = torch.tensor([trees[t].nodes[leaf].reward for t, leaf in owners]).view(2, 16)
    expected = ADVANTAGES.get("grpo")(rewards.flatten(), torch.arange(2).repeat_interleave(16)).values
    _, adv, mask = trainer.token_targets(trees, owners, credit)
    assert torch.equal(mask, torch.ones_like(mask))
    torch.testing.assert_close(adv, expected[:, None].expand_as(adv))
    # node credit on the same trees counts each of a tree's 2 + 4 + 8 + 16 edges once
    _, _, node_mask = trainer.token_targets(trees, owners, assign_credit(trees, "tree_depthwise"))
    assert node_mask.sum() == 2 * (2 + 4 + 8 + 16)


def test_the_policy_loss_is_the_one_train_loss_names(tmp_path, monkeypatch):
    calls = []

    def frozen(logp, old_logp, advantages, mask, **options):  # no gradient signal: weights stay
        calls.append((logp.shape, advantages.shape, mask.shape, sorted(options)))
        return LossOutput(0.0 * logp.sum(), {})

    monkeypatch.setitem(LOSSES._entries, "test_frozen", frozen)
    monkeypatch.setitem(LOSSES._entry_kinds, "test_frozen", "policy")
    with pytest.raises(ConfigError, match="unknown loss 'ppo'.*did you mean 'ppo_clip'"):
        load_config("core/tiny_grpo", [*TINY, "train.loss=ppo"])
    config = load_config("core/tiny_grpo", [*TINY, f"output_dir={tmp_path}", "train.loss=test_frozen"])
    trainer = TinyGRPOTrainer(config)
    trainer.prepare_run_dir()
    trainer.setup()
    trainer.start_run_dir()
    before = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.train_step(0)
    leaves = (4 * 16, 4)  # prompts_per_step x branch_factor answers of 4 digits
    assert calls == [(leaves, leaves, leaves, ["adv_clip", "clip_high", "clip_low"])] * 2  # ppo_epochs
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    assert "clip_fraction" not in metrics and metrics["loss"] == 0.0
