"""Questions for the VLM trainers and their demonstrations: the synthetic zoom task or a jsonl file.

A trainer sees `Question`s (text, options, image, answer, and, for the synthetic task, whether a zoom
is needed and where). `demonstration` writes the assistant's side of a conversation for supervised
fine-tuning: with a tool call on the question's target box and its crop, or a direct answer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from mmrl.config import ConfigError, option
from vlm_rl.models import IM_END, WORD, ImageSizeError, Segment, VLMAdapter
from vlm_rl.question_jsonl import IMAGE_ERRORS, MCQuestion, read_benchmark
from vlm_rl.tasks import (
    COLOURS,
    LETTERS,
    OPTION_LETTERS,
    REGIONS,
    SHAPES,
    TaskConfig,
    make_example,
)
from vlm_rl.tools import ImageStore, ToolCall

Box = tuple[float, float, float, float]


@dataclass
class Question:
    """A multiple-choice question about one image (answer: an option letter)."""

    question: str
    options: Sequence[str]
    answer: str
    load_image: Callable[[], Image.Image]  # images are drawn or read only when needed
    kind: str = ""  # "global" / "detail" for the synthetic task; "" when unknown
    category: str = ""
    target_box: Box | None = None  # normalised box a zoom should take (demonstrations)

    @property
    def image(self) -> Image.Image:
        return self.load_image()


def question_text(question: str, options: Sequence[str]) -> str:
    """The user turn's text: the question and its options, one letter each."""
    listed = " ".join(f"{OPTION_LETTERS[i]} . {option}" for i, option in enumerate(options))
    return f"{question} Options : {listed} Answer with the letter ."


@dataclass
class DataConfig:
    source: str = option("zoom_task", "'zoom_task' (synthetic) or a jsonl file of multiple-choice questions")
    train_size: int = option(20000, "training questions (synthetic; a file uses all its rows)", min=1)
    heldout_size: int = option(256, "held-out questions for evaluation", min=1)
    heldout_file: str | None = option(
        None, "jsonl of held-out questions (default: the synthetic held-out split)"
    )
    detail_fraction: float = option(0.3, "synthetic: share of questions that need a zoom", min=0.0, max=1.0)
    heldout_detail_fraction: float | None = option(
        None, "synthetic: that share among held-out questions (null: detail_fraction)", min=0.0, max=1.0
    )
    canvas_size: int = option(
        448, "synthetic: image side in pixels", min=32, max=4096, why="the task needs 448 px"
    )
    max_large: int = option(
        1, "synthetic: large shapes per image, 1 to 3 (more: questions name them)", min=1, max=3
    )
    seed: int = option(0, "synthetic: data seed", min=0)


def synthetic_question(index: int, split: str, cfg: DataConfig) -> Question:
    detail = cfg.detail_fraction
    if split == "heldout" and cfg.heldout_detail_fraction is not None:
        detail = cfg.heldout_detail_fraction
    example = make_example(
        index,
        cfg.seed,
        split,
        TaskConfig(canvas_size=cfg.canvas_size, detail_fraction=detail, max_large=cfg.max_large),
    )
    return Question(
        example.question,
        example.options,
        example.answer,
        lambda: example.image,
        example.kind,
        example.category,
        example.target_box,
    )


class QuestionSet:
    """Questions by index: the synthetic ones are drawn on demand (any index regenerates alone)."""

    def __init__(self, cfg: DataConfig, split: str) -> None:
        self.cfg, self.split = cfg, split
        if cfg.source != "zoom_task" and cfg.heldout_file is None:
            raise ConfigError(
                f"config error: data.source = {cfg.source!r} needs data.heldout_file (a jsonl of held-out "
                "questions): evaluating on the training file would measure memorisation"
            )
        self.key = "data.source" if split == "train" else "data.heldout_file"  # the file's config key
        self.path = cfg.source if split == "train" else cfg.heldout_file or cfg.source
        self.file_rows: list[MCQuestion] | None = None  # a jsonl's rows, as read
        self.rows: list[Question] | None = None
        if self.path != "zoom_task":
            self.file_rows = load_questions(self.path)
            self.rows = [file_question(row) for row in self.file_rows]
        self.size = (
            len(self.rows)
            if self.rows is not None
            else (cfg.train_size if split == "train" else cfg.heldout_size)
        )
        if split == "heldout":
            self.size = min(self.size, cfg.heldout_size)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Question:
        if not 0 <= index < self.size:
            raise IndexError(f"question {index} of a set of {self.size}")
        if self.rows is not None:
            return self.rows[index]
        return synthetic_question(index, self.split, self.cfg)

    def check_images(self, adapter: VLMAdapter) -> None:
        """Refuse (ConfigError naming the file's key, the row and its image) a question of a jsonl whose
        image does not open or that `adapter`'s processor cannot resize (Qwen2-VL's takes no side over
        200 times the other), so that a run stops before it writes anything rather than at the step
        that draws the question. Reads each image's header only; the synthetic task's images fit."""
        checked: set[Path] = set()  # rows may share an image
        for row in (self.file_rows or [])[: self.size]:
            if row.image_path in checked:
                continue
            where = f"config error: {self.key} = {self.path!r}: question_id={row.question_id!r}"
            try:
                with Image.open(row.image_path) as image:
                    adapter.resized_size(image)
            except ImageSizeError as err:
                raise ConfigError(
                    f"{where}: {row.image_path}: {err}; pad or crop that image nearer to square, or remove "
                    "the row"
                ) from None
            except IMAGE_ERRORS as err:
                raise ConfigError(
                    f"{where}: image {row.image_path} cannot be read ({type(err).__name__}: {err}); replace "
                    "the file or remove the row"
                ) from None
            checked.add(row.image_path)


