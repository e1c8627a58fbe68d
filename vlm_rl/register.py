"""Entry point `mmrl.plugins`: declares vlm_rl's trainers, reward, replica, speed bench (`mmrl bench
vlm`) and benchmark evaluator (`mmrl eval vlm`); each module is imported when one of its entries is
first used (`Registry.provide`)."""

from mmrl.registry import BENCHES, EVALUATORS, GPU_BENCH_SECTIONS, REPLICAS, REWARDS, TRAINERS

TRAINERS.provide("vlm_rl.trainer", "tool_grpo")
TRAINERS.provide("vlm_rl.sft", "vlm_sft")
TRAINERS.provide("vlm_rl.vision", "vlm_vision")
REWARDS.provide("vlm_rl.rewards", "adaptive_tool")
REPLICAS.provide("vlm_rl.replicas", "qwen25vl_3b")
BENCHES.provide("vlm_rl.speed_bench", "vlm")
GPU_BENCH_SECTIONS.provide("vlm_rl.gpu_bench", "vlm")
EVALUATORS.provide("vlm_rl.eval_benchmarks", "vlm")
