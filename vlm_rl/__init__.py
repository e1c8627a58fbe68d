"""vlm_rl: adaptive pixel-space reasoning for vision-language models (crop tools, rollouts, RL)."""
