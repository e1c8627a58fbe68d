import hashlib

import numpy as np
import pytest
import torch

from mmrl.noise import NoiseKey, keyed_rand_batch, keyed_randn_batch, noise_seed

KEY = dict(seed=7, step=3, prompt=11, node=5)


def keyed_randn(shape, dtype=torch.float32, **fields):
    """The draw of one key."""
    return keyed_randn_batch(shape, [NoiseKey(**fields)], dtype=dtype)[0]


def keyed_rand(shape, **fields):
    return keyed_rand_batch(shape, [NoiseKey(**fields)])[0]


def test_noise_seed_is_blake2b_of_the_fields_and_pinned():
    # The derivation is part of a run's on-disk format: changing it breaks replays of saved runs.
    fields = (1, 2, 3, 4, 0)
    packed = b"".join(value.to_bytes(8, "little") for value in fields)
    digest = hashlib.blake2b(packed, digest_size=8).digest()
    assert noise_seed(*fields) == int.from_bytes(digest, "little") >> 1
    assert noise_seed(0, 0, 0, 0) == 7712375960500741298
    assert noise_seed(1, 2, 3, 4) == 4715540608313698598
    assert noise_seed(2**64 - 1, 0, 0, 0, stream=5) == 2146062244920740380
    assert noise_seed(1, 2, 3, 4, stream=0) == NoiseKey(1, 2, 3, 4).seed_int()
    seeds = [noise_seed(s, 0, 0, 0) for s in range(1000)]
    assert all(0 <= s < 2**63 for s in seeds)
    assert len(set(seeds)) == 1000


def test_noise_seed_field_order_and_every_field_matter():
    assert noise_seed(1, 2, 0, 0) != noise_seed(2, 1, 0, 0)
    assert noise_seed(0, 0, 1, 2) != noise_seed(0, 0, 2, 1)
    base = NoiseKey(1, 2, 3, 4, 5)
    changed = [NoiseKey(9, 2, 3, 4, 5), NoiseKey(1, 9, 3, 4, 5), NoiseKey(1, 2, 9, 4, 5)]
    changed += [NoiseKey(1, 2, 3, 9, 5), NoiseKey(1, 2, 3, 4, 9)]
    assert len({k.seed_int() for k in [base, *changed]}) == 6


@pytest.mark.parametrize(
    "fields",
    [(-1, 0, 0, 0, 0), (0, 1.5, 0, 0, 0), (0, 0, "3", 0, 0), (0, 0, 0, True, 0), (0, 0, 0, 0, 2**64)],
)
def test_bad_fields_raise_value_error_naming_the_field(fields):
    names = ["seed", "step", "prompt", "node", "stream"]
    bad = next(name for name, value in zip(names, fields, strict=True) if value != 0)
    with pytest.raises(ValueError, match=f"noise key field '{bad}' must be an int"):
        noise_seed(*fields)
    with pytest.raises(ValueError, match=bad):
        keyed_randn((2,), **dict(zip(names, fields, strict=True)))


def test_numpy_integers_are_accepted_as_plain_ints():
    key = NoiseKey(np.int64(1), np.int32(2), 3, 4)
    assert key == NoiseKey(1, 2, 3, 4)
    assert type(key.seed) is int


def test_same_key_gives_bit_identical_draws_regardless_of_history():
    first = keyed_randn((4, 8, 8), **KEY)
    torch.randn(100)  # global RNG use must not matter
    keyed_randn((3,), seed=1, step=1, prompt=1, node=1)  # nor other keyed draws in between
    assert torch.equal(first, keyed_randn((4, 8, 8), **KEY))
    assert torch.equal(keyed_rand(100, **KEY), keyed_rand(100, **KEY))


@pytest.mark.parametrize("field", ["seed", "step", "prompt", "node", "stream"])
def test_changing_any_field_changes_the_draw(field):
    key = dict(KEY, stream=0)
    other = dict(key, **{field: key[field] + 1})
    assert not torch.equal(keyed_randn(64, **key), keyed_randn(64, **other))
    assert not torch.equal(keyed_rand(64, **key), keyed_rand(64, **other))


def test_normal_and_uniform_draws_of_a_key_are_different_distributions():
    normal, uniform = keyed_randn(1000, **KEY), keyed_rand(1000, **KEY)
    assert normal.min() < 0
    assert uniform.min() >= 0 and uniform.max() < 1


@pytest.mark.parametrize(
    ("batch_draw", "single_draw"), [(keyed_randn_batch, keyed_randn), (keyed_rand_batch, keyed_rand)]
)
def test_batch_row_equals_the_draw_of_its_key_alone(batch_draw, single_draw):
    keys = [
        NoiseKey(7, 3, prompt, node, stream=position)
        for prompt in range(2)
        for node in range(5)
        for position in range(2)
    ]
    batch = batch_draw((4, 6, 6), keys)
    assert batch.shape == (20, 4, 6, 6)
    for row, key in zip(batch, keys, strict=True):
        single = single_draw(
            (4, 6, 6), seed=key.seed, step=key.step, prompt=key.prompt, node=key.node, stream=key.stream
        )
        assert torch.equal(row, single)
    assert torch.equal(batch_draw((4, 6, 6), keys[3:4])[0], batch[3])
    assert batch_draw(5, []).shape == (0, 5)


def test_dtype_cast_agrees_with_float32_draw():
    fp32 = keyed_randn((8, 16), **KEY)
    bf16 = keyed_randn((8, 16), **KEY, dtype=torch.bfloat16)
    fp64 = keyed_randn((8, 16), **KEY, dtype=torch.float64)
    assert bf16.dtype == torch.bfloat16 and fp64.dtype == torch.float64
    assert torch.equal(bf16, fp32.to(torch.bfloat16))
    assert torch.equal(fp64, fp32.double())
    batch = keyed_randn_batch((8, 16), [NoiseKey(**KEY)], dtype=torch.bfloat16)
    assert torch.equal(batch[0], bf16)


def test_statistics_of_draws():
    normal = keyed_randn(100_000, **KEY).double()
    # Standard errors: mean 0.0032, std 0.0022; tolerances are about 6 sigma.
    assert abs(normal.mean().item()) < 0.02
    assert abs(normal.std().item() - 1) < 0.015
    uniform = keyed_rand(100_000, **KEY).double()
    assert abs(uniform.mean().item() - 0.5) < 0.006
    assert abs(uniform.var().item() - 1 / 12) < 0.002
    # Draws of neighbouring nodes are uncorrelated.
    other = keyed_randn(100_000, **dict(KEY, node=KEY["node"] + 1)).double()
    assert abs(torch.corrcoef(torch.stack([normal, other]))[0, 1].item()) < 0.02
