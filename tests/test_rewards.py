import math

import pytest
import torch

from mmrl.registry import REWARDS, UnknownNameError
from mmrl.rewards import RewardOutputError, checked_rewards, extract_answer

EXTRACTION_CASES = [
    ("<think>hmm</think><answer>B</answer>", None, "B"),
    ("<answer> Paris </answer>", None, "Paris"),
    ("<answer>first</answer> then <answer>second</answer>", None, "second"),
    ("<ANSWER>(c)</ANSWER>", None, "C"),
    ("<answer>A dog</answer>", None, "A dog"),  # an article, not an option letter
    ("<answer></answer>", None, None),
    ("so x = \\boxed{42}.", None, "42"),
    ("\\boxed{1} no wait \\boxed{\\frac{1}{2}}", None, "\\frac{1}{2}"),
    ("\\boxed{unclosed", None, None),
    ("<answer>7</answer> \\boxed{8}", None, "7"),  # the tag wins over boxed
    ("The answer is (C).", None, "C"),
    ("the answer is (c)", None, "C"),
    ("Answer: B", None, "B"),
    ("So the answer is b.", None, "B"),
    ("The answer is a dog.", None, None),
    ("Answer: Because the cat is small", None, None),
    ("Between (A) and (D), I pick (D)", None, "D"),
    ("The answer is (B), not (A).", None, "B"),  # an explicit answer beats a later "(X)"
    (" c ", None, "C"),
    ("(B)", None, "B"),
    ("I have no idea.", None, None),
    ("", None, None),
    # with options: option texts count as their letters
    ("<answer>dog</answer>", ["cat", "dog"], "B"),
    ("<answer>Dog.</answer>", ["cat", "dog"], "B"),
    ("<answer>(B) dog</answer>", ["cat", "dog"], "B"),
    ("<answer>dog</answer>", ["(A) cat", "(B) dog"], "B"),
    ("<answer>horse</answer>", ["cat", "dog"], "horse"),
    ("I am fairly sure it is the dog.", ["cat", "dog"], "B"),
    ("cat or dog, hard to say", ["cat", "dog"], None),
    ("The answer is (E).", ["cat", "dog"], None),  # not an option
    ("The answer is (A).", ["cat", "dog"], "A"),
]


@pytest.mark.parametrize(("text", "options", "expected"), EXTRACTION_CASES)
def test_extract_answer(text, options, expected):
    assert extract_answer(text, options) == expected


def test_registered_names():
    assert {"answer_match", "format", "weighted_sum"} <= set(REWARDS.names())


def test_answer_match():
    reward = REWARDS.get("answer_match")()
    completions = [
        "<answer>PARIS</answer>",
        "<answer>Lyon</answer>",
        "no answer here",
        "The answer is (B).",
        "<answer>dog</answer>",
        "<answer>A</answer>",
        "\\boxed{1 / 2}",
    ]
    answers = ["paris", "paris", "paris", "dog", "B", "(B) dog", "1/2"]
    options = [None, None, None, ["cat", "dog"], ["cat", "dog"], ["cat", "dog"], None]
    values = reward(completions, answers=answers, options=options, prompts=["ignored"] * 7)
    assert values.dtype == torch.float32
    assert values.tolist() == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    # options are optional
    assert reward(["<answer>x</answer>"], answers=["X"]).tolist() == [1.0]


def test_format_reward():
    reward = REWARDS.get("format")()
    completions = [
        "<think>reason</think><answer>B</answer>",
        "  <think>multi\nline</think>\n<answer>B</answer>\n",
        "<answer>B</answer><think>reason</think>",  # wrong order
        "<think>reason</think>",  # missing tag
        "<think>a</think><think>b</think><answer>B</answer>",  # repeated tag
        "<think>reason</think> stray text <answer>B</answer>",
        "<think>reason</think><answer>B</answer><answer>C</answer>",
    ]
    assert reward(completions).tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    answer_only = REWARDS.get("format")(tags=["answer"])
    assert answer_only(["<answer>x</answer>", "<think>t</think><answer>x</answer>"]).tolist() == [1.0, 0.0]


def test_weighted_sum():
    reward = REWARDS.get("weighted_sum")(
        weights={"answer_match": 1.0, "format": 0.5}, reward_kwargs={"format": {"tags": ["answer"]}}
    )
    completions = ["<answer>4</answer>", "<answer>5</answer>", "it is 4"]
    assert reward(completions, answers=["4", "4", "4"]).tolist() == [1.5, 0.5, 0.0]


def test_weighted_sum_rejects_bad_names():
    with pytest.raises(UnknownNameError, match="answer_match"):
        REWARDS.get("weighted_sum")(weights={"answer_mach": 1.0})
    with pytest.raises(ValueError, match="not in weights"):
        REWARDS.get("weighted_sum")(weights={"format": 1.0}, reward_kwargs={"answer_match": {}})


@pytest.mark.parametrize(
    ("returned", "found"),
    [
        ([1.0], "shape (1,) for 2 samples"),
        ([1.0, 2.0, 3.0], "shape (3,) for 2 samples"),
        ([[1.0], [2.0]], "shape (2, 1)"),
        (["a", "b"], "not one number per sample"),
        ([1e308, 0.0], "beyond float32's range"),
        ([1 + 2j, 0.0], "complex"),
    ],
)
def test_a_reward_that_does_not_return_one_float_per_sample_is_named(returned, found):
    with pytest.raises(RewardOutputError, match="reward 'mine'") as err:
        checked_rewards(returned, 2, "mine")
    assert found in str(err.value)


def test_checked_rewards_keep_nan_as_data_and_numbers_as_float32():
    out = checked_rewards([float("nan"), 1], 2, "mine")
    assert out.dtype == torch.float32 and math.isnan(out[0]) and out[1] == 1.0
    assert checked_rewards(torch.tensor([True, False]), 2, "mine").tolist() == [1.0, 0.0]


def test_weighted_sum_names_the_part_that_returned_too_few():
    @REWARDS.register("returns_one_value")
    def returns_one_value():
        return lambda samples, **_: torch.ones(1)

    try:
        total = REWARDS.get("weighted_sum")(weights={"format": 1.0, "returns_one_value": 1.0})
        with pytest.raises(RewardOutputError, match="'returns_one_value' returned shape"):
            total(["a", "b"])
    finally:
        REWARDS._entries.pop("returns_one_value")
