import math

import pytest
import torch
from diffusers import DDIMScheduler

from diffusion_rl.sde import (
    SDE_KINDS,
    adams_bashforth2_step,
    dance_grpo_step,
    ddim_flow_step,
    ddim_step,
    flow_grpo_step,
    flow_to_vp,
    gaussian_log_prob,
    initial_noise_std,
    ode_step,
    sde_step,
    sde_step_mask,
    shifted_sigmas,
)
from mmrl.noise import NoiseKey, keyed_randn_batch

LATENT_SHAPE = (4, 4, 16, 16)
FLOW_STEPS = {"flow_grpo": flow_grpo_step, "dance_grpo": dance_grpo_step, "ddim": ddim_flow_step}
# Steps near both ends of the schedule: first step (sigma = 1 and just below), middle, last steps.
SIGMA_PAIRS = [(1.0, 0.98), (0.999, 0.995), (0.5, 0.45), (0.05, 0.0), (0.02, 0.0)]
# |exp(new - old) - 1| when the training pass sees the velocity in fp32 while the rollout used its
# bf16 rounding (same stored bf16 latents and sample). Measured over SIGMA_PAIRS and both forms with
# these inputs: at most 1.1e-4 (flow_grpo at sigma 0.02 -> 0), 1.6e-6 at sigma 1 -> 0.98.
BF16_RATIO_TOLERANCE = 1e-3


def _randn(*shape, seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype)


def _inputs(seed=0, dtype=torch.float32):
    return (
        _randn(*LATENT_SHAPE, seed=seed, dtype=dtype),  # velocity
        _randn(*LATENT_SHAPE, seed=seed + 1, dtype=dtype),  # x
        _randn(*LATENT_SHAPE, seed=seed + 2),  # noise
    )


def _reference_log_prob(sample, mean, std):
    normal = torch.distributions.Normal(mean.double(), torch.as_tensor(std).double())
    return normal.log_prob(sample.double()).reshape(sample.shape[0], -1).mean(dim=1)


def _skip_noiseless(kind, sigma_next):
    if kind == "ddim" and sigma_next == 0:
        pytest.skip("DDIM's step to sigma = 0 has no noise (the trainer runs it as an ODE step)")


def test_ddim_flow_step_to_zero_is_the_clean_estimate_and_eta_is_checked():
    velocity, x, noise = _inputs()
    out = ddim_flow_step(velocity, x, 0.05, 0.0, noise=noise)
    torch.testing.assert_close(out.prev_sample, x - 0.05 * velocity)  # x0_hat, no noise
    assert float(out.std.max()) == 0.0
    with pytest.raises(ValueError, match="eta > 0"):
        ddim_flow_step(velocity, x, 0.5, 0.4, eta=0.0, noise=noise)


def test_flow_to_vp_is_the_variance_preserving_change_of_variables():
    sigma = torch.tensor([1.0, 0.7, 0.3, 0.0], dtype=torch.float64)
    alpha_bar, c = flow_to_vp(sigma)
    # x_vp = c * ((1 - sigma) x0 + sigma eps) = sqrt(ab) x0 + sqrt(1 - ab) eps
    torch.testing.assert_close(c * (1 - sigma), alpha_bar.sqrt())
    torch.testing.assert_close(c * sigma, (1 - alpha_bar).sqrt())
    torch.testing.assert_close(initial_noise_std(sigma[:1]), torch.ones(1, dtype=torch.float64))


# --- schedule ---


def test_shifted_sigmas_endpoints_and_monotone():
    for shift in (0.3, 1.0, 3.0, 7.5):
        sigmas = shifted_sigmas(20, shift)
        assert sigmas.shape == (21,) and sigmas.dtype == torch.float32
        assert sigmas[0].item() == 1.0 and sigmas[-1].item() == 0.0
        assert torch.all(sigmas[1:] < sigmas[:-1])


def test_shifted_sigmas_linear_and_shift_by_hand():
    torch.testing.assert_close(shifted_sigmas(4), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))
    # shift 3 at linear sigma 0.75: 3 * 0.75 / (1 + 2 * 0.75) = 2.25 / 2.5 = 0.9
    assert shifted_sigmas(4, shift=3.0)[1].item() == pytest.approx(0.9)


def test_shifted_sigmas_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_steps"):
        shifted_sigmas(0)
    with pytest.raises(ValueError, match="shift"):
        shifted_sigmas(10, shift=0.0)


# --- log-probs of the SDE forms ---


