"""Loading a chat-VLM checkpoint directory as a `VLMAdapter` (`vlm_rl.models`): `load(path)`, and the
checks of what the directory holds, made before any weights are read.

A directory is a local transformers checkpoint of a supported family (`FAMILIES`: Qwen2-VL and
Qwen2.5-VL), as `VLMAdapter.save_pretrained` writes it or as the hub ships it: config.json, safetensors
weights, tokenizer files and preprocessor_config.json. Nothing is read from the network.
``load(path, weights=False)`` builds the same adapter from config.json alone, in the dtype it was saved
in, with random weights in the current default device: under ``torch.device("meta")``, a real model to
plan (`mmrl train --dry-run`) without reading or allocating its weights.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoConfig

from mmrl.config import ConfigError, describe_saved_model, read_json_object
from mmrl.precision import default_dtype
from vlm_rl.models import FAMILIES, VLMAdapter

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# what transformers and safetensors raise for a file that is missing, malformed or of another model
LOAD_ERRORS = (OSError, ValueError, KeyError, RuntimeError, SafetensorError)
REMAKE = (
    "give a folder written by VLMAdapter.save_pretrained (e.g. `mmrl pretrain vlm`) or a local "
    "Qwen2-VL / Qwen2.5-VL checkpoint"
)


def load(
    path: str | Path,
    *,
    weights: bool = True,
    dtype: torch.dtype | str = "auto",
    attn_implementation: str | None = None,
) -> VLMAdapter:
    """The checkpoint in the local directory `path` (never the network), with the family class its
    config names, its model in `dtype` with `attn_implementation`. With `weights` False, the model built
    from config.json alone, in the dtype it was saved in, with random weights in the current default
    device (`dtype` and `attn_implementation` are not used).

    A directory of another model, or with files missing, malformed or of another model, is a
    ConfigError (or FileNotFoundError) that says what was found."""
    directory = Path(path)
    if not weights:
        return _from_config(directory)
    model_type = check_checkpoint(directory)
    family = next(family for family in FAMILIES if model_type in family.model_classes)
    try:
        model, info = family.model_classes[model_type].from_pretrained(
            directory,
            dtype=dtype,
            attn_implementation=attn_implementation,
            local_files_only=True,
            output_loading_info=True,
        )
        tokenizer, image_processor = family.load_processors(directory)
    except LOAD_ERRORS as err:
        reason = " ".join(str(err).split())
        raise ConfigError(
            f"{str(directory)!r}: the {model_type} checkpoint does not load ({reason}): {REMAKE}"
        ) from None
    if info["missing_keys"]:  # transformers would start them at random
        missing = sorted(info["missing_keys"])
        raise ConfigError(
            f"{str(directory)!r}: the weights lack {len(missing)} of the {model_type} model's tensors "
            f"(e.g. {missing[0]!r}), so they were saved from another model: {REMAKE}"
        )
    return family(model, tokenizer, image_processor)


def _from_config(directory: Path) -> VLMAdapter:
    """The checkpoint's adapter with the model built from its config.json alone, in the dtype it was
    saved in, with random weights in the current default device."""
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{str(directory)!r} has no config.json")
    model_type = read_json_object(directory / "config.json", REMAKE).get("model_type")
    family = next((f for f in FAMILIES if model_type in f.model_classes), None)
    if family is None:
        known = sorted(name for f in FAMILIES for name in f.model_classes)
        raise ConfigError(f"{str(directory)!r}: model_type {model_type!r} is not one of {', '.join(known)}")
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    saved = config.dtype or torch.float32
    dtype = getattr(torch, saved.removeprefix("torch.")) if isinstance(saved, str) else saved
    with default_dtype(dtype):
        model = family.model_classes[model_type](config)
    return family(model, *family.load_processors(directory))


def check_checkpoint(directory: Path) -> str:
    """The model_type of a local checkpoint directory of a supported family; FileNotFoundError names what
    the directory lacks, ConfigError what else it holds (read before loading: transformers builds a
    default-sized model from another model's config)."""
    if not directory.is_dir():
        raise FileNotFoundError(
            f"{str(directory)!r} is not a directory: give a local folder written by save_pretrained "
            "(config.json, model weights, tokenizer files, preprocessor_config.json)"
        )
    model_type = None
    if (directory / "config.json").is_file():
        config = read_json_object(directory / "config.json", REMAKE)
        model_type = config.get("model_type")
        if not any(model_type in family.model_classes for family in FAMILIES):
            what = describe_saved_model(config)
            known = sorted(name for family in FAMILIES for name in family.model_classes)
            raise ConfigError(
                f"{str(directory)!r} holds {what}, not a chat VLM of a supported model_type "
                f"({', '.join(known)}): {REMAKE}"
            )
    missing = [
        name for name in ("config.json", "preprocessor_config.json") if not (directory / name).is_file()
    ]
    for group in (WEIGHT_FILES, TOKENIZER_FILES):
        if not any((directory / name).is_file() for name in group):
            missing.append(" or ".join(group))
    if missing:
        raise FileNotFoundError(f"checkpoint directory {str(directory)!r} has no {', '.join(missing)}")
    return model_type
