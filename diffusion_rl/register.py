"""Entry point `mmrl.plugins`: declares diffusion_rl's trainers, rewards, replicas, benches and evaluator.
Each module is imported when one of its entries is first used (`Registry.provide`), so a command that
runs no diffusion code does not load diffusers; tests/test_registry.py checks that every declared entry
is what its module registers."""

from mmrl.registry import BENCHES, EVALUATORS, GPU_BENCH_SECTIONS, REPLICAS, REWARDS, TRAINERS

TRAINERS.provide("diffusion_rl.trainer", "branch_grpo")
TRAINERS.provide("diffusion_rl.nft_trainer", "diffusion_nft")
TRAINERS.provide("diffusion_rl.pretrain", "diffusion_pretrain")
REWARDS.provide(
    "diffusion_rl.rewards",
    "aesthetic",
    "clip_score",
    "http_reward",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "pickscore",
)
REWARDS.provide("diffusion_rl.alignment", "geneval_mini", "shapes_strict")
REPLICAS.provide("diffusion_rl.replicas", "flux_dev", "pickscore", "sd35m")
BENCHES.provide("diffusion_rl.bench", "diffusion")
BENCHES.provide("diffusion_rl.gradient_bench", "diffusion_gradient")
GPU_BENCH_SECTIONS.provide("diffusion_rl.gpu_bench", "denoiser", "ranking", "tree")
EVALUATORS.provide("diffusion_rl.evaluate", "diffusion")
