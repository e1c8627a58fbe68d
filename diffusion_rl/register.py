"""Entry point `mmrl.plugins`: declares the diffusion_rl modules that register trainers, rewards,
replicas, benches, GPU-bench sections, real-size runs and the evaluator. Each module is imported when
one of its entries is first used (`mmrl.registry.provide`), so a command that runs no diffusion code
does not load diffusers."""

from mmrl.registry import provide

provide(
    "diffusion_rl.branch_grpo",
    "diffusion_rl.nft",
    "diffusion_rl.pretrain",
    "diffusion_rl.rewards",
    "diffusion_rl.ocr_reward",
    "diffusion_rl.reward_server",
    "diffusion_rl.judge_reward",
    "diffusion_rl.alignment",
    "diffusion_rl.shapes_strict",
    "diffusion_rl.replicas",
    "diffusion_rl.bench.method_cost",
    "diffusion_rl.bench.gradient_signal",
    "diffusion_rl.bench.real_models",
    "diffusion_rl.bench.real_size",
    "diffusion_rl.evaluate",
)
