"""Entry point `mmrl.plugins`: importing this registers vla_rl's trainers."""

from vla_rl import bench, evaluate, pretrain, trainer  # noqa: F401
