"""`ocr`: the text-rendering reward of Flow-GRPO, on PaddleOCR's PP-OCRv4 networks run by onnxruntime
on the CPU (`rapidocr-onnxruntime`, which ships them in its wheel: `pip install -e ".[ocr]"`).

For each image, the text the prompt asks for is compared with the text the OCR model reads:

- the asked text is what stands between the prompt's first pair of double quotes (``a sign that says
  "open"`` asks for ``open``), or the whole prompt when it has none;
- both are compared in lower case with every whitespace character removed, and the read text is the
  detected lines joined in the detector's order, each kept when its recognition confidence reaches
  `text_score`;
- the distance is 0 when the asked text appears within the read text, else their Levenshtein distance,
  at most the asked text's length; the reward is ``1 - distance / len(asked)``, in [0, 1].

A prompt that asks for no text (empty quotes) cannot be scored: a ValueError naming it, which the
trainers report as the reward's failure.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from diffusion_rl.rewards import OPTIONS_KEY, ImageBatch, as_image_list
from mmrl.config import ConfigError
from mmrl.registry import REWARDS
from mmrl.rewards import RewardFn

INSTALL = 'pip install -e ".[ocr]"'


def asked_text(prompt: str) -> str:
    """The text `prompt` asks to render, normalised (the module docstring)."""
    parts = prompt.split('"')
    return normalised(parts[1] if len(parts) >= 3 else prompt)


def normalised(text: str) -> str:
    return "".join(text.split()).lower()


def text_accuracy(read: str, asked: str) -> float:
    """1 - the clipped, length-normalised edit distance between the read and the asked text (both
    normalised), 1 when the asked text appears within the read one."""
    from rapidfuzz.distance import Levenshtein

    if not asked:
        raise ValueError("there is no text to compare with")
    distance = 0 if asked in read else min(Levenshtein.distance(read, asked), len(asked))
    return 1.0 - distance / len(asked)


class OcrReader:
    """PP-OCRv4 text detection and recognition (no angle classifier, as Flow-GRPO runs PaddleOCR) on
    [3, H, W] float images in [0, 1]; `read` gives each image's normalised text."""

    def __init__(
        self, det_model_path: str | None = None, rec_model_path: str | None = None, text_score: float = 0.5
    ) -> None:
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ImportError:
            raise ConfigError(
                f"config error: the ocr reward needs rapidocr-onnxruntime, which is not installed: {INSTALL}"
            ) from None
        if not 0.0 <= text_score <= 1.0:
            raise ConfigError(
                f"config error: {OPTIONS_KEY}.text_score = {text_score!r}: a recognition confidence in [0, 1]"
            )
        paths = {}
        for key, path in (("det_model_path", det_model_path), ("rec_model_path", rec_model_path)):
            if path is not None:
                if not Path(path).is_file():
                    raise ConfigError(
                        f"config error: {OPTIONS_KEY}.{key} = {path!r} is not a file: give an ONNX export of "
                        "a PaddleOCR network, or leave it out for the PP-OCRv4 one the wheel ships"
                    )
                paths[key] = str(path)
        self.engine = RapidOCR(use_cls=False, text_score=text_score, print_verbose=False, **paths)

    def read(self, images: ImageBatch) -> list[str]:
        texts = []
        for image in as_image_list(images):
            pixels = (image.detach().float().nan_to_num(0.0).clamp(0, 1) * 255).round().to(torch.uint8)
            bgr = np.ascontiguousarray(pixels.permute(1, 2, 0).cpu().numpy()[:, :, ::-1])
            lines, _ = self.engine(bgr, use_cls=False)
            texts.append(normalised("".join(line[1] for line in lines or [])))
        return texts


@REWARDS.register("ocr")
def ocr(
    det_model_path: str | None = None, rec_model_path: str | None = None, text_score: float = 0.5
) -> RewardFn:
    """Flow-GRPO's OCR reward (the module docstring): the asked text's accuracy in what PP-OCRv4 reads.
    `det_model_path` / `rec_model_path` take a user's own ONNX exports of the detection and
    recognition networks; `text_score` is the confidence a read line needs to count."""
    reader = OcrReader(det_model_path, rec_model_path, text_score)

    def reward(images: ImageBatch, prompts: Sequence[str] | None = None, **_: Any) -> Tensor:
        if prompts is None:
            raise ValueError("the ocr reward compares each image with its prompt: call it with prompts=")
        asked = [asked_text(prompt) for prompt in prompts]
        empty = [prompt for prompt, text in zip(prompts, asked, strict=True) if not text]
        if empty:
            raise ValueError(f"prompt {empty[0]!r} asks for no text to render (its quotes are empty)")
        read = reader.read(images)
        if len(read) != len(asked):
            raise ValueError(f"{len(read)} images for {len(asked)} prompts")
        scores = [text_accuracy(text, wanted) for text, wanted in zip(read, asked, strict=True)]
        return torch.tensor(scores, dtype=torch.float32)

    return reward
