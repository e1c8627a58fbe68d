"""Image rewards for diffusion RL: JPEG size (DDPO), CLIP score, PickScore and a CLIP aesthetic head
(the client of an external reward server, `http_reward`, is `diffusion_rl.reward_server`).

They follow the `mmrl.rewards` convention: each entry of `REWARDS` registered here is a factory
returning ``reward_fn(images, **batch_fields) -> float32 Tensor[len(images)]``. Images are a float
tensor [B, 3, H, W] in [0, 1], or a list of [3, H, W] float tensors or PIL images (sizes may differ).

Scorer models only ever come from local directories written by `save_pretrained`, with safetensors
weights; nothing is downloaded from a model hub. transformers is imported when a CLIP reward is
built, so registering these rewards stays cheap.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from mmrl.config import ConfigError
from mmrl.registry import REWARDS
from mmrl.rewards import RewardFn

ImageBatch = Tensor | Sequence[Tensor | Image.Image]

# OpenAI CLIP's normalisation, used when a model directory has no preprocessor_config.json
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
AESTHETIC_HEAD_FILE = "aesthetic_head.safetensors"
# where a trainer config holds a reward factory's keyword arguments; option errors name the key there
OPTIONS_KEY = "reward.options"


# --- images -------------------------------------------------------------------------------------


def as_image_list(images: ImageBatch) -> list[Tensor]:
    """Each image as a float [3, H, W] tensor in [0, 1] on its own device, so every reward accepts
    every image form."""
    if isinstance(images, Tensor):
        if images.ndim != 4:
            raise ValueError(f"an image batch tensor must be [B, 3, H, W], got shape {tuple(images.shape)}")
        images = list(images.unbind(0))
    result = []
    for image in images:
        if isinstance(image, Image.Image):
            image = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1).float() / 255
        elif not isinstance(image, Tensor) or not image.is_floating_point():
            raise TypeError(f"images must be float tensors in [0, 1] or PIL images, got {_kind_of(image)}")
        if image.ndim != 3 or image.shape[0] != 3:
            raise ValueError(f"each image must be [3, H, W], got shape {tuple(image.shape)}")
        result.append(image)
    return result


def _kind_of(image: object) -> str:
    return f"a {image.dtype} tensor" if isinstance(image, Tensor) else type(image).__name__


def to_pil(image: Tensor) -> Image.Image:
    """An RGB PIL image of a [3, H, W] float image, clamped to [0, 1] and rounded to 8 bits."""
    pixels = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)
    return Image.fromarray(pixels.permute(1, 2, 0).cpu().numpy())


# --- JPEG size (DDPO) ---------------------------------------------------------------------------


def _jpeg_sizes_kb(images: ImageBatch, quality: int) -> Tensor:
    """JPEG file size of each image in kB (1000 bytes), as DDPO measures it."""
    sizes = []
    for image in as_image_list(images):
        buffer = io.BytesIO()
        to_pil(image).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000)
    return torch.tensor(sizes, dtype=torch.float32)


def _check_quality(quality: int) -> None:
    if not 1 <= quality <= 100:
        raise ConfigError(
            f"config error: {OPTIONS_KEY}.quality = {quality!r}: JPEG quality must be in 1..100 (default 95)"
        )


@REWARDS.register("jpeg_compressibility")
def jpeg_compressibility(quality: int = 95) -> RewardFn:
    """Minus the JPEG size in kB: rewards images that compress well (simple, smooth)."""
    _check_quality(quality)

    def reward(images: ImageBatch, **_: Any) -> Tensor:
        return -_jpeg_sizes_kb(images, quality)

    return reward


@REWARDS.register("jpeg_incompressibility")
def jpeg_incompressibility(quality: int = 95) -> RewardFn:
    """The JPEG size in kB: rewards images that compress badly (detailed, textured)."""
    _check_quality(quality)

    def reward(images: ImageBatch, **_: Any) -> Tensor:
        return _jpeg_sizes_kb(images, quality)

    return reward


# --- CLIP ---------------------------------------------------------------------------------------


def local_model_dir(model_path: str | Path) -> Path:
    """`model_path` as an existing directory; anything else (a hub id, a typo) fails before loading."""
    path = Path(model_path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"{OPTIONS_KEY}.model_path = {str(model_path)!r} is not a local directory: it must be a "
            "directory saved with save_pretrained (models are never downloaded from a hub)"
        )
    return path


def option_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A dtype from its config name ('float32', 'bfloat16', ...) or as given."""
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, dtype, None)
    if not isinstance(resolved, torch.dtype):
        raise ConfigError(
            f"config error: {OPTIONS_KEY}.dtype = {dtype!r} is not a dtype: use e.g. float32, bfloat16 or "
            "float16"
        )
    return resolved


