"""Text-to-image diffusion models behind one small interface the trainers use, in flow coordinates.

`FlowPipeline` holds a diffusers denoiser, the text encoding and optionally a VAE. Every model is
driven as a flow-matching model: x_sigma = (1 - sigma) * x0 + sigma * noise, v = noise - x0, with
sigma from 1 (noise) to 0 (data). Three families plug in:

- flow transformers (SD3Transformer2DModel; FlowMatchEulerDiscreteScheduler), which predict the
  velocity (or, for the tiny pixel-space model, optionally the clean sample);
- FLUX.1 transformers (FluxTransformer2DModel; FluxPipeline), which predict the velocity of packed
  latents. The trainers see plain [C, H, W] latents (`latent_shape`); every model call packs them
  into FLUX's 2x2 patch tokens with their position ids and unpacks the output (`_call_flux`). The sigma
  schedule is FluxPipeline's: the scheduler's resolution-dependent shift (mu, from the number of
  image tokens). `guidance_scale` is FLUX.1-dev's embedded guidance (see `FlowPipeline.velocity`);
- DDPM/DDIM UNets (UNet2DConditionModel, SD1.x style; any scheduler with `alphas_cumprod`), which
  predict noise (epsilon) or v. They are run through the exact change of variables of
  `diffusion_rl.sde.flow_to_vp`, under which DDIM (eta = 0) is the Euler step, so the trainers,
  the SDE steps and the tree rollouts need no second code path. The sigma schedule comes from the
  scheduler's own timesteps and ends at sigma = 0 (a clean x0, as DDIM with set_alpha_to_one).

The trainer needs `encode_prompts`, `velocity` (with classifier-free guidance), `sigmas`, `decode`
and the trainable `denoiser`. Two storage layouts are read by `from_pretrained`: the project's own
(the tiny pixel-space default: ``transformer/``, ``text_encoder/``, ``tokenizer/``, optionally
``vae/``, and ``mmrl_pipeline.json``) and any local diffusers pipeline directory
(``model_index.json``: StableDiffusion3Pipeline, FluxPipeline or StableDiffusionPipeline), whose own
``encode_prompt`` builds the conditioning. Everything is stored as safetensors.

A LoRA result (``save_lora_weights``; a run's ``final/`` with ``model.lora_rank > 0``) is a third
kind of directory: ``pytorch_lora_weights.safetensors`` in diffusers' format, with the adapter's
config (rank, alpha, targets) in the file's ``lora_adapter_metadata`` so that plain diffusers'
``load_lora_weights`` applies it at the trained strength, and ``mmrl_lora.json`` naming the base
model (``base`` as given, ``base_resolved`` as an absolute path). `from_pretrained` loads the base
and merges the adapter into it. `check_model_directory` checks any of the three kinds, a LoRA
result's base included, without loading weights.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel
from safetensors import SafetensorError, safe_open
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer, T5Tokenizer

from diffusion_rl.sde import flow_to_vp, shifted_sigmas
from mmrl.config import ConfigError, describe_saved_model, read_json_object, shipped_path

PIPELINE_FILE = "mmrl_pipeline.json"
LORA_FILE = "mmrl_lora.json"  # a LoRA result's record of its base model
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"  # diffusers' name, which load_lora_weights looks for
# What a flow model outputs: the velocity itself (SD3, FLUX), or the clean sample x0, turned into a
# velocity v = (x - x0) / sigma (for pixel-space transformers with large patches, where a velocity
# carries the input noise that a narrow token must copy through every layer).
FLOW_PREDICTIONS = ("velocity", "sample")
# What a DDPM/DDIM UNet outputs (its scheduler's prediction_type).
VP_PREDICTIONS = ("epsilon", "v_prediction", "sample")
MIN_SIGMA_DIVISOR = 0.05  # v = (x - x0) / max(sigma, this): bounded near sigma = 0
MIN_SQRT_ALPHA_BAR = 1e-4
SPECIAL_TOKENS = ["<|startoftext|>", "<|endoftext|>"]
DENOISERS = {"transformer": SD3Transformer2DModel, "unet": UNet2DConditionModel}  # folder -> class
# what transformers, diffusers and safetensors raise for a file that is missing, malformed or of another model
LOAD_ERRORS = (OSError, ValueError, KeyError, RuntimeError, SafetensorError)
REMAKE = (
    "give a directory written by FlowPipeline.save_pretrained (e.g. `mmrl pretrain diffusion`), a "
    "diffusers pipeline directory or a LoRA result (a run's final/)"
)


SUPPORTED_PIPELINES = (
    "FlowPipeline takes SD3-style pipelines (SD3Transformer2DModel, two or three text encoders), "
    "FLUX.1-style text-to-image pipelines (FluxTransformer2DModel, CLIP and T5 text encoders, VAE) and "
    "SD1.x-style pipelines (UNet2DConditionModel, CLIP text encoder, DDPM/DDIM-type scheduler)"
)
# what a FLUX pipeline needs besides its transformer: pooled CLIP and sequence T5 embeddings, a VAE
FLUX_PARTS = ("vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "scheduler")
WORD_START = "\u2581"  # SentencePiece's mark before every word, as T5 tokenizers write it
FLUX_MAX_SEQUENCE_LENGTH = 512  # FluxPipeline's default (and limit) for the T5 prompt tokens
SD3_MAX_SEQUENCE_LENGTH = 256  # StableDiffusion3Pipeline.encode_prompt's default for the T5 prompt tokens
PICKLE_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl")  # weight files that torch.load would unpickle
# FlowMatchEulerDiscreteScheduler options that move the first sigma off 1; our steps start from noise
FLUX_UNSUPPORTED_SCHEDULE = (
    "use_karras_sigmas",
    "use_exponential_sigmas",
    "use_beta_sigmas",
    "invert_sigmas",
)


def one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def build_clip_tokenizer(words: Sequence[str], max_length: int = 16) -> CLIPTokenizer:
    """A CLIP BPE tokenizer whose vocabulary holds every word in `words` as one token.

    The merges are learned here on the word list itself (most frequent adjacent pair first, ties
    broken alphabetically) until each word is a single ``word</w>`` token, so the same words give
    the same ids in every process; the `tokenizers` trainer breaks ties by hash order, which
    differs between processes. Any other lowercase word falls back to characters. Nothing is
    downloaded.
    """
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    vocab = {
        token: i for i, token in enumerate([*SPECIAL_TOKENS, *alphabet, *(c + "</w>" for c in alphabet)])
    }
    pieces = [[*word[:-1], word[-1] + "</w>"] for word in sorted(set(words)) if word]
    merges = []
    while True:
        counts: dict[tuple[str, str], int] = {}
        for symbols in pieces:
            for pair in zip(symbols, symbols[1:], strict=False):
                counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            break
        best = min(counts, key=lambda pair: (-counts[pair], pair))
        merges.append(best)
        vocab.setdefault(best[0] + best[1], len(vocab))
        for symbols in pieces:
            i = 0
            while i < len(symbols) - 1:
                if (symbols[i], symbols[i + 1]) == best:
                    symbols[i : i + 2] = [best[0] + best[1]]
                i += 1
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


def build_t5_tokenizer(words: Sequence[str], max_length: int = 16) -> T5Tokenizer:
    """A T5 (Unigram) tokenizer for tiny FLUX pipelines whose vocabulary holds every word in `words`
    as one token (WORD_START + word): <pad> = 0, </s> = 1 (ends every prompt), <unk> = 2, the bare
    WORD_START, the words, then single characters, which other words fall back to. Nothing is
    downloaded; `save_pretrained` writes tokenizer.json, which FluxPipeline.from_pretrained reads."""
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), (WORD_START, -2.0)]
    vocab += [(WORD_START + word, -1.0) for word in sorted(set(words)) if word]
    vocab += [(c, -5.0) for c in alphabet]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=max_length)


def pack_latents(x: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] latents as FLUX's tokens [B, (H/2)(W/2), 4C]: each 2x2 patch one token, row-major
    (FluxPipeline._pack_latents)."""
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), 4 * c)


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of `pack_latents`: tokens [B, (H/2)(W/2), 4C] as latents [B, C, H, W]
    (FluxPipeline._unpack_latents, with the latent size given instead of the pixel size)."""
    b, _, channels = tokens.shape
    x = tokens.view(b, height // 2, width // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, channels // 4, height, width)


def latent_image_ids(height: int, width: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """FLUX's position ids of the packed tokens of a height x width latent: (0, row, column) per 2x2
    patch, [(H/2)(W/2), 3] (FluxPipeline._prepare_latent_image_ids)."""
    ids = torch.zeros(height // 2, width // 2, 3)
    ids[..., 1] = torch.arange(height // 2)[:, None]
    ids[..., 2] = torch.arange(width // 2)[None, :]
    return ids.reshape(-1, 3).to(device=device, dtype=dtype)


@dataclass
class TinyFlowSpec:
    """Sizes of the tiny pixel-space flow model: an SD3 transformer or a UNet, and a CLIP text encoder."""

    image_size: int = 32
    backbone: str = "sd3"  # "sd3" (SD3Transformer2DModel) or "unet" (UNet2DConditionModel)
    patch_size: int = 4  # sd3
    layers: int = 4  # sd3
    heads: int = 2  # sd3
    head_dim: int = 32  # sd3
    unet_channels: tuple[int, ...] = (32, 64, 64)  # unet: channels per resolution, attention at the last
    text_hidden: int = 64
    text_layers: int = 2
    max_tokens: int = 16


@dataclass
class Conditioning:
    """Text conditioning: per-token embeddings and one pooled vector per prompt."""

    embeds: torch.Tensor
    pooled: torch.Tensor | None  # None for UNets, which take per-token embeddings only

    def __getitem__(self, index: Any) -> Conditioning:
        return Conditioning(self.embeds[index], None if self.pooled is None else self.pooled[index])

    @staticmethod
    def cat(parts: Sequence[Conditioning]) -> Conditioning:
        pooled = None if parts[0].pooled is None else torch.cat([p.pooled for p in parts])
        return Conditioning(torch.cat([p.embeds for p in parts]), pooled)

    def to(self, target: torch.dtype | torch.device) -> Conditioning:
        """The conditioning in another dtype or on another device."""
        return Conditioning(self.embeds.to(target), None if self.pooled is None else self.pooled.to(target))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.embeds, self.pooled) if t is not None)


class FlowPipeline:
    """A text-to-image model driven in flow coordinates (see the module docstring)."""

    def __init__(
        self,
        denoiser: SD3Transformer2DModel | UNet2DConditionModel,
        text_encoder: CLIPTextModelWithProjection | None = None,
        tokenizer: CLIPTokenizer | None = None,
        vae: torch.nn.Module | None = None,
        shift: float = 1.0,
        prediction: str = "velocity",
        scheduler: Any = None,
        diffusers_pipeline: Any = None,
    ) -> None:
        """`scheduler` (with `alphas_cumprod`) makes this a DDPM/DDIM model; `diffusers_pipeline`
        (the loaded diffusers pipeline) encodes prompts and saves results in its own layout."""
        self.is_vp = scheduler is not None and hasattr(scheduler, "alphas_cumprod")
        allowed = VP_PREDICTIONS if self.is_vp else FLOW_PREDICTIONS
        if prediction not in allowed:
            raise ValueError(f"unknown prediction {prediction!r}: choose one of {', '.join(allowed)}")
        if diffusers_pipeline is None and (text_encoder is None or tokenizer is None):
            raise ValueError("give a text encoder and tokenizer, or the diffusers pipeline that holds them")
        self.denoiser = denoiser
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.vae = vae
        self.shift = shift
        self.prediction = prediction
        self.scheduler = scheduler
        self.diffusers_pipeline = diffusers_pipeline
        self.source: Path | None = None  # the directory `from_pretrained` read, which a LoRA result names
        self.prompt_cache: dict[str, Conditioning] | None = None  # `cache_prompts`
        self.call_rows: int | None = None  # `_in_fixed_rows`
        for frozen in (text_encoder, vae):
            if frozen is not None:
                frozen.requires_grad_(False)
        if self.is_vp:
            alphas_cumprod = scheduler.alphas_cumprod.double()
            # log-SNR of every training timestep, increasing (t descending), to map sigma -> timestep
            self._log_snr = torch.log(alphas_cumprod / (1 - alphas_cumprod)).flip(0).numpy()
            self._timesteps = np.arange(len(alphas_cumprod), dtype=np.float64)[::-1].copy()

    # -- construction and storage ----------------------------------------------------------------

    @classmethod
    def tiny(
        cls,
        words: Sequence[str],
        spec: TinyFlowSpec | None = None,
        seed: int = 0,
        prediction: str = "velocity",
    ) -> FlowPipeline:
        """A new, untrained tiny pixel-space model for prompts made of `words`."""
        spec = spec or TinyFlowSpec()
        torch.manual_seed(seed)
        tokenizer = build_clip_tokenizer(words, spec.max_tokens)
        text_encoder = CLIPTextModelWithProjection(
            CLIPTextConfig(
                vocab_size=len(tokenizer),
                hidden_size=spec.text_hidden,
                intermediate_size=2 * spec.text_hidden,
                num_hidden_layers=spec.text_layers,
                num_attention_heads=2,
                max_position_embeddings=spec.max_tokens,
                projection_dim=spec.text_hidden,
                bos_token_id=0,
                eos_token_id=1,
                pad_token_id=1,
            )
        )
        if spec.backbone == "unet":
            levels = len(spec.unet_channels)
            denoiser = UNet2DConditionModel(
                sample_size=spec.image_size,
                in_channels=3,
                out_channels=3,
                block_out_channels=spec.unet_channels,
                layers_per_block=1,
                down_block_types=("DownBlock2D",) * (levels - 1) + ("CrossAttnDownBlock2D",),
                up_block_types=("CrossAttnUpBlock2D",) + ("UpBlock2D",) * (levels - 1),
                cross_attention_dim=spec.text_hidden,
                attention_head_dim=8,
                norm_num_groups=min(16, spec.unet_channels[0]),
            )
            return cls(denoiser, text_encoder, tokenizer, prediction=prediction)
        transformer = SD3Transformer2DModel(
            sample_size=spec.image_size,
            patch_size=spec.patch_size,
            in_channels=3,
            out_channels=3,
            num_layers=spec.layers,
            attention_head_dim=spec.head_dim,
            num_attention_heads=spec.heads,
            joint_attention_dim=spec.text_hidden,
            caption_projection_dim=spec.heads * spec.head_dim,
            pooled_projection_dim=spec.text_hidden,
            pos_embed_max_size=spec.image_size // spec.patch_size,
        )
        return cls(transformer, text_encoder, tokenizer, prediction=prediction)

    def with_denoiser(self, denoiser: torch.nn.Module) -> FlowPipeline:
        """The same pipeline around another denoiser (an EMA copy, an unwrapped training module)."""
        other = copy.copy(self)
        other.denoiser = denoiser
        return other

    def save_pretrained(self, directory: str | Path) -> None:
        """Full weights: the diffusers layout for a loaded diffusers pipeline, else the project's own."""
        directory = Path(directory)
        if self.diffusers_pipeline is not None:
            pipeline = copy.copy(self.diffusers_pipeline)
            setattr(pipeline, "unet" if self.is_unet else "transformer", self.denoiser)
            pipeline.save_pretrained(directory, safe_serialization=True)
            return
        directory.mkdir(parents=True, exist_ok=True)
        self.denoiser.save_pretrained(directory / self.denoiser_folder)
        self.text_encoder.save_pretrained(directory / "text_encoder")
        self.tokenizer.save_pretrained(directory / "tokenizer")
        if self.vae is not None:
            self.vae.save_pretrained(directory / "vae")
        settings = {
            "shift": self.shift,
            "vae": self.vae is not None,
            "prediction": self.prediction,
            "denoiser": self.denoiser_folder,
        }
        (directory / PIPELINE_FILE).write_text(json.dumps(settings, indent=1))

    def save_lora_weights(self, directory: str | Path, denoiser: torch.nn.Module, base: str) -> None:
        """The adapter of `denoiser` (this pipeline's denoiser with the peft adapter "default"), written so
        that plain diffusers' `pipe.load_lora_weights(directory)` rebuilds the trained denoiser: the
        adapter config goes into the safetensors metadata (without it diffusers assumes alpha = rank),
        and LORA_FILE names the base, `base` as given and the directory this pipeline was read from."""
        from peft.utils import get_peft_model_state_dict

        if self.source is None:
            raise ValueError("save_lora_weights needs a pipeline read by from_pretrained: its base directory")
        config = denoiser.peft_config["default"].to_dict()
        layers = get_peft_model_state_dict(denoiser)
        if self.is_unet:
            from diffusers import StableDiffusionPipeline

            StableDiffusionPipeline.save_lora_weights(
                directory, unet_lora_layers=layers, unet_lora_adapter_metadata=config, safe_serialization=True
            )
        elif self.is_flux:
            from diffusers import FluxPipeline

            FluxPipeline.save_lora_weights(
                directory,
                transformer_lora_layers=layers,
                transformer_lora_adapter_metadata=config,
                safe_serialization=True,
            )
        else:
            from diffusers import StableDiffusion3Pipeline

            StableDiffusion3Pipeline.save_lora_weights(
                directory,
                transformer_lora_layers=layers,
                transformer_lora_adapter_metadata=config,
                safe_serialization=True,
            )
        record = {
            "base": str(base),
            "base_resolved": str(self.source.resolve()),
            "denoiser": self.denoiser_folder,
            "lora_rank": config["r"],
            "lora_alpha": config["lora_alpha"],
        }
        (Path(directory) / LORA_FILE).write_text(json.dumps(record, indent=1))

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> FlowPipeline:
        """Load a directory written by `save_pretrained`, a local diffusers pipeline directory or a LoRA
        result (its base with the adapter merged in).

        A directory of another kind, or one whose files are missing, malformed or of another model,
        is a ConfigError (or FileNotFoundError) that says what was found and what is expected."""
        directory = Path(directory)
        loaders = {"own": cls.from_own_layout, "diffusers": cls.from_diffusers, "lora": cls.from_lora_result}
        pipe = loaders[directory_kind(directory)](directory)
        pipe.source = directory
        return pipe

    @classmethod
    def from_lora_result(cls, directory: Path) -> FlowPipeline:
        """A LoRA result's base with the adapter merged into the denoiser's weights. The adapter is read
        as plain diffusers reads it (`load_lora_adapter`: rank and alpha from the safetensors metadata)."""
        base, folder = check_lora_result(directory)
        pipe = cls.from_pretrained(base)
        try:
            pipe.denoiser.load_lora_adapter(
                directory,
                prefix=folder,
                weight_name=LORA_WEIGHTS,
                adapter_name="result",
                local_files_only=True,
            )
        except LOAD_ERRORS as err:
            raise ConfigError(
                f"{str(directory)!r}: the LoRA weights do not fit the base model {str(base)!r} "
                f'({one_line(err)}): write the model they were trained on as "base" in {LORA_FILE}'
            ) from None
        pipe.denoiser.fuse_lora()
        pipe.denoiser.unload_lora()
        return pipe

    @classmethod
    def from_own_layout(cls, directory: Path) -> FlowPipeline:
        """The project's layout: one folder per component and the settings in PIPELINE_FILE."""
        settings, folder = check_own_layout(directory)
        denoiser_class = DENOISERS[folder]
        try:
            vae = None
            if settings.get("vae"):
                from diffusers import AutoencoderKL

                vae = AutoencoderKL.from_pretrained(
                    directory / "vae", local_files_only=True, use_safetensors=True
                )
            denoiser = denoiser_class.from_pretrained(
                directory / folder, local_files_only=True, use_safetensors=True
            )
            text_encoder, info = CLIPTextModelWithProjection.from_pretrained(
                directory / "text_encoder",
                local_files_only=True,
                use_safetensors=True,
                output_loading_info=True,
            )
            tokenizer = CLIPTokenizer.from_pretrained(directory / "tokenizer", local_files_only=True)
        except LOAD_ERRORS as err:
            raise ConfigError(
                f"{str(directory)!r}: the pipeline does not load ({one_line(err)}): {REMAKE}"
            ) from None
        if info["missing_keys"]:  # transformers would start them at random
            raise ConfigError(
                f"{str(directory / 'text_encoder')!r}: the weights lack {len(info['missing_keys'])} of the "
                f"CLIP text encoder's tensors (e.g. {sorted(info['missing_keys'])[0]!r}): {REMAKE}"
            )
        try:
            return cls(
                denoiser,
                text_encoder,
                tokenizer,
                vae=vae,
                shift=settings.get("shift", 1.0),
                prediction=settings.get("prediction", "velocity"),
            )
        except ValueError as err:
            raise ConfigError(f"{str(directory / PIPELINE_FILE)!r}: {err}") from None

    @classmethod
    def from_configs(cls, directory: str | Path) -> FlowPipeline:
        """The pipeline of `directory` built from its config files alone, every network with random
        weights in the current default device: under ``torch.device("meta")``, a real model for a memory
        plan without reading its weights or allocating them. A LoRA result gives its base."""
        from diffusers import AutoencoderKL

        directory = Path(directory)
        kind = directory_kind(directory)
        if kind == "lora":
            return cls.from_configs(check_lora_result(directory)[0])
        if kind == "diffusers":
            index, _ = check_diffusers_layout(directory)
            return cls.wrap_diffusers(directory, empty_diffusers_pipeline(directory, index))
        settings, folder = check_own_layout(directory)
        denoiser_class = DENOISERS[folder]
        vae = None
        if settings.get("vae"):
            vae = AutoencoderKL.from_config(AutoencoderKL.load_config(directory / "vae"))
        return cls(
            denoiser_class.from_config(denoiser_class.load_config(directory / folder)),
            CLIPTextModelWithProjection(CLIPTextConfig.from_pretrained(directory / "text_encoder")),
            CLIPTokenizer.from_pretrained(directory / "tokenizer", local_files_only=True),
            vae=vae,
            shift=settings.get("shift", 1.0),
            prediction=settings.get("prediction", "velocity"),
        )

    @classmethod
    def from_diffusers(cls, directory: str | Path) -> FlowPipeline:
        """A local diffusers pipeline with a flow transformer (SD3 style) or a DDPM/DDIM UNet (SD1.x)."""
        from diffusers import DiffusionPipeline

        index, _ = check_diffusers_layout(Path(directory))
        name = index["_class_name"]
        # components saved as [null, null] (e.g. SD3 without its T5 encoder) are passed as None
        absent = {part: None for part, entry in index.items() if entry == [None, None]}
        try:
            pipeline = DiffusionPipeline.from_pretrained(
                directory, use_safetensors=True, local_files_only=True, **absent
            )
        except LOAD_ERRORS as err:
            raise ConfigError(f"{directory}: the diffusers {name} does not load ({one_line(err)})") from None
        return cls.wrap_diffusers(directory, pipeline)

    @classmethod
    def wrap_diffusers(cls, directory: str | Path, pipeline: Any) -> FlowPipeline:
        """A loaded (or empty, `from_configs`) diffusers pipeline of `directory` as a FlowPipeline."""
        name = type(pipeline).__name__
        scheduler = pipeline.scheduler
        if isinstance(getattr(pipeline, "transformer", None), FluxTransformer2DModel):
            return cls.from_flux(Path(directory), pipeline)
        if isinstance(getattr(pipeline, "transformer", None), SD3Transformer2DModel) and hasattr(
            pipeline, "text_encoder_2"
        ):
            if hasattr(scheduler, "alphas_cumprod"):
                raise ConfigError(
                    f"{directory}: a flow transformer with a DDPM-type scheduler is not supported"
                )
            return cls(
                pipeline.transformer,
                vae=pipeline.vae,
                shift=float(scheduler.config.get("shift", 1.0)),
                diffusers_pipeline=pipeline,
            )
        if isinstance(getattr(pipeline, "unet", None), UNet2DConditionModel) and hasattr(
            pipeline, "text_encoder"
        ):
            if not hasattr(scheduler, "alphas_cumprod"):
                raise ConfigError(
                    f"{directory}: the UNet's scheduler {type(scheduler).__name__} has no alphas_cumprod; "
                    "use a DDPM/DDIM-type scheduler"
                )
            return cls(
                pipeline.unet,
                vae=pipeline.vae,
                prediction=scheduler.config.prediction_type,
                scheduler=scheduler,
                diffusers_pipeline=pipeline,
            )
        raise ConfigError(f"{directory}: diffusers pipeline {name!r} is not supported; {SUPPORTED_PIPELINES}")

    @classmethod
    def from_flux(cls, directory: Path, pipeline: Any) -> FlowPipeline:
        """A loaded diffusers FLUX pipeline, once its scheduler is a flow scheduler starting at sigma 1."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        scheduler = pipeline.scheduler
        if not isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
            raise ConfigError(
                f"{directory}: the FLUX pipeline's scheduler is a {type(scheduler).__name__}; FlowPipeline "
                "drives FLUX with FlowMatchEulerDiscreteScheduler's sigmas (FluxPipeline's own scheduler)"
            )
        options = [name for name in FLUX_UNSUPPORTED_SCHEDULE if scheduler.config.get(name)]
        if options:
            raise ConfigError(
                f"{directory}: the FLUX scheduler sets {', '.join(options)}, whose sigmas do not start at 1 "
                "(pure noise), where every sampler here starts: set them to false in scheduler_config.json"
            )
        return cls(
            pipeline.transformer,
            vae=pipeline.vae,
            shift=float(scheduler.config.get("shift", 1.0)),
            scheduler=scheduler,
            diffusers_pipeline=pipeline,
        )

    def to(self, device: torch.device | str) -> FlowPipeline:
        if self.diffusers_pipeline is not None:
            self.diffusers_pipeline.to(device)
        for module in (self.denoiser, self.text_encoder, self.vae):
            if module is not None:
                module.to(device)
        return self

    @property
    def device(self) -> torch.device:
        return next(self.denoiser.parameters()).device

    @property
    def is_unet(self) -> bool:
        return isinstance(self.denoiser, UNet2DConditionModel)

    @property
    def is_flux(self) -> bool:
        """A FLUX transformer: packed 2x2 latent tokens, CLIP pooled and T5 sequence conditioning."""
        return isinstance(self.denoiser, FluxTransformer2DModel)

    @property
    def guidance_embedded(self) -> bool:
        """Guidance is an input of the denoiser (FLUX.1-dev's guidance embedding), not classifier-free
        guidance: `velocity` passes `guidance_scale` to the model in one pass and never uses `uncond`."""
        return self.is_flux and bool(self.denoiser.config.guidance_embeds)

    @property
    def denoiser_folder(self) -> str:
        return "unet" if self.is_unet else "transformer"

    # -- what the trainers call ------------------------------------------------------------------

    @property
    def vae_scale(self) -> int:
        """Pixels per latent cell (1 in pixel space)."""
        return 1 if self.vae is None else 2 ** (len(self.vae.config.block_out_channels) - 1)

    def set_image_size(self, size: int) -> None:
        """Generate `size` x `size` images; raise ValueError if the model cannot take that size."""
        config = self.denoiser.config
        if self.is_unet:
            step = 2 ** (len(config.block_out_channels) - 1) * self.vae_scale
            largest, what = None, f"{len(config.block_out_channels) - 1} UNet downsamplings"
        elif self.is_flux:
            step = 2 * self.vae_scale
            largest, what = None, "FLUX packs 2 x 2 latent cells into one token"
        else:
            step = config.patch_size * self.vae_scale
            largest, what = config.pos_embed_max_size * step, f"patch size {config.patch_size}"
        if size % step or size < step or (largest is not None and size > largest):
            limit = f" between {step} and {largest}" if largest is not None else ""
            raise ValueError(
                f"image size {size} does not fit this model: use a multiple of {step} ({what} x "
                f"{self.vae_scale} pixels per latent){limit}"
            )
        self.image_size = size

    def latent_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of the latents the trainers hold; for FLUX unpacked (C = the transformer's input
        channels / 4), its default size FluxPipeline's (default_sample_size latent cells a side)."""
        config = self.denoiser.config
        if self.is_flux:
            default = self.diffusers_pipeline.default_sample_size * self.vae_scale
            side = getattr(self, "image_size", default) // self.vae_scale
            return (config.in_channels // 4, side, side)
        side = getattr(self, "image_size", config.sample_size * self.vae_scale) // self.vae_scale
        return (config.in_channels, side, side)

    def sigmas(self, steps: int) -> torch.Tensor:
        """steps + 1 noise levels from the start of sampling down to 0: the shifted flow schedule, or
        for a DDPM/DDIM model its scheduler's own timesteps mapped to flow noise levels; for FLUX,
        FluxPipeline's: linear sigmas through its scheduler, shifted by mu = calculate_shift(number of
        image tokens) (exp(mu) / (exp(mu) + 1 / sigma - 1) with dynamic shifting), then 0."""
        if self.is_flux:
            return self._flux_sigmas(steps)
        if not self.is_vp:
            return shifted_sigmas(steps, self.shift, device=self.device)
        scheduler = copy.deepcopy(self.scheduler)
        scheduler.set_timesteps(steps)
        alpha_bar = scheduler.alphas_cumprod.double()[scheduler.timesteps.long()]
        ratio = ((1 - alpha_bar) / alpha_bar).sqrt()  # sigma / (1 - sigma)
        sigmas = torch.cat([ratio / (1 + ratio), torch.zeros(1, dtype=torch.float64)])
        return sigmas.to(torch.float32).to(self.device)

    def _flux_sigmas(self, steps: int) -> torch.Tensor:
        """FluxPipeline.__call__'s schedule (step 5) at this pipeline's image size."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        if steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {steps}")
        _, height, width = self.latent_shape()
        scheduler = copy.deepcopy(self.scheduler)
        config = scheduler.config
        mu = calculate_shift(
            (height // 2) * (width // 2),
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        sigmas = None if config.get("use_flow_sigmas") else np.linspace(1.0, 1 / steps, steps)
        if sigmas is None:
            scheduler.set_timesteps(steps, mu=mu)
        else:
            scheduler.set_timesteps(sigmas=sigmas, mu=mu)
        return scheduler.sigmas.to(dtype=torch.float32, device=self.device)

    @property
    def max_sequence_length(self) -> int:
        """T5 prompt tokens of a FLUX pipeline: FluxPipeline's default of 512, or fewer where the T5
        tokenizer's model_max_length is smaller."""
        tokenizer = self.diffusers_pipeline.tokenizer_2
        return min(FLUX_MAX_SEQUENCE_LENGTH, int(tokenizer.model_max_length))

    def prompt_tokenizers(self) -> dict[str, tuple[Any, int]]:
        """Every tokenizer a prompt goes through, by component name, with the most tokens its text
        encoder is given (encoding cuts a longer prompt there): ours at its text encoder's length; a
        diffusers pipeline's CLIP tokenizers at the pipeline's tokenizer_max_length and its T5 tokenizer
        at the max_sequence_length `encode_prompts` gives it (FLUX: `max_sequence_length`; SD3:
        encode_prompt's default)."""
        if self.diffusers_pipeline is None:
            positions = self.text_encoder.config.max_position_embeddings
            return {"tokenizer": (self.tokenizer, min(int(self.tokenizer.model_max_length), positions))}
        pipeline = self.diffusers_pipeline
        clip = getattr(pipeline, "tokenizer_max_length", None) or int(pipeline.tokenizer.model_max_length)
        t5 = self.max_sequence_length if self.is_flux else SD3_MAX_SEQUENCE_LENGTH
        t5_parts = ("tokenizer_2",) if self.is_flux else ("tokenizer_3",)
        return {
            name: (tokenizer, t5 if name in t5_parts else clip)
            for name in ("tokenizer", "tokenizer_2", "tokenizer_3")
            if (tokenizer := getattr(pipeline, name, None)) is not None
        }

    def vocabulary_gaps(self, prompts: Sequence[str]) -> dict[str, str]:
        """Each of `prompts` with a word our own tokenizer does not hold as one token, and that word.
        Ours has a closed vocabulary (`build_clip_tokenizer`: every word the model was trained on is
        one token), so another word is spelt out in characters, or <|endoftext|> for characters outside
        its alphabet, which the text encoder never learnt. Empty for a diffusers pipeline, whose
        tokenizers read any word as pieces they know."""
        if self.diffusers_pipeline is not None:
            return {}
        known: dict[str, bool] = {}
        gaps = {}
        for prompt in prompts:
            for word in prompt.split():
                if word not in known:
                    pieces = self.tokenizer.tokenize(word)
                    known[word] = len(pieces) == 1 and pieces[0] != self.tokenizer.unk_token
                if not known[word]:
                    gaps[prompt] = word
                    break
        return gaps

    def frozen_modules(self) -> list[torch.nn.Module]:
        """The networks that are never trained: the text encoders and the VAE."""
        if self.diffusers_pipeline is None:
            parts = [self.text_encoder, self.vae]
        else:
            components = self.diffusers_pipeline.components
            parts = [module for name, module in components.items() if name.startswith("text_encoder")]
            parts.append(self.vae)
        return [module for module in parts if module is not None]

    def set_frozen_dtype(self, dtype: torch.dtype) -> None:
        """Keep the text encoders and the VAE in `dtype` (e.g. bfloat16: half the memory of float32);
        prompt embeddings come out in the denoiser's dtype and images in float32 all the same."""
        for module in self.frozen_modules():
            module.to(dtype)

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> Conditioning:
        dtype = next(self.denoiser.parameters()).dtype
        if self.prompt_cache is None:
            return self._encode_prompts(prompts).to(dtype)
        missing = [p for p in prompts if p not in self.prompt_cache]
        if missing:
            raise ValueError(
                f"prompt {missing[0]!r} was not among the cached prompts (`cache_prompts`): the text "
                "encoders are offloaded, so every prompt must be cached before training starts"
            )
        return Conditioning.cat([self.prompt_cache[p] for p in prompts]).to(self.device).to(dtype)

    @torch.no_grad()
    def cache_prompts(self, prompts: Sequence[str], batch_size: int = 64) -> int:
        """Encode `prompts` once (in batches on the pipeline's device) and keep their embeddings in CPU
        memory, from which `encode_prompts` reads them from then on; the text encoders move to the CPU,
        so the device holds the denoiser and the VAE only. Returns the cache's bytes."""
        unique = list(dict.fromkeys(prompts))
        cache = {}
        for start in range(0, len(unique), batch_size):
            chunk = unique[start : start + batch_size]
            cond = self._encode_prompts(chunk).to(torch.device("cpu"))
            cache |= {prompt: cond[i : i + 1] for i, prompt in enumerate(chunk)}  # together, the chunk
        for module in self.frozen_modules():
            if module is not self.vae:
                module.to("cpu")
        self.prompt_cache = cache
        return sum(c.nbytes for c in cache.values())

    def _encode_prompts(self, prompts: Sequence[str]) -> Conditioning:
        if self.diffusers_pipeline is not None:
            return self._encode_with_diffusers(list(prompts))
        tokens = self.tokenizer(
            list(prompts),
            padding="max_length",
            max_length=self.tokenizer.model_max_length,
            truncation=True,
            return_tensors="pt",
        ).to(self.device)
        out = self.text_encoder(input_ids=tokens.input_ids)
        return Conditioning(out.last_hidden_state, out.text_embeds)

    def _encode_with_diffusers(self, prompts: list[str]) -> Conditioning:
        pipeline = self.diffusers_pipeline
        if self.is_unet:
            embeds, _ = pipeline.encode_prompt(prompts, self.device, 1, False)
            return Conditioning(embeds, None)
        if self.is_flux:  # T5 sequence embeddings and the pooled CLIP vector; text ids are all zero
            embeds, pooled, _ = pipeline.encode_prompt(
                prompt=prompts,
                prompt_2=None,
                device=self.device,
                max_sequence_length=self.max_sequence_length,
            )
            return Conditioning(embeds, pooled)
        embeds, _, pooled, _ = pipeline.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=False,
        )
        return Conditioning(embeds, pooled)

    def velocity(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor,
        cond: Conditioning,
        guidance_scale: float = 1.0,
        uncond: Conditioning | None = None,
        denoiser: torch.nn.Module | None = None,
    ) -> torch.Tensor:
        """Predicted velocity at noise level `sigma` [B]; with guidance_scale != 1, classifier-free
        guidance against `uncond` (the empty prompt). Guidance on the velocity equals guidance on the
        network output, which the velocity is affine in. `denoiser` overrides the module called (its
        DDP wrapper while training, a frozen reference).

        FLUX: `x` is unpacked ([B, C, H, W], `latent_shape`) and so is the velocity. A guidance-distilled
        model (FLUX.1-dev, `guidance_embeds`; `guidance_embedded`) takes `guidance_scale` as its
        embedded guidance, whatever its value (1.0 included), in one pass without `uncond`, as
        FluxPipeline(guidance_scale=g). A FLUX model without the embedding (FLUX.1-schnell) is guided
        like any other: guidance_scale 1 is none (FluxPipeline's default there), another value is
        classifier-free guidance against `uncond`, as FluxPipeline(true_cfg_scale=g, negative_prompt="")."""
        model = denoiser or self.denoiser
        if self.guidance_embedded:
            return self._in_fixed_rows(model, x, sigma, cond, guidance_scale)
        if guidance_scale == 1.0:
            return self._in_fixed_rows(model, x, sigma, cond)
        if uncond is None:
            raise ValueError("guidance_scale != 1 needs the unconditional embedding (uncond)")
        both = Conditioning.cat([uncond, cond])
        v_uncond, v_cond = self._in_fixed_rows(
            model, torch.cat([x, x]), torch.cat([sigma, sigma]), both
        ).chunk(2)
        return v_uncond + guidance_scale * (v_cond - v_uncond)

    def _in_fixed_rows(
        self,
        model: torch.nn.Module,
        x: torch.Tensor,
        sigma: torch.Tensor,
        cond: Conditioning,
        guidance: float | None = None,
    ) -> torch.Tensor:
        """`_velocity`, with `call_rows` set in calls of exactly that many rows (the last filled with
        copies of its final row): a matmul rounds a row the same way wherever it sits among a fixed
        number of rows, so a sample's result no longer depends on the batch it was drawn in."""
        rows = self.call_rows
        if rows is None:
            return self._velocity(model, x, sigma, cond, guidance)
        count = x.shape[0]
        fill = [count - 1] * (-count % rows)
        x, sigma = torch.cat([x, x[fill]]), torch.cat([sigma, sigma[fill]])
        cond = Conditioning.cat([cond, cond[fill]])
        parts = [
            self._velocity(model, x[i : i + rows], sigma[i : i + rows], cond[i : i + rows], guidance)
            for i in range(0, len(x), rows)
        ]
        return torch.cat(parts)[:count]

    def _velocity(
        self,
        model: torch.nn.Module,
        x: torch.Tensor,
        sigma: torch.Tensor,
        cond: Conditioning,
        guidance: float | None = None,
    ) -> torch.Tensor:
        shape = (-1, *([1] * (x.dim() - 1)))
        if self.is_flux:
            return self._call_flux(model, x, sigma * 1000.0, cond, guidance)
        if not self.is_vp:
            out = self._call(model, x, sigma * 1000.0, cond)
            if self.prediction == "velocity":
                return out
            divisor = sigma.clamp(min=MIN_SIGMA_DIVISOR).view(shape).to(out.dtype)
            return (x - out) / divisor
        alpha_bar, scale = flow_to_vp(sigma.double())
        x_vp = x * scale.view(shape).to(x.dtype)
        out = self._call(model, x_vp, self.timestep_for(alpha_bar), cond)
        a = alpha_bar.sqrt().clamp_min(MIN_SQRT_ALPHA_BAR).view(shape).to(out.dtype)
        s = (1 - alpha_bar).sqrt().view(shape).to(out.dtype)
        if self.prediction == "epsilon":
            eps, x0 = out, (x_vp - s * out) / a
        elif self.prediction == "v_prediction":
            eps, x0 = s * x_vp + a * out, a * x_vp - s * out
        else:
            eps, x0 = (x_vp - a * out) / s.clamp_min(MIN_SQRT_ALPHA_BAR), out
        return eps - x0

    def _call(
        self, model: torch.nn.Module, x: torch.Tensor, timestep: torch.Tensor, cond: Conditioning
    ) -> torch.Tensor:
        timestep = timestep.to(device=x.device, dtype=x.dtype)
        if self.is_unet:
            return model(x, timestep, encoder_hidden_states=cond.embeds).sample
        return model(
            hidden_states=x,
            timestep=timestep,
            encoder_hidden_states=cond.embeds,
            pooled_projections=cond.pooled,
        ).sample

    def _call_flux(
        self,
        model: torch.nn.Module,
        x: torch.Tensor,
        timestep: torch.Tensor,
        cond: Conditioning,
        guidance: float | None,
    ) -> torch.Tensor:
        """FluxPipeline's transformer call on latents `x` [B, C, H, W], packed for it and its output
        unpacked: the timestep (in 0..1000, as the scheduler's) divided by 1000 (the transformer
        multiplies it and the guidance by 1000 again), the embedded guidance for a guidance-distilled
        model, position ids of the image tokens and all-zero ids for the text tokens."""
        b, _, height, width = x.shape
        embedded = None
        if self.guidance_embedded:
            embedded = torch.full((b,), float(guidance), device=x.device, dtype=torch.float32)
        out = model(
            hidden_states=pack_latents(x),
            timestep=timestep.to(device=x.device, dtype=x.dtype) / 1000,
            guidance=embedded,
            pooled_projections=cond.pooled,
            encoder_hidden_states=cond.embeds,
            txt_ids=torch.zeros(cond.embeds.shape[1], 3, device=x.device, dtype=x.dtype),
            img_ids=latent_image_ids(height, width, x.device, x.dtype),
        ).sample
        return unpack_latents(out, height, width)

    def timestep_for(self, alpha_bar: torch.Tensor) -> torch.Tensor:
        """The (fractional) training timestep of a VP model with this alpha_bar, by log-SNR."""
        log_snr = torch.log(alpha_bar / (1 - alpha_bar)).cpu().numpy()
        return torch.from_numpy(np.interp(log_snr, self._log_snr, self._timesteps))

    @torch.no_grad()
    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1], [B, 3, H, W]."""
        if self.vae is not None:
            scaled = x / self.vae.config.scaling_factor + (self.vae.config.shift_factor or 0.0)
            x = self.vae.decode(scaled.to(self.vae.dtype)).sample
        return ((x.float() + 1) / 2).clamp(0, 1)

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Training targets x0 from images in [0, 1] (pixel space: scaled to [-1, 1])."""
        x = images * 2 - 1
        if self.vae is not None:
            latents = self.vae.encode(x.to(self.vae.dtype)).latent_dist.sample()
            x = (latents - (self.vae.config.shift_factor or 0.0)) * self.vae.config.scaling_factor
        return x


