"""What tool GRPO trains of the VLM and how it holds the rest: `trainable_policy` (the base in
`model.base_dtype`, the frozen reference copy, gradient checkpointing, and every weight or a LoRA
adapter), the trainer's and its memory plan's alike.

LoRA sits on the language model's decoder layers: `add_lora` puts a float32 adapter on their
projections while the other weights stay frozen, and `merged_state_dict` folds it back into plain
weights, so that vLLM's reload and the saved result are an ordinary checkpoint of the family
(`from_pretrained` loads it, no adapter code needed).

The adapter is peft's, injected in place (`inject_adapter_in_model`): module names and the model's
class stay those of transformers, so the trainer, its checkpoints and the memory plan see the same
model with a few more parameters.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from mmrl.precision import keep_adapter_in_float32, lora_base_dtype

# peft target regexes by `model.lora_targets`: the language model's decoder layers only (the vision
# tower's blocks have projections of the same names, which stay frozen)
LORA_TARGETS = {
    "attention": r".*language_model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj",
    "attention_mlp": r".*language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)",
}


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each layer's activations in the backward pass (while the model trains): the same
    gradients, a layer's activations instead of all of them held at once."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def trainable_policy(
    adapter: Any, model: Any, kl_coef: float, device: torch.device | str | None
) -> tuple[nn.Module | None, list[nn.Parameter]]:
    """Make `adapter` (a `vlm_rl.models.VLMAdapter`) ready to train as `model` (the config's `model`
    section) says, for `device` (None: the GPU a `--dry-run` plan is for): its weights held in the
    base dtype (`mmrl.precision.lora_base_dtype`), gradient checkpointing, a LoRA adapter. Returns the
    frozen reference the KL needs (kl_coef > 0: a copy of the base, without adapter or checkpointing)
    and the parameters to train (every weight, or the adapter's)."""
    adapter.hold_base_in(lora_base_dtype(model.base_dtype, model.lora_rank, device))
    reference = copy.deepcopy(adapter.model).requires_grad_(False) if kl_coef > 0 else None
    if model.gradient_checkpointing:
        enable_gradient_checkpointing(adapter.model)
    if model.lora_rank == 0:
        return reference, [p for p in adapter.model.parameters() if p.requires_grad]
    return reference, add_lora(adapter.model, model.lora_rank, model.lora_alpha, model.lora_targets)


def add_lora(model: nn.Module, rank: int, alpha: float, targets: str) -> list[nn.Parameter]:
    """Freeze `model` and add a rank-`rank` LoRA adapter (alpha 0: equal to the rank) on the projections
    `targets` names (`LORA_TARGETS`); its B starts at zero, so the policy starts as the base. Returns the
    adapter's parameters, in float32 whatever dtype the base is held in."""
    from peft import LoraConfig, inject_adapter_in_model

    model.requires_grad_(False)
    config = LoraConfig(r=rank, lora_alpha=alpha or rank, target_modules=LORA_TARGETS[targets])
    inject_adapter_in_model(config, model)
    return keep_adapter_in_float32([p for p in model.parameters() if p.requires_grad])


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s state dict with each LoRA layer folded into its base weight (W + scale * B @ A,
    computed in float32 and stored in the base's dtype) under the base layer's own name; the same
    as `model.state_dict()` for a model without an adapter."""
    from peft.tuners.lora import LoraLayer

    state = model.state_dict()
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        weight = module.base_layer.weight
        delta = sum(module.get_delta_weight(adapter).float() for adapter in module.active_adapters)
        for key in module.state_dict():  # base_layer.*, lora_A.*, lora_B.*
            del state[f"{name}.{key}"]
        state[f"{name}.weight"] = (weight.detach().float() + delta).to(weight.dtype)
        if module.base_layer.bias is not None:
            state[f"{name}.bias"] = module.base_layer.bias.detach()
    return state