def clip_normalisation(model_dir: Path) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(mean, std) from the directory's preprocessor_config.json, else OpenAI CLIP's."""
    config_file = model_dir / "preprocessor_config.json"
    if not config_file.is_file():
        return CLIP_MEAN, CLIP_STD
    config = json.loads(config_file.read_text())
    return tuple(config.get("image_mean", CLIP_MEAN)), tuple(config.get("image_std", CLIP_STD))


def clip_preprocess(image: Tensor, size: int, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """CLIP's image recipe in torch, so images stay on their device: resize the short side to `size`
    (bicubic, antialiased, clamped back to [0, 1]), centre-crop to `size` x `size`, normalise."""
    height, width = image.shape[-2:]
    if height <= width:
        new_height, new_width = size, int(size * width / height)
    else:
        new_height, new_width = int(size * height / width), size
    resized = F.interpolate(
        image[None].float(), size=(new_height, new_width), mode="bicubic", antialias=True, align_corners=False
    ).clamp(0, 1)[0]
    top, left = (new_height - size) // 2, (new_width - size) // 2
    cropped = resized[:, top : top + size, left : left + size]
    mean_t = torch.tensor(mean, dtype=cropped.dtype, device=cropped.device)[:, None, None]
    std_t = torch.tensor(std, dtype=cropped.dtype, device=cropped.device)[:, None, None]
    return (cropped - mean_t) / std_t


class ClipScorer:
    """A CLIP model with its tokenizer and image preprocessing, loaded once; gives L2-normalised float32
    image and text embeddings."""

    def __init__(
        self, model_path: str | Path, device: str | None = None, dtype: str | torch.dtype = "float32"
    ) -> None:
        from transformers import CLIPModel, CLIPTokenizer

        model_dir = local_model_dir(model_path)
        key = f"config error: {OPTIONS_KEY}.model_path = {str(model_path)!r}"
        fix = "give a CLIPModel directory saved with save_pretrained"
        try:
            saved = json.loads((model_dir / "config.json").read_text())
        except (OSError, ValueError) as err:
            raise ConfigError(f"{key}: no readable config.json ({err}): {fix}") from None
        found = saved.get("model_type") if isinstance(saved, dict) else None
        if found != "clip":  # checked first: transformers would build a default CLIP and fill it at random
            raise ConfigError(f"{key} holds a {found!r} model, not a CLIP model (model_type 'clip'): {fix}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        torch_dtype = option_dtype(dtype)
        try:
            self.model, info = CLIPModel.from_pretrained(
                model_dir,
                use_safetensors=True,
                local_files_only=True,
                dtype=torch_dtype,
                output_loading_info=True,
            )
            self.tokenizer = CLIPTokenizer.from_pretrained(model_dir, local_files_only=True)
        except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as err:
            raise ConfigError(
                f"{key}: the CLIP model does not load ({' '.join(str(err).split())}): {fix}"
            ) from None
        if info["missing_keys"]:
            raise ConfigError(f"{key}: the weights lack {len(info['missing_keys'])} of CLIP's tensors: {fix}")
        self.model.to(self.device).eval()
        self.image_size = self.model.config.vision_config.image_size
        self.max_text_tokens = self.model.config.text_config.max_position_embeddings
        self.mean, self.std = clip_normalisation(model_dir)

    @property
    def embedding_dim(self) -> int:
        return self.model.config.projection_dim

    @torch.no_grad()
    def image_embeddings(self, images: ImageBatch) -> Tensor:
        pixels = torch.stack(
            [
                clip_preprocess(image.to(self.device), self.image_size, self.mean, self.std)
                for image in as_image_list(images)
            ]
        )
        features = self.model.get_image_features(pixel_values=pixels.to(self.model.dtype)).pooler_output
        return F.normalize(features.float(), dim=-1)

    @torch.no_grad()
    def text_embeddings(self, prompts: Sequence[str]) -> Tensor:
        tokens = self.tokenizer(
            list(prompts), padding=True, truncation=True, max_length=self.max_text_tokens, return_tensors="pt"
        ).to(self.device)
        features = self.model.get_text_features(
            input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]
        ).pooler_output
        return F.normalize(features.float(), dim=-1)

    def cosine(self, images: ImageBatch, prompts: Sequence[str] | None) -> Tensor:
        """Per-sample cosine similarity of each image with its prompt, on the CPU."""
        images = as_image_list(images)
        if prompts is None or len(prompts) != len(images):
            got = "no prompts" if prompts is None else f"{len(prompts)} prompts"
            raise ValueError(
                f"CLIP rewards need one prompt per image (batch field `prompts`): {got} for "
                f"{len(images)} images"
            )
        return (self.image_embeddings(images) * self.text_embeddings(prompts)).sum(-1).cpu()


@REWARDS.register("clip_score")
def clip_score(
    model_path: str, scale: float = 1.0, device: str | None = None, dtype: str = "float32"
) -> RewardFn:
    """`scale` x the cosine similarity of CLIP image and prompt embeddings (prompts: batch field `prompts`).

    scale=1 gives the raw cosine in [-1, 1]; scale=100 gives the usual "CLIP score" magnitude (as in
    torchmetrics, without its clipping at 0). `model_path` is a local CLIPModel + CLIPTokenizer directory.
    """
    scorer = ClipScorer(model_path, device, dtype)

    def reward(images: ImageBatch, prompts: Sequence[str] | None = None, **_: Any) -> Tensor:
        return scale * scorer.cosine(images, prompts)

    return reward


@REWARDS.register("pickscore")
def pickscore(model_path: str, device: str | None = None, dtype: str = "float32") -> RewardFn:
    """PickScore: the cosine scaled by the model's own learned temperature (exp(logit_scale), about 100).

    Point `model_path` at a local copy of the PickScore CLIP model with its preprocessor_config.json.
    """
    scorer = ClipScorer(model_path, device, dtype)
    temperature = scorer.model.logit_scale.exp().item()

    def reward(images: ImageBatch, prompts: Sequence[str] | None = None, **_: Any) -> Tensor:
        return temperature * scorer.cosine(images, prompts)

    return reward


# --- aesthetic head -----------------------------------------------------------------------------

_ACTIVATIONS: dict[str, type[nn.Module]] = {"identity": nn.Identity, "relu": nn.ReLU, "gelu": nn.GELU}


class AestheticHead(nn.Module):
    """An MLP from a normalised CLIP image embedding to one aesthetic score.

    Saved as two files side by side: ``NAME.safetensors`` holding ``layers.{2i}.weight`` and
    ``layers.{2i}.bias`` for the i-th Linear of `layers` (activations sit at the odd indices), and
    ``NAME.json`` holding ``{"input_dim": D, "hidden_dims": [...], "activation": "relu"}``. A linear
    head has no hidden dims. The LAION aesthetic predictor v2 used by DDPO (768 -> 1024 -> 128 -> 64 ->
    16 -> 1, no activations, for CLIP ViT-L/14) converts by renaming its ``layers.7.*`` to
    ``layers.8.*`` with ``hidden_dims [1024, 128, 64, 16]`` and ``activation "identity"``.
    """

    def __init__(self, input_dim: int, hidden_dims: Sequence[int] = (), activation: str = "relu") -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}: choose one of {sorted(_ACTIVATIONS)}")
        self.config = {"input_dim": input_dim, "hidden_dims": list(hidden_dims), "activation": activation}
        layers: list[nn.Module] = []
        for in_dim, out_dim in pairwise([input_dim, *hidden_dims, 1]):
            if layers:
                layers.append(_ACTIVATIONS[activation]())
            layers.append(nn.Linear(in_dim, out_dim))
        self.layers = nn.Sequential(*layers)

    def forward(self, embeddings: Tensor) -> Tensor:
        return self.layers(embeddings).squeeze(-1)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        save_file({name: value.contiguous() for name, value in self.state_dict().items()}, path)
        path.with_suffix(".json").write_text(json.dumps(self.config, indent=2))

    @classmethod
    def load(cls, path: str | Path) -> AestheticHead:
        path = Path(path)
        config_file = path.with_suffix(".json")
        for required in (path, config_file):
            if not required.is_file():
                raise FileNotFoundError(f"aesthetic head file {str(required)!r} does not exist")
        head = cls(**json.loads(config_file.read_text()))
        head.load_state_dict(load_file(path))
        return head.eval()


@REWARDS.register("aesthetic")
def aesthetic(
    model_path: str, head_path: str | None = None, device: str | None = None, dtype: str = "float32"
) -> RewardFn:
    """An aesthetic score: an `AestheticHead` applied to the normalised CLIP image embedding.

    `head_path` defaults to ``aesthetic_head.safetensors`` inside `model_path` (see `AestheticHead` for
    the file format).
    """
    scorer = ClipScorer(model_path, device, dtype)
    head_file = Path(head_path) if head_path is not None else Path(model_path) / AESTHETIC_HEAD_FILE
    head = AestheticHead.load(head_file).to(scorer.device)
    if head.config["input_dim"] != scorer.embedding_dim:
        raise ConfigError(
            f"config error: {OPTIONS_KEY}.head_path: the aesthetic head {str(head_file)!r} takes "
            f"{head.config['input_dim']}-dim embeddings but the CLIP model in {model_path!r} makes "
            f"{scorer.embedding_dim}-dim ones"
        )

    def reward(images: ImageBatch, **_: Any) -> Tensor:
        with torch.no_grad():
            return head(scorer.image_embeddings(images)).cpu()

    return reward
