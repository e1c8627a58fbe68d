"""Entry point `mmrl.plugins`: declares the vla_rl modules that register trainers, the bench, the
evaluator and the replica; each module is imported when one of its entries is first used
(`mmrl.registry.provide`)."""

from mmrl.registry import provide

provide("vla_rl.trainer", "vla_rl.pretrain", "vla_rl.bench", "vla_rl.evaluate", "vla_rl.smolvla_replica")
