"""DiffusionNFT trainer on a very small flow model: sampling by the old policy with any solver, the
noised training samples, the old policy's EMA, exact resume, faults and config errors."""

import json

import pytest
import torch
from pinned_runs import metric_rows

from diffusion_rl.branch_rollout import rollout_trees
from diffusion_rl.loading import load
from diffusion_rl.models import FlowPipeline
from diffusion_rl.nft import DiffusionNFTTrainer, old_policy_decay
from diffusion_rl.shapes import train_prompts, vocabulary
from mmrl.cli import load_plugins
from mmrl.config import ConfigError, load_config
from mmrl.run_stops import TrainingStopped
from tests.tiny_flow import SMALL

load_plugins()

NO_EVAL = {"heldout_alignment": 0.0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_flow")
    FlowPipeline.tiny(vocabulary(), SMALL).save_pretrained(path)
    return path


def trainer_for(model_dir, run_dir, *overrides, setup=True):
    config = load_config(
        "diffusion/nft",
        [
            f"model.path={model_dir}",
            f"output_dir={run_dir}",
            "progress=false",
            "rollout.prompts_per_step=2",
            "rollout.group_size=4",
            "rollout.steps=4",
            "reward.name=jpeg_incompressibility",
            "reward.options={}",  # the recipe's options are shapes_strict's
            "eval.prompts=2",
            "eval.steps=2",
            *overrides,
        ],
    )
    trainer = DiffusionNFTTrainer(config)
    if setup:
        trainer.prepare_run_dir()
        trainer.seed_everything()
        trainer.setup()
        trainer.start_run_dir()
    return trainer


def rows_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "overrides, nfe",
    [
        ([], 4 * 4),  # 4 Euler steps per sample, 4 samples per prompt
        (["rollout.ode_stride=2"], 2 * 4),
        (["rollout.solver=sde"], 4 * 4),
        (["rollout.guidance_scale=2.0"], 4 * 4),
    ],
)
def test_solvers_sample_groups_and_train(model_dir, tmp_path, overrides, nfe):
    trainer = trainer_for(model_dir, tmp_path, "train.lr=1e-3", *overrides)
    before = [p.detach().clone() for p in trainer.trained_params]
    metrics = trainer.train_step(0)
    assert metrics["nfe"] == nfe and metrics["trained_samples"] == 8
    assert 0.0 <= float(metrics["optimality_mean"]) <= 1.0 and metrics["loss"] > 0
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.trained_params, strict=True))


@pytest.mark.parametrize("eval_guidance, warned", [("1.0", False), ("3.0", True)])
def test_an_evaluation_at_another_guidance_than_the_rollouts_is_warned(
    model_dir, tmp_path, capsys, eval_guidance, warned
):
    """The update trains the sampler of `rollout.guidance_scale`; a held-out score at another guidance
    measures a sampler that was never trained, so the run says so."""
    trainer_for(model_dir, tmp_path, "rollout.guidance_scale=1.0", f"eval.guidance_scale={eval_guidance}")
    err = capsys.readouterr().err
    assert ("eval.guidance_scale = 3 scores a sampler it never trained" in err) == warned


def test_samples_come_from_the_old_policy(model_dir, tmp_path, monkeypatch):
    """With the old policy away from the trained weights, a step samples with the old policy's weights,
    and the trained weights are back in place for the update."""
    from diffusion_rl import nft as module

    trainer = trainer_for(model_dir, tmp_path)
    with torch.no_grad():
        for old in trainer.old_policy:
            old.add_(0.05 * torch.randn_like(old))
    old_before = [o.clone() for o in trainer.old_policy]
    live = [p.detach().clone() for p in trainer.trained_params]
    seen = {}

    def spy(*args, **kwargs):
        seen["weights"] = [p.detach().clone() for p in trainer.trained_params]
        return rollout_trees(*args, **kwargs)

    def update(*args):
        seen["update"] = [p.detach().clone() for p in trainer.trained_params]
        return {}

    monkeypatch.setattr(module, "rollout_trees", spy)
    monkeypatch.setattr(trainer, "optimise", update)
    trainer.train_step(0)
    assert all(torch.equal(w, o) for w, o in zip(seen["weights"], old_before, strict=True))
    assert all(torch.equal(w, p) for w, p in zip(seen["update"], live, strict=True))


