"""A text-to-image run's inputs, located and checked before anything is built: the prompt files and held-out
prompts, their token lengths, the model directory, the gold reward, the prompts a step draws, and the
parameters training updates (all weights or a LoRA adapter)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from diffusion_rl.config import EvalConfig, ModelConfig
from diffusion_rl.models import FlowPipeline
from diffusion_rl.sampling import evaluation_prompts
from diffusion_rl.shapes import train_prompts
from mmrl.config import ConfigError, shipped_path
from mmrl.precision import keep_adapter_in_float32
from mmrl.resources import check_enough_prompts

LORA_TARGETS = {  # module-name suffixes, by model.lora_targets
    "attention": ["to_q", "to_k", "to_v", "to_out.0"],
    "attention_mlp": [
        *["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"],
        *["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp"],
    ],
}


def located_prompts(prompt_file: str | None, key: str = "prompt_file") -> list[tuple[str, str]]:
    """Every prompt of `prompt_file` (UTF-8 text, one prompt per line, blank lines skipped) with where it
    is, e.g. "prompt_file = 'p.txt' line 3", for errors that name it; None: the built-in shapes prompts
    ("built-in prompt 3"). A file that is missing, unreadable, not UTF-8 or empty is a ConfigError
    naming config key `key`."""
    if prompt_file is None:
        return [(f"built-in prompt {n}", prompt) for n, prompt in enumerate(train_prompts(), start=1)]
    path = Path(prompt_file)
    if not path.is_file():
        raise ConfigError(
            f"config error: {key} = {prompt_file!r} does not exist; give a text file with one "
            "prompt per line, or null for the built-in shapes prompts"
        )
    where = f"{key} = {prompt_file!r}"
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(
            f"config error: {where} cannot be read ({err.strerror or err}): fix its permissions or give "
            "another file"
        ) from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise ConfigError(
            f"config error: {where} is not UTF-8 text: byte {err.start} (line {line}) is "
            f"0x{data[err.start]:02x} ({err.reason}); save the file as UTF-8 (from Latin-1: "
            "iconv -f latin1 -t utf-8)"
        ) from None
    located = [
        (f"{where} line {n}", line.strip())
        for n, line in enumerate(text.splitlines(), start=1)
        if line.strip()
    ]
    if not located:
        raise ConfigError(f"config error: {where} holds no prompts (one per line)")
    return located


def load_prompts(prompt_file: str | None, key: str = "prompt_file") -> list[str]:
    """The prompts of `prompt_file` (see `located_prompts`), or the built-in shapes prompts for None."""
    return [prompt for _, prompt in located_prompts(prompt_file, key)]


def located_heldout_prompts(cfg: EvalConfig) -> list[tuple[str, str]]:
    """The prompts a held-out evaluation samples, with where each is: eval.prompt_file's first
    eval.prompts, or the shapes world's held-out subset ("built-in held-out prompt 3")."""
    if cfg.prompt_file is None:
        chosen = evaluation_prompts(cfg.prompts)
        return [(f"built-in held-out prompt {n}", prompt) for n, prompt in enumerate(chosen, start=1)]
    located = located_prompts(cfg.prompt_file, "eval.prompt_file")
    if len(located) < cfg.prompts:
        raise ConfigError(
            f"config error: eval.prompt_file = {cfg.prompt_file!r} holds {len(located)} prompts, fewer "
            f"than eval.prompts = {cfg.prompts}: lower eval.prompts or add prompts"
        )
    return located[: cfg.prompts]


def load_heldout_prompts(cfg: EvalConfig) -> list[str] | None:
    """eval.prompt_file's first eval.prompts prompts (None: the shapes world's held-out prompts)."""
    if cfg.prompt_file is None:
        return None
    return [prompt for _, prompt in located_heldout_prompts(cfg)]


