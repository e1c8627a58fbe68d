"""BranchGRPO trainer on a very small flow model: tree shapes, NFE, exact replays, ratios, faults."""

import json

import pytest
import torch
from pinned_runs import metric_rows

from diffusion_rl.branch_grpo import BranchGRPOTrainer
from diffusion_rl.branch_rollout import (
    ancestors,
    plan_for,
    rollout_trees,
    set_leaf_rewards,
    step_log_probs,
    training_samples,
)
from diffusion_rl.loading import load
from diffusion_rl.models import FlowPipeline
from diffusion_rl.sde import sde_step, shifted_sigmas
from diffusion_rl.shapes import vocabulary
from mmrl.advantages import grpo
from mmrl.cli import load_plugins, main
from mmrl.config import ConfigError, load_config
from mmrl.credit import assign_credit
from mmrl.registry import SAMPLERS
from mmrl.run_stops import TrainingStopped
from tests.tiny_flow import SMALL

load_plugins()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_flow")
    FlowPipeline.tiny(vocabulary(), SMALL).save_pretrained(path)
    return path


def trainer_for(model_dir, run_dir, *overrides):
    config = load_config(
        "diffusion/branchgrpo",
        [
            f"model.path={model_dir}",
            f"output_dir={run_dir}",
            "progress=false",
            "rollout.prompts_per_step=2",
            "rollout.steps=8",
            "rollout.split_steps=[0,2,4]",
            "rollout.guidance_scale=1.0",
            "reward.name=jpeg_incompressibility",
            "eval.prompts=4",
            "eval.steps=2",
            *overrides,
        ],
    )
    trainer = BranchGRPOTrainer(config)
    trainer.seed_everything()
    trainer.setup()
    return trainer


def rollout(trainer, plan, step=0, skeletons=None, ids=(3, 5)):
    prompts = [trainer.prompts[i] for i in ids]
    cond = trainer.pipe.encode_prompts(prompts)
    uncond = trainer.uncond_one[[0] * len(prompts)]
    return rollout_trees(
        trainer.pipe, cond, uncond, list(ids), plan, trainer.config.rollout, 0, step, skeletons
    )


def test_tree_shape_and_model_evaluations(model_dir, tmp_path):
    trainer = trainer_for(model_dir, tmp_path, "rollout.steps=20", "rollout.split_steps=[0,3,6,9]")
    trees, leaves, nfe = rollout(trainer, trainer.plan)
    assert leaves.shape == (32, 3, 16, 16)
    for tree in trees:
        assert [len([n for n in tree.nodes if n.depth == d]) for d in range(5)] == [1, 2, 4, 8, 16]
    # the model runs once per node and step; children of a split share their parent's evaluation
    assert nfe / len(trees) == 1 + 2 * 2 + 2 + 4 * 2 + 4 + 8 * 2 + 8 + 16 * 10 == 203
    flat = plan_for(trainer.config.rollout, branch_factor=16)
    flat.split_steps, flat.sde_mask = [0], [True] * 20
    _, _, flat_nfe = rollout(trainer, flat)
    assert flat_nfe / 2 == 1 + 16 * 19  # flat groups share only the first evaluation
    trainer.config.rollout.shared_initial_noise = False  # Flow-GRPO: every sample its own initial noise
    independent, leaves, independent_nfe = rollout(trainer, flat)
    assert independent_nfe / 2 == 16 * 20
    assert [len(t.leaves()) for t in independent] == [16, 16]
    starts = torch.stack([independent[0].nodes[n].state["records"][0].x for n in independent[0].leaves()])
    assert len(torch.unique(starts.flatten(1), dim=0)) == 16


def test_independent_initial_noise_replays_exactly(model_dir, tmp_path):
    trainer = trainer_for(model_dir, tmp_path, "rollout.shared_initial_noise=false")
    plan = trainer.plan
    trees, leaves, nfe = rollout(trainer, plan)
    assert nfe / 2 == 2 * 2 + 2 + 4 * 1 + 4 + 8 * 3  # the root is never evaluated; 2 children from step 0
    keys = [trees[0].nodes[n].state["key"] for n in trees[0].leaves()]
    replay, replay_leaves, _ = rollout(trainer, plan, skeletons=[ancestors(plan, keys[5:6])] * 2)
    torch.testing.assert_close(replay_leaves[0], leaves[5], rtol=0, atol=1e-5)