@pytest.mark.parametrize("kind", SDE_KINDS)
@pytest.mark.parametrize(("sigma", "sigma_next"), SIGMA_PAIRS)
def test_log_prob_matches_independent_normal_and_recompute_is_exact(kind, sigma, sigma_next):
    _skip_noiseless(kind, sigma_next)
    velocity, x, noise = _inputs()
    drawn = FLOW_STEPS[kind](velocity, x, sigma, sigma_next, noise=noise)
    expected = _reference_log_prob(drawn.prev_sample, drawn.mean, drawn.std)
    torch.testing.assert_close(drawn.log_prob.double(), expected, atol=1e-5, rtol=0)
    assert drawn.log_prob.shape == (LATENT_SHAPE[0],) and drawn.log_prob.dtype == torch.float32
    torch.testing.assert_close(drawn.prev_sample, drawn.mean + drawn.std * noise)

    scored = FLOW_STEPS[kind](velocity, x, sigma, sigma_next, prev_sample=drawn.prev_sample)
    assert torch.equal(scored.log_prob, drawn.log_prob)
    assert torch.all(torch.exp(scored.log_prob - drawn.log_prob) == 1)


@pytest.mark.parametrize("kind", SDE_KINDS)
@pytest.mark.parametrize(("sigma", "sigma_next"), SIGMA_PAIRS)
def test_bf16_inputs_give_fp32_log_probs_and_ratio_one(kind, sigma, sigma_next):
    _skip_noiseless(kind, sigma_next)
    velocity, x, noise = _inputs(dtype=torch.bfloat16)
    step = FLOW_STEPS[kind]
    drawn = step(velocity, x, sigma, sigma_next, noise=noise)
    assert drawn.prev_sample.dtype == torch.bfloat16
    assert drawn.log_prob.dtype == torch.float32 and drawn.mean.dtype == torch.float32
    assert torch.isfinite(drawn.log_prob).all() and torch.isfinite(drawn.prev_sample).all()

    # The same stored bf16 tensors score to the very same log-prob: ratio exactly 1.
    scored = step(velocity, x, sigma, sigma_next, prev_sample=drawn.prev_sample)
    assert torch.equal(scored.log_prob, drawn.log_prob)

    # A training pass that sees the fp32 velocity whose bf16 rounding the rollout used.
    velocity_fp32 = _randn(*LATENT_SHAPE, seed=0)
    assert torch.equal(velocity_fp32.bfloat16(), velocity)
    training = step(velocity_fp32, x, sigma, sigma_next, prev_sample=drawn.prev_sample)
    ratio = torch.exp(training.log_prob - drawn.log_prob)
    assert torch.isfinite(ratio).all()
    assert (ratio - 1).abs().max().item() < BF16_RATIO_TOLERANCE


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_per_sample_sigmas_match_per_row_calls(kind):
    velocity, x, noise = _inputs()
    sigmas = torch.tensor([1.0, 0.7, 0.3, 0.05])
    sigmas_next = torch.tensor([0.95, 0.6, 0.2, 0.0])
    batched = FLOW_STEPS[kind](velocity, x, sigmas, sigmas_next, noise=noise)
    for row in range(len(sigmas)):
        alone = FLOW_STEPS[kind](
            velocity[row : row + 1],
            x[row : row + 1],
            sigmas[row].item(),
            sigmas_next[row].item(),
            noise=noise[row : row + 1],
        )
        torch.testing.assert_close(batched.prev_sample[row : row + 1], alone.prev_sample)
        torch.testing.assert_close(batched.log_prob[row : row + 1], alone.log_prob)


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_recompute_log_prob_is_differentiable_in_velocity(kind):
    velocity, x, noise = _inputs()
    drawn = FLOW_STEPS[kind](velocity, x, 0.6, 0.55, noise=noise)
    velocity = velocity.clone().requires_grad_()
    scored = FLOW_STEPS[kind](velocity, x, 0.6, 0.55, prev_sample=drawn.prev_sample)
    scored.log_prob.sum().backward()
    assert torch.isfinite(velocity.grad).all() and velocity.grad.abs().sum() > 0


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_empirical_moments_match_mean_and_std(kind):
    draws = 20_000
    velocity = _randn(1, 8, seed=3).expand(draws, 8)
    x = _randn(1, 8, seed=4).expand(draws, 8)
    noise = _randn(draws, 8, seed=5)
    out = FLOW_STEPS[kind](velocity, x, 0.6, 0.5, noise=noise)
    std = out.std.item()
    # standard error of the mean is std / sqrt(20000) = 0.007 std: allow about 4 standard errors.
    torch.testing.assert_close(out.prev_sample.mean(dim=0), out.mean[0], atol=0.03 * std, rtol=0)
    torch.testing.assert_close(out.prev_sample.std(dim=0), torch.full((8,), std), atol=0.03 * std, rtol=0)


