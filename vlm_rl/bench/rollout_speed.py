"""`mmrl bench vlm`: the batched multi-turn rollout engine against a per-sample loop, side by side,
partial rollouts (APRIL) against synchronous ones, and tree rollouts against flat groups in whole
training steps (`vlm_rl.bench.tree_steps`).

Both run the same multi-turn procedure (generate, crop, show the crop, generate) with the same model,
questions and keyed sampling noise, so they produce the same conversations; the baseline rolls out
one conversation at a time (a plain per-sample `generate` loop), the engine all of them in one batch.
The table prints generated tokens per second and the ratio (target: at least 3x). Where vLLM is
installed, a third row times the vLLM backend on the same questions and keys (its conversations
differ: vLLM draws its own sampling noise).

Partial vs synchronous rollouts: the same policy trains `partial_groups` complete groups of
`PARTIAL_GROUP_SIZE` conversations per step, either rolled out to the end every step (synchronous),
or with `rollout.partial` at its defaults (over-provision 0.5, staleness cap 2, steps ending at turn
boundaries), over `partial_steps` timed steps after `PARTIAL_WARMUP` untimed ones (which fill the
partial pipeline; the policy does not change, the steps only count versions); the two take turns
step by step, so that a change in the machine's load reaches both. Throughput is trained
(complete-group) tokens per second. The lengths are long-tailed by the policy's own choice: on the zoom
task's held-out questions, at a detail share of `PARTIAL_DETAIL`, the shipped policy answers most
questions in one short turn and zooms on the others (a tool-call turn several times as long, a crop,
an answer turn), so the few zooming groups hold most of the tokens and all of the second turns.
Partial rollouts save the time a batch spends waiting on its longest conversations; where a wave's
time grows with its rows (a CPU, on which the vision tower encodes every image again at every turn and
prefill dominates) there is little of it.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import torch

from mmrl.bench_all import check_counts, print_table
from mmrl.config import ConfigError
from mmrl.noise import NoiseKey
from mmrl.partial import groups_in_flight
from mmrl.registry import BENCHES
from vlm_rl.bench import print_ratios
from vlm_rl.bench.tree_steps import tree_vs_flat_rows
from vlm_rl.config import PartialRolloutConfig, ToolRolloutConfig
from vlm_rl.conversation import Trajectory, TurnGenerator
from vlm_rl.data import DataConfig, QuestionSet
from vlm_rl.eval_benchmarks import resolve_model
from vlm_rl.loading import load
from vlm_rl.models import VLMAdapter
from vlm_rl.rollout import generate, rollout
from vlm_rl.schedules import CarriedGroups
from vlm_rl.vllm_engine import INSTALL_HINT, vllm_available

TARGET = 3.0
PARTIAL_TARGET = 1.2
PARTIAL_GROUP_SIZE = 4
PARTIAL_WARMUP = 2  # untimed steps
PARTIAL_DETAIL = 0.2  # share of held-out questions that need a zoom


def tokens_per_second(
    adapter: VLMAdapter,
    questions: list,
    cfg: ToolRolloutConfig,
    batched: bool,
    engine: TurnGenerator | None = None,
) -> tuple:
    """(generated tokens per second, tokens, trajectories) of the questions rolled out with keys 0..n-1,
    in one batch or one at a time, on `engine` (as `rollout` takes it)."""
    keys = [NoiseKey(0, 0, i, 0) for i in range(len(questions))]
    start = time.perf_counter()
    if batched:
        trajectories = rollout(adapter, questions, cfg, keys, engine=engine)
    else:
        trajectories = [
            t
            for i, q in enumerate(questions)
            for t in rollout(adapter, [q], cfg, keys[i : i + 1], engine=engine)
        ]
    seconds = time.perf_counter() - start
    tokens = sum(t.generated_tokens for t in trajectories)
    return tokens / seconds, tokens, trajectories


def _partial_rows(adapter: VLMAdapter, groups: int, steps: int) -> list[dict[str, Any]]:
    """Synchronous and partial rollouts of the same policy, side by side (see the module docstring):
    trained (complete-group) tokens per second over `steps` timed steps after `PARTIAL_WARMUP` untimed
    ones. The two take turns step by step, so that a change in the machine's load reaches both."""
    cfg = ToolRolloutConfig(max_new_tokens=48, partial=PartialRolloutConfig(enabled=True))
    g, total = PARTIAL_GROUP_SIZE, PARTIAL_WARMUP + steps
    size = total * groups_in_flight(groups, cfg.partial.over_provision)
    questions = QuestionSet(DataConfig(heldout_size=size, heldout_detail_fraction=PARTIAL_DETAIL), "heldout")
    orders = [itertools.count(), itertools.count()]  # both draw the questions in index order
    carried = CarriedGroups(adapter, questions, cfg, groups, g, seed=0)

    def synchronous(step: int) -> list[Trajectory]:
        items = [next(orders[0]) for _ in range(groups)]
        keys = [NoiseKey(0, step, s * g + j, 0) for s in range(groups) for j in range(g)]
        return rollout(adapter, [questions[i] for i in items for _ in range(g)], cfg, keys)

    metrics = []

    def partial(step: int) -> list[Trajectory]:
        generate(adapter, carried.begin(step, lambda n: [next(orders[1]) for _ in range(n)]), cfg)
        out = carried.end()
        metrics.append(out.metrics)
        return out.trajectories

    tokens, seconds = [0, 0], [0.0, 0.0]
    for step in range(total):
        for arm, run in enumerate((synchronous, partial)):
            start = time.perf_counter()
            trajectories = run(step)
            if step >= PARTIAL_WARMUP:
                seconds[arm] += time.perf_counter() - start
                tokens[arm] += sum(t.generated_tokens for t in trajectories)
    timed = metrics[PARTIAL_WARMUP:]
    case = f"{PARTIAL_DETAIL:.0%} zoom questions, {groups} groups of {g} trained per step"
    labels = ("synchronous rollouts", "partial rollouts (APRIL)")
    rows = [
        {
            "variant": labels[arm],
            "case": case,
            "tokens_per_second": tokens[arm] / seconds[arm],
            "tokens": tokens[arm],
        }
        for arm in range(2)
    ]
    rows[1] |= {
        "ratio": rows[1]["tokens_per_second"] / rows[0]["tokens_per_second"],
        "target": PARTIAL_TARGET,
        "target_op": ">=",
        "staleness_mean": sum(m["partial_staleness_mean"] for m in timed) / len(timed),
        "staleness_max": max(m["partial_staleness_max"] for m in timed),
        "old_token_fraction": sum(m["partial_old_token_fraction"] for m in timed) / len(timed),
        "dropped": metrics[-1]["partial_dropped_total"],
    }
    print(
        f"partial vs synchronous rollouts: {groups} trained groups of {g} per step, {steps} timed steps "
        f"after {PARTIAL_WARMUP}, held-out questions with {PARTIAL_DETAIL:.0%} needing a zoom"
    )
    print_table(
        "partial vs synchronous rollouts, trained tokens",
        ["variant", "trained tokens", "tokens/s", "staleness", "old tokens"],
        [
            [
                row["variant"],
                str(row["tokens"]),
                f"{row['tokens_per_second']:.1f}",
                f"{row['staleness_mean']:.2f}" if "staleness_mean" in row else "-",
                f"{row['old_token_fraction']:.2f}" if "old_token_fraction" in row else "-",
            ]
            for row in rows
        ],
    )
    print_ratios("partial / synchronous trained tokens per second", rows)
    return rows