def test_old_policy_decay_schedule_and_update(model_dir, tmp_path):
    assert old_policy_decay(0, 0, 0.001, 0.5) == 0.0
    assert old_policy_decay(3, 5, 0.1, 0.5) == 0.0
    assert old_policy_decay(7, 5, 0.1, 0.5) == pytest.approx(0.2)
    assert old_policy_decay(100, 5, 0.1, 0.5) == 0.5
    trainer = trainer_for(model_dir, tmp_path, "train.lr=1e-3")
    old = [o.clone() for o in trainer.old_policy]
    metrics = trainer.train_step(0)
    # after the step's one update the decay is 0.001 (DiffusionNFT reads it after the update)
    assert trainer.optimizer_steps == 1 and metrics["old_policy_decay"] == pytest.approx(0.001)
    for o, before, p in zip(trainer.old_policy, old, trainer.trained_params, strict=True):
        torch.testing.assert_close(o, 0.001 * before + 0.999 * p.detach())
    old = [o.clone() for o in trainer.old_policy]
    with torch.no_grad():
        for p in trainer.trained_params:
            p.add_(1.0)
    trainer.update_old_policy(0.25)
    for o, before, p in zip(trainer.old_policy, old, trainer.trained_params, strict=True):
        torch.testing.assert_close(o, 0.25 * before + 0.75 * p.detach())


def test_the_old_policy_decay_counts_optimizer_steps_not_iterations(model_dir, tmp_path):
    trainer = trainer_for(model_dir, tmp_path, "train.minibatches=2")
    assert trainer.train_step(0)["old_policy_decay"] == pytest.approx(0.002)
    assert trainer.train_step(1)["old_policy_decay"] == pytest.approx(0.004)
    # DiffusionNFT's schedule (decay_type 1) reaches its cap 0.5 at its 500th optimizer step
    assert old_policy_decay(499, 0, 0.001, 0.5) < 0.5 == old_policy_decay(500, 0, 0.001, 0.5)


def test_nft_defaults_are_diffusionnfts():
    """Each default against DiffusionNFT's train_nft_sd3.py / config (decay_type 1, adv_clip_max 5,
    the per-prompt stat tracker with global std, timestep_fraction 0.99 of the sampler's steps)."""
    import numpy as np

    from diffusion_rl.config import DiffusionNFTConfig
    from diffusion_rl.nft import noise_levels_per_sample
    from mmrl.registry import ADVANTAGES

    cfg = DiffusionNFTConfig()
    t = cfg.train
    assert (t.adv_clip, t.loss_scale, t.beta) == (5.0, None, 1.0)  # the policy term times adv_clip_max
    assert (t.old_decay_start, t.old_decay_rate, t.old_decay_max) == (0, 0.001, 0.5)
    assert t.noise_levels == "sampler" and noise_levels_per_sample(cfg) == 9  # int(10 * 0.99)
    # the advantage: each prompt's mean, the batch's numpy (population) std + 1e-4
    rewards = np.array([0.1, 0.5, 0.2, 0.9, 0.9, 0.3], dtype=np.float64)
    groups = np.array([0, 0, 0, 1, 1, 1])
    means = np.array([rewards[groups == g].mean() for g in groups])
    official = (rewards - means) / (np.std(rewards) + 1e-4)
    ours = ADVANTAGES.get(t.advantage)(torch.tensor(rewards, dtype=torch.float32), torch.tensor(groups))
    np.testing.assert_allclose(ours.values.numpy(), official, rtol=1e-6)


def test_the_policy_term_is_scaled_by_the_advantage_clip_by_default(model_dir, tmp_path):
    def scale_used(*overrides: str) -> float:
        trainer = trainer_for(model_dir, tmp_path / "_".join(overrides), *overrides)
        seen, loss_fn = [], trainer.loss_fn

        def spy(*args, **kwargs):
            seen.append(kwargs["scale"])
            return loss_fn(*args, **kwargs)

        trainer.loss_fn = spy
        trainer.train_step(0)
        return seen[0]

    assert scale_used() == 5.0  # DiffusionNFT's code: the policy loss times adv_clip_max
    assert scale_used("train.adv_clip=2.0") == 2.0
    assert scale_used("train.loss_scale=1.0") == 1.0