# -- what a model directory holds, checked without loading weights ---------------------------------


def directory_kind(directory: Path) -> str:
    """'own' (PIPELINE_FILE), 'diffusers' (model_index.json) or 'lora' (a LoRA result); anything else
    is a ConfigError or FileNotFoundError naming what was found."""
    if (directory / PIPELINE_FILE).is_file():
        return "own"
    if (directory / "model_index.json").is_file():
        return "diffusers"
    if (directory / LORA_FILE).is_file() or (directory / LORA_WEIGHTS).is_file():
        return "lora"
    if (directory / "config.json").is_file():
        found = read_json_object(directory / "config.json", REMAKE)
        raise ConfigError(
            f"{str(directory)!r} holds {describe_saved_model(found)}, not a text-to-image pipeline (no "
            f"{PIPELINE_FILE}, model_index.json or {LORA_FILE}): {REMAKE}"
        )
    raise FileNotFoundError(
        f"{str(directory)!r} is not a model directory (no {PIPELINE_FILE}, model_index.json or {LORA_FILE}): "
        f"{REMAKE}"
    )


def check_model_directory(directory: str | Path, _seen: frozenset[Path] = frozenset()) -> str:
    """Check that `FlowPipeline.from_pretrained` can read `directory`, without loading any weights: its
    kind, its configs and, for a LoRA result, its base (checked the same way), so that a list of models
    fails on a bad entry before any work. Returns the denoiser folder, "unet" or "transformer"."""
    directory = Path(directory)
    kind = directory_kind(directory)
    if kind == "own":
        return check_own_layout(directory)[1]
    if kind == "diffusers":
        return check_diffusers_layout(directory)[1]
    return check_lora_result(directory, _seen)[1]