@BENCHES.register("vlm")
def bench_vlm(
    rollouts: int = 64,
    model: str | None = None,
    vllm: bool = True,
    partial_steps: int = 8,
    partial_groups: int = 8,
    tree_steps: int = 3,
) -> list[dict[str, Any]]:
    """`vllm=false` leaves the vLLM row out (it builds an engine, and vLLM allows one per process);
    `partial_steps=0` the partial vs synchronous rows; `tree_steps=0` the tree vs flat rows."""
    check_counts(rollouts=rollouts, partial_groups=partial_groups)
    for key, value in (("partial_steps", partial_steps), ("tree_steps", tree_steps)):
        if value < 0:
            raise ConfigError(f"config error: {key} = {value}: must be at least 0 (0: leaves its rows out)")
    path = resolve_model(model)
    if not path.is_dir():
        raise ConfigError(
            f"config error: model = {model!r} is not a directory: give a VLM checkpoint folder "
            "(save_pretrained), or leave model out to time the shipped tiny model"
        )
    adapter = load(path)
    name = str(path)
    adapter.model.eval()
    data = QuestionSet(DataConfig(heldout_size=rollouts), "heldout")
    questions = [data[i] for i in range(rollouts)]
    cfg = ToolRolloutConfig(max_new_tokens=48)
    torch.manual_seed(0)
    tokens_per_second(adapter, questions[:4], cfg, batched=True)  # warm-up
    rows, conversations = [], []
    for label, batched in (("per-sample generate loop", False), ("batched multi-turn engine", True)):
        rate, tokens, trajectories = tokens_per_second(adapter, questions, cfg, batched)
        tool = sum(t.used_tool for t in trajectories) / len(trajectories)
        rows.append({"variant": label, "tokens_per_second": rate, "tokens": tokens, "tool_ratio": tool})
        conversations.append([t.sequence.token_ids for t in trajectories])
    rows[1] |= {
        "ratio": rows[1]["tokens_per_second"] / rows[0]["tokens_per_second"],
        "target": TARGET,
        "target_op": ">=",
    }
    timed = (
        vllm_row(adapter, path, questions, cfg, rows[1]["tokens_per_second"])
        if vllm
        else "vLLM backend: not timed (vllm=false)"
    )
    if isinstance(timed, dict):
        rows.append(timed)
        vllm_note = (
            f"vLLM / batched transformers: {timed['ratio_to_batched']:.2f}x (vLLM samples its own tokens "
            "from the same keys: the conversations differ, the rate is per generated token)"
        )
    else:
        vllm_note = timed
    print(f"model: {name}; {rollouts} rollouts, up to {cfg.max_turns} turns of {cfg.max_new_tokens} tokens")
    print_table(
        "rollout engines, generated tokens",
        ["variant", "tokens", "tokens/s", "tool use"],
        [
            [
                row["variant"],
                str(row["tokens"]),
                f"{row['tokens_per_second']:.1f}",
                f"{row['tool_ratio']:.2f}",
            ]
            for row in rows
        ],
    )
    print_ratios("batched / per-sample tokens per second", rows)
    same = conversations[0] == conversations[1]
    print("the same conversations in both (keyed sampling): " + ("yes" if same else "NO: compare with care"))
    rows[1]["same_conversations"] = same
    print(vllm_note)
    if partial_steps > 0:
        rows += _partial_rows(adapter, partial_groups, partial_steps)
    if tree_steps > 0:
        rows += tree_vs_flat_rows(path, tree_steps)
    return rows


