"""The VLM benches: rollout throughput (`rollout_speed`: `mmrl bench vlm`), tree against flat training
steps (`tree_steps`), and the VLM section of `mmrl bench gpu` (`gpu_rollouts`). Their ratios are
judged, and printed, by the shared bench harness (`mmrl.bench_all.ratio_rows`)."""

from __future__ import annotations

from typing import Any

from mmrl.bench_all import print_table, ratio_rows


def print_ratios(title: str, rows: list[dict[str, Any]]) -> None:
    """The rows' ratios with their targets and verdicts, as the shared harness reads them."""
    print_table(
        title,
        ["row", "ratio", "target", "verdict"],
        [[r["row"], f"{r['ratio']:.3f}x", r["target"] or "-", r["verdict"]] for r in ratio_rows("vlm", rows)],
    )