def test_flow_grpo_formula_by_hand():
    velocity, x, noise = _inputs()
    sigma, sigma_next, a = 0.6, 0.5, 0.7
    dt = sigma_next - sigma
    sig_t = a * math.sqrt(sigma / (1 - sigma))
    mean = x * (1 + sig_t**2 * dt / (2 * sigma)) + velocity * (1 + sig_t**2 * (1 - sigma) / (2 * sigma)) * dt
    out = flow_grpo_step(velocity, x, sigma, sigma_next, noise_level=a, noise=noise)
    torch.testing.assert_close(out.mean, mean)
    assert out.std.item() == pytest.approx(sig_t * math.sqrt(-dt))


def test_flow_grpo_first_step_takes_noise_level_from_step_size():
    velocity, x, noise = _inputs()
    out = flow_grpo_step(velocity, x, 1.0, 0.9, noise_level=0.7, noise=noise)
    # sqrt(sigma / (1 - sigma)) is infinite at sigma = 1: 1 - sigma_next = 0.1 stands in for 1 - sigma.
    assert out.std.item() == pytest.approx(0.7 * math.sqrt(1 / 0.1) * math.sqrt(0.1))
    torch.testing.assert_close(out.mean, x * (1 - 0.49 / 2) - 0.1 * velocity)


def test_flow_grpo_without_noise_is_the_euler_step():
    velocity, x, noise = _inputs()
    for sigma, sigma_next in SIGMA_PAIRS:
        out = flow_grpo_step(velocity, x, sigma, sigma_next, noise_level=0.0, noise=noise)
        torch.testing.assert_close(out.mean, x + (sigma_next - sigma) * velocity)
        assert out.std.item() == 0.0
        assert torch.isfinite(out.log_prob).all()
        torch.testing.assert_close(out.mean, ode_step(velocity, x, sigma, sigma_next))


def test_dance_grpo_formula_by_hand_and_euler_limit():
    velocity, x, noise = _inputs()
    sigma, sigma_next, eta = 0.4, 0.3, 0.3
    dt = sigma_next - sigma
    x0_hat = x - sigma * velocity
    score = -(x - (1 - sigma) * x0_hat) / sigma**2
    out = dance_grpo_step(velocity, x, sigma, sigma_next, eta=eta, noise=noise)
    torch.testing.assert_close(out.mean, x + dt * velocity - 0.5 * eta**2 * score * dt)
    assert out.std.item() == pytest.approx(eta * math.sqrt(-dt))

    no_noise = dance_grpo_step(velocity, x, sigma, sigma_next, eta=0.0, noise=noise)
    torch.testing.assert_close(no_noise.mean, x + dt * velocity)


def test_ode_step_keeps_dtype():
    velocity, x, _ = _inputs(dtype=torch.bfloat16)
    out = ode_step(velocity, x, 0.5, 0.4)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), x.float() - 0.1 * velocity.float(), atol=1e-2, rtol=1e-2)


def test_adams_bashforth2_is_second_order_on_a_known_flow():
    """dx/dsigma = x from sigma 1 to 0 ends at x * e^-1. Half as many second-order steps (the first
    one Euler) land closer than Euler with all of them, and halving their length cuts the error
    about four times (second order), where Euler's only halves."""
    x0 = torch.ones(1, 4)

    def integrate(steps: int, second_order: bool) -> float:
        sigmas = torch.linspace(1.0, 0.0, steps + 1)
        x, previous = x0, None
        for i in range(steps):
            v = x.clone()
            if second_order and previous is not None:
                x_next = adams_bashforth2_step(v, previous[0], x, sigmas[i], sigmas[i + 1], previous[1])
            else:
                x_next = ode_step(v, x, sigmas[i], sigmas[i + 1])
            previous, x = (v, sigmas[i + 1] - sigmas[i]), x_next
        return float((x - x0 * math.exp(-1.0)).abs().max())

    assert integrate(5, True) < integrate(10, False)
    assert integrate(5, True) / integrate(10, True) > 3.0
    assert integrate(5, False) / integrate(10, False) < 2.5


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_degenerate_steps_stay_finite(kind):
    velocity, x, noise = _inputs()
    for sigma, sigma_next in [(1.0, 1.0), (0.0, 0.0), (1.0, 0.0), (0.3, 0.4)]:
        out = FLOW_STEPS[kind](velocity, x, sigma, sigma_next, noise=noise)
        assert torch.isfinite(out.prev_sample).all() and torch.isfinite(out.log_prob).all()


