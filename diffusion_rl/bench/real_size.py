"""The diffusion runs of `mmrl bench realsize` (`mmrl.bench_realsize`): Stable Diffusion 3.5 Medium's
LoRA recipe for one iteration at the real model's size, and FLUX.1-dev's, which a 24 GiB machine
cannot hold in any dtype (its row says so and names the launch)."""

from __future__ import annotations

from mmrl.bench_realsize import RealSizeRun
from mmrl.registry import REALSIZE_RUNS

PROMPTS = {"prompts.txt": "a red square on a table\ntwo blue crosses\n", "heldout.txt": "a photo of a cat\n"}
# one short iteration: 128 px, two denoising steps, two samples, no guidance, one held-out prompt
SHORT = [
    "model.base_dtype=bfloat16",  # the frozen base as a GPU holds it (auto gives float32 on a CPU)
    "model.cache_prompt_embeddings=true",  # the text encoders encode once and are released
    "rollout.image_size=128",
    "rollout.steps=2",
    "rollout.prompts_per_step=1",
    "rollout.guidance_scale=1.0",
    "train.micro_batch=2",
    "eval.prompts=1",
    "eval.steps=2",
    "eval.guidance_scale=1.0",
    "eval.gold_reward=null",
    "reward.options.dtype=bfloat16",
    "prompt_file={folder}/prompts.txt",
    "eval.prompt_file={folder}/heldout.txt",
]


@REALSIZE_RUNS.register("sd35m")
def sd35m() -> RealSizeRun:
    """`diffusion/sd35m_pickscore_lora` (flat GRPO, LoRA rank 32 on SD3.5-M's 2.24B transformer,
    T5-XXL and both CLIPs, PickScore's ViT-H/14) with two samples per prompt."""
    return RealSizeRun(
        "diffusion/sd35m_pickscore_lora",
        {"sd35m": ["model.path"], "pickscore": ["reward.options.model_path"]},
        [*SHORT, "rollout.branch_factor=2"],
        files=PROMPTS,
    )


@REALSIZE_RUNS.register("flux_dev")
def flux_dev() -> RealSizeRun:
    """`diffusion/flux_dev_branchgrpo_lora` (BranchGRPO on FLUX.1-dev's 11.9B transformer)."""
    return RealSizeRun(
        "diffusion/flux_dev_branchgrpo_lora",
        {"flux_dev": ["model.path"], "pickscore": ["reward.options.model_path"]},
        [*SHORT, "rollout.split_steps=[0]", "rollout.branch_factor=2"],
        launch=(
            "On GPUs: `accelerate launch --config_file configs/accelerate/fsdp_1node_8gpu_flux.yaml -m mmrl "
            "train diffusion/flux_dev_branchgrpo_lora` (`mmrl train ... --dry-run --launch` plans it); on "
            "one process the keys that shrink it are model.cache_prompt_embeddings, eval.prompts and "
            "model.gradient_checkpointing, not the transformer's 22 GiB in bfloat16"
        ),
        files=PROMPTS,
    )
