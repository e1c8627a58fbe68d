"""Entry point `mmrl.plugins`: importing this registers diffusion_rl's trainers, rewards, benches and
evaluator."""

from diffusion_rl import alignment, bench, evaluate, nft_trainer, pretrain, replicas, rewards, trainer  # noqa: F401
