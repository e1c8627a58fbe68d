"""diffusion_rl: branching-tree GRPO for diffusion / flow-matching models, with FP4 exploration."""