def check_prompt_tokens(pipe: FlowPipeline, prompts: Sequence[tuple[str, str]]) -> str | None:
    """Check every (where, prompt) against the model's tokenizers before anything is written. Our own
    tokenizer has a closed vocabulary (`FlowPipeline.vocabulary_gaps`): a word outside it, or a prompt
    longer than its text encoder reads, is a ConfigError naming the prompt. A diffusers pipeline's
    tokenizers read any word, and its encode_prompt cuts a long prompt to the encoder's length, as
    diffusers does: returns the warning that counts the prompts cut (None when none are cut)."""
    texts = list(dict.fromkeys(prompt for _, prompt in prompts))
    gaps = pipe.vocabulary_gaps(texts)
    limits = pipe.prompt_tokenizers()
    lengths = {
        name: dict(zip(texts, map(len, tokenizer(texts, verbose=False).input_ids), strict=True))
        for name, (tokenizer, _) in limits.items()
    }
    cut: dict[str, int] = {}  # prompts cut, by tokenizer
    cut_prompts, first = set(), None
    for where, prompt in prompts:
        if prompt in gaps:
            raise ConfigError(
                f"config error: {where} ({prompt!r}): the word {gaps[prompt]!r} is not in the model's "
                "vocabulary, so its text encoder never learnt it (the tokenizer would spell it out in "
                "characters): write the prompt in the words the model was trained on"
            )
        for name, (_, limit) in limits.items():
            length = lengths[name][prompt]
            if length <= limit:
                continue
            if pipe.diffusers_pipeline is None:
                raise ConfigError(
                    f"config error: {where} ({prompt!r}) is {length} tokens long, more than the {limit} "
                    "the model's text encoder reads: shorten it"
                )
            cut[name] = cut.get(name, 0) + 1
            cut_prompts.add(prompt)
            first = first or f"the first: {where}, {length} tokens for {name}'s {limit}"
    if not cut:
        return None
    counts = ", ".join(f"{count} by {name} ({limits[name][1]} tokens)" for name, count in cut.items())
    return (
        f"{len(cut_prompts)} of the {len(texts)} training and held-out prompts are longer than the text "
        f"encoders read and are cut to their length, as diffusers does: {counts}; {first}"
    )


def check_gold_reward(cfg: Any) -> None:
    """Refuse an eval.gold_reward that is also trained: a gold reward is one the run never trains on."""
    gold = cfg.eval.gold_reward
    if gold is None:
        return
    terms = cfg.reward.terms
    trained = sorted({term["name"] for term in terms} if terms is not None else {cfg.reward.name})
    if gold["name"] in trained:
        raise ConfigError(
            f"config error: eval.gold_reward.name = {gold['name']!r} is also a trained reward "
            f"({', '.join(trained)}): a gold reward must be one the run never trains on (set "
            "eval.gold_reward to another reward, or to null)"
        )


def resolve_model_path(path: str) -> Path:
    """A model directory as given (relative to the working directory), or relative to the repository."""
    found = shipped_path(path)
    if found.is_dir():
        return found
    raise ConfigError(
        f"config error: model.path = {path!r} is not a directory; give a local model directory (a "
        "diffusers pipeline saved from the hub id the recipe names, a tiny replica from `mmrl replica "
        "NAME`, or `mmrl pretrain diffusion`'s runs/pretrain/diffusion/pipeline)"
    )


def trainable_denoiser(denoiser: torch.nn.Module, model: ModelConfig) -> list[torch.nn.Parameter]:
    """The parameters training updates: every weight, or (model.lora_rank > 0) a LoRA adapter added
    on the projections model.lora_targets names (LORA_TARGETS), in float32 whatever the frozen rest is
    held in (`FlowPipeline.set_base_dtype`). With model.gradient_checkpointing the denoiser recomputes
    its blocks in the backward pass."""
    if model.gradient_checkpointing:
        denoiser.enable_gradient_checkpointing()
    if model.lora_rank == 0:
        return [p for p in denoiser.parameters() if p.requires_grad]
    from peft import LoraConfig

    denoiser.requires_grad_(False)
    denoiser.add_adapter(
        LoraConfig(
            r=model.lora_rank,
            lora_alpha=model.lora_alpha or model.lora_rank,
            init_lora_weights="gaussian",
            target_modules=LORA_TARGETS[model.lora_targets],
        )
    )
    return keep_adapter_in_float32([p for p in denoiser.parameters() if p.requires_grad])


def check_prompt_count(cfg: Any, prompts: int, processes: int) -> None:
    """Refuse a step that would draw a prompt twice: `rollout.prompts_per_step` on every process."""
    source = f"prompts of prompt_file = {cfg.prompt_file!r}" if cfg.prompt_file else "built-in prompts"
    check_enough_prompts(
        "rollout.prompts_per_step",
        cfg.rollout.prompts_per_step,
        processes,
        prompts,
        f"the {prompts} {source}",
        "lower rollout.prompts_per_step or give a longer prompt_file",
    )
