import json

import pytest
import torch

from mmrl.registry import SAMPLERS
from mmrl.samplers import (
    BetaThompsonSampler,
    DynamicFilterSampler,
    UniformSampler,
    group_success_counts,
    keep_groups,
)

SAMPLER_NAMES = ["uniform", "dynamic_filter", "beta_thompson"]


def test_registered_names():
    assert set(SAMPLER_NAMES) <= set(SAMPLERS.names())


def _feed_back(sampler, indices):
    """Fake group outcomes: 4 rollouts per item, item i succeeds in (i % 5) of them."""
    rewards = torch.tensor([float(k < i % 5) for i in indices for k in range(4)])
    group_ids = torch.arange(len(indices)).repeat_interleave(4)
    sampler.update(indices, rewards, group_ids)


@pytest.mark.parametrize("name", SAMPLER_NAMES)
def test_same_seed_same_sequence(name):
    first, second, other = (SAMPLERS.get(name)(20, seed=seed) for seed in (3, 3, 4))
    draws = []
    for sampler in (first, second, other):
        drawn = []
        for _ in range(5):
            indices = sampler.sample(6)
            _feed_back(sampler, indices)
            drawn.append(indices)
        draws.append(drawn)
    assert draws[0] == draws[1]
    assert draws[0] != draws[2]


@pytest.mark.parametrize("name", SAMPLER_NAMES)
def test_state_dict_round_trip_continues_identically(name):
    sampler = SAMPLERS.get(name)(13, seed=7)
    for _ in range(3):
        _feed_back(sampler, sampler.sample(5))
    state = sampler.state_dict()

    # what the checkpoint writer does: tensors to safetensors, the rest to JSON
    assert set(sampler.TENSOR_KEYS) == {k for k, v in state.items() if isinstance(v, torch.Tensor)}
    assert state["generator_state"].dtype == torch.uint8
    json_part = json.loads(json.dumps({k: v for k, v in state.items() if k not in sampler.TENSOR_KEYS}))
    restored_state = {**json_part, **{k: state[k].clone() for k in sampler.TENSOR_KEYS}}

    expected = []
    for _ in range(4):
        indices = sampler.sample(5)
        _feed_back(sampler, indices)
        expected.append(indices)

    torch.manual_seed(12345)  # the global RNG must not matter
    resumed = SAMPLERS.get(name)(13, seed=999)
    resumed.load_state_dict(restored_state)
    got = []
    for _ in range(4):
        indices = resumed.sample(5)
        _feed_back(resumed, indices)
        got.append(indices)
    assert got == expected


def test_load_state_dict_rejects_other_dataset_size():
    state = UniformSampler(10).state_dict()
    with pytest.raises(ValueError, match="10 items"):
        UniformSampler(11).load_state_dict(state)


def test_uniform_covers_every_item_once_per_epoch():
    sampler = UniformSampler(10, seed=0)
    drawn = sampler.sample(7) + sampler.sample(7) + sampler.sample(16)  # crosses epoch boundaries
    for epoch in range(3):
        assert sorted(drawn[10 * epoch : 10 * (epoch + 1)]) == list(range(10))
    assert sampler.epoch == 2
    assert drawn[:10] != drawn[10:20]  # a fresh permutation each epoch


def test_sampling_leaves_global_rng_alone():
    before = torch.get_rng_state()
    UniformSampler(10, seed=0).sample(25)
    thompson = BetaThompsonSampler(10, seed=0)
    thompson.sample(5)
    assert torch.equal(before, torch.get_rng_state())


def test_group_success_counts():
    rewards = torch.tensor([1.0, 0.0, 0.7, 0.2, 0.9])
    group_ids = torch.tensor([0, 0, 1, 1, 1])
    successes, rollouts = group_success_counts(rewards, group_ids, success_threshold=0.5, num_groups=3)
    assert successes.tolist() == [1.0, 2.0, 0.0]
    assert rollouts.tolist() == [2.0, 3.0, 0.0]


def test_keep_groups_hand_cases():
    rewards = torch.tensor(
        [1.0, 1.0, 1.0]  # group 0: all equal (all correct)      -> drop
        + [0.0, 0.0, 0.0]  # group 1: all equal (all wrong)      -> drop
        + [1.0, 0.0, 0.0]  # group 2: success 1/3               -> keep
        + [1.0, 1.0, 0.0]  # group 3: success 2/3               -> keep
        + [0.3, 0.1, 0.2]  # group 4: varied, success 0          -> keep only if lo == 0
    )
    group_ids = torch.arange(5).repeat_interleave(3)
    assert keep_groups(rewards, group_ids).tolist() == [False, False, True, True, True]
    assert keep_groups(rewards, group_ids, lo=0.1, hi=0.5).tolist() == [False, False, True, False, False]
    assert keep_groups(rewards, group_ids, success_threshold=0.25).tolist() == [
        False,
        False,
        True,
        True,
        True,
    ]
    # an empty group (no rollouts) gives no signal
    assert keep_groups(rewards, group_ids, num_groups=6).tolist()[-1] is False


def test_dynamic_filter_counts_drops():
    sampler = DynamicFilterSampler(8, seed=0, lo=0.0, hi=1.0)
    indices = sampler.sample(3)
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    keep = sampler.update(indices, rewards, torch.tensor([0, 0, 1, 1, 2, 2]))
    assert keep.tolist() == [False, True, False]
    assert (sampler.groups_seen, sampler.groups_dropped) == (3, 2)


def test_beta_update_matches_formula():
    sampler = BetaThompsonSampler(3, alpha0=2.0, beta0=1.0, prior_decay=0.5)
    sampler.alpha = torch.tensor([4.0, 6.0, 1.0], dtype=torch.float64)
    sampler.beta = torch.tensor([3.0, 2.0, 5.0], dtype=torch.float64)
    # item 0: 3 of 4 succeed; item 2: 0 of 2; item 1 not rolled out
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    keep = sampler.update([0, 2], rewards, torch.tensor([0, 0, 0, 0, 1, 1]))
    assert keep.tolist() == [True, True]
    # alpha = 0.5*alpha + 0.5*2 + s*n ; beta = 0.5*beta + 0.5*1 + (1-s)*n
    assert sampler.alpha.tolist() == [0.5 * 4 + 1 + 3, 6.0, 0.5 * 1 + 1 + 0]
    assert sampler.beta.tolist() == [0.5 * 3 + 0.5 + 1, 2.0, 0.5 * 5 + 0.5 + 2]


def test_beta_draws_have_the_right_mean():
    sampler = BetaThompsonSampler(20_000, seed=0)
    sampler.alpha[:] = 2.0
    sampler.beta[:] = 6.0
    draws = sampler.draw_success_probabilities()
    assert draws.mean().item() == pytest.approx(0.25, abs=0.005)
    assert draws.var().item() == pytest.approx(2 * 6 / (8**2 * 9), rel=0.05)


def test_thompson_prefers_uncertain_items():
    sampler = BetaThompsonSampler(3, seed=0)
    sampler.alpha = torch.tensor([50.0, 99.0, 1.0], dtype=torch.float64)
    sampler.beta = torch.tensor([50.0, 1.0, 99.0], dtype=torch.float64)
    picks = torch.bincount(torch.tensor([sampler.sample(1)[0] for _ in range(300)]), minlength=3)
    assert picks[0] >= 295


def test_thompson_cannot_pick_more_than_the_dataset():
    with pytest.raises(ValueError, match="distinct"):
        BetaThompsonSampler(3).sample(4)
