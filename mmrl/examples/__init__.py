"""Demo trainers of the core on a task small enough for a laptop CPU: `tiny_grpo` and `tiny_sft`."""
