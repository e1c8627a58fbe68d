"""Entry point `mmrl.plugins`: declares the demo trainers' modules (`tiny_grpo`, `tiny_sft`); each is
imported when its trainer is first used (`mmrl.registry.provide`)."""

from mmrl.registry import provide

provide("mmrl.examples.tiny_grpo", "mmrl.examples.tiny_sft")
