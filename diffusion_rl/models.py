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
and the trainable `denoiser`. `save_pretrained` writes the project's own layout (the tiny pixel-space
default: ``transformer/``, ``text_encoder/``, ``tokenizer/``, optionally ``vae/``, and
``mmrl_pipeline.json``), or for a loaded diffusers pipeline its own layout, whose ``encode_prompt``
builds the conditioning. Everything is stored as safetensors.

A LoRA result (``save_lora_weights``; a run's ``final/`` with ``model.lora_rank > 0``) is
``pytorch_lora_weights.safetensors`` in diffusers' format, with the adapter's config (rank, alpha,
targets) in the file's ``lora_adapter_metadata`` so that plain diffusers' ``load_lora_weights``
applies it at the trained strength, and ``mmrl_lora.json`` naming the base model (``base`` as given,
``base_resolved`` as an absolute path). `diffusion_rl.loading.load` reads every kind of directory.
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
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer, T5Tokenizer

from diffusion_rl.sde import flow_to_vp, shifted_sigmas

PIPELINE_FILE = "mmrl_pipeline.json"
# the model inputs `FlowPipeline._forward` gives a base held in a lower dtype in that dtype
LOW_PRECISION_INPUTS = frozenset({"sample", "hidden_states", "encoder_hidden_states", "pooled_projections"})
CACHE_BATCH = 64  # prompts `FlowPipeline.cache_prompts` encodes at once
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


WORD_START = "\u2581"  # SentencePiece's mark before every word, as T5 tokenizers write it
FLUX_MAX_SEQUENCE_LENGTH = 512  # FluxPipeline's default (and limit) for the T5 prompt tokens
SD3_MAX_SEQUENCE_LENGTH = 256  # StableDiffusion3Pipeline.encode_prompt's default for the T5 prompt tokens


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
        self.source: Path | None = None  # the directory `loading.load` read, which a LoRA result names
        self.prompt_cache: dict[str, Conditioning] | None = None  # `cache_prompts`
        self.call_rows: int | None = None  # `_in_fixed_rows`
        self.base_dtype = torch.float32  # `set_base_dtype`
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
            raise ValueError("save_lora_weights needs a pipeline read by loading.load: its base directory")
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

    def to(self, device: torch.device | str) -> FlowPipeline:
        """Move the networks the pipeline runs to `device`: once the prompts are cached
        (`cache_prompts`), the denoiser and the VAE; the text encoders stay where caching left them."""
        encoders = self.text_encoders() if self.prompt_cache is None else []
        for module in (self.denoiser, self.vae, *encoders):
            if module is not None:
                module.to(device)
        return self

    @property
    def encoder_device(self) -> torch.device:
        return next(self.text_encoders()[0].parameters()).device

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

    def text_encoders(self) -> list[torch.nn.Module]:
        if self.diffusers_pipeline is None:
            return [self.text_encoder]
        components = self.diffusers_pipeline.components.items()
        return [part for name, part in components if name.startswith("text_encoder") and part is not None]

    def frozen_modules(self) -> list[torch.nn.Module]:
        """The networks that are never trained: the text encoders and the VAE."""
        return [*self.text_encoders(), *([] if self.vae is None else [self.vae])]

    def set_base_dtype(self, dtype: torch.dtype) -> None:
        """Hold the denoiser's weights in `dtype` (bfloat16: the frozen base of a LoRA run, at half the
        memory of float32) and call it on inputs in that dtype (`_forward`); the velocity comes out in
        float32 all the same. Set it before the adapter is added (the trainer's
        adapter stays float32: `mmrl.precision.keep_adapter_in_float32`)."""
        self.denoiser.to(dtype)
        self.base_dtype = dtype

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
    def cache_prompts(
        self,
        prompts: Sequence[str],
        device: torch.device | str | None = None,
        batch_size: int = CACHE_BATCH,
        release_encoders: bool = False,
    ) -> int:
        """Encode `prompts` once (in batches, the text encoders moved to `device` if given) and keep
        their embeddings in CPU memory, from which `encode_prompts` reads them from then on; the text
        encoders then move to the CPU, or with `release_encoders` their weights are dropped altogether (a
        run whose result is an adapter never needs them again). Called before `to(device)`, the device
        never holds the encoders and the denoiser at once. Returns the cache's bytes."""
        if device is not None:
            for module in self.text_encoders():
                module.to(device)
        unique = list(dict.fromkeys(prompts))
        cache = {}
        for start in range(0, len(unique), batch_size):
            chunk = unique[start : start + batch_size]
            cond = self._encode_prompts(chunk).to(torch.device("cpu"))
            cache |= {prompt: cond[i : i + 1] for i, prompt in enumerate(chunk)}  # together, the chunk
        for module in self.text_encoders():
            module.to("meta" if release_encoders else "cpu")
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
        ).to(self.encoder_device)
        out = self.text_encoder(input_ids=tokens.input_ids)
        return Conditioning(out.last_hidden_state, out.text_embeds)

    def _encode_with_diffusers(self, prompts: list[str]) -> Conditioning:
        pipeline = self.diffusers_pipeline
        if self.is_unet:
            embeds, _ = pipeline.encode_prompt(prompts, self.encoder_device, 1, False)
            return Conditioning(embeds, None)
        if self.is_flux:  # T5 sequence embeddings and the pooled CLIP vector; text ids are all zero
            embeds, pooled, _ = pipeline.encode_prompt(
                prompt=prompts,
                prompt_2=None,
                device=self.encoder_device,
                max_sequence_length=self.max_sequence_length,
            )
            return Conditioning(embeds, pooled)
        embeds, _, pooled, _ = pipeline.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.encoder_device,
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
            return self._forward(model, sample=x, timestep=timestep, encoder_hidden_states=cond.embeds)
        return self._forward(
            model,
            hidden_states=x,
            timestep=timestep,
            encoder_hidden_states=cond.embeds,
            pooled_projections=cond.pooled,
        )

    def _forward(self, model: torch.nn.Module, **inputs: Any) -> torch.Tensor:
        """The network's output (``.sample``) on `inputs`; with a base in a lower dtype (`set_base_dtype`)
        the latents and the prompt's embeddings in that dtype (timesteps, guidance and position ids stay
        float32, as diffusers' pipelines pass them), so that its activations are held in that dtype
        (a float32 adapter computes in float32: peft casts its input), and the output in float32."""
        if self.base_dtype == torch.float32:
            return model(**inputs).sample
        for name in LOW_PRECISION_INPUTS.intersection(inputs):
            if inputs[name] is not None:
                inputs[name] = inputs[name].to(self.base_dtype)
        return model(**inputs).sample.float()

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
        out = self._forward(
            model,
            hidden_states=pack_latents(x),
            timestep=timestep.to(device=x.device, dtype=x.dtype) / 1000,
            guidance=embedded,
            pooled_projections=cond.pooled,
            encoder_hidden_states=cond.embeds,
            txt_ids=torch.zeros(cond.embeds.shape[1], 3, device=x.device, dtype=x.dtype),
            img_ids=latent_image_ids(height, width, x.device, x.dtype),
        )
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