@pytest.mark.parametrize("factors", [[], ["rollout.branch_factor=[4,2,2]"]], ids=["uniform", "per-split"])
def test_any_leaves_replay_exactly_from_their_keys(model_dir, tmp_path, factors):
    trainer = trainer_for(model_dir, tmp_path, *factors)
    plan = trainer.plan
    trees, leaves, _ = rollout(trainer, plan)
    shape = [1, 4, 8, 16] if factors else [1, 2, 4, 8]
    assert [len([n for n in trees[0].nodes if n.depth == d]) for d in range(4)] == shape
    keys = [[t.nodes[n].state["key"] for n in t.leaves()] for t in trees]
    chosen = [[keys[0][1], keys[0][6]], [keys[1][0]]]
    replay, replay_leaves, _ = rollout(trainer, plan, skeletons=[ancestors(plan, c) for c in chosen])
    assert [len(t.leaves()) for t in replay] == [2, 1]
    expected = torch.stack([leaves[1], leaves[6], leaves[len(keys[0])]])
    # the same noise everywhere; the model's batched matmuls may round differently for another batch
    # size, so the replay agrees to float32 rounding rather than bit for bit
    torch.testing.assert_close(replay_leaves, expected, rtol=0, atol=1e-5)
    original = {t.nodes[n].state["key"]: t.nodes[n].old_logp for t in trees[:1] for n in range(len(t))}
    for node in replay[0].nodes:
        torch.testing.assert_close(node.old_logp, original[node.state["key"]], rtol=0, atol=1e-5)
    _, other, _ = rollout(trainer, plan, step=1)
    assert not torch.equal(other, leaves)


def test_fewer_step_exploration_shares_initial_and_split_noise_with_the_replay(model_dir, tmp_path):
    trainer = trainer_for(model_dir, tmp_path)  # 8 steps, splits 0, 2, 4
    few = plan_for(trainer.config.rollout, steps=4)  # splits 0, 1, 2
    full_trees, _, _ = rollout(trainer, trainer.plan)
    few_trees, _, _ = rollout(trainer, few)
    cond = trainer.pipe.encode_prompts([trainer.prompts[3]])

    def drawn_noise(record, steps):
        sigmas = trainer.pipe.sigmas(steps)
        v = trainer.pipe.velocity(record.x[None], sigmas[:1], cond)
        out = sde_step(
            "flow_grpo",
            v,
            record.x[None],
            sigmas[0],
            sigmas[1],
            noise_scale=0.7,
            prev_sample=record.x_next[None],
        )
        return (record.x_next - out.mean[0]) / out.std

    first_full, first_few = (
        full_trees[0].nodes[1].state["records"][0],
        few_trees[0].nodes[1].state["records"][0],
    )
    assert torch.equal(first_full.x, first_few.x)  # the same initial noise
    # and the same noise drawn at the split step 0, although the step sizes differ
    torch.testing.assert_close(drawn_noise(first_full, 8), drawn_noise(first_few, 4), atol=1e-3, rtol=1e-3)
    assert not torch.equal(first_full.x_next, first_few.x_next)


def test_recomputed_log_probs_give_ratio_one(model_dir, tmp_path, monkeypatch):
    trainer = trainer_for(model_dir, tmp_path, "rollout.split_noise_scale=1.5")
    trees, _, _ = rollout(trainer, trainer.plan)
    for tree in trees:
        for leaf in tree.leaves():
            tree.set_leaf_reward(leaf, float(leaf))
    groups = training_samples(
        trees, assign_credit(trees, "tree_depthwise", clip=5.0).nodes, trainer.config.prune
    )
    samples = [sample for group in groups for sample in group]
    assert len(samples) == 2 * (2 * 2 + 4 * 2 + 8 * 4)
    # siblings' first steps (at splits 0, 2, 4: 1 + 2 + 4 parents per tree) share their input
    assert len(groups) == len(samples) - 2 * (1 + 2 + 4)
    for group in groups:
        assert all(torch.equal(r.x, group[0][1].x) and r.step == group[0][1].step for _, r, _, _ in group)
    cond = trainer.pipe.encode_prompts([trainer.prompts[3], trainer.prompts[5]])
    evaluated, velocity = [], trainer.pipe.velocity
    monkeypatch.setattr(
        trainer.pipe, "velocity", lambda x, *a, **k: evaluated.append(len(x)) or velocity(x, *a, **k)
    )
    with torch.no_grad():
        out = trainer.chunk_log_probs(
            trainer.model, samples, cond, trainer.uncond_one[[0, 0]], shifted_sigmas(8), {0, 2, 4}
        )
    assert evaluated == [len(groups)]  # one model evaluation per shared input
    old = torch.tensor([r.old_logp for _, r, _, _ in samples])
    # exact for the same velocity (tests/test_sde.py); here the training batch differs from the rollout
    # batches, so the model's matmuls round differently: ratios are 1 to float32 rounding
    ratio = (out.log_prob - old).exp()
    assert (ratio - 1).abs().max() < 1e-5


