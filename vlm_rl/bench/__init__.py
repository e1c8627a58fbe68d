"""The VLM benches: rollout throughput (`rollout_speed`: `mmrl bench vlm`), tree against flat training
steps (`tree_steps`), and the VLM section of `mmrl bench gpu` (`gpu_rollouts`)."""