def check_safetensors(folder: Path) -> None:
    """Refuse a component folder whose weights are pickle files only (``*.bin``, ``*.pt``, ...): loading
    one runs pickle, which can execute any code, so weights are read from safetensors files only."""
    if any(folder.glob("*.safetensors")):
        return
    pickles = sorted(path.name for path in folder.iterdir() if path.suffix in PICKLE_WEIGHTS)
    if pickles:
        raise ConfigError(
            f"{str(folder)!r} holds its weights as pickle ({', '.join(pickles)}) and no .safetensors file; "
            "weights are loaded from safetensors only, as a pickle file can run code: convert them (load "
            "the model once with from_pretrained where you trust the file, and write it back with "
            "save_pretrained(..., safe_serialization=True))"
        )


def check_own_layout(directory: Path) -> tuple[dict[str, Any], str]:
    """PIPELINE_FILE's settings and the denoiser folder, once every folder they name is there and the
    denoiser's config names the class PIPELINE_FILE expects."""
    settings = read_json_object(directory / PIPELINE_FILE, REMAKE)
    folder = settings.get("denoiser", "transformer")
    if folder not in DENOISERS:
        raise ConfigError(
            f"{str(directory / PIPELINE_FILE)!r} names denoiser {folder!r}; expected one of "
            f"{', '.join(DENOISERS)}: {REMAKE}"
        )
    parts = [folder, "text_encoder", "tokenizer", *(["vae"] if settings.get("vae") else [])]
    missing = [part for part in parts if not (directory / part).is_dir()]
    if missing:
        raise FileNotFoundError(
            f"{str(directory)!r} has {PIPELINE_FILE} but no {', '.join(missing)} folder: {REMAKE}"
        )
    for part in parts:
        check_safetensors(directory / part)
    expected = DENOISERS[folder].__name__
    found = read_json_object(directory / folder / "config.json", REMAKE).get("_class_name")
    if found != expected:
        # checked before loading: diffusers would build a default-sized model from another config
        raise ConfigError(
            f"{str(directory / folder)!r} holds a {found!r}, but {PIPELINE_FILE} names a {expected} there: "
            f"{REMAKE}"
        )
    return settings, folder


