"""Qwen2.5-VL-3B-Instruct as a config, and a tiny replica of it.

`FULL` is the published config's text and vision entries (Qwen/Qwen2.5-VL-3B-Instruct); `build_full`
makes the model at full size with random weights (on the meta device for a memory plan, on a GPU for a
benchmark). The replica (`mmrl replica qwen25vl_3b`) is the same class, saved by `save_pretrained`
with a tokenizer and image processor, loaded by `vlm_rl.loading.load` as the real checkpoint is.
`TINY` overrides sizes only; kept are grouped-query attention (8 query heads per key/value head),
M-RoPE's 2 : 3 : 3 split of the rotary frequencies over time, height and width, SwiGLU, tied embeddings,
the vision tower's 14-pixel patches, 2x2 merging, 112-pixel attention windows with full attention in
the last block of every group, and the merger into the text width. The tokenizer is word-level over
the zoom task's words (the real one is Qwen's BPE); the image processor limits images to 112x112.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
)

from mmrl.precision import default_dtype
from mmrl.registry import REPLICAS
from mmrl.resources import check_replica_weights_fit
from vlm_rl.data import DataConfig, task_vocabulary
from vlm_rl.models import QwenVLAdapter, build_chat_tokenizer

ARCHITECTURE = "qwen2_5_vl"

FULL: dict[str, dict[str, Any]] = {
    "text": {
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 128000,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
        "tie_word_embeddings": True,
    },
    "vision": {
        "depth": 32,
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "out_hidden_size": 2048,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "hidden_act": "silu",
    },
}
TINY: dict[str, dict[str, Any]] = {
    "text": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,  # head width 16; 8 query heads per key/value head, as 16 / 2
        "num_key_value_heads": 1,
        "max_position_embeddings": 4096,
        # the 8 rotary frequencies of a 16-wide head split 2 : 3 : 3, as 16 : 24 : 24 of 64
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
    },
    "vision": {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 128,  # the text width
        "fullatt_block_indexes": [1],  # full attention closes every group of window blocks
    },
}


def configs(tiny: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    text, vision = copy.deepcopy(FULL["text"]), copy.deepcopy(FULL["vision"])
    if tiny:
        text |= copy.deepcopy(TINY["text"])
        vision |= copy.deepcopy(TINY["vision"])
    return text, vision


def build_full() -> Qwen2_5_VLForConditionalGeneration:
    """The full-size model with random weights in the current default device (`with
    torch.device("meta"):` allocates nothing)."""
    text, vision = configs(tiny=False)
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision))


def full_size_tokenizer(words: list[str], max_length: int) -> PreTrainedTokenizerFast:
    """The replica's word-level tokenizer padded with unused words up to the published vocabulary
    (151936), so that a full-size model's embedding and output layer cost what the real one's do and
    every id it samples decodes."""
    short = len(build_chat_tokenizer(words, max_length))
    missing = FULL["text"]["vocab_size"] - short
    fillers = [f"unused{i}" for i in range((missing + 1) // 2)]  # each word is a token bare and spaced
    return build_chat_tokenizer([*words, *fillers], max_length)


@REPLICAS.register("qwen25vl_3b")
def qwen25vl_3b(
    directory: str | Path, seed: int = 0, full: bool = False, weights: bool | None = None, device: str = "cpu"
) -> Path:
    """Qwen2.5-VL-3B-Instruct: Qwen2_5_VLForConditionalGeneration with its window-attention vision tower.
    `full`: the published sizes, with the replica's tokenizer (`full_size_tokenizer`) and image
    processor. `weights` (default: only for the tiny replica) writes random weights, built on `device`,
    in bfloat16 at full size (on a GPU, for `mmrl bench gpu`); without them only the config is written."""
    directory = Path(directory)
    weights = not full if weights is None else weights
    if full and weights:
        check_replica_weights_fit("qwen25vl_3b", lambda: [build_full()], device)
    text, vision = configs(tiny=not full)
    words, max_length = task_vocabulary(DataConfig()), TINY["text"]["max_position_embeddings"]
    tokenizer = full_size_tokenizer(words, max_length) if full else build_chat_tokenizer(words, max_length)
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=56 * 56,
        max_pixels=112 * 112,
        patch_size=vision["patch_size"],
        merge_size=vision["spatial_merge_size"],
        temporal_patch_size=vision["temporal_patch_size"],
    )
    dtype = torch.bfloat16 if full and weights else torch.float32
    with torch.device(device if weights else "meta"), default_dtype(dtype):
        adapter = QwenVLAdapter.build(ARCHITECTURE, text, vision, tokenizer, image_processor, seed)
    if weights:
        adapter.save_pretrained(directory)
        return directory
    adapter.model.config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    image_processor.save_pretrained(directory)
    return directory
