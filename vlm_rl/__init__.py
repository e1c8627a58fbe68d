"""vlm_rl: adaptive pixel-space reasoning for vision-language models (crop tools, rollouts, RL)."""

import mmrl  # noqa: F401  (first: its package setup, e.g. quieter logging, comes before any model library)