def check_diffusers_layout(directory: Path) -> tuple[dict[str, Any], str]:
    """A diffusers pipeline directory's model_index.json and denoiser folder, once the index names a
    pipeline diffusers has, with the components FlowPipeline drives, and every folder it lists is there."""
    import diffusers
    from diffusers import DiffusionPipeline

    index = read_json_object(directory / "model_index.json", REMAKE)
    name = index.get("_class_name")
    pipeline_class = getattr(diffusers, name, None) if isinstance(name, str) else None
    if not (isinstance(pipeline_class, type) and issubclass(pipeline_class, DiffusionPipeline)):
        raise ConfigError(
            f"{directory}: model_index.json names pipeline {name!r}, which diffusers does not have; "
            f"{SUPPORTED_PIPELINES}"
        )
    # saved components are [library, class]; absent ones (SD3 without its T5 encoder) are [null, null]
    classes = {
        part: entry[1]
        for part, entry in index.items()
        if not part.startswith("_") and isinstance(entry, list) and len(entry) == 2 and None not in entry
    }
    missing = [part for part in classes if not (directory / part).is_dir()]
    if missing:
        raise FileNotFoundError(
            f"{str(directory)!r}: model_index.json lists {', '.join(missing)}, but there is no such folder: "
            "copy the whole pipeline directory"
        )
    for part in classes:
        check_safetensors(directory / part)
    if classes.get("transformer") == SD3Transformer2DModel.__name__ and "text_encoder_2" in index:
        folder = "transformer"
    elif classes.get("transformer") == FluxTransformer2DModel.__name__:
        folder = "transformer"
        check_flux_layout(directory, classes)
    elif classes.get("unet") == UNet2DConditionModel.__name__ and "text_encoder" in index:
        folder = "unet"
    else:
        raise ConfigError(f"{directory}: diffusers pipeline {name!r} is not supported; {SUPPORTED_PIPELINES}")
    read_json_object(directory / folder / "config.json", REMAKE)
    return index, folder


