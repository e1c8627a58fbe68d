"""Chat VLMs behind one small interface that multi-turn pixel-tool rollouts and their training use.

`VLMAdapter` holds a transformers image-text-to-text model, its tokenizer and its image processor.
A rollout never re-tokenizes model output: a conversation is kept as a `Segment` (token ids plus the
images whose placeholder tokens those ids hold), the sum of

- the prompt (`prompt_token_ids`): system and user turn, ending with the assistant header;
- generated tokens (`generate`), which stop at the end of a tool call or of the assistant turn;
- observations (`observation_token_ids`): ``<|im_end|>\\n<|im_start|>user\\n(image or error
  text)<|im_end|>\\n<|im_start|>assistant\\n``. An observation closes the assistant turn that the
  generation stopped in at ``</tool_call>``, so a whole rollout is token for token what the chat
  template renders for the same messages, and observation tokens are masked out of the loss.

`collate` pads segments into a model batch and `token_log_probs` scores chosen tokens under the model.
Inputs are built from the tokenizer and the image processor directly: in transformers 5.x the
Qwen2-VL processor insists on a video processor that needs torchvision.

Families differ in how an image is resized and becomes placeholder tokens and model inputs; those
are the hooks a family class fills. `QwenVLAdapter` covers Qwen2-VL and Qwen2.5-VL (their 3D M-RoPE
positions the model computes itself from ``mm_token_type_ids``, the image grids and the attention
mask, so padding is skipped); an Idefics3/SmolVLM class would add its image splitting and
``pixel_attention_mask``. `tiny` builds an untrained Qwen2-VL of the real architecture with a
word-level tokenizer over a closed vocabulary; `save_pretrained` stores it like a hub checkpoint, which
`vlm_rl.loading.load` reads back.
"""

from __future__ import annotations

import json
import re
import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import torch
from PIL import Image
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import (
    AutoTokenizer,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
    SuppressTokensLogitsProcessor,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from mmrl.noise import NoiseKey, keyed_rand_batch
from vlm_rl.policy_weights import merged_state_dict

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
UNK = "<|unk|>"  # the tiny tokenizer's stand-in for words outside its closed vocabulary
SPECIAL_TOKENS = (PAD, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD, UNK)
TOOL_CALL_END = "</tool_call>"
TAGS = ("<tool_call>", TOOL_CALL_END, "<answer>", "</answer>")
# Words every tiny vocabulary holds: chat roles and the tool-call schema (vlm_rl.tools).
ROLES = ("system", "user", "assistant")
BASE_WORDS = (*ROLES, "name", "arguments", "bbox_2d", "crop", "zoom_in", "image_index", "label")
PUNCTUATION = tuple("{}[]:,\".?!'()-/")
DIGITS = tuple("0123456789")
NUMBERS = tuple(f"{i / 100:.2f}" for i in range(101))  # 0.00 .. 1.00: normalised box coordinates
SPACE = "\u2581"  # "▁": a token's leading space, so that decoding needs no spaces between tokens
WORD = r"[A-Za-z_][A-Za-z0-9_]*"
# One token per piece: an optional leading space, then a box number, a digit, a word or a punctuation
# mark; other whitespace (newlines) and extra spaces are tokens of their own.
PIECE = rf"{SPACE}?(?:0\.\d\d|1\.00|\d|{WORD}|[^\s\w{SPACE}])|\s|{SPACE}"

# The Qwen2-VL chat format without its default system prompt (the tiny vocabulary lacks its words).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Stands for the assistant's text when rendering an observation, to find where that turn's text ends.
ASSISTANT_SENTINEL = "@@assistant-text@@"
MAX_IMAGE_SIDE = 8000
PADDING_WASTE = 0.25  # `length_buckets`: the share of a batch's tokens that may be left padding


def build_chat_tokenizer(words: Sequence[str], max_length: int = 4096) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over a closed vocabulary, with the Qwen2-VL special tokens and chat format.

    Every word, punctuation mark, digit and two-decimal number 0.00..1.00 is one token, once bare and
    once with a leading space, so decoding concatenates tokens and gives back the exact text: a tool
    call decodes to the JSON it was written as. Other numbers are spelled digit by digit; words
    outside the vocabulary become ``<|unk|>``. The ids depend on `words` only, not on the process.
    """
    bad = [word for word in words if not re.fullmatch(WORD, word)]
    if bad:
        raise ValueError(
            f"vocabulary words are letters, digits and underscores, not starting with a digit: {bad}"
        )
    pieces = list(dict.fromkeys([*BASE_WORDS, *words, *PUNCTUATION, *DIGITS, *NUMBERS]))
    tokens = [*SPECIAL_TOKENS, *TAGS, "\n", SPACE, *pieces, *(SPACE + piece for piece in pieces)]
    backend = Tokenizer(models.WordLevel({token: i for i, token in enumerate(tokens)}, unk_token=UNK))
    backend.normalizer = normalizers.Replace(" ", SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(PIECE), behavior="isolated")
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.Fuse()])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    backend.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in TAGS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD,
        unk_token=UNK,
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=max_length,
    )


class ImageSizeError(ValueError):
    """An image whose size the model's image processor cannot resize (Qwen2-VL's takes no image with
    one side more than 200 times the other); the message names the size and the processor's reason."""


def safe_size(size: tuple[int, int]) -> tuple[int, int]:
    """The (width, height) `safe_image` gives an image of `size`: no side above MAX_IMAGE_SIDE."""
    if max(size) <= MAX_IMAGE_SIDE:
        return size
    scale = MAX_IMAGE_SIDE / max(size)
    return max(1, round(size[0] * scale)), max(1, round(size[1] * scale))