def test_flat_credit_on_a_tree_is_flat_grpo_on_its_leaves_paths(model_dir, tmp_path):
    """A group estimator on a branching tree: each edge counts once per leaf below it with their mean
    advantage, so the loss (KL term included) and its gradient equal flat GRPO's on every leaf's full
    path, taken as its own sample, while each shared step is evaluated once."""
    trainer = trainer_for(model_dir, tmp_path, "train.advantage=grpo", "train.kl_coef=0.5")
    trees, _, _ = rollout(trainer, trainer.plan)
    rewards = torch.rand(
        sum(len(tree.leaves()) for tree in trees), generator=torch.Generator().manual_seed(0)
    )
    leaf_advantages = grpo(rewards, torch.arange(len(trees)).repeat_interleave(8)).values
    set_leaf_rewards(trees, rewards)
    credit = assign_credit(trees, "grpo")
    assert credit.per_leaf
    weighted = [s for g in training_samples(trees, credit.nodes, trainer.config.prune, True) for s in g]
    unrolled = [
        (t, record, a, 1.0)
        for t, (tree, row) in enumerate(zip(trees, leaf_advantages.view(2, 8).tolist(), strict=True))
        for leaf, a in zip(tree.leaves(), row, strict=True)
        for _, child in tree.path_to(leaf)
        for record in tree.nodes[child].state["records"]
    ]
    assert len(weighted) == 2 * (2 * 2 + 4 * 2 + 8 * 4) and len(unrolled) == 2 * 8 * 8
    assert sum(w for *_, w in weighted) == len(unrolled)
    # the root's first child carries the mean advantage of its four leaves, counted four times
    first = [(a, w) for t, r, a, w in weighted if t == 0 and r.step == 0]
    assert first[0] == (pytest.approx(leaf_advantages[:4].mean().item()), 4.0)
    cond = trainer.pipe.encode_prompts([trainer.prompts[3], trainer.prompts[5]])
    args = (cond, trainer.uncond_one[[0, 0]], shifted_sigmas(8), {0, 2, 4})

    def loss_and_gradient(samples):
        trainer.model.zero_grad()
        loss, _ = trainer.chunk_loss(samples, *args)
        loss.backward()
        return loss.detach(), torch.cat([p.grad.flatten() for p in trainer.model.parameters()])

    loss, gradient = loss_and_gradient(weighted)
    flat_loss, flat_gradient = loss_and_gradient(unrolled)
    assert gradient.norm() > 0
    assert loss == pytest.approx(flat_loss.item(), rel=1e-4, abs=1e-8)
    torch.testing.assert_close(
        gradient, flat_gradient, rtol=1e-3, atol=1e-7 * flat_gradient.abs().max().item()
    )
    # node credit (tree_depthwise) on the same tree weighs every edge once
    set_leaf_rewards(trees, rewards)
    node = training_samples(
        trees, assign_credit(trees, "tree_depthwise", clip=5.0).nodes, trainer.config.prune
    )
    assert {w for g in node for *_, w in g} == {1.0}