def empty_diffusers_pipeline(directory: Path, index: dict[str, Any]) -> Any:
    """The diffusers pipeline `index` (model_index.json) describes, its networks built from their
    configs in the current default device, its schedulers and tokenizers read from `directory`."""
    import diffusers
    import transformers

    parts: dict[str, Any] = {}
    for part, entry in index.items():
        if part.startswith("_") or not (isinstance(entry, list) and len(entry) == 2):
            continue
        library, class_name = entry
        if library is None:
            parts[part] = None
            continue
        component_class = getattr(diffusers if library == "diffusers" else transformers, class_name)
        path = directory / part
        try:
            if issubclass(component_class, diffusers.ModelMixin):
                parts[part] = component_class.from_config(component_class.load_config(path))
            elif issubclass(component_class, transformers.PreTrainedModel):
                parts[part] = component_class(
                    transformers.AutoConfig.from_pretrained(path, local_files_only=True)
                )
            else:  # schedulers, tokenizers: small files
                parts[part] = component_class.from_pretrained(path, local_files_only=True)
        except LOAD_ERRORS as err:
            raise ConfigError(f"{path}: the {class_name} config does not load ({one_line(err)})") from None
    return getattr(diffusers, index["_class_name"])(**parts)


def check_flux_layout(directory: Path, classes: dict[str, str]) -> None:
    """A FLUX pipeline FlowPipeline can run: every part of FLUX_PARTS saved (not null), and a
    text-to-image transformer, whose input tokens are 2 x 2 patches of the VAE's latents and whose
    output is their velocity (Fill and Control transformers take extra conditioning channels)."""
    missing = [part for part in FLUX_PARTS if part not in classes]
    if missing:
        raise ConfigError(
            f"{directory}: the FLUX pipeline has no {', '.join(missing)} (null in model_index.json); "
            "FlowPipeline needs its VAE, its CLIP text encoder (pooled embedding), its T5 text encoder "
            "(text_encoder_2, the sequence embeddings) with their tokenizers and its scheduler: save the "
            "whole pipeline"
        )
    config = read_json_object(directory / "transformer" / "config.json", REMAKE)
    latent = read_json_object(directory / "vae" / "config.json", REMAKE).get("latent_channels")
    channels = config.get("in_channels", 64)
    out = config.get("out_channels") or channels
    fits = isinstance(latent, int) and (channels, out) == (4 * latent, channels)
    if config.get("patch_size", 1) != 1 or not fits:
        raise ConfigError(
            f"{directory}: the FLUX transformer takes {channels} input and gives {out} output channels per "
            f"token (patch size {config.get('patch_size', 1)}) for a VAE of {latent} latent channels; "
            f"FlowPipeline runs text-to-image FLUX only (patch size 1, 4 x {latent} channels in and out), "
            "not Fill, Control or other conditioned variants"
        )