def test_noised_samples_are_keyed_and_at_the_samplers_levels(model_dir, tmp_path):
    trainer = trainer_for(model_dir, tmp_path, "train.timesteps_per_sample=3")
    levels = trainer.pipe.sigmas(4)[:-1].tolist()  # rollout.steps = 4: the levels the rollout denoised at
    clean = torch.randn(2, *trainer.pipe.latent_shape())
    x0, t, x_t, rows = trainer.noised(clean, [5, 9], step=4)
    assert x0.shape[0] == t.shape[0] == x_t.shape[0] == 6 and rows.tolist() == [0, 0, 0, 1, 1, 1]
    for sample in (t[:3].tolist(), t[3:].tolist()):  # three of the four levels, none twice
        assert len(set(sample)) == 3 and all(any(abs(v - level) < 1e-6 for level in levels) for v in sample)
    eps = (x_t - (1 - t.view(-1, 1, 1, 1)) * x0) / t.view(-1, 1, 1, 1)
    assert eps.std() == pytest.approx(1.0, abs=0.2)
    again = trainer.noised(clean[1:], [9], step=4)  # a sample's draws depend on its id, not the batch
    torch.testing.assert_close(again[2], x_t[3:])
    assert not torch.equal(trainer.noised(clean, [5, 9], step=5)[2], x_t)
    uniform = trainer_for(
        model_dir, tmp_path / "u", "train.noise_levels=uniform", "train.timesteps_per_sample=3"
    )
    t = uniform.noised(clean, [5, 9], step=4)[1]
    assert ((t >= 0) & (t < 1)).all() and len(set(t.tolist())) == 6


def test_several_rewards_are_logged_each(model_dir, tmp_path):
    trainer = trainer_for(
        model_dir,
        tmp_path,
        "reward.name=null",
        "reward.terms=[{name: jpeg_incompressibility, weight: 1.0},"
        " {name: jpeg_compressibility, weight: 0.5}]",
    )
    metrics = trainer.train_step(0)
    high, low = metrics["reward_jpeg_incompressibility"], metrics["reward_jpeg_compressibility"]
    assert float(metrics["reward"]) == pytest.approx(high + 0.5 * low, rel=1e-5)


def test_groups_the_sampler_drops_are_not_trained(model_dir, tmp_path, monkeypatch):
    trainer = trainer_for(model_dir, tmp_path, "train.sampler=dynamic_filter")
    trainer.reward_fn = lambda images, prompts: torch.zeros(len(images))  # equal rewards: every group dropped
    metrics = trainer.train_step(0)
    assert metrics["trained_samples"] == 0 and "loss" not in metrics


