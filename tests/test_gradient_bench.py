"""`mmrl bench diffusion_gradient`: its estimators recover known signal, noise and angles, and what it
measures is the gradient a training step follows."""

import math

import pytest
import torch

from diffusion_rl.bench.gradient_signal import (
    _draw,
    _load,
    _segment_bounds,
    _trainer,
    alignment,
    bench_diffusion_gradient,
    signal_noise,
)
from diffusion_rl.loading import load
from diffusion_rl.models import FlowPipeline
from diffusion_rl.shapes import vocabulary
from mmrl.cli import load_plugins
from mmrl.config import ConfigError
from tests.tiny_flow import SMALL

load_plugins()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_flow")
    FlowPipeline.tiny(vocabulary(), SMALL).save_pretrained(path)
    return path


def overrides(model_dir):
    return [
        f"model.path={model_dir}",
        "rollout.prompts_per_step=2",
        "rollout.steps=6",
        "rollout.guidance_scale=1.0",
        "reward.name=jpeg_incompressibility",
        "reward.options={}",  # the recipe's options are shapes_strict's
        "eval.gold_reward=null",
        "train.micro_batch=8",
    ]


def draws(mean: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    return mean + torch.randn(k, len(mean), generator=generator)


def test_signal_is_unbiased_where_the_squared_mean_is_not():
    generator = torch.Generator().manual_seed(0)
    p, k = 100, 10
    signals, squared_means, noises = [], [], []
    for _ in range(300):  # no signal: the squared mean is the noise / k = 10 on average
        g = draws(torch.zeros(p), k, generator)
        signal, noise = signal_noise(g @ g.T)
        signals.append(signal)
        noises.append(noise)
        squared_means.append(float(g.mean(0) @ g.mean(0)))
    assert sum(squared_means) / 300 == pytest.approx(p / k, rel=0.1)
    assert abs(sum(signals) / 300) < 0.5
    assert sum(noises) / 300 == pytest.approx(p, rel=0.05)

    mean = torch.full((p,), 0.5)  # ||mean||^2 = 25, SNR 0.25 per draw
    g = draws(mean, 2000, generator)
    signal, noise = signal_noise(g @ g.T)
    assert signal == pytest.approx(25.0, rel=0.15) and noise == pytest.approx(100.0, rel=0.05)


def test_alignment_recovers_the_angle_between_expected_gradients():
    generator = torch.Generator().manual_seed(1)
    p, k = 200, 2000
    a = torch.zeros(p)
    a[0] = 3.0
    for angle in (0.0, math.pi / 3, math.pi / 2, math.pi):
        b = torch.zeros(p)
        b[0], b[1] = 2.0 * math.cos(angle), 2.0 * math.sin(angle)  # a different length: cos ignores it
        ga, gb = draws(a, k, generator), draws(b, k, generator)
        cos = alignment(gb @ ga.T, signal_noise(gb @ gb.T)[0], signal_noise(ga @ ga.T)[0])
        assert cos == pytest.approx(math.cos(angle), abs=0.12)  # a negated update reads -1
    noise_only = draws(torch.zeros(p), 3, generator)  # a signal estimate <= 0 has no direction
    assert math.isnan(alignment(noise_only @ noise_only.T, -1.0, 1.0))


@pytest.mark.parametrize("advantage", ["tree_depthwise", "grpo"])  # node credit; flat credit, weighted
def test_segments_add_up_to_the_gradient_a_training_step_follows(model_dir, tmp_path, monkeypatch, advantage):
    cfg_args = [
        *overrides(model_dir),
        "rollout.split_steps=[0,2,4]",
        "train.minibatches=1",
        f"train.advantage={advantage}",
    ]
    first = _trainer(_load("diffusion/branchgrpo", cfg_args, 0, str(tmp_path / "a")))
    bounds = _segment_bounds([first.config], None)
    assert bounds == [(0, 2), (2, 4), (4, 6)]
    grads, seconds, trained = _draw(first, 0, bounds)
    assert seconds > 0 and trained == 2 * (2 * 2 + 4 * 2 + 8 * 2)
    assert all(float(g.norm()) > 0 for g in grads)  # every segment has trained steps with credit

    again = _trainer(_load("diffusion/branchgrpo", cfg_args, 0, str(tmp_path / "b")))
    followed = []
    monkeypatch.setattr(  # capture the gradient the optimizer step would take, and take none
        again,
        "apply_gradients",
        lambda *a, **k: (
            followed.append(torch.cat([p.grad.flatten() for p in again.trained_params])) or torch.tensor(0.0)
        ),
    )
    samples, cond, uncond, _ = again.collect_samples(0)
    again.optimise(samples, cond, uncond, 0)
    assert len(followed) == 1
    torch.testing.assert_close(grads.sum(0), followed[0], rtol=1e-4, atol=1e-7)


def test_bench_rows_and_ratio(model_dir):
    rows = bench_diffusion_gradient(
        configs=["diffusion/flat_grpo", "diffusion/branchgrpo_quick"],
        overrides=[*overrides(model_dir), "rollout.steps=8"],
        estimates=3,
    )
    recipes = ["diffusion/flat_grpo", "diffusion/branchgrpo_quick"]
    assert [(r["variant"], r["segment"]) for r in rows] == [
        (recipe, segment) for segment in ["all", 0, 1, 2, 3] for recipe in recipes
    ]
    assert [r["steps"] for r in rows[::2]] == ["0-7", "0-1", "2-3", "4-5", "6-7"]  # the tree's splits
    assert rows[0]["alignment"] == 1.0 and "ratio" not in rows[0] and "ratio" in rows[1]
    # flat GRPO trains every step of its 16 samples per prompt; the quick tree prunes the edges into
    # its leaves, so it trains steps 0-5 of its 2 + 4 + 8 inner edges
    assert rows[0]["trained_steps"] == 2 * 16 * 8 and rows[1]["trained_steps"] == 2 * 2 * (2 + 4 + 8)
    assert math.isnan(rows[-1]["snr"]) and not math.isnan(rows[-2]["snr"])  # steps 6-7: pruned


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"estimates": 2}, "estimates = 2"),
        ({"configs": ["diffusion/flat_grpo"]}, "at least one recipe"),
        ({"configs": ["diffusion/flat_grpo", "diffusion/nft"]}, "uses trainer 'diffusion_nft'"),
        ({"configs": ["diffusion/flat_grpo"] * 2, "segments": [1, 3]}, "segments = [1, 3]"),
    ],
)
def test_bad_options_are_one_clear_error(model_dir, kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        bench_diffusion_gradient(**{"overrides": overrides(model_dir), **kwargs})


def test_push_is_positive_towards_where_descent_goes_and_negative_away(model_dir, tmp_path):
    """A run that moved its weights down the gradient of the bench's own first draw points where the
    recipe's updates go: their push along it is positive; a run that climbed it gets a negative push."""
    args = [*overrides(model_dir), "rollout.split_steps=[0,2,4]"]
    probe = _trainer(_load("diffusion/branchgrpo", args, 0, str(tmp_path / "probe")))
    first, _, _ = _draw(probe, 0, [(0, 6)])
    pushes = {}
    for sign, name in ((-1.0, "descent"), (1.0, "ascent")):
        run = tmp_path / name
        _trainer(_load("diffusion/branchgrpo", args, 0, str(run)))  # writes run/config.yaml
        pipe = load(model_dir)
        offset = 0
        for p in (p for p in pipe.denoiser.parameters() if p.requires_grad):
            with torch.no_grad():
                p += sign * 1e3 * first[0, offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        pipe.save_pretrained(run / "final")
        rows = bench_diffusion_gradient(
            configs=["diffusion/branchgrpo"] * 2, overrides=args, estimates=3, direction=[str(run)]
        )
        pushes[name] = rows[0]["push"]
        assert rows[0]["push_interval"][0] <= rows[0]["push"] <= rows[0]["push_interval"][1]
        assert "push_ratio" in rows[1] and "push_ratio" not in rows[0]
    assert pushes["descent"] > 0.2 and pushes["ascent"] == pytest.approx(-pushes["descent"], rel=1e-3)


def test_direction_runs_must_start_where_the_bench_does(model_dir, tmp_path):
    other = tmp_path / "other_model"
    FlowPipeline.tiny(vocabulary(), SMALL).save_pretrained(other)
    run = tmp_path / "run"
    args = [*overrides(model_dir), "rollout.split_steps=[0,2,4]"]
    _trainer(_load("diffusion/branchgrpo", [*args, f"model.path={other}"], 0, str(run)))
    load(other).save_pretrained(run / "final")
    with pytest.raises(ConfigError, match="started from"):
        bench_diffusion_gradient(
            configs=["diffusion/branchgrpo"] * 2, overrides=args, estimates=3, direction=[str(run)]
        )
    with pytest.raises(ConfigError, match="not a finished run"):
        bench_diffusion_gradient(
            configs=["diffusion/branchgrpo"] * 2, overrides=args, estimates=3, direction=[str(tmp_path)]
        )
