"""Entry point `mmrl.plugins`: declares the vlm_rl modules that register trainers, the adaptive tool
reward, the replica, the speed bench (`mmrl bench vlm`), its GPU-bench section, its real-size run and
the benchmark evaluator (`mmrl eval vlm`); each module is imported when one of its entries is first
used (`mmrl.registry.provide`)."""

from mmrl.registry import provide

provide(
    "vlm_rl.trainer",
    "vlm_rl.sft",
    "vlm_rl.vision",
    "vlm_rl.rewards",
    "vlm_rl.replicas",
    "vlm_rl.bench.rollout_speed",
    "vlm_rl.bench.gpu_rollouts",
    "vlm_rl.bench.real_size",
    "vlm_rl.eval_benchmarks",
)
