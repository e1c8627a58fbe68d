"""The tool-GRPO trainer's plan for `mmrl train RECIPE --dry-run` (see `mmrl.memory_plan`).

The policy is built from `model.path`'s config.json on the meta device, in the dtype the run loads it
in, with its reference copy (`train.kl_coef` > 0) and the optimizer; the tokenizer and image processor
are read from the same folder, so the conversations are the real ones: a task question with its
image, then crops of that image shown back as observations up to `rollout.max_images`, then text up to
`rollout.max_tokens`, the longest a rollout may grow. Token ids, masks and image grids stay real on
the CPU (`RealIndicesOnMeta`), so the model's own position and image-token bookkeeping runs as on a
GPU. Phases: the update (`train.micro_batch` such conversations through the policy with gradients,
the reference's log-probs, then the optimizer step), a rollout (the prefill of every conversation of
a step at its longest, its key/value cache kept: the transformers backend's peak; with vLLM, the
engine's weights and cache instead), and an evaluation chunk like a rollout.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from mmrl.config import ConfigError, shipped_path
from mmrl.memory_plan import (
    MemoryPlan,
    PhasePeak,
    RealIndicesOnMeta,
    largest_blocks,
    measure_phase,
    optimizer_state_bytes,
    parameter_count,
    per_process_sizes,
    weight_bytes,
)
from mmrl.precision import base_dtype_note
from vlm_rl.conversation import prompt_segment
from vlm_rl.data import QuestionSet
from vlm_rl.loading import load
from vlm_rl.models import Segment, VLMAdapter
from vlm_rl.policy_weights import trainable_policy

CROP = (0.25, 0.25, 0.75, 0.75)  # the observations' crops: the middle of the image, as fractions


def longest_conversation(adapter: VLMAdapter, question: Any, rollout: Any) -> Segment:
    """A question's prompt, crops shown back up to `rollout.max_images` images, and text (the
    assistant's turns) up to `rollout.max_tokens` tokens in all."""
    sequence = prompt_segment(adapter, question, rollout.system_prompt)
    width, height = question.image.size
    box = (CROP[0] * width, CROP[1] * height, CROP[2] * width, CROP[3] * height)
    for _ in range(rollout.max_images - 1):
        crop = adapter.observation_token_ids(question.image.crop(box))
        if len(sequence) + len(crop) > rollout.max_tokens:
            break
        sequence = sequence + crop
    filler = adapter.segment("the")
    while len(sequence) + len(filler) <= rollout.max_tokens:
        sequence = sequence + filler
    return sequence


def tool_grpo_memory_plan(config: Any, recipe: str, processes: int) -> MemoryPlan:
    r, t = config.rollout, config.train
    path = shipped_path(config.model.path)
    try:
        with torch.device("meta"):
            adapter = load(path, weights=False)
    except (FileNotFoundError, OSError, ValueError) as err:
        raise ConfigError(f"config error: model.path = {config.model.path!r}: {err}") from None
    reference, trained = trainable_policy(adapter, config.model, t.kl_coef, None)
    model = adapter.model
    with torch.device("meta"):
        optimizer = torch.optim.AdamW(trained, lr=t.lr)
    question = QuestionSet(config.data, "heldout")[0]
    conversation = longest_conversation(adapter, question, r)

    def log_probs(rows: int, module: torch.nn.Module) -> torch.Tensor:
        batch = adapter.collate([conversation] * rows)
        return adapter.token_log_probs(batch, batch["attention_mask"].bool(), model=module)

    def update() -> None:
        model.train()  # as the trainer's update: checkpointing acts in training mode only
        with RealIndicesOnMeta():
            if reference is not None:
                with torch.no_grad():
                    log_probs(t.micro_batch, reference)
            log_probs(t.micro_batch, model).sum().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def prefill(rows: int) -> None:
        model.eval()
        with RealIndicesOnMeta(), torch.no_grad():
            batch = adapter.on_device(adapter.collate([conversation] * rows, "left"))
            model(**batch, use_cache=True, logits_to_keep=1)

    rollout_rows = t.questions_per_step * t.group_size
    eval_rows = min(config.data.heldout_size, rollout_rows)
    with RealIndicesOnMeta():
        update()  # the first step creates the optimizer's states, which every later phase holds
    gradients = sum(p.numel() * p.element_size() for p in trained)
    phases = {
        f"update ({t.micro_batch} conversations)": replace(
            measure_phase(update, model, optimizer, config.optimizer), gradients=gradients
        )
    }
    other: dict[str, int] = {}
    if reference is not None:
        other["reference (kl)"] = weight_bytes([reference])
    if r.backend == "vllm":  # the engine's weights (in the policy's dtype) and cache, not a prefill
        engine = weight_bytes([model]) + int((r.vllm_kv_cache_gib or 0) * 2**30)
        if r.vllm_sleep:  # held while rolling out only
            states = optimizer_state_bytes(optimizer, config.optimizer)
            phases["rollout (vLLM engine)"] = PhasePeak(weight_bytes([model]), states, engine)
        else:
            other["vLLM engine"] = engine
    else:
        phases[f"rollout prefill ({rollout_rows} conversations)"] = measure_phase(
            lambda: prefill(rollout_rows), model, optimizer, config.optimizer
        )
    if r.backend != "vllm":  # with vLLM, the engine also evaluates
        phases[f"evaluation prefill ({eval_rows} conversations)"] = measure_phase(
            lambda: prefill(eval_rows), model, optimizer, config.optimizer
        )
    work = {
        "conversations per iteration": f"{rollout_rows:,d} ({t.questions_per_step} questions x "
        f"{t.group_size})",
        "tokens generated, at most": f"{rollout_rows * r.max_turns * r.max_new_tokens:,d} "
        f"({r.max_turns} turns of {r.max_new_tokens})",
        "planned conversation": f"{len(conversation):,d} tokens, {len(conversation.images)} image(s) "
        f"(rollout.max_tokens = {r.max_tokens}, rollout.max_images = {r.max_images})",
    }
    if r.backend == "vllm" and r.vllm_gpu_memory_fraction is not None:
        work["vLLM key/value cache"] = (
            f"what rollout.vllm_gpu_memory_fraction = {r.vllm_gpu_memory_fraction} of the GPU leaves after "
            "the weights: not in the figures above"
        )
    batch, warnings = per_process_sizes(
        "train.questions_per_step", t.questions_per_step, config.processes, processes
    )
    batch.append(f"{t.group_size} rollouts per question; updates of train.micro_batch = {t.micro_batch}")
    return MemoryPlan(
        recipe=recipe,
        processes=processes,
        parameters=parameter_count([model]),
        trainable=parameter_count([model], trainable=True),
        gradients=gradients,
        other_weights=other,
        phases=phases,
        work=work,
        batch=batch,
        warnings=warnings,
        blocks=largest_blocks(model),
        notes=[base_dtype_note(config.model)] if config.model.lora_rank > 0 else [],
    )
