"""Denoising steps with log-probabilities, for GRPO on flow-matching and DDIM diffusion models.

Pure functions on batch-first latents `[B, ...]`. Every step works in float32 whatever the input
dtype: bf16 latents and velocities are cast up, the mean, std and log-density are computed in
float32, the new sample is returned in the dtype of `x` and log-probs always in float32. The
log-prob is that of the sample *as returned* (after the cast to `x.dtype`), so scoring the stored
sample again with `prev_sample=` and the same inputs reproduces it bit for bit: importance ratios
are exactly 1 before the first update, in bf16 too.

DDPM/DDIM (variance-preserving) models run in the same flow coordinates: x_vp = c * x_flow with
alpha_bar = (1 - sigma)^2 / ((1 - sigma)^2 + sigma^2) and c = 1 / sqrt((1 - sigma)^2 + sigma^2)
(`flow_to_vp`), an exact change of variables under which DDIM with eta = 0 is the Euler step.

A step either draws (`noise=` given: sample = mean + std * noise) or scores (`prev_sample=` given:
the training-time recompute); exactly one of the two. Timesteps (`sigma`, `alpha_bar`) are python
floats or per-sample `[B]` tensors.

Numerical guards, so that finite inputs never give NaN:
- quantities that divide (1 - sigma in Flow-GRPO, sigma in the DanceGRPO score, 1 - ab_t, ab_prev
  and sqrt(ab_t) in DDIM) are clamped to at least `DENOMINATOR_EPS` = 1e-4, which only changes
  steps whose values lie closer than that to the singular endpoint;
- at sigma = 1 the Flow-GRPO noise level sqrt(sigma / (1 - sigma)) is infinite; like the Flow-GRPO
  reference, 1 - sigma_next (the step's own size) is used there instead;
- square roots see their argument clamped at 0 (e.g. sigma_next > sigma gives std 0, not NaN);
- the log-density floors std at `MIN_STD` = 1e-6, so a step without noise has a finite (but
  meaningless) log-prob. Do not train such steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

DENOMINATOR_EPS = 1e-4
MIN_STD = 1e-6
SDE_KINDS = ("flow_grpo", "dance_grpo", "ddim")

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)

Timestep = float | Tensor  # a python float, a 0-d tensor, or one value per sample [B]


class StepOutput(NamedTuple):
    prev_sample: Tensor  # x_{i+1}, in the dtype of x
    log_prob: Tensor  # [B] float32: mean (not sum) over non-batch dims of the Gaussian log-density
    mean: Tensor  # float32 transition mean, shaped like x (for the KL to a reference policy)
    std: Tensor  # float32, 0-d or [B, 1, ..., 1]: broadcasts against x


def shifted_sigmas(num_steps: int, shift: float = 1.0, device: torch.device | str | None = None) -> Tensor:
    """The flow-matching schedule: num_steps + 1 sigmas from 1 down to 0, linear then shifted by s as
    s * sig / (1 + (s - 1) * sig). s > 1 spends more steps at high noise (SD3 uses 3)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    linear = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64, device=device)
    shifted = shift * linear / (1 + (shift - 1) * linear)  # in float64 so the endpoints land on 1 and 0
    return shifted.to(torch.float32)


def gaussian_log_prob(sample: Tensor, mean: Tensor, std: Tensor | float) -> Tensor:
    """[B] float32 log N(sample; mean, std^2), averaged (not summed) over the non-batch dims as in
    Flow-GRPO and DanceGRPO. std is floored at MIN_STD so a zero-noise step stays finite."""
    sample, mean = sample.float(), mean.float()
    std = torch.as_tensor(std, dtype=torch.float32, device=mean.device).clamp_min(MIN_STD)
    log_density = -((sample - mean) ** 2) / (2 * std**2) - std.log() - _HALF_LOG_2PI
    return log_density.reshape(sample.shape[0], -1).mean(dim=1)


def ode_step(velocity: Tensor, x: Tensor, sigma: Timestep, sigma_next: Timestep) -> Tensor:
    """Deterministic Euler flow step x + (sigma_next - sigma) * v, in the dtype of x (no log-prob)."""
    _check_shapes(x, velocity=velocity)
    dt = _per_sample(sigma_next, x, "sigma_next") - _per_sample(sigma, x, "sigma")
    return (x.float() + dt * velocity.float()).to(x.dtype)


