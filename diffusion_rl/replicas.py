"""The real text-to-image models the GPU recipes name, as configs, and tiny replicas of them.

`FULL` holds each model's component configs as published with its weights (hub ids in comments).
They build the real architecture at full size with random weights (`build_full`: on the meta device for
a memory plan, on a GPU for a benchmark) without downloading anything.

A replica (`save_replica`, `mmrl replica NAME`) is the same pipeline class with the same component
classes, saved by `save_pretrained` in the same layout, so a recipe loads it by the code path that
loads the real weights. `TINY` overrides only sizes: widths, depths, heads, vocabularies (tokenizers
are built locally for the shapes prompts and fall back to characters for other words). What the
code depends on is kept: latent channels and the VAE's 8x downsampling, patching, FLUX's guidance
embedding and RoPE axes (scaled with the head width), SD3.5's dual-attention blocks and q/k norm,
three text encoders for SD3.5 and two for FLUX, pooled and joint widths that agree with the text
encoders, and the schedulers unchanged.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
)
from transformers import (
    CLIPConfig,
    CLIPModel,
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    T5Config,
    T5EncoderModel,
)

from diffusion_rl.models import build_clip_tokenizer, build_t5_tokenizer
from diffusion_rl.shapes import vocabulary
from mmrl.config import ConfigError
from mmrl.precision import default_dtype
from mmrl.registry import REPLICAS
from mmrl.resources import check_replica_weights_fit

_VAE_16CH = {  # SD3.5 and FLUX.1 share the 16-channel, 8x-downsampling VAE layout
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "latent_channels": 16,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
_CLIP_L = {  # openai/clip-vit-large-patch14's text tower
    "vocab_size": 49408,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 77,
    "projection_dim": 768,
    "hidden_act": "quick_gelu",
}
_CLIP_G = {  # laion CLIP-ViT-bigG-14's text tower
    "vocab_size": 49408,
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "num_hidden_layers": 32,
    "num_attention_heads": 20,
    "max_position_embeddings": 77,
    "projection_dim": 1280,
    "hidden_act": "gelu",
}
_T5_XXL = {  # google/t5-v1_1-xxl's encoder
    "vocab_size": 32128,
    "d_model": 4096,
    "d_kv": 64,
    "d_ff": 10240,
    "num_layers": 24,
    "num_heads": 64,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "feed_forward_proj": "gated-gelu",
    "is_encoder_decoder": False,
}

FULL: dict[str, dict[str, dict[str, Any]]] = {
    "sd35m": {  # stabilityai/stable-diffusion-3.5-medium
        "transformer": {
            "sample_size": 128,
            "patch_size": 2,
            "in_channels": 16,
            "out_channels": 16,
            "num_layers": 24,
            "attention_head_dim": 64,
            "num_attention_heads": 24,
            "joint_attention_dim": 4096,
            "caption_projection_dim": 1536,
            "pooled_projection_dim": 2048,
            "pos_embed_max_size": 384,
            "dual_attention_layers": list(range(13)),
            "qk_norm": "rms_norm",
        },
        "vae": {**_VAE_16CH, "scaling_factor": 1.5305, "shift_factor": 0.0609},
        "text_encoder": _CLIP_L,
        "text_encoder_2": _CLIP_G,
        "text_encoder_3": _T5_XXL,
        "scheduler": {"num_train_timesteps": 1000, "shift": 3.0},
    },
    "flux_dev": {  # black-forest-labs/FLUX.1-dev
        "transformer": {
            "patch_size": 1,
            "in_channels": 64,
            "num_layers": 19,
            "num_single_layers": 38,
            "attention_head_dim": 128,
            "num_attention_heads": 24,
            "joint_attention_dim": 4096,
            "pooled_projection_dim": 768,
            "guidance_embeds": True,
            "axes_dims_rope": [16, 56, 56],
        },
        "vae": {**_VAE_16CH, "scaling_factor": 0.3611, "shift_factor": 0.1159},
        "text_encoder": _CLIP_L,
        "text_encoder_2": _T5_XXL,
        "scheduler": {
            "num_train_timesteps": 1000,
            "shift": 3.0,
            "use_dynamic_shifting": True,
            "base_shift": 0.5,
            "max_shift": 1.15,
            "base_image_seq_len": 256,
            "max_image_seq_len": 4096,
        },
    },
    "pickscore": {  # yuvalkirstain/PickScore_v1: a CLIP ViT-H/14 fine-tuned on Pick-a-Pic preferences
        "model": {
            "projection_dim": 1024,
            "text_config": {
                "vocab_size": 49408,
                "hidden_size": 1024,
                "intermediate_size": 4096,
                "num_hidden_layers": 24,
                "num_attention_heads": 16,
                "max_position_embeddings": 77,
                "hidden_act": "gelu",
            },
            "vision_config": {
                "hidden_size": 1280,
                "intermediate_size": 5120,
                "num_hidden_layers": 32,
                "num_attention_heads": 16,
                "image_size": 224,
                "patch_size": 14,
                "hidden_act": "gelu",
            },
        },
    },
}

_TINY_VAE = {
    "block_out_channels": [8, 8, 16, 16],
    "layers_per_block": 1,
    "norm_num_groups": 4,
    "sample_size": 64,
}
_TINY_CLIP = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "projection_dim": 16,
}
_TINY_T5 = {
    "d_model": 32,
    "d_kv": 8,
    "d_ff": 64,
    "num_layers": 1,
    "num_heads": 4,
    "relative_attention_num_buckets": 8,
}

TINY: dict[str, dict[str, dict[str, Any]]] = {
    "sd35m": {
        "transformer": {
            "sample_size": 8,
            "num_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,  # the T5 width; the two CLIP widths (16 + 16) are padded to it
            "caption_projection_dim": 32,
            "pooled_projection_dim": 32,  # the two CLIP projections concatenated
            "pos_embed_max_size": 16,
            "dual_attention_layers": [0],
        },
        "vae": _TINY_VAE,
        "text_encoder": _TINY_CLIP,
        "text_encoder_2": _TINY_CLIP,
        "text_encoder_3": _TINY_T5,
        "scheduler": {},
    },
    "flux_dev": {
        "transformer": {
            "num_layers": 1,
            "num_single_layers": 1,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,  # the T5 width
            "pooled_projection_dim": 16,  # the CLIP projection width
            "axes_dims_rope": [4, 6, 6],  # even (RoPE pairs), summing to the head width as 16 + 56 + 56 = 128
        },
        "vae": _TINY_VAE,
        "text_encoder": _TINY_CLIP,
        "text_encoder_2": _TINY_T5,
        "scheduler": {},
    },
    "pickscore": {
        "model": {
            "projection_dim": 16,
            "text_config": {**_TINY_CLIP, "projection_dim": 16},
            "vision_config": {
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "image_size": 32,
                "patch_size": 8,
            },
        },
    },
}

TOKENS = 32  # the replicas' tokenizer length (SD3's CLIP 77 / T5 256, FLUX's 512 at full size)


def merged(full: dict[str, Any], tiny: dict[str, Any]) -> dict[str, Any]:
    """`full` with `tiny`'s values, nested dicts merged key by key."""
    out = copy.deepcopy(full)
    for key, value in tiny.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and key in out else copy.deepcopy(value)
    return out


