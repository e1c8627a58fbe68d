"""The diffusion trainers' plan for `mmrl train RECIPE --dry-run` (see `mmrl.memory_plan`).

The config is checked first as `mmrl train` checks it (`planned_prompts`, `check_gold_reward`, then
`check_prompt_tokens` with the model's tokenizers), so that a plan is never made of a run that train
would refuse (a missing prompt file is left out: a plan may be made where the data are not). The
pipeline is built from its config files on the meta device (`diffusion_rl.loading.load` with
`weights=False`), with the LoRA adapter, the reference copy and the optimizer the trainer would make.
Four phases are measured: the update (a forward and backward of `train.micro_batch` rows through the
velocity the trainer trains, guidance included where it trains with it, then the optimizer step), a
rollout step (one model call on every row a step evaluates at once, twice with classifier-free
guidance), decoding every sample to pixels, and a held-out evaluation's chunk of prompts (a model call
and decoding); with `model.cache_prompt_embeddings` a fifth, the text encoders filling the cache (they
are held then and not after).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from diffusion_rl.inputs import (
    check_gold_reward,
    check_prompt_count,
    check_prompt_tokens,
    located_heldout_prompts,
    located_prompts,
    resolve_model_path,
    trainable_denoiser,
)
from diffusion_rl.loading import load
from diffusion_rl.models import CACHE_BATCH, FlowPipeline
from diffusion_rl.rewards import option_dtype
from mmrl.config import ConfigError
from mmrl.memory_plan import (
    MemoryPlan,
    human_bytes,
    largest_blocks,
    measure_phase,
    parameter_count,
    per_process_sizes,
    weight_bytes,
)
from mmrl.precision import base_dtype_note, default_dtype, lora_base_dtype

EVAL_BATCH = 64  # sample_ode's prompts per chunk
PROMPT = "a photo of a red square"  # any prompt: the conditioning's shape does not depend on it


def reward_model_bytes(names_and_options: list[tuple[str, dict[str, Any]]]) -> int:
    """Weights of the rewards that load a transformers model from `model_path` (CLIP score, PickScore,
    aesthetic), built from its config on the meta device in the dtype they load it in (their `dtype`
    option, float32 by default); rewards without one hold small scorers."""
    from transformers import AutoConfig, AutoModel

    total = 0
    for name, options in names_and_options:
        path = options.get("model_path")
        if path is None or not (Path(path) / "config.json").is_file():
            continue
        dtype = option_dtype(options.get("dtype", "float32"))
        try:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
            with torch.device("meta"), default_dtype(dtype):
                model = AutoModel.from_config(config, dtype=dtype)
        except (OSError, ValueError, KeyError) as err:
            raise ConfigError(f"config error: reward {name!r}: model_path = {path!r}: {err}") from None
        total += weight_bytes([model])
    return total


def planned_prompts(config: Any, processes: int) -> list[tuple[str, str]] | None:
    """The training and held-out prompts (with where each is), checked as `mmrl train` checks them: the
    files' text, enough training prompts for a step on `processes`, enough held-out ones. None when a
    prompt file is not on this machine: a plan may be made where the data are not."""
    files = [config.prompt_file, config.eval.prompt_file]
    if any(file is not None and not Path(file).is_file() for file in files):
        return None
    training = located_prompts(config.prompt_file)
    check_prompt_count(config, len(training), processes)
    return [*training, *located_heldout_prompts(config.eval)]


def prompt_cache_size(pipe: FlowPipeline, config: Any, prompts: list[tuple[str, str]] | None) -> str:
    """What `model.cache_prompt_embeddings` keeps in CPU memory (the text encoders leave the GPU): the
    embeddings of every training and held-out prompt (`prompts`), or per prompt where a prompt file is
    not there (None)."""
    per_prompt = pipe._encode_prompts([PROMPT]).nbytes
    each = f"{per_prompt / 1024:,.1f} KiB"
    if prompts is None:
        files = f"prompt_file = {config.prompt_file!r}, eval.prompt_file = {config.eval.prompt_file!r}"
        return f"{each} per prompt ({files}: not all there to count)"
    count = len(prompts) + 1
    return f"{human_bytes(count * per_prompt).strip()} ({count:,d} prompts of {each})"


@dataclass(frozen=True)
class PlannedRollout:
    """What one prompt's iteration asks of the denoiser under a training method, for its plan: the rows
    of each denoising step, the samples rewarded, the guidance its update trains the velocity at, the
    rows evaluated in a low-precision exploration pool (0: none) and the copies of the trained weights
    the method holds besides an EMA (DiffusionNFT's old policy)."""

    steps_rows: list[int]
    leaves: int
    train_guidance: float
    explore_rows: int = 0
    policy_copies: int = 0


def diffusion_memory_plan(
    config: Any, recipe: str, processes: int, planned_rollout: Callable[[Any, bool], PlannedRollout]
) -> MemoryPlan:
    """The plan of a diffusion method's iteration; `planned_rollout(config, guidance_embedded)` is the
    method's (`BranchGRPOTrainer.planned_rollout`, `DiffusionNFTTrainer.planned_rollout`)."""
    r, t = config.rollout, config.train
    located = planned_prompts(config, processes)
    check_gold_reward(config)
    with torch.device("meta"):
        pipe = load(resolve_model_path(config.model.path), weights=False)
        pipe.set_frozen_dtype(getattr(torch, config.model.frozen_dtype))
        pipe.set_base_dtype(lora_base_dtype(config.model.base_dtype, config.model.lora_rank, None))
        pipe.call_rows = r.call_rows  # a step's rows in calls of this many: the plan measures those calls
        if r.image_size is not None:
            try:
                pipe.set_image_size(r.image_size)
            except ValueError as err:
                raise ConfigError(f"config error: rollout.image_size = {r.image_size}: {err}") from None
        reference = copy.deepcopy(pipe.denoiser).requires_grad_(False) if t.kl_coef > 0 else None
        trained = trainable_denoiser(pipe.denoiser, config.model)
        optimizer = torch.optim.AdamW(trained, lr=t.lr)
    truncated = None if located is None else check_prompt_tokens(pipe, located)
    denoiser = pipe.denoiser
    guidance = r.guidance_scale
    guided = guidance != 1.0 and not pipe.guidance_embedded  # classifier-free: two rows per row

    def velocity(rows: int, scale: float) -> torch.Tensor:
        uncond = pipe.encode_prompts([""] * rows) if scale != 1.0 and not pipe.guidance_embedded else None
        x = torch.empty(rows, *pipe.latent_shape(), device="meta")
        sigma = torch.full((rows,), 0.5, device="meta")
        return pipe.velocity(x, sigma, pipe.encode_prompts([PROMPT] * rows), scale, uncond)

    planned = planned_rollout(config, pipe.guidance_embedded)
    steps_rows, leaves, call_rows = planned.steps_rows, planned.leaves, r.prompts_per_step * planned.leaves

    def update() -> None:
        velocity(t.micro_batch, planned.train_guidance).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    update()  # the first step creates the optimizer's states, which every later phase holds

    def rollout() -> None:
        with torch.no_grad():
            velocity(call_rows, guidance)

    def decode() -> None:
        with torch.no_grad():
            pipe.decode(torch.empty(call_rows, *pipe.latent_shape(), device="meta"))

    eval_rows = min(config.eval.prompts, EVAL_BATCH)

    def evaluate() -> None:  # sample_ode: a model call on a chunk of prompts, then their decoding
        with torch.no_grad():
            velocity(eval_rows, config.eval.guidance_scale)
            pipe.decode(torch.empty(eval_rows, *pipe.latent_shape(), device="meta"))

    frozen = pipe.frozen_modules()
    text_encoders = [module for module in frozen if module is not pipe.vae]
    cached = 1 + (len(located) if located is not None else r.prompts_per_step + eval_rows)

    def cache_prompts() -> None:  # the encoders alone on the device while they encode (`cache_prompts`)
        pipe._encode_prompts([PROMPT] * min(cached, CACHE_BATCH))

    gradients = sum(p.numel() * p.element_size() for p in trained)
    phases = {
        f"update ({t.micro_batch} rows)": replace(
            measure_phase(update, denoiser, optimizer, config.optimizer), gradients=gradients
        ),
        f"rollout step ({call_rows} rows)": measure_phase(rollout, denoiser, optimizer, config.optimizer),
        f"decode ({call_rows} images)": measure_phase(decode, denoiser, optimizer, config.optimizer),
        f"evaluation ({eval_rows} prompts)": measure_phase(evaluate, denoiser, optimizer, config.optimizer),
    }
    if config.model.cache_prompt_embeddings:
        with torch.no_grad():
            caching = measure_phase(cache_prompts, denoiser, optimizer, config.optimizer)
        # before the denoiser is on the device and the optimizer exists; the encoders' weights are the
        # phase's own
        phases["prompt caching (the text encoders)"] = replace(
            caching, weights=0, optimizer=0, transient=caching.transient + weight_bytes(text_encoders)
        )
    other = {}
    if not config.model.cache_prompt_embeddings:
        other["text encoders"] = weight_bytes(text_encoders)
    if pipe.vae is not None:
        other["vae"] = weight_bytes([pipe.vae])
    if reference is not None:
        other["reference (kl)"] = weight_bytes([reference])
    copies = planned.policy_copies + (1 if t.ema_decay > 0 else 0)
    if copies:
        other["old policy / EMA"] = copies * sum(p.numel() * p.element_size() for p in trained)
    rewards = [(term["name"], term.get("options") or {}) for term in (config.reward.terms or [])]
    if config.reward.terms is None:
        rewards = [(config.reward.name, config.reward.options or {})]
    if config.eval.gold_reward is not None:
        rewards.append((config.eval.gold_reward["name"], config.eval.gold_reward["options"]))
    reward_bytes = reward_model_bytes(rewards)
    if reward_bytes:
        other["reward models"] = reward_bytes

    per_call = 2 if guided else 1
    prompts = r.prompts_per_step
    work = {
        "denoiser evaluations in rollouts": f"{prompts * sum(steps_rows) * per_call:,d} "
        f"({prompts} prompts x {sum(steps_rows)} node steps{' x 2 (guidance)' if guided else ''})",
        "samples rewarded": f"{prompts * leaves:,d}",
    }
    if planned.explore_rows:
        work["denoiser evaluations in rollouts"] += (
            f", plus {prompts * planned.explore_rows * per_call:,d} in the {config.explore.precision} pool"
        )
    if config.model.cache_prompt_embeddings:
        work["prompt embeddings cached in CPU memory"] = prompt_cache_size(pipe, config, located)
    batch, warnings = per_process_sizes("rollout.prompts_per_step", prompts, config.processes, processes)
    if truncated is not None:
        warnings.append(truncated)
    batch.append(f"{leaves} samples per prompt; updates of train.micro_batch = {t.micro_batch} rows")
    notes = [base_dtype_note(config.model)] if config.model.lora_rank > 0 else []
    return MemoryPlan(
        recipe=recipe,
        processes=processes,
        parameters=parameter_count([denoiser, *frozen]),
        trainable=parameter_count([denoiser], trainable=True),
        gradients=gradients,
        other_weights=other,
        phases=phases,
        work=work,
        batch=batch,
        warnings=warnings,
        blocks=largest_blocks(denoiser),
        notes=notes,
    )