def adams_bashforth2_step(
    velocity: Tensor,
    prev_velocity: Tensor,
    x: Tensor,
    sigma: Timestep,
    sigma_next: Timestep,
    prev_dt: Timestep,
) -> Tensor:
    """Second-order multistep flow step: extrapolates the velocity from this and the previous
    evaluation (taken `prev_dt` earlier, in sigma), so a long ODE stretch can take steps twice as long
    for one model evaluation each at an error comparable to Euler's (MixGRPO-Flash's idea)."""
    _check_shapes(x, velocity=velocity, prev_velocity=prev_velocity)
    dt = _per_sample(sigma_next, x, "sigma_next") - _per_sample(sigma, x, "sigma")
    ratio = dt / _per_sample(prev_dt, x, "prev_dt")
    slope = (1 + ratio / 2) * velocity.float() - (ratio / 2) * prev_velocity.float()
    return (x.float() + dt * slope).to(x.dtype)


def flow_grpo_step(
    velocity: Tensor,
    x: Tensor,
    sigma: Timestep,
    sigma_next: Timestep,
    *,
    noise_level: float = 0.7,
    noise: Tensor | None = None,
    prev_sample: Tensor | None = None,
) -> StepOutput:
    """Flow-GRPO's SDE step, which keeps the ODE's marginals while adding noise of level a:
    sig_t = a * sqrt(sigma / (1 - sigma)), dt = sigma_next - sigma < 0,
    mean = x * (1 + sig_t^2 * dt / (2 sigma)) + v * (1 + sig_t^2 * (1 - sigma) / (2 sigma)) * dt,
    std = sig_t * sqrt(-dt). a = 0 gives the Euler step (and std 0)."""
    if noise_level < 0:
        raise ValueError(f"noise_level must be >= 0, got {noise_level}")
    _check_shapes(x, velocity=velocity, noise=noise, prev_sample=prev_sample)
    _check_one_of(noise, prev_sample)
    sigma_t = _per_sample(sigma, x, "sigma")
    sigma_n = _per_sample(sigma_next, x, "sigma_next")
    dt = sigma_n - sigma_t
    # At sigma = 1, 1 - sigma_next stands in for 1 - sigma (Flow-GRPO's choice, see the module docstring).
    one_minus_sigma = torch.where(sigma_t >= 1, 1 - sigma_n, 1 - sigma_t).clamp_min(DENOMINATOR_EPS)
    # sig_t^2 / sigma = a^2 / (1 - sigma): written this way nothing divides by sigma.
    noise_var_over_sigma = noise_level**2 / one_minus_sigma
    x_coef = 1 + noise_var_over_sigma * dt / 2
    v_coef = (1 + noise_var_over_sigma * (1 - sigma_t) / 2) * dt
    mean = x.float() * x_coef + velocity.float() * v_coef
    std = _safe_sqrt(noise_var_over_sigma * sigma_t) * _safe_sqrt(-dt)
    return _finish_step(x, mean, std, noise, prev_sample)


def dance_grpo_step(
    velocity: Tensor,
    x: Tensor,
    sigma: Timestep,
    sigma_next: Timestep,
    *,
    eta: float = 0.3,
    noise: Tensor | None = None,
    prev_sample: Tensor | None = None,
) -> StepOutput:
    """DanceGRPO's SDE step: the same reverse SDE as Flow-GRPO but with a constant diffusion eta.
    x0_hat = x - sigma * v, score = -(x - (1 - sigma) * x0_hat) / sigma^2,
    mean = x + dt * v - 0.5 * eta^2 * score * dt, std = eta * sqrt(-dt). eta = 0 gives the Euler step."""
    if eta < 0:
        raise ValueError(f"eta must be >= 0, got {eta}")
    _check_shapes(x, velocity=velocity, noise=noise, prev_sample=prev_sample)
    _check_one_of(noise, prev_sample)
    sigma_t = _per_sample(sigma, x, "sigma")
    dt = _per_sample(sigma_next, x, "sigma_next") - sigma_t
    x32, v32 = x.float(), velocity.float()
    # x - (1 - sigma) * x0_hat = sigma * (x + (1 - sigma) * v): one division by sigma instead of sigma^2
    # and no cancellation between two nearly equal terms at small sigma.
    score = -(x32 + (1 - sigma_t) * v32) / sigma_t.clamp_min(DENOMINATOR_EPS)
    mean = x32 + dt * v32 - 0.5 * eta**2 * score * dt
    std = eta * _safe_sqrt(-dt)
    return _finish_step(x, mean, std, noise, prev_sample)


