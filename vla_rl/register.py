"""Entry point `mmrl.plugins`: declares vla_rl's trainers, bench, evaluator and replica; each module is
imported when one of its entries is first used (`Registry.provide`)."""

from mmrl.registry import BENCHES, EVALUATORS, REPLICAS, TRAINERS

TRAINERS.provide("vla_rl.trainer", "vla_habc")
TRAINERS.provide("vla_rl.pretrain", "vla_bc")
BENCHES.provide("vla_rl.bench", "vla")
EVALUATORS.provide("vla_rl.evaluate", "vla")
REPLICAS.provide("vla_rl.smolvla_replica", "smolvla")
