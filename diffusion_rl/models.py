"""Flow-matching text-to-image models behind one small interface the trainers use.

`FlowPipeline` holds a diffusers flow transformer (SD3Transformer2DModel), a CLIP text encoder with
projection and its tokenizer, and optionally a VAE. The tiny default works in pixel space (no
VAE): a 32x32 RGB image is the "latent". The trainer only needs four things from a model:
`encode_prompts`, `velocity` (with classifier-free guidance), `decode` and the trainable module,
so a real SD3-style pipeline loaded from a local diffusers directory plugs in the same way
(`from_diffusers`).

Saved layout (``save_pretrained``): ``transformer/``, ``text_encoder/``, ``tokenizer/``,
optionally ``vae/``, and ``mmrl_pipeline.json`` with the settings below; every component is
written by its own ``save_pretrained`` (safetensors).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import SD3Transformer2DModel
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer

PIPELINE_FILE = "mmrl_pipeline.json"
# What the network outputs: the velocity itself (SD3, FLUX), or the clean sample x0, turned into a
# velocity v = (x - x0) / sigma. The second is for pixel-space transformers with large patches: a
# velocity carries the input noise, which a narrow token must copy through every layer (the tiny
# velocity model's samples are speckled); a clean image does not. Not yet measured here.
PREDICTIONS = ("velocity", "sample")
MIN_SIGMA_DIVISOR = 0.05  # v = (x - x0) / max(sigma, this): bounded near sigma = 0
SPECIAL_TOKENS = ["<|startoftext|>", "<|endoftext|>"]


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


@dataclass
class TinyFlowSpec:
    """Sizes of the tiny pixel-space flow model (an SD3 transformer and a CLIP text encoder)."""

    image_size: int = 32
    patch_size: int = 4
    layers: int = 4
    heads: int = 2
    head_dim: int = 32
    text_hidden: int = 64
    text_layers: int = 2
    max_tokens: int = 16


@dataclass
class Conditioning:
    """Text conditioning: per-token embeddings and one pooled vector per prompt."""

    embeds: torch.Tensor
    pooled: torch.Tensor

    def __getitem__(self, index: Any) -> Conditioning:
        return Conditioning(self.embeds[index], self.pooled[index])

    @staticmethod
    def cat(parts: Sequence[Conditioning]) -> Conditioning:
        return Conditioning(torch.cat([p.embeds for p in parts]), torch.cat([p.pooled for p in parts]))


class FlowPipeline:
    """A flow-matching text-to-image model: x_sigma = (1 - sigma) * x0 + sigma * noise, v = noise - x0."""

    def __init__(
        self,
        transformer: SD3Transformer2DModel,
        text_encoder: CLIPTextModelWithProjection,
        tokenizer: CLIPTokenizer,
        vae: torch.nn.Module | None = None,
        shift: float = 1.0,
        prediction: str = "velocity",
    ) -> None:
        if prediction not in PREDICTIONS:
            raise ValueError(f"unknown prediction {prediction!r}: choose one of {', '.join(PREDICTIONS)}")
        self.transformer = transformer
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.vae = vae
        self.shift = shift
        self.prediction = prediction
        self.text_encoder.requires_grad_(False)
        if self.vae is not None:
            self.vae.requires_grad_(False)

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

    def save_pretrained(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.transformer.save_pretrained(directory / "transformer")
        self.text_encoder.save_pretrained(directory / "text_encoder")
        self.tokenizer.save_pretrained(directory / "tokenizer")
        if self.vae is not None:
            self.vae.save_pretrained(directory / "vae")
        settings = {"shift": self.shift, "vae": self.vae is not None, "prediction": self.prediction}
        (directory / PIPELINE_FILE).write_text(json.dumps(settings, indent=1))

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> FlowPipeline:
        """Load a directory written by `save_pretrained`, or a local SD3 diffusers pipeline."""
        directory = Path(directory)
        if (directory / PIPELINE_FILE).is_file():
            settings = json.loads((directory / PIPELINE_FILE).read_text())
            vae = None
            if settings.get("vae"):
                from diffusers import AutoencoderKL

                vae = AutoencoderKL.from_pretrained(directory / "vae")
            return cls(
                SD3Transformer2DModel.from_pretrained(directory / "transformer"),
                CLIPTextModelWithProjection.from_pretrained(directory / "text_encoder"),
                CLIPTokenizer.from_pretrained(directory / "tokenizer"),
                vae=vae,
                shift=settings.get("shift", 1.0),
                prediction=settings.get("prediction", "velocity"),
            )
        if (directory / "model_index.json").is_file():
            raise ValueError(
                f"{str(directory)!r} is a diffusers pipeline directory (model_index.json); FlowPipeline "
                f"reads only its own layout ({PIPELINE_FILE}) so far"
            )
        raise FileNotFoundError(
            f"{str(directory)!r} is not a model directory (no {PIPELINE_FILE}): give a local directory "
            "written by save_pretrained, e.g. by `mmrl pretrain diffusion`"
        )

    def to(self, device: torch.device | str) -> FlowPipeline:
        for module in (self.transformer, self.text_encoder, self.vae):
            if module is not None:
                module.to(device)
        return self

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    # -- what the trainers call ------------------------------------------------------------------

    @property
    def vae_scale(self) -> int:
        """Pixels per latent cell (1 in pixel space)."""
        return 1 if self.vae is None else 2 ** (len(self.vae.config.block_out_channels) - 1)

    def set_image_size(self, size: int) -> None:
        """Generate `size` x `size` images; raise ValueError if the model cannot take that size."""
        config = self.transformer.config
        step = config.patch_size * self.vae_scale
        largest = config.pos_embed_max_size * step
        if size % step or not step <= size <= largest:
            raise ValueError(
                f"image size {size} does not fit this model: use a multiple of {step} (patch size "
                f"{config.patch_size} x {self.vae_scale} pixels per latent) between {step} and {largest}"
            )
        self.image_size = size

    def latent_shape(self) -> tuple[int, int, int]:
        side = (
            getattr(self, "image_size", self.transformer.config.sample_size * self.vae_scale)
            // self.vae_scale
        )
        return (self.transformer.config.in_channels, side, side)

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> Conditioning:
        tokens = self.tokenizer(
            list(prompts),
            padding="max_length",
            max_length=self.tokenizer.model_max_length,
            truncation=True,
            return_tensors="pt",
        ).to(self.device)
        out = self.text_encoder(input_ids=tokens.input_ids)
        return Conditioning(out.last_hidden_state, out.text_embeds)

    def velocity(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor,
        cond: Conditioning,
        guidance_scale: float = 1.0,
        uncond: Conditioning | None = None,
        transformer: torch.nn.Module | None = None,
    ) -> torch.Tensor:
        """Predicted velocity at noise level `sigma` [B]; with guidance_scale != 1, classifier-free
        guidance against `uncond` (the empty prompt). `transformer` overrides the module called
        (e.g. its DDP wrapper during training)."""
        model = transformer or self.transformer
        if guidance_scale == 1.0:
            return self._velocity(model, x, sigma, cond)
        if uncond is None:
            raise ValueError("guidance_scale != 1 needs the unconditional embedding (uncond)")
        both = Conditioning.cat([uncond, cond])
        v_uncond, v_cond = self._velocity(model, torch.cat([x, x]), torch.cat([sigma, sigma]), both).chunk(2)
        return v_uncond + guidance_scale * (v_cond - v_uncond)

    def _velocity(
        self, model: torch.nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning
    ) -> torch.Tensor:
        out = model(
            hidden_states=x,
            timestep=sigma.to(x.dtype) * 1000.0,
            encoder_hidden_states=cond.embeds,
            pooled_projections=cond.pooled,
        ).sample
        if self.prediction == "velocity":
            return out
        divisor = sigma.clamp(min=MIN_SIGMA_DIVISOR).view(-1, *([1] * (x.dim() - 1))).to(out.dtype)
        return (x - out) / divisor

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
