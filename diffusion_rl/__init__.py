"""diffusion_rl: branching-tree GRPO for diffusion / flow-matching models, with FP4 exploration."""

import mmrl  # noqa: F401  (first: its package setup, e.g. quieter logging, comes before any model library)