def safe_image(image: Image.Image) -> Image.Image:
    """RGB, with no side above MAX_IMAGE_SIDE: huge images are downscaled first (with a warning), since
    the processor would spend seconds and gigabytes resizing them to a few hundred pixels anyway."""
    size = safe_size(image.size)
    if size != image.size:
        message = f"image of {image.width}x{image.height} pixels downscaled to {size[0]}x{size[1]}"
        warnings.warn(message, stacklevel=2)
        image = image.resize(size, Image.Resampling.BICUBIC)
    return image if image.mode == "RGB" else image.convert("RGB")


@dataclass
class ImageInput:
    """One image as the model sees it."""

    pixel_values: torch.Tensor  # the processor's output for this image alone
    grid_thw: torch.Tensor  # [3]: patches in time, height and width
    num_tokens: int  # placeholder tokens it takes in the text
    size: tuple[int, int]  # (width, height) after the processor's resize
    image: Image.Image  # the picture before that resize

    @cached_property
    def seen(self) -> Image.Image:
        """The picture at `size`, for another engine (vLLM) to process again; resized once per image,
        not at every turn that resends the conversation."""
        return (
            self.image
            if self.image.size == self.size
            else self.image.resize(self.size, Image.Resampling.BICUBIC)
        )


@dataclass
class Segment:
    """Token ids of a piece of conversation and, in order, the images whose placeholders they hold.

    Segments add up (prompt + generated + observation + ...) to the sequence a rollout trains on."""

    token_ids: list[int]
    images: list[ImageInput] = field(default_factory=list)

    def __add__(self, other: Segment) -> Segment:
        return Segment(self.token_ids + other.token_ids, self.images + other.images)

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class Generation:
    """What `generate` sampled for each row of a batch."""

    token_ids: list[list[int]]  # new tokens, up to and including the stop token
    log_probs: list[torch.Tensor]  # their log-probs at the sampling temperature (fp32, CPU)
    stopped: list[bool]  # ended on a stop token, rather than at max_new_tokens
    # prompt tokens the model ran before decoding, padding excluded: a sequence shared by several rows
    # (or found in an engine's prefix cache) counts once
    prefill_tokens: int

    @staticmethod
    def gather(parts: Sequence[Generation], rows: Sequence[Sequence[int]]) -> Generation:
        """One generation from `parts`, part k's row i becoming row `rows[k][i]`."""
        count = sum(len(part_rows) for part_rows in rows)
        token_ids: list[list[int]] = [[] for _ in range(count)]
        log_probs = [torch.empty(0)] * count
        stopped = [False] * count
        for part, part_rows in zip(parts, rows, strict=True):
            for i, row in enumerate(part_rows):
                token_ids[row], log_probs[row] = part.token_ids[i], part.log_probs[i]
                stopped[row] = part.stopped[i]
        return Generation(token_ids, log_probs, stopped, sum(part.prefill_tokens for part in parts))


def shared_prefixes(
    sequences: Sequence[Segment], prefix_groups: Sequence[int]
) -> tuple[list[int], list[int]]:
    """(the first row of each prefix id, in order; for every row, the position of its id's first row in
    that list). Rows under one id must hold the same token ids and the same images, else ValueError."""
    if len(prefix_groups) != len(sequences):
        raise ValueError(f"{len(prefix_groups)} prefix_groups ids for {len(sequences)} sequences")
    distinct: list[int] = []
    position: dict[int, int] = {}  # prefix id -> its place in `distinct`
    rows = []
    for row, group in enumerate(prefix_groups):
        if group not in position:
            position[group] = len(distinct)
            distinct.append(row)
        owner = distinct[position[group]]
        if not same_sequence(sequences[owner], sequences[row]):
            raise ValueError(
                f"prefix_groups puts rows {owner} and {row} under id {group}, but their sequences differ: "
                "rows sharing an id must hold the same token ids and images"
            )
        rows.append(position[group])
    return distinct, rows


def length_buckets(lengths: Sequence[int], waste: float = PADDING_WASTE) -> list[list[int]]:
    """Row indices in groups to generate apart, shortest first: a group whose left padding would be more
    than `waste` of its padded tokens splits, recursively, at the length that leaves the least padding.
    On the transformers backend a padded token costs as much as a real one in every layer, and a batch
    that mixes fresh conversations with long continued ones (partial and tree rollouts) would be
    mostly padding; rows of similar length stay together, so a batch of one turn is not split."""
    order = sorted(range(len(lengths)), key=lambda row: lengths[row])
    buckets, pending = [], [order] if order else []
    while pending:
        rows = pending.pop()
        sizes = [lengths[row] for row in rows]
        padded = sizes[-1] * len(rows)  # sorted: the last row is the longest
        if padded - sum(sizes) <= waste * padded:
            buckets.append(rows)
            continue
        cut = min(range(1, len(rows)), key=lambda c: sizes[c - 1] * c + sizes[-1] * (len(rows) - c))
        pending += [rows[cut:], rows[:cut]]  # the shorter part comes off the stack first
    return buckets


def same_sequence(a: Segment, b: Segment) -> bool:
    """Same token ids and, in order, the same images (the same object, or equal pixels and grid)."""
    return (
        a.token_ids == b.token_ids
        and len(a.images) == len(b.images)
        and all(
            x is y or (torch.equal(x.grid_thw, y.grid_thw) and torch.equal(x.pixel_values, y.pixel_values))
            for x, y in zip(a.images, b.images, strict=True)
        )
    )