def vllm_row(
    adapter: VLMAdapter,
    path: Path,
    questions: list,
    cfg: ToolRolloutConfig,
    batched_rate: float,
    kv_cache_gib: float = 0.5,
) -> dict[str, Any] | str:
    """The vLLM backend timed on the same questions, as a row with its rate's ratio to `batched_rate`
    (the batched transformers engine's), or why it was not timed."""
    if not vllm_available():
        return f"vLLM backend: not timed ({INSTALL_HINT})"
    from vlm_rl.vllm_engine import VLLMTurnGenerator

    try:
        engine = VLLMTurnGenerator(path, adapter, cfg.max_tokens, cfg.max_images, kv_cache_gib=kv_cache_gib)
    except ValueError as err:
        return f"vLLM backend: not timed ({err})"
    tokens_per_second(adapter, questions[:4], cfg, batched=True, engine=engine)  # warm-up
    rate, tokens, trajectories = tokens_per_second(adapter, questions, cfg, batched=True, engine=engine)
    tool = sum(t.used_tool for t in trajectories) / len(trajectories)
    return {
        "variant": "vLLM multi-turn engine",
        "tokens_per_second": rate,
        "tokens": tokens,
        "tool_ratio": tool,
        "ratio_to_batched": rate / batched_rate,
    }