def load_questions(path: str) -> list[MCQuestion]:
    """Rows of a jsonl of multiple-choice questions (question_id, image, question, options, answer, ...)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(
            f"config error: data file {path!r} does not exist; give a jsonl of multiple-choice questions "
            "or 'zoom_task' for the synthetic task"
        )
    try:
        rows = read_benchmark(file)
    except ValueError as err:
        raise ConfigError(f"config error: {path}: {err}") from None
    if not rows:
        raise ConfigError(f"config error: data file {path!r} holds no questions")
    return rows


def file_question(row: MCQuestion) -> Question:
    """A jsonl row as a trainer's question; its image is read when the question is asked."""
    kinds = {True: "detail", False: "global", None: ""}
    return Question(
        row.question,
        row.options,
        row.answer,
        lambda: row.image,
        kinds[row.needs_zoom],
        row.category,
        row.target_box,
    )


def task_vocabulary(cfg: DataConfig, samples: int = 400) -> list[str]:
    """Every word the synthetic task's questions, options and answers use (tokenizer vocabulary)."""
    words = {*COLOURS, *SHAPES, *LETTERS, *(w for region in REGIONS for w in re.findall(WORD, region))}
    for split in ("train", "heldout"):
        for index in range(samples):
            q = synthetic_question(index, split, cfg)
            words.update(re.findall(WORD, question_text(q.question, q.options)))
    return sorted(words)


def round_box(box: Box, padding: float = 0.02) -> Box:
    """A normalised box grown by `padding`, clamped to [0, 1] and rounded to the tokenizer's 2 decimals."""
    x1, y1, x2, y2 = box
    grown = (x1 - padding, y1 - padding, x2 + padding, y2 + padding)
    return tuple(round(min(max(v, 0.0), 1.0), 2) for v in grown)  # type: ignore[return-value]


def tool_call_text(box: Box) -> str:
    numbers = ", ".join(f"{v:.2f}" for v in box)
    return f'<tool_call>{{"name": "crop", "arguments": {{"bbox_2d": [{numbers}]}}}}</tool_call>'


def demonstration(
    adapter: VLMAdapter, question: Question, prompt: Segment, use_tool: bool, image: Image.Image
) -> tuple[Segment, list[bool]]:
    """The whole conversation of a demonstration and its loss mask (True at the assistant's tokens):
    optionally a crop of the target box (of `image`, the question's) and the crop shown back, then
    the answer as the right option's text (``<answer>red</answer>``; rule-based extraction maps an
    option's text to its letter), which a small model learns more easily than the letter."""
    sequence, mask = prompt, [False] * len(prompt)
    if use_tool:
        if question.target_box is None:
            raise ValueError("a tool demonstration needs the question's target_box")
        box = round_box(question.target_box)
        call = adapter.segment(tool_call_text(box))
        store = ImageStore(image)
        observation = store.crop(ToolCall("crop", box))
        shown = adapter.observation_token_ids(observation.image)
        sequence = sequence + call + shown
        mask += [True] * len(call) + [False] * len(shown)
    answer_text = question.options[OPTION_LETTERS.index(question.answer)]
    answer = adapter.segment(f"<answer>{answer_text}</answer>{IM_END}")
    return sequence + answer, mask + [True] * len(answer)


def keyed_rng(*key: int) -> np.random.Generator:
    return np.random.default_rng(list(key))