def cut_positions(
    positions: torch.Tensor,
    prefix_lengths: Sequence[int],
    rows: Sequence[int],
    prefix_mask: torch.Tensor,
    suffix_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The position ids [..., B, L] of right-padded whole sequences, cut into those of their distinct
    prefixes (row i's is prefix `rows[i]`), left-padded like `prefix_mask`, and those of their suffixes,
    right-padded like `suffix_mask` (0 at padding)."""
    prefixes = positions.new_zeros((*positions.shape[:-2], *prefix_mask.shape))
    suffixes = positions.new_zeros((*positions.shape[:-2], *suffix_mask.shape))
    for row, (prefix, start) in enumerate(zip(rows, prefix_lengths, strict=True)):
        prefixes[..., prefix, prefix_mask.shape[1] - start :] = positions[..., row, :start]
        end = start + int(suffix_mask[row].sum())
        suffixes[..., row, : end - start] = positions[..., row, start:end]
    return prefixes, suffixes


@dataclass
class TinyVLMSpec:
    """Sizes of the tiny Qwen2-VL / Qwen2.5-VL: a 2-layer text model and a 2-block vision tower."""

    architecture: str = "qwen2_vl"  # or "qwen2_5_vl"
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    vision_width: int = 32
    vision_depth: int = 2
    vision_heads: int = 2
    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 112 * 112  # a 448x448 image becomes a 112x112 view: 16 image tokens
    max_positions: int = 4096


class VLMAdapter(ABC):
    """A chat VLM with what multi-turn tool rollouts and their training need (see the module docstring).

    Family classes set `model_classes` (config model_type -> model class) and `image_processor_class`
    and fill the hooks `encode_image`, `resized_size`, `image_token_ids`, `image_inputs`,
    `vision_token_ids` and `decode_position_ids`."""

    model_classes: ClassVar[dict[str, type[PreTrainedModel]]] = {}
    image_processor_class: ClassVar[Any] = None

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, image_processor: Any
    ) -> None:
        if tokenizer.chat_template is None:
            raise ValueError("the tokenizer has no chat template")
        self.model = model
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.base_dtype = torch.float32  # `hold_base_in`
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.image_token_id = model.config.image_token_id
        # The policy never writes vision tokens: a generated placeholder would have no image behind it.
        # They are masked out of sampling and of every log-prob, so both see the same distribution.
        self.banned_ids = torch.tensor(self.vision_token_ids())

    # -- construction and storage ----------------------------------------------------------------

    @classmethod
    def load_processors(cls, directory: Path) -> tuple[PreTrainedTokenizerBase, Any]:
        """The tokenizer (with the chat template hub VLMs keep beside the processor) and the image
        processor of a checkpoint folder."""
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        processor_template = directory / "chat_template.json"
        if tokenizer.chat_template is None and processor_template.is_file():
            tokenizer.chat_template = json.loads(processor_template.read_text())["chat_template"]
        return tokenizer, cls.image_processor_class.from_pretrained(directory, local_files_only=True)

    def save_pretrained(self, path: str | Path) -> None:
        """Config, safetensors weights, tokenizer files and preprocessor_config.json in one folder; a
        LoRA adapter (`vlm_rl.lora`) is saved merged into the weights it adapts."""
        self.model.save_pretrained(path, state_dict=merged_state_dict(self.model))
        self.tokenizer.save_pretrained(path)
        self.image_processor.save_pretrained(path)

    @staticmethod
    def tiny(vocabulary: Sequence[str], spec: TinyVLMSpec | None = None, seed: int = 0) -> QwenVLAdapter:
        """A new, untrained tiny Qwen2-VL (or Qwen2.5-VL) whose tokenizer holds `vocabulary`."""
        return QwenVLAdapter.tiny(vocabulary, spec, seed)

    def to(self, device: torch.device | str) -> VLMAdapter:
        self.model.to(device)
        return self

    def hold_base_in(self, dtype: torch.dtype) -> None:
        """Keep the model's weights in `dtype` (bfloat16: a LoRA run's frozen base at half the memory of
        float32, before `vlm_rl.policy_weights.add_lora` adds the float32 adapter): its forward then
        runs in `dtype`, the adapter's products in float32 (peft casts their input), and scores and
        samples from float32 logits (`allowed`)."""
        self.model.to(dtype)
        self.base_dtype = dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- family hooks ------------------------------------------------------------------------------

    @abstractmethod
    def encode_image(self, image: Image.Image) -> ImageInput:
        """Resize and patchify one image; `ImageSizeError` for one the processor cannot resize."""

    @abstractmethod
    def resized_size(self, image: Image.Image) -> tuple[int, int]:
        """(width, height) the processor resizes `image` to: the space the model's coordinates live in.
        Computed from `image.size` alone (a lazily opened file is not decoded); `ImageSizeError` for an
        image the processor cannot resize, the error `encode_image` would raise for it."""

    @abstractmethod
    def image_token_ids(self, image: ImageInput) -> list[int]:
        """The tokens one image placeholder of the rendered text expands to."""

    @abstractmethod
    def vision_token_ids(self) -> list[int]:
        """Tokens that only images' placeholders hold."""

    @abstractmethod
    def image_inputs(self, input_ids: torch.Tensor, images: list[ImageInput]) -> dict[str, torch.Tensor]:
        """Model inputs for the images of a batch, in the order their placeholders appear (row-major)."""

    @abstractmethod
    def decode_position_ids(self, attention_mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Position ids of each row's last token during decoding outside `model.generate`, right after
        `model.generate` prefilled the batch whose rows `rows` continue; `attention_mask` [R, length]
        covers each row's tokens so far, the last one included."""

    @abstractmethod
    def sequence_position_ids(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Position ids of every token of a collated batch, as the model's own forward computes them
        (in the shape its `position_ids` argument takes, tokens last), so that pieces of the batch can
        run in separate calls at the positions they have in the whole."""

    # -- text and images -> token ids --------------------------------------------------------------

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The chat template's text; an image part (``{"type": "image"}``) is one placeholder."""
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def segment(self, text: str, images: Sequence[Image.Image] = ()) -> Segment:
        """Tokenize rendered text and expand its image placeholders, one per image in order."""
        encoded = [self.encode_image(image) for image in images]
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        placeholders = ids.count(self.image_token_id)
        if placeholders != len(encoded):
            raise ValueError(f"the text has {placeholders} image placeholders but {len(encoded)} images")
        pending = iter(encoded)
        expanded = []
        for token in ids:
            expanded.extend(self.image_token_ids(next(pending)) if token == self.image_token_id else [token])
        return Segment(expanded, encoded)

    def prompt_token_ids(
        self, question: str, image: Image.Image | None = None, system: str | None = None
    ) -> Segment:
        """System turn (if any) and a user turn with the image before the question, ending with the
        assistant header."""
        content = [{"type": "image"}] if image is not None else []
        messages = [{"role": "user", "content": [*content, {"type": "text", "text": question}]}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        return self.segment(self.render(messages), [image] if image is not None else [])

    def observation_token_ids(self, observation: Image.Image | str, role: str = "user") -> Segment:
        """A tool's result (an image, or error text) as a new turn: the assistant turn's end, the turn,
        and the next assistant header. Rendered by the chat template after a stand-in assistant turn,
        so the tokens are the template's own for any family."""
        is_image = isinstance(observation, Image.Image)
        content = [{"type": "image"}] if is_image else [{"type": "text", "text": observation}]
        history = [
            {"role": "user", "content": "question"},
            {"role": "assistant", "content": ASSISTANT_SENTINEL},
        ]
        text = self.render([*history, {"role": role, "content": content}])
        text = text[text.index(ASSISTANT_SENTINEL) + len(ASSISTANT_SENTINEL) :]
        return self.segment(text, [observation] if is_image else [])

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    # -- batches ---------------------------------------------------------------------------------------

    def encode_prompts(
        self, conversations: Sequence[tuple[list[dict[str, Any]], Sequence[Image.Image]]]
    ) -> dict[str, torch.Tensor]:
        """A left-padded generation batch from (chat messages, their images in order) pairs."""
        segments = [self.segment(self.render(messages), images) for messages, images in conversations]
        return self.collate(segments, "left")

    def collate(self, sequences: Sequence[Segment], padding_side: str = "right") -> dict[str, torch.Tensor]:
        """Pad sequences into a model batch (left for generation, either for scoring); the images of all
        rows are concatenated in order."""
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', not {padding_side!r}")
        length = max(len(sequence) for sequence in sequences)
        input_ids = torch.full((len(sequences), length), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
        for row, sequence in enumerate(sequences):
            needed = sum(image.num_tokens for image in sequence.images)
            found = sequence.token_ids.count(self.image_token_id)
            if found != needed:
                raise ValueError(f"sequence {row} has {found} image tokens but its images need {needed}")
            start = length - len(sequence) if padding_side == "left" else 0
            input_ids[row, start : start + len(sequence)] = torch.tensor(sequence.token_ids)
            attention_mask[row, start : start + len(sequence)] = 1
        images = [image for sequence in sequences for image in sequence.images]
        batch = {"input_ids": input_ids, "attention_mask": attention_mask}
        return batch | self.image_inputs(input_ids, images)

    def on_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: value.to(self.device) for name, value in batch.items()}

    def allowed(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 logits with the vision tokens at -inf."""
        return logits.float().index_fill(-1, self.banned_ids.to(logits.device), float("-inf"))

    def token_log_probs(
        self,
        batch: dict[str, torch.Tensor],
        target_mask: torch.Tensor,
        model: torch.nn.Module | None = None,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        """Log-probs [B, L] (fp32) of each token given the tokens before it, at `target_mask` positions
        (0 elsewhere, and at a sequence's first token, which nothing predicts). Logits are computed
        only from the first target column on. `model` is the module to call, e.g. the DDP/FSDP
        wrapper of `self.model` while training."""
        target_mask = target_mask.to(self.device, torch.bool, copy=True)
        target_mask[:, 1:] &= batch["attention_mask"][:, :-1].to(self.device).bool()
        target_mask[:, 0] = False
        out = torch.zeros(target_mask.shape, dtype=torch.float32, device=self.device)
        columns = target_mask.any(0).nonzero()
        if len(columns) == 0:
            return out
        first = int(columns[0])  # the first target column; the logits one column earlier predict it
        inputs = self.on_device(batch)
        keep = torch.arange(first - 1, target_mask.shape[1] - 1, device=self.device)
        logits = (model or self.model)(**inputs, logits_to_keep=keep, use_cache=False).logits
        log_probs = torch.log_softmax(self.allowed(logits) / temperature, dim=-1)
        chosen = log_probs.gather(-1, inputs["input_ids"][:, first:, None]).squeeze(-1)
        out[:, first:] = torch.where(target_mask[:, first:], chosen, 0.0)
        return out

    def split(self, sequence: Segment, length: int) -> tuple[Segment, Segment]:
        """(the first `length` tokens with their images, the rest with theirs). ValueError where the cut
        falls inside an image's placeholder tokens, whose features cannot go to both halves."""
        placeholders = sequence.token_ids[:length].count(self.image_token_id)
        taken = count = 0
        while taken < placeholders and count < len(sequence.images):
            taken += sequence.images[count].num_tokens
            count += 1
        if taken < placeholders:
            raise ValueError(f"the sequence has more image tokens than its {count} images need")
        if taken > placeholders:
            raise ValueError(
                f"a cut after token {length} falls inside the placeholder tokens of image {count - 1}: "
                "a shared prefix must end outside every image"
            )
        head = Segment(sequence.token_ids[:length], sequence.images[:count])
        return head, Segment(sequence.token_ids[length:], sequence.images[count:])

    def split_at_prefixes(
        self, sequences: Sequence[Segment], prefix_lengths: Sequence[int], prefix_groups: Sequence[int]
    ) -> tuple[list[Segment], list[int], list[Segment]]:
        """(the distinct prefixes, for every row the index of its prefix among them, every row's suffix).
        Rows under one prefix id must give the same length and hold the same prefix, else ValueError."""
        for name, values in (("prefix_lengths", prefix_lengths), ("prefix_groups", prefix_groups)):
            if len(values) != len(sequences):
                raise ValueError(f"{len(values)} {name} for {len(sequences)} sequences")
        owners: dict[int, int] = {}
        for row, (group, length) in enumerate(zip(prefix_groups, prefix_lengths, strict=True)):
            if not 1 <= length <= len(sequences[row]):
                raise ValueError(
                    f"prefix_lengths[{row}] is {length}, but a prefix holds 1 to {len(sequences[row])} "
                    "tokens of its sequence"
                )
            owner = owners.setdefault(group, row)
            if length != prefix_lengths[owner]:
                raise ValueError(
                    f"prefix_groups puts rows {owner} and {row} under id {group}, but prefix_lengths gives "
                    f"them {prefix_lengths[owner]} and {length} tokens: rows sharing an id share one prefix"
                )
        halves = [
            self.split(sequence, length) for sequence, length in zip(sequences, prefix_lengths, strict=True)
        ]
        distinct, rows = shared_prefixes([head for head, _ in halves], prefix_groups)
        return [halves[row][0] for row in distinct], rows, [tail for _, tail in halves]

    def shared_token_log_probs(
        self,
        sequences: Sequence[Segment],
        prefix_lengths: Sequence[int],
        prefix_groups: Sequence[int],
        target_mask: torch.Tensor,
        model: torch.nn.Module | None = None,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        """`token_log_probs` of ``collate(sequences, "right")`` ([B, L], 0 off `target_mask` and at a
        sequence's first token, which nothing predicts), running each shared prefix once.

        Rows under one `prefix_groups` id share their first `prefix_lengths[row]` tokens (a question's
        prompt for its G rollouts; for a tree's leaves, what their branch holds: the prompt, the trained
        turns above the branch and their observations). The distinct prefixes run left-padded in one
        call; its key/value cache, part of the autograd graph, is copied to the rows by index_select and
        the suffixes (images included) run on top of it at the positions (M-RoPE's too) they have in the
        whole sequences. Targets may lie in a prefix too: its token log-probs come from the prefix call
        (logits from the first column any row of the batch trains there) and are copied to its rows,
        each keeping those its own mask marks, so a shared trained turn counts once per row. Gradients
        through a prefix add up over its rows, as in the unshared call."""
        prefixes, rows, suffixes = self.split_at_prefixes(sequences, prefix_lengths, prefix_groups)
        target_mask = target_mask.to(self.device, torch.bool, copy=True)
        width = max(len(sequence) for sequence in sequences)
        if tuple(target_mask.shape) != (len(sequences), width):
            raise ValueError(
                f"target_mask is {list(target_mask.shape)}, not [sequences, longest sequence] = "
                f"[{len(sequences)}, {width}]"
            )
        starts = torch.tensor(list(prefix_lengths), device=self.device)
        ends = torch.tensor([len(sequence) for sequence in sequences], device=self.device)
        column = torch.arange(width, device=self.device)
        marked = (target_mask & (column >= ends[:, None])).nonzero()
        if len(marked):
            row, token = (int(i) for i in marked[0])
            raise ValueError(
                f"target_mask marks token {token} of row {row}, past its end ({len(sequences[row])} tokens)"
            )
        target_mask[:, 0] = False
        if not target_mask.any():
            return torch.zeros(target_mask.shape, dtype=torch.float32, device=self.device)
        prefix_batch, suffix_batch = self.collate(prefixes, "left"), self.collate(suffixes, "right")
        prefix_width = prefix_batch["input_ids"].shape[1]
        prefix_positions, suffix_positions = cut_positions(
            self.sequence_position_ids(self.collate(sequences, "right")),
            prefix_lengths,
            rows,
            prefix_batch["attention_mask"],
            suffix_batch["attention_mask"],
        )
        # rows aligned as the left-padded prefixes are: token t of row r sits in column t + shift[r]
        shift = prefix_width - starts
        in_prefixes = (target_mask & (column < starts[:, None])).nonzero()
        first = (
            int((in_prefixes[:, 1] + shift[in_prefixes[:, 0]]).min()) if len(in_prefixes) else prefix_width
        )
        call = model or self.model
        index = torch.tensor(rows, device=self.device)
        prefix_inputs = self.on_device(prefix_batch)
        keep = torch.arange(first - 1, prefix_width, device=self.device)
        prefix_out = call(
            **prefix_inputs,
            position_ids=prefix_positions.to(self.device),
            use_cache=True,
            logits_to_keep=keep,
        )
        cache = prefix_out.past_key_values
        if cache is None:
            raise RuntimeError(
                "the model returned no key/value cache for the shared prefixes (gradient checkpointing "
                "turns it off while training): score with token_log_probs instead"
            )
        cache.reorder_cache(index)
        suffix_inputs = self.on_device(suffix_batch)
        prefix_mask = prefix_inputs["attention_mask"][index]
        suffix_inputs["attention_mask"] = torch.cat([prefix_mask, suffix_inputs["attention_mask"]], dim=1)
        suffix_logits = call(
            **suffix_inputs,
            position_ids=suffix_positions.to(self.device),
            past_key_values=cache,
            use_cache=True,
        ).logits
        # prefix columns first-1 .. width-2 predict the prefix's own tokens (once per prefix, copied to its
        # rows); its last logits predict each row's first suffix token, suffix column j the token after j
        prefix_log_probs = torch.log_softmax(self.allowed(prefix_out.logits[:, :-1]) / temperature, dim=-1)
        in_prefix = prefix_log_probs.gather(-1, prefix_inputs["input_ids"][:, first:, None]).squeeze(-1)
        logits = torch.cat([prefix_out.logits[index, -1:], suffix_logits[:, :-1]], dim=1)
        log_probs = torch.log_softmax(self.allowed(logits) / temperature, dim=-1)
        in_suffix = log_probs.gather(-1, suffix_inputs["input_ids"][..., None]).squeeze(-1)
        aligned = torch.cat(
            [in_prefix.new_zeros(len(sequences), first), in_prefix[index], in_suffix], dim=1
        )  # [B, prefix width + suffix width]
        placed = (column + shift[:, None]).clamp(max=aligned.shape[1] - 1)
        return torch.where(target_mask, aligned.gather(1, placed), 0.0)

    def generate(
        self,
        batch: dict[str, torch.Tensor],
        max_new_tokens: int,
        keys: Sequence[NoiseKey] | None = None,
        temperature: float = 1.0,
        stop_tokens: Sequence[str] = (IM_END, TOOL_CALL_END),
        banned_tokens: Sequence[str] = (),
        rows: Sequence[int] | None = None,
    ) -> Generation:
        """Up to `max_new_tokens` per row of a left-padded batch, stopping at any of `stop_tokens`.

        With `keys` (one per row), tokens are sampled at `temperature` by Gumbel-max with noise keyed
        by the row's key and the token's index (the key's `stream`), so a row's tokens depend on its
        key alone, not on the batch it shares or on a global RNG; without, greedy. The checkpoint's
        top-k/top-p/repetition settings are never applied, so the returned log-probs are the policy's
        as `token_log_probs` computes them. `banned_tokens` (e.g. ``<tool_call>`` for a policy that may
        not use tools) are never produced; their log-probs are not renormalised away.

        With `rows`, the batch holds distinct sequences and output row i continues batch row `rows[i]`:
        each batch row is prefilled once and its key/value cache copied to the rows that continue it
        (`generate_turn`'s prefix sharing); keys then go one per output row."""
        stop_ids = self.token_ids_of(stop_tokens)
        inputs = self.on_device(batch)
        prompt_length = inputs["input_ids"].shape[1]
        count = inputs["input_ids"].shape[0] if rows is None else len(rows)
        processors = LogitsProcessorList()
        if keys is not None:
            if len(keys) != count:
                raise ValueError(f"{len(keys)} sampling keys for {count} rows")
            processors.append(KeyedGumbel(keys, temperature, prompt_length))
        settings = {
            "do_sample": False,
            "top_k": None,
            "top_p": None,
            "temperature": None,
            "repetition_penalty": 1.0,
            "eos_token_id": stop_ids,
            "pad_token_id": self.pad_id,
            "return_dict_in_generate": True,
            "output_logits": True,
        }
        suppressed = self.banned_ids.tolist() + self.token_ids_of(banned_tokens)
        if rows is None:
            out = self.model.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                suppress_tokens=suppressed,
                logits_processor=processors,
                **settings,
            )
            new, raw_logits = out.sequences[:, prompt_length:], torch.stack(out.logits, dim=1)
        else:
            processors.insert(0, SuppressTokensLogitsProcessor(suppressed, device=self.device))
            new, raw_logits = self.decode_shared(inputs, rows, max_new_tokens, processors, stop_ids, settings)
        logits = self.allowed(raw_logits) / (temperature if keys is not None else 1.0)
        log_probs = torch.log_softmax(logits, dim=-1).gather(-1, new[..., None]).squeeze(-1).cpu()
        token_ids, row_log_probs, stopped = [], [], []
        for row, ids in enumerate(new.tolist()):
            end = next((i + 1 for i, token in enumerate(ids) if token in stop_ids), None)
            stopped.append(end is not None)
            end = end or len(ids)
            token_ids.append(ids[:end])
            row_log_probs.append(log_probs[row, :end])
        prefill_tokens = int(batch["attention_mask"].sum())  # the batch holds each shared sequence once
        return Generation(token_ids, row_log_probs, stopped, prefill_tokens)

    @torch.no_grad()
    def decode_shared(
        self,
        inputs: dict[str, torch.Tensor],
        rows: Sequence[int],
        max_new_tokens: int,
        processors: LogitsProcessorList,
        stop_ids: Sequence[int],
        settings: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(new tokens [R, T], their raw fp32 logits [R, T, V]) for R rows continuing the batch's rows.

        The prefill is `generate`'s own first step on the distinct rows (its positions, cache and rope
        state; its token is discarded); the cache is copied to the rows, which then decode as
        `generate`'s greedy loop does (processors, then argmax) until every row has written a stop
        token (what a row writes after its stop token is cut off by the caller)."""
        index = torch.tensor(rows, device=self.device)
        first = self.model.generate(**inputs, max_new_tokens=1, **settings)
        cache = first.past_key_values
        cache.reorder_cache(index)
        sequence = inputs["input_ids"][index]
        attention_mask = inputs["attention_mask"][index]
        logits = first.logits[0][index].float()
        stop = torch.tensor(stop_ids, device=self.device)
        unfinished = torch.ones(len(rows), dtype=torch.bool, device=self.device)
        steps = []
        for step in range(max_new_tokens):
            if step > 0:
                out = self.model(
                    input_ids=sequence[:, -1:],
                    attention_mask=attention_mask,
                    position_ids=self.decode_position_ids(attention_mask, index),
                    past_key_values=cache,
                    use_cache=True,
                )
                logits = out.logits[:, -1].float()
            steps.append(logits)
            token = processors(sequence, logits).argmax(-1)
            sequence = torch.cat([sequence, token[:, None]], dim=-1)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(rows), 1)], dim=-1)
            unfinished &= ~torch.isin(token, stop)
            if not unfinished.any():
                break
        return sequence[:, inputs["input_ids"].shape[1] :], torch.stack(steps, dim=1)

    def generate_turn(
        self,
        sequences: Sequence[Segment],
        max_new_tokens: int,
        keys: Sequence[NoiseKey] | None = None,
        temperature: float = 1.0,
        stop_tokens: Sequence[str] = (IM_END, TOOL_CALL_END),
        banned_tokens: Sequence[str] = (),
        prefix_groups: Sequence[int] | None = None,
    ) -> Generation:
        """`generate` on whole conversations (left-padded together): the rollout engine's turn step;
        `vlm_rl.vllm_engine.VLLMTurnGenerator` does the same on vLLM.

        `prefix_groups` gives each row an id; rows with one id hold the same sequence (e.g. a tree
        rollout's siblings, which continue one conversation), which is then prefilled once and its
        key/value cache shared by them, with the tokens and log-probs of the unshared call.

        Rows of very different lengths are generated in separate calls (`length_buckets`); a row's
        tokens depend on its key alone, so they are the same either way (log-probs to float rounding)."""
        for name, given in (("sampling keys", keys), ("prefix_groups ids", prefix_groups)):
            if given is not None and len(given) != len(sequences):
                raise ValueError(f"{len(given)} {name} for {len(sequences)} sequences")
        if prefix_groups is not None:
            shared_prefixes(sequences, prefix_groups)  # the check, naming rows as the caller numbers them
        options = {"temperature": temperature, "stop_tokens": stop_tokens, "banned_tokens": banned_tokens}
        buckets, parts = length_buckets([len(sequence) for sequence in sequences]), []
        for rows in buckets:
            part = [sequences[row] for row in rows]
            if prefix_groups is None:
                batch, shared = self.collate(part, "left"), None
            else:
                distinct, shared = shared_prefixes(part, [prefix_groups[row] for row in rows])
                batch = self.collate([part[row] for row in distinct], "left")
            part_keys = None if keys is None else [keys[row] for row in rows]
            parts.append(self.generate(batch, max_new_tokens, keys=part_keys, rows=shared, **options))
        return Generation.gather(parts, buckets)

    def token_ids_of(self, tokens: Sequence[str]) -> list[int]:
        """Ids of tokens that must each be one token of the vocabulary (stop and banned tokens)."""
        ids = [self.tokenizer.convert_tokens_to_ids(token) for token in tokens]
        if any(token_id is None or token_id == self.tokenizer.unk_token_id for token_id in ids):
            raise ValueError(
                f"stop and banned tokens must each be one token of the vocabulary: {list(tokens)}"
            )
        return ids


class KeyedGumbel(LogitsProcessor):
    """Turns greedy decoding into sampling at `temperature`: adds Gumbel noise keyed by each row's
    NoiseKey with the token's index as its stream (argmax of logits / T + Gumbel samples softmax(logits
    / T)). Runs after the processors that set banned tokens to -inf, which stay -inf."""

    def __init__(self, keys: Sequence[NoiseKey], temperature: float, prompt_length: int) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
        self.keys, self.temperature, self.prompt_length = list(keys), temperature, prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        index = input_ids.shape[1] - self.prompt_length
        keys = [replace(key, stream=index) for key in self.keys]
        uniform = keyed_rand_batch((scores.shape[-1],), keys, device=scores.device).clamp_(1e-20, 1.0 - 1e-7)
        return scores.float() / self.temperature - torch.log(-torch.log(uniform))


class QwenVLAdapter(VLMAdapter):
    """Qwen2-VL and Qwen2.5-VL: one ``<|image_pad|>`` per merged patch, 3D M-RoPE positions."""

    model_classes: ClassVar[dict[str, type[PreTrainedModel]]] = {
        "qwen2_vl": Qwen2VLForConditionalGeneration,
        "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
    }
    image_processor_class = Qwen2VLImageProcessorPil  # the default class needs torchvision

    @staticmethod
    def tiny(vocabulary: Sequence[str], spec: TinyVLMSpec | None = None, seed: int = 0) -> QwenVLAdapter:
        spec = spec or TinyVLMSpec()
        if spec.architecture not in QwenVLAdapter.model_classes:
            raise ValueError(f"architecture must be one of {sorted(QwenVLAdapter.model_classes)}")
        tokenizer = build_chat_tokenizer(vocabulary, spec.max_positions)
        # rotary frequencies per head, split over (time, height, width) like Qwen2-VL's 16:24:24
        half = spec.hidden // spec.heads // 2
        height = (half - half // 4) // 2
        mrope_section = [half // 4, height, half - half // 4 - height]
        text = {
            "hidden_size": spec.hidden,
            "intermediate_size": 2 * spec.hidden,
            "num_hidden_layers": spec.layers,
            "num_attention_heads": spec.heads,
            "num_key_value_heads": spec.kv_heads,
            "max_position_embeddings": spec.max_positions,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": mrope_section},
        }
        vision = {
            "depth": spec.vision_depth,
            "num_heads": spec.vision_heads,
            "patch_size": spec.patch_size,
            "spatial_merge_size": spec.merge_size,
            "temporal_patch_size": 2,
        }
        if spec.architecture == "qwen2_vl":
            vision |= {"embed_dim": spec.vision_width, "hidden_size": spec.hidden, "mlp_ratio": 2}
        else:
            vision |= {
                "hidden_size": spec.vision_width,
                "intermediate_size": 2 * spec.vision_width,
                "out_hidden_size": spec.hidden,
                "window_size": 2 * spec.patch_size * spec.merge_size,  # 2x2 merged tokens per window
                "fullatt_block_indexes": [spec.vision_depth - 1],
            }
        image_processor = Qwen2VLImageProcessorPil(
            min_pixels=spec.min_pixels,
            max_pixels=spec.max_pixels,
            patch_size=spec.patch_size,
            merge_size=spec.merge_size,
            temporal_patch_size=2,
        )
        return QwenVLAdapter.build(spec.architecture, text, vision, tokenizer, image_processor, seed)

    @staticmethod
    def build(
        architecture: str,
        text: dict[str, Any],
        vision: dict[str, Any],
        tokenizer: PreTrainedTokenizerFast,
        image_processor: Qwen2VLImageProcessorPil,
        seed: int = 0,
    ) -> QwenVLAdapter:
        """A new model of `architecture` from its text and vision config entries (sizes), its token ids
        and vocabulary size taken from `tokenizer` (a `build_chat_tokenizer`), weights from `seed`."""
        ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
        text = {
            **text,
            "vocab_size": len(tokenizer),
            "bos_token_id": ids[PAD],
            "eos_token_id": ids[IM_END],
            "pad_token_id": ids[PAD],
        }
        config_class = Qwen2VLConfig if architecture == "qwen2_vl" else Qwen2_5_VLConfig
        config = config_class(
            text_config=text,
            vision_config=vision,
            image_token_id=ids[IMAGE_PAD],
            video_token_id=ids[VIDEO_PAD],
            vision_start_token_id=ids[VISION_START],
            vision_end_token_id=ids[VISION_END],
            tie_word_embeddings=True,
        )
        torch.manual_seed(seed)
        model = QwenVLAdapter.model_classes[architecture](config).eval()
        model.generation_config.eos_token_id = ids[IM_END]
        model.generation_config.pad_token_id = ids[PAD]
        return QwenVLAdapter(model, tokenizer, image_processor)

    def resized_size(self, image: Image.Image) -> tuple[int, int]:
        width, height = safe_size(image.size)
        processor = self.image_processor
        try:
            height, width = smart_resize(
                height,
                width,
                factor=processor.patch_size * processor.merge_size,
                min_pixels=processor.size["shortest_edge"],
                max_pixels=processor.size["longest_edge"],
            )
        except ValueError as err:  # smart_resize's one refusal: too extreme an aspect ratio
            raise ImageSizeError(
                f"image of {image.width}x{image.height} pixels cannot be resized for the model ({err})"
            ) from None
        return width, height

    def encode_image(self, image: Image.Image) -> ImageInput:
        self.resized_size(image)  # the processor's own refusal, raised as ImageSizeError
        image = safe_image(image)
        processed = self.image_processor(images=[image], return_tensors="pt")
        grid = processed["image_grid_thw"][0]
        patch, merge = self.image_processor.patch_size, self.image_processor.merge_size
        return ImageInput(
            pixel_values=processed["pixel_values"],
            grid_thw=grid,
            num_tokens=int(grid.prod()) // merge**2,
            size=(int(grid[2]) * patch, int(grid[1]) * patch),
            image=image,
        )

    def image_token_ids(self, image: ImageInput) -> list[int]:
        return [self.image_token_id] * image.num_tokens  # the template already wrote vision start/end

    def vision_token_ids(self) -> list[int]:
        config = self.model.config
        return [
            config.image_token_id,
            config.video_token_id,
            config.vision_start_token_id,
            config.vision_end_token_id,
        ]

    def decode_position_ids(self, attention_mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        # a token after the prompt's last (text) token sits at its unpadded index plus the row's M-RoPE
        # offset (images take fewer positions than tokens), which the prefill left in rope_deltas
        deltas = self.model.base_model.rope_deltas[rows]
        positions = attention_mask.sum(-1, keepdim=True) - 1 + deltas
        return positions[None].expand(3, -1, -1)

    def sequence_position_ids(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # the model's own M-RoPE index (3 x B x L), as its forward computes it from the batch's images
        positions, _ = self.model.base_model.get_rope_index(
            batch["input_ids"],
            mm_token_type_ids=batch["mm_token_type_ids"],
            image_grid_thw=batch.get("image_grid_thw"),
            attention_mask=batch["attention_mask"],
        )
        return positions

    def image_inputs(self, input_ids: torch.Tensor, images: list[ImageInput]) -> dict[str, torch.Tensor]:
        # transformers 5.x needs mm_token_type_ids (1 at image tokens) to compute M-RoPE positions; with
        # them the model counts each row's positions without its padding
        inputs = {"mm_token_type_ids": (input_ids == self.image_token_id).long()}
        if images:
            inputs["pixel_values"] = torch.cat([image.pixel_values for image in images])
            inputs["image_grid_thw"] = torch.stack([image.grid_thw for image in images])
        return inputs


FAMILIES: tuple[type[VLMAdapter], ...] = (QwenVLAdapter,)