def component_configs(name: str, tiny: bool) -> dict[str, dict[str, Any]]:
    if name not in FULL:
        raise ConfigError(f"unknown model {name!r}: choose one of {', '.join(FULL)}")
    if not tiny:
        return copy.deepcopy(FULL[name])
    return {part: merged(config, TINY[name][part]) for part, config in FULL[name].items()}


def _text_encoder(config: dict[str, Any], vocab_size: int, projection: bool) -> torch.nn.Module:
    text = CLIPTextConfig(
        **{**config, "vocab_size": vocab_size, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1}
    )
    return CLIPTextModelWithProjection(text) if projection else CLIPTextModel(text)


def _t5(config: dict[str, Any], vocab_size: int) -> T5EncoderModel:
    return T5EncoderModel(
        T5Config(
            **{
                **config,
                "vocab_size": vocab_size,
                "pad_token_id": 0,
                "eos_token_id": 1,
                "decoder_start_token_id": 0,
            }
        )
    )


def build(name: str, tiny: bool) -> Any:
    """The model with random weights in the current default device: the diffusers pipeline
    (StableDiffusion3Pipeline, FluxPipeline), or for PickScore (CLIPModel, tokenizer, image processor).
    Tokenizers are built for the shapes prompts; tiny, the text encoders' vocabularies and positions
    are theirs, full size the published ones."""
    configs = component_configs(name, tiny)
    words = vocabulary()
    clip_tokenizer = build_clip_tokenizer(words, max_length=TOKENS)
    clip_vocab = len(clip_tokenizer) if tiny else None
    positions = {"max_position_embeddings": TOKENS} if tiny else {}
    if name == "pickscore":
        from transformers import CLIPImageProcessor  # imported here: it warns that torchvision is absent

        model_config = configs["model"]
        text = {
            **model_config["text_config"],
            **positions,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": 1,
        }
        model_config["text_config"] = {**text, "vocab_size": clip_vocab or text["vocab_size"]}
        size = model_config["vision_config"]["image_size"]
        processor = CLIPImageProcessor(
            size={"shortest_edge": size}, crop_size={"height": size, "width": size}
        )
        return CLIPModel(CLIPConfig(**model_config)), clip_tokenizer, processor
    # the pipelines' modules import transformers' image processors, which warn that torchvision is absent
    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    t5_tokenizer = build_t5_tokenizer(words, max_length=TOKENS)

    def clip(part: str, projection: bool) -> torch.nn.Module:
        config = {**configs[part], **positions}
        return _text_encoder(config, clip_vocab or config["vocab_size"], projection)

    def t5(part: str) -> T5EncoderModel:
        return _t5(configs[part], len(t5_tokenizer) if tiny else configs[part]["vocab_size"])

    common = {
        "transformer": (FluxTransformer2DModel if name == "flux_dev" else SD3Transformer2DModel)(
            **configs["transformer"]
        ),
        "scheduler": FlowMatchEulerDiscreteScheduler(**configs["scheduler"]),
        "vae": AutoencoderKL(**configs["vae"]),
        "tokenizer": clip_tokenizer,
    }
    if name == "sd35m":
        return StableDiffusion3Pipeline(
            **common,
            text_encoder=clip("text_encoder", projection=True),
            text_encoder_2=clip("text_encoder_2", projection=True),
            tokenizer_2=clip_tokenizer,
            text_encoder_3=t5("text_encoder_3"),
            tokenizer_3=t5_tokenizer,
        )
    return FluxPipeline(
        **common,
        text_encoder=clip("text_encoder", projection=False),
        text_encoder_2=t5("text_encoder_2"),
        tokenizer_2=t5_tokenizer,
    )


