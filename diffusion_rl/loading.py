"""Loading a model directory as a `FlowPipeline` (`diffusion_rl.models`): `load(path)`, whatever the
directory holds, and the checks of what it holds, made before any weights are read.

Three kinds of directory are read (`directory_kind`): the project's own layout (``transformer/`` or
``unet/``, ``text_encoder/``, ``tokenizer/``, optionally ``vae/``, and ``mmrl_pipeline.json``, as
`FlowPipeline.save_pretrained` writes it), any local diffusers pipeline directory (``model_index.json``:
StableDiffusion3Pipeline, FluxPipeline or StableDiffusionPipeline) and a LoRA result
(`FlowPipeline.save_lora_weights`; a run's ``final/`` with ``model.lora_rank > 0``), whose base is
loaded with the adapter merged in. ``load(path, weights=False)`` builds the same pipeline from the
config files alone, every network with random weights in the current default device: under
``torch.device("meta")``, a real model's memory plan without reading or allocating its weights.
`check_model_directory` checks any of the three kinds, a LoRA result's base included, without loading
weights. Weights are read from safetensors files only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel
from safetensors import SafetensorError, safe_open
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer

from diffusion_rl.models import LORA_FILE, LORA_WEIGHTS, PIPELINE_FILE, FlowPipeline, one_line
from mmrl.config import ConfigError, describe_saved_model, read_json_object, shipped_path

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
PICKLE_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl")  # weight files that torch.load would unpickle
# FlowMatchEulerDiscreteScheduler options that move the first sigma off 1; our steps start from noise
FLUX_UNSUPPORTED_SCHEDULE = (
    "use_karras_sigmas",
    "use_exponential_sigmas",
    "use_beta_sigmas",
    "invert_sigmas",
)


def load(
    path: str | Path,
    *,
    weights: bool = True,
    denoiser_dtype: torch.dtype | None = None,
    frozen_dtype: torch.dtype | None = None,
) -> FlowPipeline:
    """The pipeline in the model directory `path`: the project's layout, a local diffusers pipeline or a
    LoRA result (its base with the adapter merged in), its denoiser in `denoiser_dtype` and its text
    encoders and VAE in `frozen_dtype` (None: float32 as read, or the default dtype without weights); a
    diffusers pipeline is read in those dtypes, so that a large model never stands in float32 in memory
    on its way to bfloat16. With `weights` False, the same
    pipeline built from its config files alone, its networks with random weights in the current
    default device (a LoRA result gives its base).

    A directory of another kind, or one whose files are missing, malformed or of another model, is a
    ConfigError (or FileNotFoundError) that says what was found and what is expected."""
    directory = Path(path)
    kind = directory_kind(directory)
    if kind == "lora":
        base, folder = check_lora_result(directory)
        if not weights:
            return load(base, weights=False)
        pipe = _merged_lora(load(base), directory, base, folder)
    elif kind == "diffusers":
        dtypes = {
            "transformer": denoiser_dtype or torch.float32,
            "unet": denoiser_dtype or torch.float32,
            "default": frozen_dtype or torch.float32,
        }
        pipe = _wrap_diffusers(directory, _diffusers_pipeline(directory, weights, dtypes))
    else:
        pipe = _own_layout(directory, weights)
    if weights:
        pipe.source = directory  # the directory a LoRA result trained on it names as its base
    if denoiser_dtype is not None:
        pipe.denoiser.to(denoiser_dtype)
    if frozen_dtype is not None:
        pipe.set_frozen_dtype(frozen_dtype)
    return pipe


def _merged_lora(pipe: FlowPipeline, directory: Path, base: Path, folder: str) -> FlowPipeline:
    """`pipe` (the LoRA result's base) with the adapter in `directory` merged into the denoiser's
    weights. The adapter is read as plain diffusers reads it (`load_lora_adapter`: rank and alpha from
    the safetensors metadata)."""
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


def _own_layout(directory: Path, weights: bool) -> FlowPipeline:
    """The project's layout: one folder per component and the settings in PIPELINE_FILE; with `weights`
    False, every network built from its config."""
    settings, folder = check_own_layout(directory)
    denoiser_class = DENOISERS[folder]
    if weights:
        denoiser, text_encoder, tokenizer, vae = _own_layout_parts(directory, settings, folder)
    else:
        from diffusers import AutoencoderKL

        denoiser = denoiser_class.from_config(denoiser_class.load_config(directory / folder))
        text_encoder = CLIPTextModelWithProjection(CLIPTextConfig.from_pretrained(directory / "text_encoder"))
        tokenizer = CLIPTokenizer.from_pretrained(directory / "tokenizer", local_files_only=True)
        vae = None
        if settings.get("vae"):
            vae = AutoencoderKL.from_config(AutoencoderKL.load_config(directory / "vae"))
    try:
        return FlowPipeline(
            denoiser,
            text_encoder,
            tokenizer,
            vae=vae,
            shift=settings.get("shift", 1.0),
            prediction=settings.get("prediction", "velocity"),
        )
    except ValueError as err:
        raise ConfigError(f"{str(directory / PIPELINE_FILE)!r}: {err}") from None


def _own_layout_parts(directory: Path, settings: dict[str, Any], folder: str) -> tuple[Any, Any, Any, Any]:
    """The denoiser, text encoder, tokenizer and VAE (or None) of the project's layout, read with their
    weights; a ConfigError for a part that does not load or a text encoder with missing tensors."""
    try:
        vae = None
        if settings.get("vae"):
            from diffusers import AutoencoderKL

            vae = AutoencoderKL.from_pretrained(
                directory / "vae", local_files_only=True, use_safetensors=True
            )
        denoiser = DENOISERS[folder].from_pretrained(
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
    return denoiser, text_encoder, tokenizer, vae


def _diffusers_pipeline(directory: Path, weights: bool, dtypes: dict[str, torch.dtype]) -> Any:
    """The local diffusers pipeline in `directory`, read with its weights in `dtypes` (diffusers'
    `torch_dtype` by component, "default" for the rest), or (`weights` False) its networks built from
    their configs (`empty_diffusers_pipeline`)."""
    from diffusers import DiffusionPipeline

    index, _ = check_diffusers_layout(directory)
    if not weights:
        return empty_diffusers_pipeline(directory, index)
    name = index["_class_name"]
    # components saved as [null, null] (e.g. SD3 without its T5 encoder) are passed as None
    absent = {part: None for part, entry in index.items() if entry == [None, None]}
    try:
        return DiffusionPipeline.from_pretrained(
            directory, use_safetensors=True, local_files_only=True, dtype=dtypes, **absent
        )
    except LOAD_ERRORS as err:
        raise ConfigError(f"{directory}: the diffusers {name} does not load ({one_line(err)})") from None


def _wrap_diffusers(directory: str | Path, pipeline: Any) -> FlowPipeline:
    """A loaded (or empty, `empty_diffusers_pipeline`) diffusers pipeline of `directory` as a FlowPipeline."""
    name = type(pipeline).__name__
    scheduler = pipeline.scheduler
    if isinstance(getattr(pipeline, "transformer", None), FluxTransformer2DModel):
        return _wrap_flux(Path(directory), pipeline)
    if isinstance(getattr(pipeline, "transformer", None), SD3Transformer2DModel) and hasattr(
        pipeline, "text_encoder_2"
    ):
        if hasattr(scheduler, "alphas_cumprod"):
            raise ConfigError(f"{directory}: a flow transformer with a DDPM-type scheduler is not supported")
        return FlowPipeline(
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
        return FlowPipeline(
            pipeline.unet,
            vae=pipeline.vae,
            prediction=scheduler.config.prediction_type,
            scheduler=scheduler,
            diffusers_pipeline=pipeline,
        )
    raise ConfigError(f"{directory}: diffusers pipeline {name!r} is not supported; {SUPPORTED_PIPELINES}")


def _wrap_flux(directory: Path, pipeline: Any) -> FlowPipeline:
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
    return FlowPipeline(
        pipeline.transformer,
        vae=pipeline.vae,
        shift=float(scheduler.config.get("shift", 1.0)),
        scheduler=scheduler,
        diffusers_pipeline=pipeline,
    )


# ---------------------------------------------------------------------------------------------
# What a model directory holds, checked without loading weights


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
    """Check that `load` can read `directory`, without loading any weights: its
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