# --- DDIM ---


@pytest.mark.parametrize("clip_sample", [False, True])
def test_ddim_matches_diffusers_scheduler(clip_sample):
    eps, x, noise = _inputs()
    scheduler = DDIMScheduler(set_alpha_to_one=False, clip_sample=clip_sample)
    scheduler.set_timesteps(50)
    timestep, prev_timestep = 801, 781
    expected = scheduler.step(eps, timestep, x, eta=1.0, variance_noise=noise).prev_sample
    alpha_bars = scheduler.alphas_cumprod
    out = ddim_step(
        eps,
        x,
        alpha_bars[timestep].item(),
        alpha_bars[prev_timestep].item(),
        noise=noise,
        clip_sample=clip_sample,
    )
    torch.testing.assert_close(out.prev_sample, expected)


def test_ddim_variance_by_hand_and_log_prob():
    eps, x, noise = _inputs()
    ab_t, ab_prev = 0.3, 0.5
    out = ddim_step(eps, x, ab_t, ab_prev, eta=1.0, noise=noise)
    variance = (1 - ab_prev) / (1 - ab_t) * (1 - ab_t / ab_prev)
    assert out.std.item() == pytest.approx(math.sqrt(variance))
    x0_hat = (x - math.sqrt(1 - ab_t) * eps) / math.sqrt(ab_t)
    torch.testing.assert_close(
        out.mean, math.sqrt(ab_prev) * x0_hat + math.sqrt(1 - ab_prev - variance) * eps
    )
    expected = _reference_log_prob(out.prev_sample, out.mean, out.std)
    torch.testing.assert_close(out.log_prob.double(), expected, atol=1e-5, rtol=0)
    scored = ddim_step(eps, x, ab_t, ab_prev, eta=1.0, prev_sample=out.prev_sample)
    assert torch.equal(scored.log_prob, out.log_prob)


def test_ddim_without_variance_is_deterministic_ddim():
    eps, x, noise = _inputs()
    scheduler = DDIMScheduler(set_alpha_to_one=True, clip_sample=False)
    scheduler.set_timesteps(50)
    # The last step goes to alpha_bar = 1, where the variance vanishes for any eta.
    expected = scheduler.step(eps, 1, x, eta=0.0).prev_sample
    out = ddim_step(eps, x, scheduler.alphas_cumprod[1].item(), 1.0, eta=1.0, noise=noise)
    assert out.std.item() == 0.0
    torch.testing.assert_close(out.mean, expected)
    assert torch.isfinite(out.log_prob).all()


def test_ddim_degenerate_alpha_bars_stay_finite():
    eps, x, noise = _inputs()
    for ab_t, ab_prev in [(1.0, 1.0), (0.0, 0.0), (0.0, 1.0), (0.5, 0.3)]:
        out = ddim_step(eps, x, ab_t, ab_prev, noise=noise)
        assert torch.isfinite(out.prev_sample).all() and torch.isfinite(out.log_prob).all()


def test_ddim_eta_zero_raises():
    eps, x, noise = _inputs()
    with pytest.raises(ValueError, match="eta > 0"):
        ddim_step(eps, x, 0.3, 0.5, eta=0.0, noise=noise)


def test_ddim_bf16_per_sample_alpha_bars():
    eps, x, noise = _inputs(dtype=torch.bfloat16)
    alpha_bars = DDIMScheduler().alphas_cumprod
    ab_t = alpha_bars[torch.tensor([999, 500, 100, 1])]
    ab_prev = alpha_bars[torch.tensor([979, 480, 80, 0])]
    drawn = ddim_step(eps, x, ab_t, ab_prev, noise=noise)
    assert drawn.prev_sample.dtype == torch.bfloat16 and torch.isfinite(drawn.log_prob).all()
    scored = ddim_step(eps, x, ab_t, ab_prev, prev_sample=drawn.prev_sample)
    assert torch.equal(scored.log_prob, drawn.log_prob)