def lora_base(directory: Path, record: dict[str, Any]) -> Path:
    """The base model directory a LoRA result's record names: "base_resolved" (absolute) when it is
    there, else "base" (relative to the working directory or the repository)."""
    given = record.get("base")
    if not isinstance(given, str) or not given:
        raise ConfigError(
            f'{str(directory / LORA_FILE)!r} has no "base" naming the model the adapter was trained on: '
            'add it, e.g. {"base": "diffusion_rl/assets/tiny_flow"}'
        )
    resolved = record.get("base_resolved")
    for candidate in [*([Path(resolved)] if isinstance(resolved, str) else []), shipped_path(given)]:
        if candidate.is_dir():
            return candidate
    also = f" (nor {resolved!r})" if isinstance(resolved, str) else ""
    raise ConfigError(
        f"{str(directory)!r} is a LoRA result whose base model {given!r}{also} is not a directory: put the "
        f'base model back there, or write where it is now as "base" in {LORA_FILE}'
    )


def check_lora_result(directory: Path, seen: frozenset[Path] = frozenset()) -> tuple[Path, str]:
    """A LoRA result's base directory and denoiser folder, once its record, the header of its weights
    and its base (checked like any model directory; `seen`: the LoRA results that led here) are in order."""
    if not (directory / LORA_FILE).is_file():
        raise ConfigError(
            f"{str(directory)!r} holds LoRA weights ({LORA_WEIGHTS}) but no {LORA_FILE} naming their base "
            'model: write one, e.g. {"base": "diffusion_rl/assets/tiny_flow"}'
        )
    record = read_json_object(
        directory / LORA_FILE, 'it names the adapter\'s base model, e.g. {"base": "DIR"}'
    )
    base = lora_base(directory, record)
    weights = directory / LORA_WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(
            f"{str(directory)!r} has {LORA_FILE} but no {LORA_WEIGHTS}: the LoRA result is incomplete; "
            "copy it whole or train again"
        )
    seen = seen | {directory.resolve()}
    if base.resolve() in seen:
        raise ConfigError(
            f"{str(directory / LORA_FILE)!r} names base {str(base)!r}, which leads back to this LoRA result: "
            "name the model the adapter was trained on"
        )
    try:
        folder = check_model_directory(base, seen)
    except (ConfigError, FileNotFoundError) as err:
        raise ConfigError(f"{str(directory)!r} is a LoRA result whose base does not load: {err}") from None
    try:
        with safe_open(weights, "pt") as file:
            keys = list(file.keys())
    except (OSError, SafetensorError) as err:
        raise ConfigError(
            f"{str(weights)!r} is not a readable safetensors file ({one_line(err)}): copy the LoRA result "
            "again or train again"
        ) from None
    if not any(key.startswith(f"{folder}.") for key in keys):
        raise ConfigError(
            f"{str(weights)!r} holds no LoRA weights for a {folder}, the denoiser of its base {str(base)!r}: "
            f'write the model the adapter was trained on as "base" in {LORA_FILE}'
        )
    return base, folder
