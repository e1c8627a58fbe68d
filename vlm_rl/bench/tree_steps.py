"""The tree-vs-flat rows of `mmrl bench vlm`: whole `tool_grpo` training steps with tree rollouts
(`rollout.tree`) against flat groups, side by side in one process.

Both trainers start from the same checkpoint and run the same questions (same sampler seed) with the
same number of leaves per question (`train.group_size`), every leaf trained as one sequence. Steps
alternate flat, tree, flat, tree, ... after one warm-up step each, so both see the same machine load.
Counted at `generate_turn`: prompt tokens prefilled; per step: wall-clock and trained tokens (the
sampled tokens of every sequence the update runs on). Targets: tree prefill <= 0.5x flat's, tree
wall-clock per trained token <= 0.7x flat's.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from mmrl.bench_all import print_table
from mmrl.config import load_config
from vlm_rl.bench import print_ratios
from vlm_rl.trainer import ToolGRPOTrainer

PREFILL_TARGET = 0.5
WALL_TARGET = 0.7


class _Counted:
    """A trainer whose turn generator and update are wrapped to count prefill and trained tokens."""

    def __init__(self, recipe: str, overrides: list[str], run_dir: Path) -> None:
        cfg = load_config(recipe, [*overrides, f"output_dir={run_dir}", "progress=false", "eval_every=0"])
        self.trainer = ToolGRPOTrainer(cfg)
        self.trainer.prepare_run_dir()
        self.trainer.seed_everything()
        self.trainer.setup()
        self.prefill = self.trained = 0
        self.seconds = 0.0
        self.steps = 0
        self.tool_ratio = 0.0
        generate_turn, optimise = self.trainer.adapter.generate_turn, self.trainer.optimise

        def counted_generate_turn(*args: Any, **kwargs: Any) -> Any:
            out = generate_turn(*args, **kwargs)
            self.prefill += out.prefill_tokens
            return out

        def counted_optimise(trajectories: list, *args: Any) -> dict[str, Any]:
            self.trained += sum(t.generated_tokens for t in trajectories)
            return optimise(trajectories, *args)

        self.trainer.adapter.generate_turn = counted_generate_turn
        self.trainer.optimise = counted_optimise

    def step(self, step: int, timed: bool) -> None:
        before = (self.prefill, self.trained)
        start = time.perf_counter()
        metrics = self.trainer.train_step(step)
        seconds = time.perf_counter() - start
        if not timed:  # the warm-up counts nothing
            self.prefill, self.trained = before
            return
        self.seconds += seconds
        self.steps += 1
        self.tool_ratio += float(metrics["tool_ratio"])

    def row(self, label: str) -> dict[str, Any]:
        return {
            "variant": label,
            "prefill_tokens": self.prefill,
            "trained_tokens": self.trained,
            "seconds": self.seconds,
            "ms_per_trained_token": 1000 * self.seconds / max(self.trained, 1),
            "tool_ratio": self.tool_ratio / max(self.steps, 1),
        }


def tree_vs_flat_rows(
    model: Path, steps: int = 3, branching: str = "[4,2]", questions: int = 8, group_size: int = 8
) -> list[dict[str, Any]]:
    """Rows for `tool_grpo` steps from `model` (`questions` x `group_size` leaves per step): flat groups as
    `vlm/tool_grpo` trains them, flat groups scoring their prompt once (`train.shared_prefix`), and tree
    rollouts as `vlm/tool_grpo_tree` trains them (shared branches scored once). The targets compare the
    tree with the first; the ratio to the second says what the tree adds to prefix-shared scoring."""
    sizes = [f"model.path={model}", f"train.questions_per_step={questions}", f"train.group_size={group_size}"]
    tree = [
        "rollout.tree.enabled=true",
        f"rollout.tree.branching={branching}",
        "train.advantage=tree_depthwise",
        "train.shared_prefix=true",
    ]
    variants = {
        "flat groups": sizes,
        "flat, shared prompt": [*sizes, "train.shared_prefix=true"],
        f"tree rollouts {branching}": [*sizes, *tree],
    }
    with tempfile.TemporaryDirectory() as tmp:
        runs = {
            label: _Counted("vlm/tool_grpo", overrides, Path(tmp) / str(k))
            for k, (label, overrides) in enumerate(variants.items())
        }
        for step in range(steps + 1):
            for run in runs.values():
                run.step(step, timed=step > 0)
    flat, shared, tree_row = (run.row(label) for label, run in runs.items())
    tree_row |= {
        "prefill_ratio": tree_row["prefill_tokens"] / max(flat["prefill_tokens"], 1),
        "prefill_target": PREFILL_TARGET,
        "wall_per_trained_token_ratio": tree_row["ms_per_trained_token"] / flat["ms_per_trained_token"],
        "wall_per_trained_token_target": WALL_TARGET,
        "wall_ratio_to_shared_flat": tree_row["ms_per_trained_token"] / shared["ms_per_trained_token"],
    }
    rows = [flat, shared, tree_row]
    print_table(
        f"tree vs flat tool_grpo steps ({steps} timed, {questions} questions x {group_size} leaves each)",
        ["variant", "prefill", "trained tok", "seconds", "ms/trained tok", "tool use"],
        [
            [
                row["variant"],
                str(row["prefill_tokens"]),
                str(row["trained_tokens"]),
                f"{row['seconds']:.1f}",
                f"{row['ms_per_trained_token']:.2f}",
                f"{row['tool_ratio']:.2f}",
            ]
            for row in rows
        ],
    )
    print_ratios("tree / flat prefill tokens and wall-clock per trained token", rows)
    shared_ratio = tree_row["wall_ratio_to_shared_flat"]
    print(f"tree / flat with a shared prompt, wall-clock per trained token: {shared_ratio:.2f}x")
    return rows
