"""The VLM run of `mmrl bench realsize` (`mmrl.bench_realsize`): Qwen2.5-VL-3B's tool-GRPO recipe for
one iteration at the real model's size, with LoRA on its bfloat16 base, a question's group of two
short conversations and a held-out conversation that zooms (`eval_modes: [always]`)."""

from __future__ import annotations

from mmrl.bench_realsize import RealSizeRun
from mmrl.registry import REALSIZE_RUNS


@REALSIZE_RUNS.register("qwen25vl_3b")
def qwen25vl_3b() -> RealSizeRun:
    """`vlm/qwen25vl_3b_tool_grpo` with LoRA rank 16 and its base in bfloat16, on the transformers
    backend (vLLM is an extra), two rollouts of up to 2 turns of 16 tokens."""
    return RealSizeRun(
        "vlm/qwen25vl_3b_tool_grpo",
        {"qwen25vl_3b": ["model.path"]},
        [
            "model.lora_rank=16",
            "model.base_dtype=bfloat16",
            "rollout.backend=transformers",
            "rollout.max_turns=2",
            "rollout.max_new_tokens=16",
            "rollout.max_tokens=1024",
            "train.questions_per_step=1",
            "train.group_size=2",
            "train.micro_batch=2",
            "data.train_size=4",
            "data.heldout_size=1",
            "eval_modes=[always]",
        ],
    )