def ddim_step(
    eps: Tensor,
    x: Tensor,
    alpha_bar_t: Timestep,
    alpha_bar_prev: Timestep,
    *,
    eta: float = 1.0,
    clip_sample: bool = False,
    noise: Tensor | None = None,
    prev_sample: Tensor | None = None,
) -> StepOutput:
    """DDPO's stochastic DDIM step for epsilon-prediction UNets (as diffusers' DDIMScheduler.step):
    x0_hat = (x - sqrt(1 - ab_t) * eps) / sqrt(ab_t), optionally clipped to [-1, 1];
    std^2 = eta^2 * (1 - ab_prev) / (1 - ab_t) * (1 - ab_t / ab_prev);
    mean = sqrt(ab_prev) * x0_hat + sqrt(1 - ab_prev - std^2) * eps."""
    if eta <= 0:
        raise ValueError(
            f"ddim_step needs eta > 0 (got {eta}): with eta = 0 the step is deterministic and has no "
            "log-prob; use eta > 0 for every step that is trained"
        )
    _check_shapes(x, eps=eps, noise=noise, prev_sample=prev_sample)
    _check_one_of(noise, prev_sample)
    ab_t = _per_sample(alpha_bar_t, x, "alpha_bar_t")
    ab_prev = _per_sample(alpha_bar_prev, x, "alpha_bar_prev")
    x32, eps32 = x.float(), eps.float()
    x0_hat = (x32 - _safe_sqrt(1 - ab_t) * eps32) / _safe_sqrt(ab_t).clamp_min(DENOMINATOR_EPS)
    if clip_sample:
        x0_hat = x0_hat.clamp(-1, 1)
    mean, std = _ddim_mean_std(x0_hat, eps32, ab_t, ab_prev, eta)
    return _finish_step(x, mean, std, noise, prev_sample)


def flow_to_vp(sigma: Tensor) -> tuple[Tensor, Tensor]:
    """(alpha_bar, c): the VP noise level and scale with x_vp = c * x_flow at flow noise level sigma."""
    norm = (1 - sigma) ** 2 + sigma**2
    return (1 - sigma) ** 2 / norm, norm.rsqrt()


def initial_noise_std(sigma: Tensor) -> Tensor:
    """Std of the pure-noise start at noise level sigma in flow coordinates: 1 at sigma = 1 (flow
    models); a VP model starts from x_T ~ N(0, I), which is N(0, 1/c^2) in flow coordinates."""
    return flow_to_vp(sigma)[1].reciprocal()


def ddim_flow_step(
    velocity: Tensor,
    x: Tensor,
    sigma: Timestep,
    sigma_next: Timestep,
    *,
    eta: float = 1.0,
    noise: Tensor | None = None,
    prev_sample: Tensor | None = None,
) -> StepOutput:
    """`ddim_step` for a model in flow coordinates: x0_hat = x - sigma * v and eps = x + (1 - sigma) * v
    (exact at sigma = 1, where the VP form divides by sqrt(alpha_bar) = 0); the VP mean and std are
    mapped back with x_flow = x_vp / c_next. A step to sigma_next = 0 has no noise."""
    if eta <= 0:
        raise ValueError(f"ddim needs eta > 0 (got {eta}): with eta = 0 the step has no log-prob")
    _check_shapes(x, velocity=velocity, noise=noise, prev_sample=prev_sample)
    _check_one_of(noise, prev_sample)
    sigma_t = _per_sample(sigma, x, "sigma")
    sigma_n = _per_sample(sigma_next, x, "sigma_next")
    x32, v32 = x.float(), velocity.float()
    ab_t, _ = flow_to_vp(sigma_t)
    ab_prev, c_next = flow_to_vp(sigma_n)
    mean, std = _ddim_mean_std(x32 - sigma_t * v32, x32 + (1 - sigma_t) * v32, ab_t, ab_prev, eta)
    return _finish_step(x, mean / c_next, std / c_next, noise, prev_sample)


def _ddim_mean_std(
    x0_hat: Tensor, eps: Tensor, ab_t: Tensor, ab_prev: Tensor, eta: float
) -> tuple[Tensor, Tensor]:
    variance = (1 - ab_prev) / (1 - ab_t).clamp_min(DENOMINATOR_EPS)
    variance = variance * (1 - ab_t / ab_prev.clamp_min(DENOMINATOR_EPS))
    std = eta * _safe_sqrt(variance)
    mean = _safe_sqrt(ab_prev) * x0_hat + _safe_sqrt(1 - ab_prev - std**2) * eps
    return mean, std


