"""Entry point `mmrl.plugins`: importing this registers vlm_rl's trainers, rewards, speed bench
(`mmrl bench vlm`) and benchmark evaluator (`mmrl eval vlm`)."""

from vlm_rl import eval_benchmarks, replicas, rewards, sft, speed_bench, trainer, vision  # noqa: F401