def build_full(name: str) -> dict[str, torch.nn.Module]:
    """Every network of the real model at full size with random weights, in the current default device
    (`with torch.device("meta"):` allocates nothing), by component name."""
    built = build(name, tiny=False)
    if name == "pickscore":
        return {"model": built[0]}
    return {part: module for part, module in built.components.items() if isinstance(module, torch.nn.Module)}


def save_replica(
    name: str,
    directory: str | Path,
    seed: int = 0,
    full: bool = False,
    weights: bool | None = None,
    device: str = "cpu",
) -> Path:
    """Write the replica of `name` with save_pretrained: a diffusers pipeline directory for the
    text-to-image models (diffusion_rl.loading.load reads it as it reads the real one), a CLIPModel
    with its tokenizer and image processor for PickScore (the `pickscore` reward's model_path).

    `full`: the real model's sizes. `weights` (default: only for the tiny replica) writes random
    weights, built on `device`, in bfloat16 at full size (on a GPU, for `mmrl bench gpu`). Without
    them the files are the configs, tokenizers and scheduler: enough for `mmrl train RECIPE --dry-run`
    to plan the real model; loading it for training fails for want of weights."""
    directory = Path(directory)
    weights = not full if weights is None else weights
    if full and weights:
        check_replica_weights_fit(name, lambda: build_full(name).values(), device)
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if full and weights else torch.float32
    with torch.device(device if weights else "meta"), default_dtype(dtype):
        built = build(name, tiny=not full)
    if name == "pickscore":
        model, tokenizer, processor = built
        if weights:
            model.save_pretrained(directory)
        else:
            model.config.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        processor.save_pretrained(directory)
        return directory
    if weights:
        built.save_pretrained(directory, safe_serialization=True)
        return directory
    built.save_config(directory)  # model_index.json
    for part, component in built.components.items():
        if isinstance(component, torch.nn.Module) and hasattr(component, "save_config"):
            component.save_config(directory / part)  # diffusers networks: config.json
        elif isinstance(component, torch.nn.Module):
            component.config.save_pretrained(directory / part)  # transformers networks
        elif component is not None:
            component.save_pretrained(directory / part)  # tokenizers, scheduler
    return directory


@REPLICAS.register("sd35m")
def sd35m(
    directory: str | Path, seed: int = 0, full: bool = False, weights: bool | None = None, device: str = "cpu"
) -> Path:
    """Stable Diffusion 3.5 Medium: StableDiffusion3Pipeline, MMDiT-X transformer, CLIP-L, CLIP-G, T5."""
    return save_replica("sd35m", directory, seed, full, weights, device)


@REPLICAS.register("flux_dev")
def flux_dev(
    directory: str | Path, seed: int = 0, full: bool = False, weights: bool | None = None, device: str = "cpu"
) -> Path:
    """FLUX.1-dev: FluxPipeline, guidance-distilled transformer, CLIP-L and T5."""
    return save_replica("flux_dev", directory, seed, full, weights, device)


@REPLICAS.register("pickscore")
def pickscore(
    directory: str | Path, seed: int = 0, full: bool = False, weights: bool | None = None, device: str = "cpu"
) -> Path:
    """PickScore v1: a CLIP ViT-H/14 model with its tokenizer and image processor."""
    return save_replica("pickscore", directory, seed, full, weights, device)
