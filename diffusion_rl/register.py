"""Entry point `mmrl.plugins`: importing this registers diffusion_rl's trainers, rewards and benches."""

from diffusion_rl import alignment, bench, pretrain, rewards, trainer  # noqa: F401
