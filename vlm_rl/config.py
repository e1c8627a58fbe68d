"""The `tool_grpo` trainer's configuration: one dataclass per section (the rollout's too, which the
SFT and evaluation reuse), the checks that need several fields, and the size check made at setup
(`check_rollout_size`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from transformers import PretrainedConfig

from mmrl.advantages import check_group_size
from mmrl.config import BaseConfig, ConfigError, option
from mmrl.partial import groups_in_flight
from mmrl.precision import BaseDtype, base_dtype_option, check_base_dtype
from mmrl.resources import ACTIVATION_FLOATS, check_enough_prompts, check_memory
from vlm_rl.data import DataConfig

DEFAULT_MODEL = "vlm_rl/assets/tiny_vlm"  # shipped; `mmrl pretrain vlm` remakes it (runs/pretrain/vlm/model)


ToolMode = Literal["auto", "always", "never"]
TOOL_MODES = get_args(ToolMode)


@dataclass
class TreeRolloutConfig:
    enabled: bool = option(
        False, "a question's group is a tree: branches continue from their shared prefix (TreePO-style)"
    )
    branching: list[int] = option(
        [4, 2],
        "children per branch point by depth: the prompt's first, then each later split (1 past the end); a "
        "finished branch hands its unused leaves back to its parent, so groups keep train.group_size leaves",
        min=1,
    )
    segment_tokens: int = option(
        0, "also split a turn after this many generated tokens (0: split only at turn boundaries)", min=0
    )


@dataclass
class PartialRolloutConfig:
    enabled: bool = option(
        False,
        "APRIL-style: launch more groups than a step trains, end the step once enough groups finished, "
        "carry the unfinished conversations into the next step",
    )
    over_provision: float = option(
        0.5, "extra groups launched, as a fraction of train.questions_per_step", min=0.0
    )
    max_staleness: int = option(
        2,
        "a carried conversation whose first token is more than this many policy versions old is dropped "
        "(counted) and its question relaunched",
        min=0,
    )
    segment_tokens: int = option(
        0,
        "also pause a turn after this many generated tokens, so a step can end mid-turn once enough groups "
        "are complete (0: steps end at turn boundaries; each pause prefills the conversation again)",
        min=0,
    )


@dataclass
class ToolRolloutConfig:
    max_turns: int = option(3, "assistant turns per rollout: tool calls plus the answer", min=1)
    max_new_tokens: int = option(48, "tokens one assistant turn may generate", min=1)
    max_tokens: int = option(1024, "tokens a whole conversation may hold (prompt and images included)", min=8)
    max_images: int = option(3, "images a conversation may hold, the original included", min=1)
    temperature: float = option(1.0, "sampling temperature", min=1e-3)
    coordinate_space: Literal["auto", "normalized", "pixels", "resized"] = option(
        "auto", "how the model writes boxes: [0,1] fractions, pixels, pixels of the resized view, or auto"
    )
    crop_padding: float = option(0.0, "fraction of a box's size added on each side of a crop", min=0.0)
    crop_min_size: int = option(28, "smallest crop side in original pixels (smaller boxes grow)", min=1)
    system_prompt: str | None = option(None, "system turn explaining the tool (real models need one)")
    backend: Literal["transformers", "vllm"] = option(
        "transformers", "what generates the turns: the policy's transformers model, or vLLM (optional)"
    )
    vllm_kv_cache_gib: float | None = option(
        2.0,
        "memory vLLM keeps for its key/value cache, GiB (backend vllm; on GPU and on CPU); null with "
        "vllm_gpu_memory_fraction",
        min=0.01,
    )
    vllm_gpu_memory_fraction: float | None = option(
        None,
        "share of the GPU's memory vLLM may take for its weights and key/value cache (its "
        "gpu_memory_utilization), the rest left to training; replaces vllm_kv_cache_gib (set that to null)",
        min=0.01,
        max=1.0,
    )
    vllm_sleep: bool = option(
        False,
        "free vLLM's GPU memory (weights and key/value cache) while the policy updates, and wake it with "
        "the new weights before the next rollouts (vLLM's sleep mode; a CUDA GPU only)",
    )
    tree: TreeRolloutConfig = field(default_factory=TreeRolloutConfig)
    partial: PartialRolloutConfig = field(default_factory=PartialRolloutConfig)

    def __post_init__(self) -> None:
        if (self.vllm_kv_cache_gib is None) == (self.vllm_gpu_memory_fraction is None):
            raise ConfigError(
                f"config error: rollout.vllm_kv_cache_gib = {self.vllm_kv_cache_gib} and "
                f"rollout.vllm_gpu_memory_fraction = {self.vllm_gpu_memory_fraction}: give exactly one "
                "(the key/value cache in GiB, or vLLM's share of the GPU) and set the other to null"
            )


@dataclass
class PolicyConfig:
    path: str = option(DEFAULT_MODEL, "local VLM checkpoint (default: the shipped tiny base)")
    gradient_checkpointing: bool = option(
        False, "recompute the decoder layers in the backward pass instead of keeping their activations"
    )
    lora_rank: int = option(
        0, "LoRA rank on the language model's decoder layers; 0 trains every weight", min=0
    )
    lora_alpha: float = option(0.0, "LoRA alpha (0: equal to the rank)", min=0.0)
    lora_targets: Literal["attention", "attention_mlp"] = option(
        "attention",
        "what LoRA adapts: the decoder layers' attention projections (q, k, v, o), or attention_mlp: those "
        "and the MLP's (gate, up, down); the vision tower stays frozen",
    )
    base_dtype: BaseDtype = base_dtype_option()

    def __post_init__(self) -> None:
        check_base_dtype(self.base_dtype, self.lora_rank)


@dataclass
class ToolGRPOTrainConfig:
    lr: float = option(1e-4, "AdamW learning rate", min=0.0)
    questions_per_step: int = option(8, "questions per step on each process", min=1)
    group_size: int = option(8, "rollouts per question", min=2, max=1024, why="groups hold 4 to 256")
    sampler: str = option("beta_thompson", "question sampler", registry="sampler")
    sampler_options: dict = option(
        {}, "keyword options of the sampler, e.g. {prior_decay: 0.8} (success: a correct answer)"
    )
    filter_equal_groups: bool = option(True, "drop groups whose rewards are all equal (no signal)")
    advantage: str = option(
        "grpo",
        "advantage estimator: a group one (each question's group, or its tree's leaves: every leaf's "
        "whole answer gets its advantage), or a tree one, e.g. tree_depthwise (scores every node of "
        "rollout.tree's trees, each segment trained with its node's; on flat groups, their depth-1 trees)",
        registry="advantage",
        kinds=("group", "tree"),
    )
    loss: str = option(
        "ppo_clip",
        "policy loss on the sampled tokens' log-probs, called with clip_low, clip_high and aggregation",
        registry="loss",
        kinds=("policy",),
    )
    clip_low: float = option(0.2, "PPO ratio clip below 1", min=0.0)
    clip_high: float = option(0.28, "PPO ratio clip above 1 (DAPO clip-higher)", min=0.0)
    adv_clip: float = option(5.0, "advantages clipped to [-adv_clip, adv_clip]", min=0.0)
    kl_coef: float = option(0.0, "weight of the k3 KL to the frozen start model", min=0.0)
    minibatches: int = option(2, "optimizer steps per rollout batch", min=1)
    micro_batch: int = option(32, "sequences per forward/backward", min=1)
    aggregation: Literal["token_mean", "sequence_mean"] = option("token_mean", "loss aggregation")
    shared_prefix: bool = option(
        False,
        "score what rollouts share once per micro-batch in the update: a group's prompt, or the branch a "
        "tree's sibling leaves grew from (same log-probs and gradients up to float rounding, less compute)",
    )
    max_grad_norm: float = option(1.0, "gradient clipping norm", min=0.0)
    nan_patience: int = option(3, "consecutive non-finite steps before the run stops", min=1)


@dataclass
class ToolRewardConfig:
    name: str = option("adaptive_tool", "reward (see `mmrl list`)", registry="reward")
    options: dict = option({}, "keyword options of the reward factory, e.g. {scheme: tool_cost}")


@dataclass
class ToolGRPOConfig(BaseConfig):
    trainer: str = option("tool_grpo", "trainer name", registry="trainer")
    model: PolicyConfig = field(default_factory=PolicyConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: ToolRolloutConfig = field(default_factory=ToolRolloutConfig)
    train: ToolGRPOTrainConfig = field(default_factory=ToolGRPOTrainConfig)
    reward: ToolRewardConfig = field(default_factory=ToolRewardConfig)
    eval_modes: list[str] = option(
        list(TOOL_MODES), "tool modes evaluated before and after", choices=TOOL_MODES
    )

    def __post_init__(self) -> None:
        check_group_size(self.train.advantage, self.train.group_size, "train.group_size")
        if self.rollout.tree.enabled and self.rollout.partial.enabled:
            raise ConfigError(
                "config error: rollout.tree.enabled and rollout.partial.enabled are not supported together: "
                "set one of them to false"
            )


def check_rollout_size(
    cfg: ToolGRPOConfig,
    model: PretrainedConfig,
    questions: tuple[int, int],
    processes: int,
    device: torch.device,
) -> None:
    """Refuse a step that would draw a question twice, or whose rollouts, updates and held-out images
    cannot fit on `device`: every rollout keeps its images and a key/value cache of up to
    `rollout.max_tokens` tokens, and each update runs `train.micro_batch` sequences with gradients and
    full logits. `questions`: (training, held-out) set sizes. Images of a question file are not
    counted (their sizes are known only once loaded)."""
    n, g = cfg.train.questions_per_step, cfg.train.group_size
    check_enough_prompts(
        "train.questions_per_step",
        n,
        processes,
        questions[0],
        f"the {questions[0]} training questions (data.train_size, or the rows of data.source)",
        "lower train.questions_per_step or use more questions",
    )
    text = model.get_text_config()
    hidden, layers, tokens = text.hidden_size, text.num_hidden_layers, cfg.rollout.max_tokens
    synthetic = cfg.data.source == "zoom_task"
    image = 3 * cfg.data.canvas_size**2 if synthetic else 0
    partial = cfg.rollout.partial
    flight = groups_in_flight(n, partial.over_provision) if partial.enabled else n
    scale = " x (1 + rollout.partial.over_provision)" if partial.enabled else ""
    rollouts = flight * g * (cfg.rollout.max_images * image + tokens * layers * 2 * hidden * 4)
    sequences = min(cfg.train.micro_batch, -(-n * g // cfg.train.minibatches))  # one micro-batch
    update = sequences * tokens * 4 * (ACTIVATION_FLOATS * hidden * layers + 3 * text.vocab_size)
    images = f" of {cfg.data.canvas_size} px (data.canvas_size)" if synthetic else ""
    check_memory(
        rollouts + update + questions[1] * image,
        f"rollouts of {flight} questions x {g} (train.questions_per_step{scale} x train.group_size), each "
        f"up to {tokens} tokens (rollout.max_tokens) and {cfg.rollout.max_images} images{images}, updates of "
        f"{sequences} sequences (train.micro_batch) and {questions[1]} held-out questions",
        ["train.questions_per_step", "train.group_size", "rollout.max_tokens", "train.micro_batch"]
        + (["rollout.partial.over_provision"] if partial.enabled else [])
        + (["data.canvas_size"] if synthetic else []),
        device,
    )
