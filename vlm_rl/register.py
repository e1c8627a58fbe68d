"""Entry point `mmrl.plugins`: importing this registers vlm_rl's trainers, rewards and bench."""

from vlm_rl import bench, benchmarks, rewards, sft, trainer, vision  # noqa: F401
