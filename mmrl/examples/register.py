"""Entry point `mmrl.plugins`: declares the demo trainers `tiny_grpo` and `tiny_sft`; each module is
imported when its trainer is first used (`Registry.provide`)."""

from mmrl.registry import TRAINERS

TRAINERS.provide("mmrl.examples.tiny_grpo", "tiny_grpo")
TRAINERS.provide("mmrl.examples.tiny_sft", "tiny_sft")