def test_non_finite_loss_skips_then_stops_with_checkpoint(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("diffusion_rl.trainer.evaluate_alignment", lambda *a, **k: NO_EVAL)
    trainer = trainer_for(
        model_dir, tmp_path, "steps=10", "train.nan_patience=2", "checkpoint_every=1", setup=False
    )
    from mmrl.losses import diffusion_nft

    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        out = diffusion_nft(*args, **kwargs)
        return out._replace(loss=out.loss * float("nan")) if calls["n"] > 1 else out

    trainer.setup = lambda original=trainer.setup: (original(), setattr(trainer, "loss_fn", poisoned))
    with pytest.raises(TrainingStopped, match="2 steps in a row"):
        trainer.train()
    assert json.loads((tmp_path / "stopped.json").read_text())["step"] == 2
    assert (tmp_path / "checkpoints" / "step_00000002" / "manifest.json").is_file()


def test_resumed_run_ends_identical_to_an_uninterrupted_one(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("diffusion_rl.trainer.evaluate_alignment", lambda *a, **k: NO_EVAL)
    common = [
        "train.minibatches=2",
        "train.ema_decay=0.5",
        "train.old_decay_rate=0.2",
        "train.kl_coef=0.01",
        "train.sampler=beta_thompson",
        "checkpoint_every=2",
    ]

    def run(run_dir, steps, *extra):
        trainer_for(model_dir, run_dir, *common, f"steps={steps}", *extra, setup=False).train()
        return metric_rows(run_dir), load(run_dir / "final").denoiser.state_dict()

    straight_rows, straight = run(tmp_path / "straight", 4)
    run(tmp_path / "stopped", 2)
    resumed_rows, resumed = run(tmp_path / "stopped", 4, "resume=true")
    assert resumed_rows == straight_rows
    # two optimizer steps per iteration at 0.2 each, up to 0.5
    assert [row["old_policy_decay"] for row in straight_rows] == pytest.approx([0.4, 0.5, 0.5, 0.5])
    assert all(torch.equal(straight[name], resumed[name]) for name in straight)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.loss=ppo_clip"], "policy loss .* but this trainer needs a forward_process loss"),
        (["train.advantage=tree_depthwise"], "needs a group advantage"),
        (["train.advantage=mc_grpo", "rollout.group_size=4"], "rollout.group_size"),
        (["rollout.solver=euler"], "rollout.solver"),
        (["train.old_decay_max=1.5"], "train.old_decay_max"),
        (["train.timesteps_per_sample=5"], "at most 4, or train.noise_levels=uniform"),
        (["rollout.prompts_per_step=10000"], "rollout.prompts_per_step"),
        (["model.path=/nonexistent/model"], "mmrl pretrain diffusion"),
    ],
)
def test_bad_input_is_one_clear_error(model_dir, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        trainer_for(model_dir, tmp_path, *overrides)


# ----- Sol-RL: `explore` ---------------------------------------------------------------------------


def sol_rl(model_dir, run_dir, *overrides):
    return trainer_for(
        model_dir,
        run_dir,
        "explore.enabled=true",
        "explore.pool=8",
        "explore.steps=2",
        *overrides,
    )


@pytest.mark.parametrize("call_rows", [None, 4])
def test_sol_rl_replays_the_kept_seeds_exactly_in_full_precision(model_dir, tmp_path, monkeypatch, call_rows):
    """The pool runs 2 low-precision steps on 8 candidates per prompt; the replay regenerates the kept
    4 with 4 full-precision steps, each the fresh full-precision sample of its seed alone (bit for bit
    with rollout.call_rows), and far from its pool sample."""
    from diffusion_rl import nft as module
    from diffusion_rl.branch_rollout import ancestors

    trainer = sol_rl(model_dir, tmp_path, f"rollout.call_rows={'null' if call_rows is None else call_rows}")
    calls = []

    def spy(*args, **kwargs):
        out = rollout_trees(*args, **kwargs)
        calls.append((args, [p.detach().clone() for p in trainer.trained_params], out))
        return out

    monkeypatch.setattr(module, "rollout_trees", spy)
    metrics = trainer.train_step(0)
    (_, _, pool), (replay_args, sampled_with, replay) = calls
    assert metrics["explore_nfe"] == 8 * 2 and metrics["nfe"] == 4 * 4
    assert -1.0 <= metrics["kendall_tau_lowp_vs_full"] <= 1.0
    replay_trees, replay_latents, _ = replay
    leaf = replay_trees[1].leaves()[2]
    key = replay_trees[1].nodes[leaf].state["key"]
    pipe, cond, uncond, slots, plan, sampling, seed, step = replay_args[:8]
    with trainer.swapped_weights(sampled_with):  # the weights the replay ran with
        _, fresh, _ = rollout_trees(
            pipe, cond[1:], uncond[1:], slots[1:], plan, sampling, seed, step, [ancestors(plan, [key])]
        )
    if call_rows is None:
        # the same keyed noise and weights; the denoiser's matmuls round differently for another batch
        # size (measured up to about 1e-5 on CPU), so this is float32 rounding rather than bit for bit
        torch.testing.assert_close(fresh[0], replay_latents[4 + 2], rtol=0, atol=1e-5)
    else:  # calls of 4 rows: the seed alone (filled up to 4) and among the 8 replayed rows agree exactly
        assert torch.equal(fresh[0], replay_latents[4 + 2])
    pool_trees, pool_latents, _ = pool
    pool_index = [pool_trees[1].nodes[n].state["key"] for n in pool_trees[1].leaves()].index(key)
    assert (pool_latents[8 + pool_index] - replay_latents[4 + 2]).abs().max() > 1e-3


def test_sol_rl_keeps_the_best_and_the_worst_of_the_pool(model_dir, tmp_path, monkeypatch):
    """Pool rewards rise with the candidate's key: the replay must hold keys 1, 2 (worst) and 7, 8
    (best) of every prompt, not the top 4."""
    from diffusion_rl import nft as module

    trainer = sol_rl(model_dir, tmp_path)
    replays = []

    def spy(*args, **kwargs):
        out = rollout_trees(*args, **kwargs)
        replays.append(out[0])
        return out

    def reward(images, prompts):
        trees = replays[-1]
        return torch.tensor([float(t.nodes[n].state["key"]) for t in trees for n in t.leaves()])

    monkeypatch.setattr(module, "rollout_trees", spy)
    trainer.reward_fn = reward
    metrics = trainer.train_step(0)
    kept = [[t.nodes[n].state["key"] for n in t.leaves()] for t in replays[1]]
    assert kept == [[1, 2, 7, 8], [1, 2, 7, 8]]
    # the same reward for a key in both passes: every pair agrees, except the 4 pairs of one key in the
    # two prompts, tied in both (tau-a counts them 0): 24 of 28
    assert metrics["kendall_tau_lowp_vs_full"] == pytest.approx(24 / 28)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["explore.pool=3"], "at most the pool"),
        (["rollout.group_size=3", "train.advantage=rloo"], "must be even"),
        (["explore.precision=fp5"], "explore.precision"),
    ],
)
def test_sol_rl_bad_input_is_one_clear_error(model_dir, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        sol_rl(model_dir, tmp_path, *overrides)


def test_cached_prompt_embeddings_train_alike_and_the_encoders_stay_idle(model_dir, tmp_path, monkeypatch):
    plain = trainer_for(model_dir, tmp_path / "plain")
    cached = trainer_for(model_dir, tmp_path / "cached", "model.cache_prompt_embeddings=true")
    prompts = [*cached.prompts[:3], ""]
    direct, from_cache = plain.pipe.encode_prompts(prompts), cached.pipe.encode_prompts(prompts)
    assert torch.allclose(direct.embeds, from_cache.embeds, atol=1e-6)
    assert torch.allclose(direct.pooled, from_cache.pooled, atol=1e-6)
    assert set(cached.pipe.prompt_cache) >= {*cached.prompts, ""}

    def refuse(*args, **kwargs):
        raise AssertionError("a text encoder ran after its prompts were cached")

    monkeypatch.setattr(cached.pipe.text_encoder, "forward", refuse)
    a, b = plain.train_step(0), cached.train_step(0)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    with pytest.raises(ValueError, match="'a purple hexagon' was not among the cached prompts"):
        cached.pipe.encode_prompts(["a purple hexagon"])


def test_the_prompts_are_cached_before_the_denoiser_goes_to_the_device(model_dir, tmp_path, monkeypatch):
    calls = []
    cache, move = FlowPipeline.cache_prompts, FlowPipeline.to

    def cache_prompts(pipe, *args, **kwargs):
        calls.append(("cache", next(pipe.denoiser.parameters()).device.type))
        return cache(pipe, *args, **kwargs)

    def to(pipe, device):
        calls.append(("to", str(device)))
        return move(pipe, device)

    monkeypatch.setattr(FlowPipeline, "cache_prompts", cache_prompts)
    monkeypatch.setattr(FlowPipeline, "to", to)
    trainer = trainer_for(
        model_dir, tmp_path, "model.cache_prompt_embeddings=true", "model.lora_rank=4", "train.kl_coef=0"
    )
    assert calls == [("cache", "cpu"), ("to", "cpu")]
    # the released encoders stay released when the pipeline moves again
    assert next(trainer.pipe.text_encoder.parameters()).device.type == "meta"
    trainer.pipe.to("cpu")
    assert next(trainer.pipe.text_encoder.parameters()).device.type == "meta"


def test_the_plan_moves_the_text_encoders_to_the_prompt_cache(model_dir, tmp_path):
    def plan(*overrides):
        config = load_config(
            "diffusion/nft",
            [f"model.path={model_dir}", f"output_dir={tmp_path}", "eval.prompts=4", *overrides],
        )
        return DiffusionNFTTrainer.memory_plan(config, "diffusion/nft", 1)

    plain, cached = plan(), plan("model.cache_prompt_embeddings=true")
    assert plain.other_weights["text encoders"] > 0 and "text encoders" not in cached.other_weights
    # the encoders are held while they fill the cache, before the denoiser and the optimizer, and never again
    encoders = plain.other_weights["text encoders"]
    caching = "prompt caching (the text encoders)"
    assert cached.phases[caching].transient > encoders
    assert cached.phases[caching].weights == cached.phases[caching].optimizer == 0
    assert cached.peak_bytes == max(plain.peak_bytes - encoders, cached.peak_bytes_of([caching]))
    prompts = len(train_prompts()) + 4 + 1  # training, held-out and the empty prompt
    assert f"({prompts:,d} prompts of " in cached.work["prompt embeddings cached in CPU memory"]