def test_training_steps_change_the_model_and_log(model_dir, tmp_path):
    trainer = trainer_for(model_dir, tmp_path, "train.lr=1e-2", "train.clip_low=0.2", "train.clip_high=0.2")
    before = [p.detach().clone() for p in trainer.pipe.denoiser.parameters()]
    metrics = trainer.train_step(0)
    assert metrics["leaves_per_prompt"] == 8 and metrics["trained_steps"] > 0
    assert all(torch.isfinite(torch.as_tensor(float(v))) for k, v in metrics.items() if k != "loss")
    after = list(trainer.pipe.denoiser.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_minibatches_take_several_optimizer_steps_off_policy(model_dir, tmp_path):
    def run(run_dir, minibatches):
        trainer = trainer_for(
            model_dir, run_dir, "train.lr=1e-3", f"train.minibatches={minibatches}", "train.micro_batch=8"
        )
        metrics = trainer.train_step(0)
        steps = {int(s["step"]) for s in trainer.optimizer.state_dict()["state"].values()}
        return metrics, steps, [p.detach().clone() for p in trainer.pipe.denoiser.parameters()]

    one, one_steps, _ = run(tmp_path / "a", 1)
    three, three_steps, weights = run(tmp_path / "b", 3)
    assert (one_steps, three_steps) == ({1}, {3})
    assert one["clip_fraction"] == 0.0 and one["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    # after the first update the stored log-probs are off-policy: ratios move and the tight clip acts
    assert three["clip_fraction"] > 0.0 and three["ratio_max"] > 1.0 + 1e-4
    _, _, again = run(tmp_path / "c", 3)  # the shuffle is keyed by (seed, step): a rerun is identical
    assert all(torch.equal(a, b) for a, b in zip(weights, again, strict=True))


def test_ema_weights_evaluate_and_are_saved_and_live_weights_survive(model_dir, tmp_path):
    trainer = trainer_for(
        model_dir,
        tmp_path,
        "train.lr=1e-2",
        "train.clip_low=0.2",
        "train.clip_high=0.2",
        "train.ema_decay=0.5",
    )
    start = [p.detach().clone() for p in trainer.trained_params]
    trainer.train_step(0)
    live = [p.detach().clone() for p in trainer.trained_params]
    for ema, s, p in zip(trainer.ema, start, live, strict=True):  # one update: ema = (start + live) / 2
        torch.testing.assert_close(ema, (s + p) / 2)
    with trainer.ema_weights():
        assert all(torch.equal(p, e) for p, e in zip(trainer.trained_params, trainer.ema, strict=True))
    assert all(torch.equal(p, q) for p, q in zip(trainer.trained_params, live, strict=True))
    assert "ema" in trainer.trainer_state()
    trainer.save_result()
    saved = load(tmp_path / "final").denoiser.state_dict()
    names = [n for n, p in trainer.pipe.denoiser.named_parameters() if p.requires_grad]
    for name, ema in zip(names, trainer.ema, strict=True):
        assert torch.equal(saved[name], ema)


@pytest.mark.parametrize(
    "variant",
    [
        ["rollout.sde=ddim", "rollout.noise_level=1.0"],
        ["rollout.split_steps=[0]", "rollout.branch_factor=6", "train.advantage=grpo_global_std"],
        ["rollout.sde_window=[0,1]", "prune.depths=[3]"],
        ["prune.width=top_half_per_branch", "rollout.reward_fusion=logprob_weighted"],
        ["train.kl_coef=0.1", "model.lora_rank=2"],
        ["train.advantage=tree_value"],
    ],
)
def test_variants_train(model_dir, tmp_path, variant):
    trainer = trainer_for(model_dir, tmp_path, *variant)
    metrics = trainer.train_step(0)
    assert metrics["trained_steps"] > 0 and "loss" in metrics


def test_mix_trains_only_stochastic_steps(model_dir, tmp_path):
    full = trainer_for(model_dir, tmp_path / "a").train_step(0)["trained_steps"]
    mix = trainer_for(model_dir, tmp_path / "b", "rollout.sde_window=[0,1]").train_step(0)["trained_steps"]
    # window [0, 1) plus splits 0, 2, 4: steps 0 (2 nodes), 2 (4 nodes), 4 (8 nodes) per prompt
    assert (full, mix) == (2 * (2 * 2 + 4 * 2 + 8 * 4), 2 * (2 + 4 + 8))


def test_ode_stride_skips_evaluations_only_between_stochastic_steps(model_dir, tmp_path):
    window = ("rollout.sde_window=[0,1]",)  # 8 steps: SDE at 0, 2, 4 (splits); ODE at 1, 3, 5, 6, 7
    euler = trainer_for(model_dir, tmp_path / "a", *window)
    strided = trainer_for(model_dir, tmp_path / "b", *window, "rollout.ode_stride=2")
    trees_e, leaves_e, nfe_e = rollout(euler, euler.plan)
    trees_s, leaves_s, nfe_s = rollout(strided, strided.plan)
    # per tree: steps 1 and 3 stay single ODE steps (each followed by a split); 5-7 become 5->7, 7->8
    assert nfe_e / 2 == 1 + 2 + 2 + 4 + 4 + 8 * 3
    assert nfe_s / 2 == 1 + 2 + 2 + 4 + 4 + 8 * 2
    for tree_e, tree_s in zip(trees_e, trees_s, strict=True):  # every stochastic step is the same
        for node_e, node_s in zip(tree_e.nodes, tree_s.nodes, strict=True):
            for record_e, record_s in zip(node_e.state["records"], node_s.state["records"], strict=True):
                assert record_e.step == record_s.step
                torch.testing.assert_close(record_e.x_next, record_s.x_next)
    assert torch.isfinite(leaves_s).all() and not torch.equal(leaves_s, leaves_e)
    assert (leaves_s - leaves_e).abs().mean() < 0.1 * leaves_e.abs().mean()


def test_fp4_exploration_keeps_best_and_worst_and_replays(model_dir, tmp_path):
    trainer = trainer_for(
        model_dir, tmp_path, "explore.enabled=true", "explore.branch_factor=3", "explore.keep=4"
    )
    metrics = trainer.train_step(0)
    assert metrics["leaves_per_prompt"] == 4
    assert metrics["explore_nfe"] > metrics["nfe"]
    assert -1.0 <= metrics["kendall_tau_lowp_vs_full"] <= 1.0


@pytest.mark.parametrize("sampler", SAMPLERS.names())
def test_every_sampler_trains_two_steps(model_dir, tmp_path, monkeypatch, sampler):
    monkeypatch.setattr("diffusion_rl.trainer.evaluate_alignment", lambda *a, **k: {"heldout_alignment": 0.0})
    small = ["rollout.steps=4", "rollout.split_steps=[0,2]", "steps=2", "checkpoint_every=2"]
    trainer = trainer_for(model_dir, tmp_path, f"train.sampler={sampler}", *small)
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(row["trained_steps"] > 0 for row in rows)
    assert trainer.checkpoint_dir.joinpath("step_00000002").is_dir()


def test_samplers_learn_from_every_prompts_leaf_rewards(model_dir, tmp_path):
    """4 leaves per prompt; the first prompt's leaves all succeed, the second's succeed once."""
    small = ["rollout.steps=4", "rollout.split_steps=[0,2]"]
    thompson = trainer_for(model_dir, tmp_path / "a", "train.sampler=beta_thompson", *small)
    filtered = trainer_for(model_dir, tmp_path / "b", "train.sampler=dynamic_filter", *small)
    for trainer in (thompson, filtered):
        trainer.reward_fn = lambda images, prompts: torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
        trainer.train_step(0)
    sampler = thompson.sampler
    drawn = [i for i in range(sampler.num_items) if sampler.alpha[i] + sampler.beta[i] != 2.0]
    assert len(drawn) == 2 and all(float(sampler.alpha[i] + sampler.beta[i]) == 6.0 for i in drawn)
    assert sorted(float(sampler.alpha[i]) - 1.0 for i in drawn) == [1.0, 4.0]
    # the dynamic filter drops the group whose rewards are all equal
    assert (filtered.sampler.groups_seen, filtered.sampler.groups_dropped) == (2, 1)


def test_prompts_the_sampler_does_not_keep_get_no_credit(model_dir, tmp_path, monkeypatch):
    trainer = trainer_for(model_dir, tmp_path, "rollout.steps=4", "rollout.split_steps=[0,2]")
    trainer.sampler.update = lambda indices, rewards, groups: torch.tensor([True, False])
    seen = {}

    def spy(trees, advantages, prune, leaf_weighted):
        seen["advantages"] = advantages
        return training_samples(trees, advantages, prune, leaf_weighted)

    monkeypatch.setattr("diffusion_rl.branch_grpo.training_samples", spy)
    trainer.train_step(0)
    kept = [a for (t, _), a in seen["advantages"].items() if t == 0]
    dropped = [a for (t, _), a in seen["advantages"].items() if t == 1]
    assert len(kept) == len(dropped) == 6
    assert any(a != 0.0 for a in kept) and all(a == 0.0 for a in dropped)


def test_nan_log_probs_skip_then_stop_with_checkpoint(model_dir, tmp_path, monkeypatch):
    config = load_config(
        "diffusion/branchgrpo",
        [
            f"model.path={model_dir}",
            f"output_dir={tmp_path}",
            "progress=false",
            "rollout.prompts_per_step=1",
            "rollout.steps=4",
            "rollout.split_steps=[0,2]",
            "rollout.guidance_scale=1.0",
            "steps=10",
            "reward.name=jpeg_incompressibility",
            "eval.prompts=2",
            "eval.steps=2",
            "train.nan_patience=2",
            "checkpoint_every=1",
        ],
    )
    trainer = BranchGRPOTrainer(config)
    original = step_log_probs
    calls = {"n": 0}

    def poisoned(*args):
        calls["n"] += 1
        out = original(*args)
        return out._replace(log_prob=out.log_prob * float("nan")) if calls["n"] > 1 else out

    monkeypatch.setattr("diffusion_rl.branch_grpo.step_log_probs", poisoned)
    monkeypatch.setattr("diffusion_rl.trainer.evaluate_alignment", lambda *a, **k: {"heldout_alignment": 0.0})
    with pytest.raises(TrainingStopped, match="2 steps in a row"):
        trainer.train()
    stopped = json.loads((tmp_path / "stopped.json").read_text())
    assert stopped["step"] == 2  # steps 1 and 2 were skipped; step 0 trained
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["skipped"] == 1 and rows[1]["skipped_steps"] == 1
    assert (tmp_path / "checkpoints" / "step_00000002" / "manifest.json").is_file()


def test_reward_server_down_mid_run_stops_cleanly(model_dir, tmp_path, monkeypatch):
    """A server that answered the check at the start and is down by the first step (one down at the
    start is refused before anything is written: tests/test_diffusion_faults.py)."""
    monkeypatch.setattr("diffusion_rl.trainer.evaluate_alignment", lambda *a, **k: {"heldout_alignment": 0.0})
    monkeypatch.setattr("diffusion_rl.trainer.check_reward_server", lambda *a, **k: None)
    code = main(
        [
            "train",
            "diffusion/branchgrpo",
            f"model.path={model_dir}",
            f"output_dir={tmp_path}",
            "progress=false",
            "rollout.prompts_per_step=1",
            "rollout.steps=2",
            "rollout.split_steps=[0]",
            "rollout.guidance_scale=1.0",
            "reward.name=http_reward",
            "reward.options={url: 'http://127.0.0.1:9', retries: 1, timeout: 1}",
        ]
    )
    assert code == 1
    assert "reward server" in json.loads((tmp_path / "stopped.json").read_text())["reason"]
    assert (tmp_path / "checkpoints" / "step_00000000" / "manifest.json").is_file()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["prompt_file=/nonexistent/prompts.txt"], "does not exist"),
        (["rollout.image_size=18"], "multiple of 4"),
        (["reward.name=clip_scor"], "did you mean 'clip_score'"),
        (["train.loss=ppo_clp"], "did you mean 'ppo_clip'"),
        (["train.sampler=thompson"], "unknown sampler 'thompson'"),
        (["train.advantage=gae"], "needs a group advantage .* or a tree advantage"),
        (["rollout.split_steps=[0,30]"], "below rollout.steps"),
        (["rollout.split_steps=[2,4]", "rollout.shared_initial_noise=false"], "needs a split at step 0"),
        (["rollout.branch_factor=[4,2]"], r"2 factors for the 3 rollout.split_steps \[0, 2, 4\]"),
        (["rollout.branch_factor=[3,2,1]"], r"rollout.branch_factor = 1 is out of range"),
        (["rollout.branch_factor=[3,3,2]", "train.advantage=mc_grpo"], "odd number of leaves.*gives 18"),
        (["model.path=/nonexistent/model"], "mmrl pretrain diffusion"),
        (["model.path=tests"], "not a model directory"),
    ],
)
def test_bad_input_is_one_clear_error(model_dir, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        trainer_for(model_dir, tmp_path, *overrides)


def test_empty_prompt_file(model_dir, tmp_path):
    empty = tmp_path / "prompts.txt"
    empty.write_text("\n \n")
    with pytest.raises(ConfigError, match="holds no prompts"):
        trainer_for(model_dir, tmp_path / "run", f"prompt_file={empty}")


def test_periodic_evaluation_and_comparison_plot(model_dir, tmp_path):
    runs = []
    for name, extra in [("flat", ["rollout.split_steps=[0]", "rollout.branch_factor=4"]), ("branch", [])]:
        config = load_config(
            "diffusion/branchgrpo",
            [
                f"model.path={model_dir}",
                f"output_dir={tmp_path / name}",
                "progress=false",
                "steps=2",
                "eval_every=1",
                "rollout.prompts_per_step=1",
                "rollout.steps=4",
                "rollout.split_steps=[0,2]",
                "eval.prompts=2",
                "eval.steps=2",
                *extra,
            ],
        )
        BranchGRPOTrainer(config).train()
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert "eval_heldout_alignment" in rows[0] and "eval_heldout_alignment" not in rows[1]
        assert all(row["step_seconds"] > 0 for row in rows)
        runs.append(str(tmp_path / name))
    png = tmp_path / "compare.png"
    assert main(["report", *runs, "--compare", str(png)]) == 0
    assert png.stat().st_size > 10_000
    assert main(["report", runs[0], str(tmp_path / "missing"), "--compare", str(png)]) == 2
    assert main(["report", *runs]) == 2  # several runs need --compare


SHORT_RUN = [
    "rollout.prompts_per_step=1",
    "rollout.steps=4",
    "rollout.split_steps=[0,2]",
    "checkpoint_every=2",
]


@pytest.fixture
def unscored(monkeypatch):
    """Held-out evaluations replaced by a constant: these tests follow runs, not scores."""
    monkeypatch.setattr("diffusion_rl.trainer.evaluate_alignment", lambda *a, **k: {"heldout_alignment": 0.0})


def final_weights(run_dir, name="final"):
    return load(run_dir / name).denoiser.state_dict()


def test_resumed_run_ends_identical_to_an_uninterrupted_one(model_dir, tmp_path, unscored):
    common = [*SHORT_RUN, "train.minibatches=2", "train.ema_decay=0.5"]

    def run(run_dir, steps, *extra):
        trainer = trainer_for(model_dir, run_dir, *common, f"steps={steps}", *extra)
        trainer.train()
        return metric_rows(run_dir), final_weights(run_dir)

    straight_rows, straight = run(tmp_path / "straight", 4)
    run(tmp_path / "stopped", 2)
    resumed_rows, resumed = run(tmp_path / "stopped", 4, "resume=true")
    assert resumed_rows == straight_rows
    assert all(torch.equal(straight[name], resumed[name]) for name in straight)


def test_a_run_continued_past_its_result_sets_the_earlier_result_aside(
    model_dir, tmp_path, monkeypatch, unscored
):
    """A launch that continues a finished run and dies before its new end leaves no `final/`: the
    earlier result moves to `final-before-step-N/`, so `final/` is never older than the run says."""
    run_dir = tmp_path / "run"
    trainer_for(model_dir, run_dir, *SHORT_RUN, "steps=2").train()
    earlier = final_weights(run_dir)

    continued = trainer_for(model_dir, run_dir, *SHORT_RUN, "steps=4", "resume=true")
    original_step = continued.train_step

    def dies_at_step_4(step):
        if step == 3:
            raise KeyboardInterrupt
        return original_step(step)

    monkeypatch.setattr(continued, "train_step", dies_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        continued.train()
    assert not (run_dir / "final").exists()
    aside = final_weights(run_dir, "final-before-step-00000002")
    assert all(torch.equal(earlier[name], aside[name]) for name in earlier)

    trainer_for(model_dir, run_dir, *SHORT_RUN, "steps=4", "resume=true").train()
    final = final_weights(run_dir)
    assert any(not torch.equal(earlier[name], final[name]) for name in earlier)
    assert (run_dir / "final-before-step-00000002").is_dir()
