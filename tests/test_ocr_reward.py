"""The `ocr` reward: PP-OCRv4 (the wheel's ONNX networks) reads words drawn with PIL as asked and scores
them near 1, wrong words low; the text rules (quotes, case, whitespace, containment, the clipped
distance) and the errors a user can make."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from diffusion_rl.ocr_reward import asked_text, text_accuracy
from diffusion_rl.reward_terms import RewardFailed, build_reward, scored
from mmrl.cli import load_plugins
from mmrl.config import ConfigError

load_plugins()

WORDS = ["hello", "River", "grpo 24", "mmrl"]
WRONG = ["table", "zebra", "moon", "blue"]


def drawn(word: str, size: int, font: ImageFont.FreeTypeFont) -> torch.Tensor:
    image = Image.new("RGB", (224, 96), "white")
    ImageDraw.Draw(image).text((10, 48), word, fill="black", font=font, anchor="lm")
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255


@pytest.fixture(scope="module")
def reward():
    return build_reward("ocr", {}, "reward.")


@pytest.mark.parametrize("size", [24, 40])
def test_words_drawn_as_asked_score_high_and_wrong_words_low(reward, size):
    font = ImageFont.load_default(size)
    images = torch.stack([drawn(word, size, font) for word in WORDS])
    right = scored("ocr", reward, images, [f'a sign that says "{word}"' for word in WORDS])
    wrong = scored("ocr", reward, images, [f'a sign that says "{word}"' for word in WRONG])
    assert right.mean() >= 0.9 and right.dtype == torch.float32
    assert wrong.mean() <= 0.3
    assert scored("ocr", reward, torch.ones(1, 3, 96, 224), ['"hello"']).item() == 0.0  # nothing to read
    nan = torch.full((1, 3, 96, 224), float("nan"))  # a model's bad output is data: no text read
    assert scored("ocr", reward, nan, ['"hello"']).item() == 0.0


def test_the_text_rules():
    assert asked_text('a neon sign that says "Open Late"') == "openlate"
    assert asked_text("Hello World") == "helloworld"  # no quotes: the whole prompt
    assert asked_text('"a" and "b"') == "a"  # the first quoted text
    assert text_accuracy("welcome:openlate!", "openlate") == 1.0  # contained
    assert text_accuracy("openlote", "openlate") == pytest.approx(1 - 1 / 8)
    assert text_accuracy("", "open") == 0.0
    assert text_accuracy("a much longer unrelated reading", "open") == 0.0  # clipped at the length


def test_a_prompt_without_text_and_bad_options_are_clear_errors(reward):
    with pytest.raises(RewardFailed, match="asks for no text to render"):
        scored("ocr", reward, torch.ones(1, 3, 32, 32), ['a sign that says ""'])
    with pytest.raises(ConfigError, match=r"reward\.terms\[0\]\.options\.det_model_path = 'nope.onnx'"):
        build_reward("ocr", {"det_model_path": "nope.onnx"}, "reward.terms[0].")
    with pytest.raises(ConfigError, match=r"reward\.options\.text_score = 2"):
        build_reward("ocr", {"text_score": 2}, "reward.")
