"""Shared-prefix turns: rows that hold one sequence (a tree rollout's siblings) are prefilled once and
decode from copies of its key/value cache, with the tokens and log-probs of the unshared call."""

from types import SimpleNamespace

import pytest
import torch

from mmrl.noise import NoiseKey
from tests.test_vlm_models import WORDS, picture, text_tokens
from vlm_rl.models import PADDING_WASTE, Segment, TinyVLMSpec, VLMAdapter, length_buckets, shared_prefixes
from vlm_rl.vllm_engine import prefill_count


@pytest.fixture(scope="module")
def vlm() -> VLMAdapter:
    return VLMAdapter.tiny(WORDS)


def prompts(vlm: VLMAdapter) -> list[Segment]:
    """Three distinct first-turn sequences of different lengths: one image, none, two."""
    return [
        vlm.prompt_token_ids("what color is the square ?", picture()),
        vlm.prompt_token_ids("what color is the small square ?", system="red green") + text_tokens(vlm, 7, 4),
        vlm.prompt_token_ids("what color is the small circle ?", picture(seed=1))
        + text_tokens(vlm, 9, 0)
        + vlm.observation_token_ids(picture(150, 90, seed=2)),
    ]


def assert_same_generation(shared, flat) -> None:
    assert shared.token_ids == flat.token_ids and shared.stopped == flat.stopped
    for got, want in zip(shared.log_probs, flat.log_probs, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("architecture", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("sampled", [True, False])
def test_shared_prefill_generates_what_each_row_would_alone(architecture, sampled):
    vlm = VLMAdapter.tiny(WORDS, TinyVLMSpec(architecture=architecture))
    distinct = prompts(vlm)
    order = [0, 1, 0, 2, 1, 0, 2, 0, 1]  # repeated 4, 3 and 2 times, interleaved
    rows = [distinct[i] for i in order]
    keys = [NoiseKey(5, 1, row, 0) for row in range(len(rows))] if sampled else None
    flat = vlm.generate_turn(rows, 16, keys=keys, temperature=0.8)
    shared = vlm.generate_turn(rows, 16, keys=keys, temperature=0.8, prefix_groups=order)
    assert_same_generation(shared, flat)
    if sampled:  # siblings under one prefix draw their own tokens
        assert shared.token_ids[0] != shared.token_ids[2]
    lengths = [len(s) for s in distinct]
    assert flat.prefill_tokens == sum(len(s) for s in rows)
    assert shared.prefill_tokens == sum(lengths)
    assert flat.prefill_tokens - shared.prefill_tokens == 3 * lengths[0] + 2 * lengths[1] + lengths[2]


def test_stop_tokens_end_shared_rows_as_they_end_unshared_ones(vlm):
    """Rows stop at different steps (the stop token is one the model writes mid-turn); a banned token
    never appears."""
    distinct = prompts(vlm)
    order = [2, 0, 0, 1, 2, 2]
    rows = [distinct[i] for i in order]
    keys = [NoiseKey(7, 0, row, 0) for row in range(len(rows))]
    probe = vlm.generate_turn(rows, 12, keys=keys)
    stop = vlm.tokenizer.convert_ids_to_tokens(probe.token_ids[1][4])
    banned = vlm.tokenizer.convert_ids_to_tokens(probe.token_ids[0][2])
    if banned == stop:
        banned = vlm.tokenizer.convert_ids_to_tokens(probe.token_ids[0][3])
    options = {"keys": keys, "stop_tokens": [stop], "banned_tokens": [banned]}
    flat = vlm.generate_turn(rows, 12, **options)
    shared = vlm.generate_turn(rows, 12, prefix_groups=order, **options)
    assert_same_generation(shared, flat)
    assert any(flat.stopped) and not all(flat.stopped)
    assert len({len(ids) for ids in flat.token_ids}) > 1
    banned_id = vlm.tokenizer.convert_tokens_to_ids(banned)
    assert all(banned_id not in ids for ids in shared.token_ids)


def test_a_second_turn_shared_by_siblings(vlm):
    """Turn 2 of a tree: two first turns, each continued (after a crop shown as a new turn) by three
    siblings, plus one unshared row; prompt + generated tokens + observation, as rollout.py builds it."""
    prompt = vlm.prompt_token_ids("what color is the small circle ?", picture(seed=3))
    keys = [NoiseKey(1, 0, 0, 0), NoiseKey(1, 0, 1, 0)]
    first = vlm.generate_turn([prompt, prompt], 6, keys=keys, prefix_groups=[0, 0])
    assert first.token_ids[0] != first.token_ids[1]
    crops = [picture(120, 80, seed=4), picture(90, 160, seed=5)]
    seconds = [
        prompt + Segment(ids) + vlm.observation_token_ids(crop)
        for ids, crop in zip(first.token_ids, crops, strict=True)
    ]
    other = prompt + text_tokens(vlm, 3, 6) + vlm.observation_token_ids("the box is left of the square")
    rows = [seconds[0], seconds[1], seconds[0], other, seconds[1], seconds[0], seconds[1]]
    order = [0, 1, 0, 2, 1, 0, 1]
    keys = [NoiseKey(1, 0, row, 1) for row in range(len(rows))]
    flat = vlm.generate_turn(rows, 10, keys=keys)
    shared = vlm.generate_turn(rows, 10, keys=keys, prefix_groups=order)
    assert_same_generation(shared, flat)
    assert shared.prefill_tokens == len(seconds[0]) + len(seconds[1]) + len(other)
    assert flat.prefill_tokens - shared.prefill_tokens == 2 * len(seconds[0]) + 2 * len(seconds[1])


def test_length_buckets_split_only_batches_mostly_padding():
    one_turn = [108, 100, 104, 108]
    assert length_buckets(one_turn) == [[1, 2, 0, 3]]
    fresh_and_continued = [108] * 6 + [215] * 2 + [108] * 2
    assert length_buckets(fresh_and_continued) == [[0, 1, 2, 3, 4, 5, 8, 9], [6, 7]]
    lengths = [10, 400, 30, 200, 40, 210, 20, 12]
    buckets = length_buckets(lengths)
    assert sorted(row for rows in buckets for row in rows) == list(range(len(lengths)))
    for rows in buckets:
        sizes = [lengths[row] for row in rows]
        assert max(sizes) * len(sizes) - sum(sizes) <= PADDING_WASTE * max(sizes) * len(sizes)
    assert len(buckets) > 2 and length_buckets([]) == []


@pytest.mark.parametrize("sampled", [True, False])
def test_rows_generated_in_length_buckets_are_those_of_one_padded_batch(vlm, sampled):
    """A turn whose rows differ in length by images and turns goes out in several calls, with the
    tokens, log-probs and prefill count of one left-padded batch."""
    distinct = prompts(vlm)
    rows = [distinct[i] for i in (2, 0, 1, 0, 2, 1)]
    assert len(length_buckets([len(s) for s in rows])) > 1
    keys = [NoiseKey(3, 0, row, 0) for row in range(len(rows))] if sampled else None
    one_batch = vlm.generate(vlm.collate(rows, "left"), 12, keys=keys, temperature=0.9)
    bucketed = vlm.generate_turn(rows, 12, keys=keys, temperature=0.9)
    assert_same_generation(bucketed, one_batch)
    assert bucketed.prefill_tokens == one_batch.prefill_tokens == sum(len(s) for s in rows)


def test_rows_under_one_prefix_id_must_hold_one_sequence(vlm):
    a, b, _ = prompts(vlm)
    with pytest.raises(ValueError, match="rows 0 and 2 under id 7"):
        vlm.generate_turn([a, b, b], 4, prefix_groups=[7, 8, 7])
    same_tokens = vlm.prompt_token_ids("what color is the square ?", picture(seed=9))  # another image
    assert same_tokens.token_ids == a.token_ids
    with pytest.raises(ValueError, match="rows 0 and 1 under id 0.*token ids and images"):
        vlm.generate_turn([a, same_tokens], 4, prefix_groups=[0, 0])
    with pytest.raises(ValueError, match="2 prefix_groups ids for 3 sequences"):
        vlm.generate_turn([a, b, a], 4, prefix_groups=[0, 1])
    with pytest.raises(ValueError, match="2 sampling keys for 3 sequences"):
        vlm.generate_turn([a, b, a], 4, keys=[NoiseKey(0, 0, 0, 0)] * 2, prefix_groups=[0, 1, 0])
    again = vlm.prompt_token_ids("what color is the square ?", picture())  # equal, not the same objects
    assert shared_prefixes([a, b, again, a], [3, 1, 3, 3]) == ([0, 1], [0, 1, 0, 0])


def test_vllm_prefill_counts_skip_its_prefix_cache_hits():
    assert prefill_count(SimpleNamespace(prompt_token_ids=[1] * 40, num_cached_tokens=32)) == 8
    assert prefill_count(SimpleNamespace(prompt_token_ids=[1] * 40, num_cached_tokens=None)) == 40
    assert prefill_count(SimpleNamespace(prompt_token_ids=[1] * 40)) == 40  # a vLLM that does not say
