import math

import pytest
import torch

from mmrl.losses import aggregate_loss, awr_weights, gaussian_kl_same_std, kl_to_reference, ppo_clip
from mmrl.registry import LOSSES


def test_only_policy_losses_are_registered():
    assert "kl" not in LOSSES and "awr" not in LOSSES  # plain functions, not something train.loss can name
    assert all(LOSSES.kind_of(name).name == "policy" for name in LOSSES.names())
    assert LOSSES.get("ppo_clip") is ppo_clip and LOSSES.kind_of("ppo_clip").name == "policy"


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
