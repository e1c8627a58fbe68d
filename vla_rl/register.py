"""Entry point `mmrl.plugins`: declares the vla_rl modules that register trainers, the bench, the
evaluator and the replica (each imported when one of its entries is first used,
`mmrl.registry.provide`), and that importing `sim` fills the task registry (`TASKS.fill_from`)."""

from mmrl.registry import TASKS, provide

provide(
    "vla_rl.trainer", "vla_rl.pretrain", "vla_rl.bench", "vla_rl.policy_comparison", "vla_rl.smolvla_replica"
)
TASKS.fill_from("sim")
