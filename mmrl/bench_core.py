"""`mmrl bench core`: cost of the shared core's hot paths, measured side by side in one run.

Two tables: keyed deterministic noise against plain `torch.randn` / `torch.rand` on the same shapes
(target: at most 1.5x the plain draw), and every advantage estimator on a million samples. Times
are medians over `repeats`; ours and the baseline are timed alternately in each repeat so that load
from other processes hits both alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from mmrl.advantages import (
    gae,
    grpo,
    grpo_global_std,
    mc_grpo,
    rloo,
    td1,
    tree_depthwise,
    tree_depthwise_nested,
    tree_value,
    treepo,
)
from mmrl.bench_all import check_counts, print_table
from mmrl.config import check_device
from mmrl.losses import awr_weights
from mmrl.noise import NoiseKey, keyed_rand_batch, keyed_randn_batch
from mmrl.registry import BENCHES

NOISE_TARGET_RATIO = 1.5
# Each timing sample repeats a call until it lasts this long, so sub-millisecond draws are not
# dominated by timer and scheduler jitter.
MIN_SAMPLE_SECONDS = 0.02


def _median_ms(fns: list[Callable[[], object]], repeats: int, sync: Callable[[], None]) -> list[float]:
    """Median milliseconds per call of each fn, timing the fns in turn within every repeat."""
    calls = []
    for fn in fns:
        fn()  # warm-up: allocator, lazy init
        sync()
        start = time.perf_counter()
        fn()
        sync()
        calls.append(max(1, round(MIN_SAMPLE_SECONDS / (time.perf_counter() - start))))
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, n_calls, fn_samples in zip(fns, calls, samples, strict=True):
            start = time.perf_counter()
            for _ in range(n_calls):
                fn()
            sync()
            fn_samples.append((time.perf_counter() - start) / n_calls * 1e3)
    return [statistics.median(fn_samples) for fn_samples in samples]


def _noise_rows(repeats: int, device: torch.device, sync: Callable[[], None]) -> list[dict]:
    def node_keys(n: int = 16) -> list[NoiseKey]:
        """Keys of a batch of n tree nodes, built inside the timed call as a rollout does."""
        return [NoiseKey(1, 2, 3, node) for node in range(n)]

    small, large, logits = (16, 4, 32, 32), (16, 16, 64, 64), (16, 32000)
    cases = [
        (
            "keyed_randn_batch, 1 key",
            small,
            lambda: keyed_randn_batch(small, node_keys(1), device=device)[0],
            torch.randn,
        ),
        (
            "keyed_randn_batch, 1 key",
            large,
            lambda: keyed_randn_batch(large, node_keys(1), device=device)[0],
            torch.randn,
        ),
        (
            "keyed_randn_batch, 16 keys",
            small,
            lambda: keyed_randn_batch(small[1:], node_keys(), device=device),
            torch.randn,
        ),
        (
            "keyed_randn_batch, 16 keys",
            large,
            lambda: keyed_randn_batch(large[1:], node_keys(), device=device),
            torch.randn,
        ),
        (
            "keyed_rand_batch, 1 key",
            logits,
            lambda: keyed_rand_batch(logits, node_keys(1), device=device)[0],
            torch.rand,
        ),
    ]
    rows = []
    for name, shape, ours, plain in cases:
        ours_ms, baseline_ms = _median_ms([ours, partial(plain, shape, device=device)], repeats, sync)
        ratio = ours_ms / baseline_ms
        rows.append(
            dict(
                section="noise",
                name=name,
                shape=shape,
                ours_ms=ours_ms,
                baseline=f"torch.{plain.__name__}",
                baseline_ms=baseline_ms,
                ratio=ratio,
                target=NOISE_TARGET_RATIO,
                verdict="PASS" if ratio <= NOISE_TARGET_RATIO else "FAIL",
            )
        )
    return rows


def _advantage_rows(
    repeats: int, device: torch.device, sync: Callable[[], None], n_groups: int
) -> list[dict]:
    gen = torch.Generator().manual_seed(0)

    def grouped(group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rewards and shuffled group ids, n_groups groups of group_size."""
        ids = torch.arange(n_groups).repeat_interleave(group_size)
        ids = ids[torch.randperm(len(ids), generator=gen)]
        return torch.rand(len(ids), generator=gen).to(device), ids.to(device)

    rewards, ids = grouped(16)
    odd_rewards, odd_ids = grouped(17)
    # Four-level binary trees of 31 nodes (rows breadth-first), as many nodes in all as the groups hold.
    node = torch.arange(31)
    n_trees = n_groups * 16 // len(node)
    offsets = torch.arange(n_trees).repeat_interleave(len(node)) * len(node)
    parents = torch.where(node > 0, (node - 1) // 2, -1).repeat(n_trees)
    parents = torch.where(parents >= 0, parents + offsets, -1).to(device)
    depths = torch.floor(torch.log2(node.double() + 1)).long().repeat(n_trees).to(device)
    node_rewards = torch.rand(len(depths), generator=gen).to(device)
    batch, horizon = max(1, n_groups // 64), 1024
    step_rewards = torch.rand(batch, horizon, generator=gen).to(device)
    values = torch.rand(batch, horizon + 1, generator=gen).to(device)
    dones = (torch.rand(batch, horizon, generator=gen) < 0.01).to(device)

    cases = [
        ("grpo", f"{len(rewards):,} rewards, {n_groups:,} groups of 16", lambda: grpo(rewards, ids)),
        (
            "grpo_global_std",
            f"{len(rewards):,} rewards, {n_groups:,} groups of 16",
            lambda: grpo_global_std(rewards, ids),
        ),
        ("rloo", f"{len(rewards):,} rewards, {n_groups:,} groups of 16", lambda: rloo(rewards, ids)),
        (
            "mc_grpo",
            f"{len(odd_rewards):,} rewards, {n_groups:,} groups of 17",
            lambda: mc_grpo(odd_rewards, odd_ids),
        ),
        (
            "tree_depthwise",
            f"{len(node_rewards):,} nodes, {n_trees:,} binary trees of depth 4",
            lambda: tree_depthwise(node_rewards, parents, depths),
        ),
        (
            "treepo",
            f"{len(node_rewards):,} nodes, {n_trees:,} binary trees of depth 4",
            lambda: treepo(node_rewards, parents, depths),
        ),
        (
            "tree_depthwise_nested",
            f"{len(node_rewards):,} nodes, {n_trees:,} binary trees of depth 4",
            lambda: tree_depthwise_nested(node_rewards, parents, depths),
        ),
        (
            "tree_value",
            f"{len(node_rewards):,} nodes, {n_trees:,} binary trees of depth 4",
            lambda: tree_value(node_rewards, parents, depths),
        ),
        ("awr_weights", f"{len(rewards):,} advantages", lambda: awr_weights(rewards)),
        ("gae", f"[{batch}, {horizon}] steps", lambda: gae(step_rewards, values, dones)),
        ("td1", f"[{batch}, {horizon}] steps", lambda: td1(step_rewards, values, dones)),
    ]
    return [
        dict(section="advantage", name=name, size=size, ms=_median_ms([fn], repeats, sync)[0])
        for name, size, fn in cases
    ]


@BENCHES.register("core")
def bench_core(repeats: int = 5, device: str | torch.device = "cpu", n_groups: int = 65536) -> list[dict]:
    """Time keyed noise against torch.randn and every advantage estimator; print and return the rows.

    n_groups sets the advantage problem sizes (65536 groups of 16 = 1M rewards; gae gets
    [n_groups // 64, 1024] steps); tests pass a small value.
    """
    check_counts(repeats=repeats, n_groups=n_groups)
    device = torch.device(check_device(str(device), "device"))
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    noise_rows = _noise_rows(repeats, device, sync)
    advantage_rows = _advantage_rows(repeats, device, sync, n_groups)

    where = f"{device}, {torch.get_num_threads()} threads, median of {repeats}"
    print_table(
        f"Deterministic noise vs plain draws ({where})",
        ["draw", "shape", "ours ms", "baseline", "baseline ms", "ratio", "target", "verdict"],
        [
            [
                row["name"],
                "x".join(map(str, row["shape"])),
                f"{row['ours_ms']:.3f}",
                row["baseline"],
                f"{row['baseline_ms']:.3f}",
                f"{row['ratio']:.2f}x",
                f"<= {row['target']}x",
                row["verdict"],
            ]
            for row in noise_rows
        ],
    )
    print_table(
        f"Advantage estimators ({where})",
        ["estimator", "input", "ms"],
        [[row["name"], row["size"], f"{row['ms']:.1f}"] for row in advantage_rows],
    )
    return noise_rows + advantage_rows
