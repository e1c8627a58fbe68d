import math

import pytest
import torch

from mmrl.cli import main
from mmrl.losses import (
    aggregate_loss,
    awr_weights,
    diffusion_nft,
    gaussian_kl_same_std,
    kl_to_reference,
    nft_optimality,
    ppo_clip,
)
from mmrl.registry import LOSSES


def test_registered_losses_and_their_kinds():
    # plain functions, not something train.loss can name
    assert "kl" not in LOSSES and "awr" not in LOSSES and "nft_optimality" not in LOSSES
    assert {name: LOSSES.kind_of(name).name for name in LOSSES.names()} == {
        "ppo_clip": "policy",
        "diffusion_nft": "forward_process",
    }
    assert LOSSES.get("ppo_clip") is ppo_clip and LOSSES.get("diffusion_nft") is diffusion_nft


def test_a_forward_process_loss_in_a_policy_loss_key_is_refused(capsys):
    assert main(["train", "core/tiny_grpo", "train.loss=diffusion_nft"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert (
        "train.loss = 'diffusion_nft' is a forward_process loss "
        "(velocity, old_velocity, x_t, x0, t, optimality), but this trainer needs a policy loss "
        "(logp, old_logp, advantages, mask): choose one of ppo_clip"
    ) in lines[0]


def test_ratio_one_gives_minus_mean_advantage():
    logp = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    advantages = torch.tensor([1.0, -2.0, 0.5, 3.0])
    out = ppo_clip(logp, logp.clone(), advantages)
    assert out.loss.item() == pytest.approx(-advantages.mean().item())
    assert out.metrics["clip_fraction"].item() == 0.0
    assert out.metrics["approx_kl"].item() == pytest.approx(0.0)
    assert out.metrics["ratio_mean"].item() == pytest.approx(1.0)
    assert out.metrics["ratio_max"].item() == pytest.approx(1.0)


# (ratio, advantage, per-element loss, clipped?) with clip_low=0.2, clip_high=0.28
HAND_CASES = [
    (1.5, 1.0, -1.28, True),  # above 1+clip_high, A>0: capped at 1.28
    (1.5, -1.0, 1.5, False),  # above, A<0: pessimistic unclipped term
    (0.5, 1.0, -0.5, False),  # below 1-clip_low, A>0: unclipped
    (0.5, -1.0, 0.8, True),  # below, A<0: capped at 0.8
    (1.1, 2.0, -2.2, False),  # inside the range
    (1.25, 1.0, -1.25, False),  # inside the asymmetric range (would be clipped at 1.2 symmetric)
]


@pytest.mark.parametrize(("ratio", "advantage", "expected", "is_clipped"), HAND_CASES)
def test_clipped_hand_cases_and_gradients(ratio, advantage, expected, is_clipped):
    old_logp = torch.tensor([-1.0])
    logp = (old_logp + math.log(ratio)).requires_grad_()
    out = ppo_clip(logp, old_logp, torch.tensor([advantage]), clip_low=0.2, clip_high=0.28)
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    assert out.metrics["clip_fraction"].item() == float(is_clipped)
    out.loss.backward()
    if is_clipped:
        assert logp.grad.item() == 0.0
    else:
        assert logp.grad.item() == pytest.approx(-advantage * ratio, rel=1e-5)


def test_separate_clip_low_and_high():
    old_logp = torch.zeros(2)
    logp = torch.log(torch.tensor([2.0, 0.1]))
    advantages = torch.tensor([1.0, -1.0])
    # entry 0 is capped at 1 + clip_high, entry 1 at 1 - clip_low
    out = ppo_clip(
        logp, old_logp, advantages, clip_low=0.3, clip_high=0.5, aggregation="sum_norm", norm_length=1
    )
    assert out.loss.item() == pytest.approx((-1.5 + 0.7) / 2)


def test_advantage_clipping():
    logp = torch.zeros(2)
    out = ppo_clip(logp, logp, torch.tensor([10.0, -0.5]), adv_clip=1.0)
    assert out.loss.item() == pytest.approx(-(1.0 - 0.5) / 2)


def test_weights_count_an_element_as_that_many_copies():
    """Integer weights give the loss and the logged means of the batch with each element repeated that
    many times, clipped elements included; a masked element's weight counts for nothing."""
    logp = torch.tensor([0.0, 0.3, -0.2, 0.1])
    old_logp = torch.zeros(4)
    advantages = torch.tensor([1.0, 2.0, -1.0, 0.5])
    weights = torch.tensor([3.0, 1.0, 2.0, 5.0])
    mask = torch.tensor([True, True, True, False])
    out = ppo_clip(logp, old_logp, advantages, mask, clip_low=0.1, clip_high=0.1, weights=weights)
    repeat = torch.tensor([0, 0, 0, 1, 2, 2])
    copies = ppo_clip(logp[repeat], old_logp[repeat], advantages[repeat], clip_low=0.1, clip_high=0.1)
    assert out.loss.item() == pytest.approx(copies.loss.item())
    for name in ("clip_fraction", "approx_kl", "ratio_mean"):
        assert out.metrics[name].item() == pytest.approx(copies.metrics[name].item()), name
    assert out.metrics["clip_fraction"].item() == pytest.approx(3 / 6)  # element 1 once, element 2 twice
    with pytest.raises(ValueError, match="token_mean"):
        ppo_clip(logp, old_logp, advantages, weights=weights, aggregation="sum_norm", norm_length=1)


def test_masked_entries_are_ignored_exactly():
    torch.manual_seed(0)
    logp = torch.randn(3, 5)
    old_logp = logp + 0.1 * torch.randn(3, 5)
    advantages = torch.randn(3)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    for aggregation in ("token_mean", "sequence_mean", "sum_norm"):
        kwargs = {"mask": mask, "aggregation": aggregation, "norm_length": 5}
        reference = ppo_clip(logp, old_logp, advantages, **kwargs)
        scrambled = logp.masked_fill(~mask, 50.0).requires_grad_()
        out = ppo_clip(scrambled, old_logp.masked_fill(~mask, -50.0), advantages, **kwargs)
        assert out.loss.item() == reference.loss.item()
        for key in reference.metrics:
            assert out.metrics[key].item() == pytest.approx(reference.metrics[key].item())
        out.loss.backward()
        assert torch.all(scrambled.grad[~mask] == 0)


def test_aggregations_on_ragged_mask():
    per_token = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    # 5 tokens: (4 + 4) / 5; per sequence: (1 + 4) / 2; fixed length 8: (4 + 4) / (2 * 8)
    assert aggregate_loss(per_token, mask, "token_mean").item() == pytest.approx(8 / 5)
    assert aggregate_loss(per_token, mask, "sequence_mean").item() == pytest.approx(5 / 2)
    assert aggregate_loss(per_token, mask, "sum_norm", norm_length=8).item() == pytest.approx(8 / 16)
    # a fully masked sequence does not count as a sequence
    empty = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    assert aggregate_loss(per_token, empty, "sequence_mean").item() == pytest.approx(1.0)


def test_aggregation_errors():
    values = torch.ones(2, 3)
    with pytest.raises(ValueError, match="token_mean, sequence_mean, sum_norm"):
        aggregate_loss(values, aggregation="mean")
    with pytest.raises(ValueError, match="token_mean, sequence_mean, sum_norm"):
        ppo_clip(values, values, torch.ones(2), aggregation="seq")
    with pytest.raises(ValueError, match="norm_length"):
        aggregate_loss(values, aggregation="sum_norm")


def test_per_sequence_advantages_broadcast_over_tokens():
    logp = torch.zeros(2, 3)
    out = ppo_clip(logp, logp, torch.tensor([1.0, 3.0]))
    assert out.loss.item() == pytest.approx(-2.0)


def test_kl_estimators_zero_when_equal_and_k3_nonnegative():
    logp = torch.randn(100, generator=torch.Generator().manual_seed(0))
    for kind in ("k1", "k2", "k3"):
        assert torch.all(kl_to_reference(logp, logp, kind) == 0)
    ref = torch.randn(100, generator=torch.Generator().manual_seed(1))
    assert torch.all(kl_to_reference(logp, ref, "k3") >= 0)
    assert torch.all(kl_to_reference(logp, ref, "k2") >= 0)
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_to_reference(logp, ref, "k4")


def test_kl_estimators_match_true_kl_on_samples():
    # policy N(0.5, 1), reference N(0, 1): KL = 0.5^2 / 2 = 0.125
    x = 0.5 + torch.randn(200_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    normal = torch.distributions.Normal
    logp, ref_logp = normal(0.5, 1.0).log_prob(x), normal(0.0, 1.0).log_prob(x)
    assert kl_to_reference(logp, ref_logp, "k1").mean().item() == pytest.approx(0.125, abs=0.005)
    assert kl_to_reference(logp, ref_logp, "k3").mean().item() == pytest.approx(0.125, abs=0.005)


def test_gaussian_kl_same_std():
    mean = torch.zeros(2, 2, 2)
    ref_mean = torch.zeros(2, 2, 2)
    ref_mean[0] = 1.0  # every dim off by 1
    ref_mean[1, 0, 0] = 2.0  # one of four dims off by 2
    kl = gaussian_kl_same_std(mean, ref_mean, std=0.5)
    assert kl.tolist() == pytest.approx([1 / (2 * 0.25), (4 / 4) / (2 * 0.25)])
    per_sample_std = torch.tensor([1.0, 2.0]).view(2, 1, 1)
    assert gaussian_kl_same_std(mean, ref_mean, per_sample_std).tolist() == pytest.approx([0.5, 1 / 8])


def test_awr_weights_values_and_clamp():
    advantages = torch.tensor([0.0, 1.0, -2.0, 50.0, 1000.0])  # exp(1000 / 2) overflows to inf: clamped
    weights = awr_weights(advantages, beta=2.0, max_weight=20.0)
    expected = torch.tensor([1.0, math.exp(0.5), math.exp(-1.0), 20.0, 20.0])
    torch.testing.assert_close(weights, expected)
    assert weights.dtype == torch.float32
    # a larger beta flattens the weights; the order of the advantages is kept
    flat = awr_weights(advantages[:3], beta=10.0)
    assert flat[1] > flat[0] > flat[2] and (flat - 1).abs().max() < (weights[:3] - 1).abs().max()


def test_awr_weights_normalize_standardises_over_the_batch():
    normalized = awr_weights(torch.tensor([1.0, 3.0]), beta=1.0, normalize=True, eps=0.0)
    torch.testing.assert_close(normalized, torch.tensor([math.exp(-1.0), math.exp(1.0)]))
    # scale and shift of the advantages do not change normalised weights
    a = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(
        awr_weights(a, normalize=True, eps=0.0), awr_weights(10 * a - 3, normalize=True, eps=0.0)
    )


def test_awr_weights_integer_advantages_become_float():
    assert awr_weights(torch.tensor([0, 1])).tolist() == pytest.approx([1.0, math.e])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_awr_weights_refuse_non_finite_advantages(bad):
    with pytest.raises(ValueError, match="advantages contain NaN or inf"):
        awr_weights(torch.tensor([0.0, bad]))


# DiffusionNFT on two samples of 3 dims, beta = 0.5, scale = 2: v+ = (v + v_old) / 2, v- = (3 v_old - v) / 2.
# sample 0, t = 1/2, r = 3/4: v+ = [1, 2, 1], x0_hat(v+) = x_t - v+/2 = [.5, 0, .5], e+ = [-.5, 0, 1.5]:
#   mean e+^2 = 2.5/3, mean|e+| = 2/3, positive = 1.25; v- = [-1, 2, 3], e- = [.5, 0, .5]:
#   mean e-^2 = .5/3, mean|e-| = 1/3, negative = .5; policy = 2 * (.75 * 1.25 + .25 * .5) / .5 = 4.25
# sample 1, t = 1/4, r = 1/2: v+ = [2, 0, 6], e+ = [.5, -1, .5]: positive = .5 / (2/3) = .75;
#   v- = [6, 0, 2], e- = [-.5, -1, 1.5]: negative = (3.5/3) / 1 = 7/6; policy = 2 * (.75 + 7/6) = 23/6
NFT_CASE = {
    "velocity": [[2.0, 2.0, 0.0], [0.0, 0.0, 8.0]],
    "old_velocity": [[0.0, 2.0, 2.0], [4.0, 0.0, 4.0]],
    "x_t": [[1.0, 1.0, 1.0], [1.0, -1.0, 2.0]],
    "x0": [[1.0, 0.0, -1.0], [0.0, 0.0, 0.0]],
    "t": [0.5, 0.25],
    "optimality": [0.75, 0.5],
}
NFT_LOSS = (4.25 + 23 / 6) / 2


def _nft_inputs(dtype=torch.float64, **changes):
    values = {**NFT_CASE, **changes}
    return {k: v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=dtype) for k, v in values.items()}


def test_diffusion_nft_matches_hand_computed_value():
    out = diffusion_nft(**_nft_inputs(), beta=0.5, scale=2.0)
    assert out.loss.item() == pytest.approx(NFT_LOSS)
    assert set(out.metrics) == {
        "nft_positive_loss",
        "nft_negative_loss",
        "nft_optimality_mean",
        "nft_policy_gap",
    }
    assert out.metrics["nft_positive_loss"].item() == pytest.approx((1.25 + 0.75) / 2)
    assert out.metrics["nft_negative_loss"].item() == pytest.approx((0.5 + 7 / 6) / 2)
    assert out.metrics["nft_optimality_mean"].item() == pytest.approx(0.625)
    # v - v_old = [2, 0, -2], [-4, 0, 4]: (8 + 32) / 6
    assert out.metrics["nft_policy_gap"].item() == pytest.approx(40 / 6)
    assert all(not m.requires_grad and m.dim() == 0 for m in out.metrics.values())


def test_diffusion_nft_reference_penalty_adds_kl_coef_times_mean_squared_velocity_gap():
    # v - v_ref = [0, 0, 1], [0, -3, 0]: per-sample means 1/3 and 3, batch mean 5/3
    reference = torch.tensor([[2.0, 2.0, -1.0], [0.0, 3.0, 8.0]], dtype=torch.float64, requires_grad=True)
    velocity = _nft_inputs()["velocity"].requires_grad_()
    inputs = _nft_inputs(velocity=velocity)
    out = diffusion_nft(**inputs, beta=0.5, scale=2.0, reference_velocity=reference, kl_coef=0.3)
    assert out.loss.item() == pytest.approx(NFT_LOSS + 0.3 * 5 / 3)
    assert out.metrics["nft_velocity_kl"].item() == pytest.approx(5 / 3)
    out.loss.backward()
    assert reference.grad is None  # a constant
    with_penalty = velocity.grad.clone()
    velocity.grad = None
    diffusion_nft(**inputs, beta=0.5, scale=2.0).loss.backward()
    # d/dv of 0.3 * mean over the 6 entries of (v - v_ref)^2
    torch.testing.assert_close(
        with_penalty - velocity.grad, 0.3 * 2 * (velocity.detach() - reference.detach()) / 6
    )
    # reported but not added without kl_coef
    off = diffusion_nft(**_nft_inputs(), beta=0.5, scale=2.0, reference_velocity=reference)
    assert off.loss.item() == pytest.approx(NFT_LOSS)
    assert off.metrics["nft_velocity_kl"].item() == pytest.approx(5 / 3)


def _nft_grad(velocity, old_velocity, optimality, beta=1.0, **kwargs):
    velocity = velocity.clone().requires_grad_()
    inputs = _nft_inputs(velocity=velocity, old_velocity=old_velocity, optimality=optimality)
    diffusion_nft(**inputs, beta=beta, **kwargs).loss.backward()
    return velocity.grad


def test_diffusion_nft_balanced_optimality_gives_no_gradient_at_the_old_policy():
    v = _nft_inputs()["old_velocity"]
    for beta in (0.1, 1.0, 3.0):
        grad = _nft_grad(v, v, torch.tensor([0.5, 0.5], dtype=torch.float64), beta=beta)
        assert grad.abs().max().item() <= 1e-7


def test_diffusion_nft_positive_and_negative_branches():
    inputs = _nft_inputs()
    v, v_old, x_t, x0 = inputs["velocity"], inputs["old_velocity"], inputs["x_t"], inputs["x0"]
    t = inputs["t"][:, None]

    def branch(v_implicit):
        error = x_t - t * v_implicit - x0
        return (error.square().mean(dim=1) / error.abs().mean(dim=1)).mean().item()

    beta, scale = 0.5, 2.0
    ones, zeros = torch.ones(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    positive = branch(beta * v + (1 - beta) * v_old)
    negative = branch((1 + beta) * v_old - beta * v)
    r1 = diffusion_nft(**_nft_inputs(optimality=ones), beta=beta, scale=scale)
    r0 = diffusion_nft(**_nft_inputs(optimality=zeros), beta=beta, scale=scale)
    assert r1.loss.item() == pytest.approx(scale * positive / beta)
    assert r0.loss.item() == pytest.approx(scale * negative / beta)
    assert positive != pytest.approx(negative)
    # at the old policy the two branches pull with equal strength in opposite directions, and the
    # gradient is linear in r: grad(r) = (2r - 1) grad(1)
    g1 = _nft_grad(v_old, v_old, ones)
    g0 = _nft_grad(v_old, v_old, zeros)
    assert g1.abs().sum() > 0
    torch.testing.assert_close(g0, -g1)
    for r in (0.2, 0.9):
        torch.testing.assert_close(
            _nft_grad(v_old, v_old, torch.full((2,), r, dtype=torch.float64)), (2 * r - 1) * g1
        )


@pytest.mark.parametrize("beta", [1.0, 0.3])
def test_diffusion_nft_step_moves_toward_good_and_away_from_bad_samples(beta):
    inputs = _nft_inputs()
    x_t, x0, t = inputs["x_t"], inputs["x0"], inputs["t"][:, None]

    def error(v):
        return (x_t - t * v - x0).square().sum(dim=1)

    v_old = inputs["old_velocity"]  # x0_hat(v_old) misses x0 in both samples
    assert torch.all(error(v_old) > 0)
    for r, closer in ((1.0, True), (0.0, False), (0.9, True), (0.1, False)):
        grad = _nft_grad(v_old, v_old, torch.full((2,), r, dtype=torch.float64), beta=beta)
        stepped = v_old - 0.01 * grad
        assert torch.all((error(stepped) < error(v_old)) == closer), (r, error(stepped), error(v_old))
    # the optimality reversed per sample reverses each sample's direction
    grad = _nft_grad(v_old, v_old, torch.tensor([1.0, 0.0], dtype=torch.float64), beta=beta)
    assert (error(v_old - 0.01 * grad) < error(v_old)).tolist() == [True, False]
    grad = _nft_grad(v_old, v_old, torch.tensor([0.0, 1.0], dtype=torch.float64), beta=beta)
    assert (error(v_old - 0.01 * grad) < error(v_old)).tolist() == [False, True]


def test_diffusion_nft_good_samples_pull_any_velocity_toward_them_at_beta_one():
    # with beta = 1, v+ is v itself: r = 1 is plain (weighted) flow matching on the sample, from anywhere
    inputs = _nft_inputs()
    x_t, x0, t = inputs["x_t"], inputs["x0"], inputs["t"][:, None]
    v, v_old = inputs["velocity"], inputs["old_velocity"]
    grad = _nft_grad(v, v_old, torch.ones(2, dtype=torch.float64), beta=1.0)
    before = (x_t - t * v - x0).square().sum(dim=1)
    after = (x_t - t * (v - 0.01 * grad) - x0).square().sum(dim=1)
    assert torch.all(after < before)


def test_diffusion_nft_gradient_at_the_old_policy_does_not_depend_on_beta():
    # the 1/beta of the loss cancels the beta inside v+ and v-
    v = _nft_inputs()["old_velocity"]
    r = torch.tensor([0.9, 0.2], dtype=torch.float64)
    reference = _nft_grad(v, v, r, beta=1.0)
    for beta in (0.05, 0.5, 4.0):
        torch.testing.assert_close(_nft_grad(v, v, r, beta=beta), reference)
    torch.testing.assert_close(_nft_grad(v, v, r, beta=0.5, scale=3.0), 3.0 * reference)


def test_diffusion_nft_old_velocity_gets_no_gradient():
    old_velocity = _nft_inputs()["old_velocity"].requires_grad_()
    velocity = _nft_inputs()["velocity"].requires_grad_()
    out = diffusion_nft(**_nft_inputs(velocity=velocity, old_velocity=old_velocity), beta=0.5)
    out.loss.backward()
    assert old_velocity.grad is None and velocity.grad.abs().sum() > 0


def test_diffusion_nft_low_precision_inputs_give_a_float32_loss():
    out = diffusion_nft(**_nft_inputs(dtype=torch.bfloat16), beta=0.5, scale=2.0)
    assert out.loss.dtype == torch.float32
    assert out.loss.item() == pytest.approx(NFT_LOSS, rel=1e-2)


def test_diffusion_nft_adaptive_weight_has_a_floor():
    # a sample the policy already reconstructs exactly: error 0 over weight min_weight, not 0 / 0
    x0 = torch.tensor([[1.0, 2.0]])
    v = torch.tensor([[0.5, -1.0]], requires_grad=True)
    x_t = x0 + 0.5 * v.detach()
    out = diffusion_nft(v, v.detach(), x_t, x0, torch.tensor([0.5]), torch.tensor([1.0]))
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert torch.all(v.grad == 0)


@pytest.mark.parametrize(
    ("changes", "options", "match"),
    [
        ({}, {"beta": 0.0}, "beta must be > 0"),
        ({}, {"beta": -1.0}, "beta must be > 0"),
        ({}, {"min_weight": 0.0}, "min_weight must be > 0"),
        ({}, {"kl_coef": -0.1}, "kl_coef must be >= 0"),
        ({"optimality": [0.5, 1.5]}, {}, r"optimality must lie in \[0, 1\]"),
        ({"optimality": [-0.1, 0.5]}, {}, r"optimality must lie in \[0, 1\]"),
        ({"optimality": [float("nan"), 0.5]}, {}, r"optimality must lie in \[0, 1\]"),
        ({"optimality": [0.5, 0.5, 0.5]}, {}, r"optimality must have shape \(2,\) .* got \(3,\)"),
        ({"t": [[0.5], [0.5]]}, {}, r"t must have shape \(2,\) for velocity \(2, 3\), got \(2, 1\)"),
        ({"x0": [[1.0, 0.0], [0.0, 0.0]]}, {}, r"x0 has shape \(2, 2\), velocity has \(2, 3\)"),
        ({"old_velocity": [[0.0] * 3] * 3}, {}, r"old_velocity has shape \(3, 3\)"),
        ({}, {"reference_velocity": torch.zeros(2, 4)}, r"reference_velocity has shape \(2, 4\)"),
    ],
)
def test_diffusion_nft_refuses_bad_arguments(changes, options, match):
    with pytest.raises(ValueError, match=match):
        diffusion_nft(**_nft_inputs(**changes), **options)


def test_nft_optimality_maps_clipped_advantages_to_unit_interval():
    clip = 2.5
    advantages = torch.tensor([-clip, 0.0, clip, 10 * clip, -10 * clip, clip / 2])
    assert nft_optimality(advantages, clip).tolist() == pytest.approx([0.0, 0.5, 1.0, 1.0, 0.0, 0.75])
    assert nft_optimality(torch.tensor([0, 1]), 1.0).tolist() == pytest.approx([0.5, 1.0])


@pytest.mark.parametrize("clip", [0.0, -1.0])
def test_nft_optimality_refuses_a_non_positive_clip(clip):
    with pytest.raises(ValueError, match="clip must be > 0"):
        nft_optimality(torch.zeros(2), clip)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nft_optimality_refuses_non_finite_advantages(bad):
    with pytest.raises(ValueError, match="advantages contain NaN or inf"):
        nft_optimality(torch.tensor([0.0, bad]), 1.0)