# --- keyed noise replay ---


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_keyed_noise_replays_the_same_sample(kind):
    velocity, x, _ = _inputs()
    keys = [
        NoiseKey(seed=7, step=3, prompt=prompt, node=node, stream=1)
        for prompt, node in [(0, 0), (0, 1), (1, 0), (2, 5)]
    ]
    first = sde_step(kind, velocity, x, 0.8, 0.7, noise=keyed_randn_batch(LATENT_SHAPE[1:], keys))
    again = sde_step(kind, velocity, x, 0.8, 0.7, noise=keyed_randn_batch(LATENT_SHAPE[1:], keys))
    assert torch.equal(first.prev_sample, again.prev_sample)
    assert torch.equal(first.log_prob, again.log_prob)
    # One tree node regenerated alone gives its row of the batch.
    alone = sde_step(kind, velocity[3:], x[3:], 0.8, 0.7, noise=keyed_randn_batch(LATENT_SHAPE[1:], keys[3:]))
    assert torch.equal(alone.prev_sample, first.prev_sample[3:])


# --- dispatch by name ---


def test_sde_step_dispatches_and_passes_the_noise_scale():
    velocity, x, noise = _inputs()
    flow = sde_step("flow_grpo", velocity, x, 0.5, 0.4, noise_scale=0.5, noise=noise)
    torch.testing.assert_close(
        flow.mean, flow_grpo_step(velocity, x, 0.5, 0.4, noise_level=0.5, noise=noise).mean
    )
    dance = sde_step("dance_grpo", velocity, x, 0.5, 0.4, noise=noise)
    assert dance.std.item() == pytest.approx(0.3 * math.sqrt(0.1))  # DanceGRPO's default eta
    with pytest.raises(ValueError, match="flow_grpo, dance_grpo"):
        sde_step("euler", velocity, x, 0.5, 0.4, noise=noise)


# --- BranchGRPO Mix mask ---


def test_sde_step_mask_hand_cases():
    mask = sde_step_mask(20, split_steps=[0, 3, 6, 9], window=(0, 4))
    assert [step for step, is_sde in enumerate(mask) if is_sde] == [0, 1, 2, 3, 6, 9]
    assert sde_step_mask(5) == [True] * 5
    assert sde_step_mask(5, split_steps=[1], window=None) == [True] * 5
    assert sde_step_mask(6, split_steps=[], window=(2, 4)) == [False, False, True, True, False, False]
    assert sde_step_mask(4, split_steps=[3], window=(1, 1)) == [False, False, False, True]


def test_sde_step_mask_rejects_bad_arguments():
    with pytest.raises(ValueError, match="outside"):
        sde_step_mask(10, split_steps=[10])
    with pytest.raises(ValueError, match="window"):
        sde_step_mask(10, window=(5, 11))
    with pytest.raises(ValueError, match="window"):
        sde_step_mask(10, window=(6, 5))


# --- bad inputs ---


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_noise_and_prev_sample_exactly_one(kind):
    velocity, x, noise = _inputs()
    with pytest.raises(ValueError, match="exactly one"):
        FLOW_STEPS[kind](velocity, x, 0.5, 0.4)
    with pytest.raises(ValueError, match="exactly one"):
        FLOW_STEPS[kind](velocity, x, 0.5, 0.4, noise=noise, prev_sample=x)
    with pytest.raises(ValueError, match="exactly one"):
        ddim_step(velocity, x, 0.3, 0.5)


def test_shape_mismatches_name_the_shapes():
    velocity, x, noise = _inputs()
    with pytest.raises(
        ValueError, match=r"velocity has shape \(4, 4, 16, 8\) but x has shape \(4, 4, 16, 16\)"
    ):
        flow_grpo_step(velocity[..., :8], x, 0.5, 0.4, noise=noise)
    with pytest.raises(ValueError, match=r"noise has shape \(2, 4, 16, 16\)"):
        dance_grpo_step(velocity, x, 0.5, 0.4, noise=noise[:2])
    with pytest.raises(ValueError, match=r"prev_sample has shape"):
        ddim_step(velocity, x, 0.3, 0.5, prev_sample=x[:, :2])
    with pytest.raises(ValueError, match=r"sigma must be .* \[4\], got shape \(3,\)"):
        flow_grpo_step(velocity, x, torch.ones(3), 0.4, noise=noise)


def test_negative_noise_scales_are_rejected():
    velocity, x, noise = _inputs()
    with pytest.raises(ValueError, match="noise_level"):
        flow_grpo_step(velocity, x, 0.5, 0.4, noise_level=-0.1, noise=noise)
    with pytest.raises(ValueError, match="eta"):
        dance_grpo_step(velocity, x, 0.5, 0.4, eta=-0.1, noise=noise)


def test_gaussian_log_prob_of_standard_normal_at_mean():
    sample = torch.zeros(3, 5)
    expected = torch.full((3,), -0.5 * math.log(2 * math.pi))
    torch.testing.assert_close(gaussian_log_prob(sample, torch.zeros(3, 5), torch.tensor(1.0)), expected)