def sde_step(
    kind: str,
    velocity: Tensor,
    x: Tensor,
    sigma: Timestep,
    sigma_next: Timestep,
    *,
    noise_scale: float | None = None,
    noise: Tensor | None = None,
    prev_sample: Tensor | None = None,
) -> StepOutput:
    """The flow SDE step named by `kind` (a config string). noise_scale is the form's own knob:
    noise_level a for "flow_grpo", eta for "dance_grpo" and "ddim"; None keeps that form's default."""
    if kind == "flow_grpo":
        scale = {} if noise_scale is None else {"noise_level": noise_scale}
        return flow_grpo_step(velocity, x, sigma, sigma_next, noise=noise, prev_sample=prev_sample, **scale)
    if kind == "dance_grpo":
        scale = {} if noise_scale is None else {"eta": noise_scale}
        return dance_grpo_step(velocity, x, sigma, sigma_next, noise=noise, prev_sample=prev_sample, **scale)
    if kind == "ddim":
        scale = {} if noise_scale is None else {"eta": noise_scale}
        return ddim_flow_step(velocity, x, sigma, sigma_next, noise=noise, prev_sample=prev_sample, **scale)
    raise ValueError(f"unknown SDE kind {kind!r}: choose one of {', '.join(SDE_KINDS)}")


def sde_step_mask(
    num_steps: int, split_steps: Sequence[int] = (), window: tuple[int, int] | None = None
) -> list[bool]:
    """Which denoising steps are stochastic (True: SDE with log-prob) and which deterministic (False:
    ODE) in BranchGRPO's Mix variant: steps inside the window [start, end) and the split steps.
    window=None means the whole trajectory, i.e. every step is an SDE step (plain GRPO)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    bad_splits = [step for step in split_steps if not 0 <= step < num_steps]
    if bad_splits:
        raise ValueError(f"split steps {bad_splits} are outside [0, {num_steps})")
    start, end = (0, num_steps) if window is None else window
    if not 0 <= start <= end <= num_steps:
        raise ValueError(f"window {window} must satisfy 0 <= start <= end <= num_steps = {num_steps}")
    splits = set(split_steps)
    return [start <= step < end or step in splits for step in range(num_steps)]


def _per_sample(value: Timestep, x: Tensor, name: str) -> Tensor:
    """A timestep as float32 on x's device, shaped to broadcast against x ([B, 1, ..., 1] if per sample)."""
    if not isinstance(value, Tensor):
        return torch.tensor(float(value), dtype=torch.float32, device=x.device)
    value = value.to(device=x.device, dtype=torch.float32)
    if value.ndim == 0:
        return value
    if value.shape != (x.shape[0],):
        raise ValueError(
            f"{name} must be a float, a 0-d tensor or one value per sample [{x.shape[0]}], "
            f"got shape {tuple(value.shape)}"
        )
    return value.reshape(-1, *([1] * (x.ndim - 1)))


def _check_shapes(x: Tensor, **others: Tensor | None) -> None:
    if x.ndim < 1:
        raise ValueError("x must be batch first, [B, ...]; got a 0-d tensor")
    for name, tensor in others.items():
        if tensor is not None and tensor.shape != x.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)} but x has shape {tuple(x.shape)}")


def _check_one_of(noise: Tensor | None, prev_sample: Tensor | None) -> None:
    if (noise is None) == (prev_sample is None):
        raise ValueError(
            "pass exactly one of noise= (draw a new sample) or prev_sample= (score a stored sample)"
        )


def _safe_sqrt(value: Tensor) -> Tensor:
    return value.clamp_min(0).sqrt()


def _finish_step(
    x: Tensor, mean: Tensor, std: Tensor, noise: Tensor | None, prev_sample: Tensor | None
) -> StepOutput:
    """Draw the sample (cast to x's dtype) or take the given one, and score it. The sample counts as
    data: gradients reach the log-prob through mean and std only."""
    if noise is not None:
        prev_sample = (mean + std * noise.float()).to(x.dtype)
    log_prob = gaussian_log_prob(prev_sample.detach(), mean, std)
    return StepOutput(prev_sample=prev_sample, log_prob=log_prob, mean=mean, std=std)
