"""Entry point `mmrl.plugins`: importing this registers the demo trainers `tiny_grpo` and `tiny_sft`."""

from mmrl.examples import tiny_grpo, tiny_sft  # noqa: F401
