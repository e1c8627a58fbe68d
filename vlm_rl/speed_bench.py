"""`mmrl bench vlm`: the batched multi-turn rollout engine against a per-sample loop, side by side.

Both run the same multi-turn procedure (generate, crop, show the crop, generate) with the same model,
questions and keyed sampling noise, so they produce the same conversations; the baseline rolls out
one conversation at a time (a plain per-sample `generate` loop), the engine all of them in one batch.
The table prints generated tokens per second and the ratio (target: at least 3x). Where vLLM is
installed, a third row times the vLLM backend on the same questions and keys (its conversations
differ: vLLM draws its own sampling noise).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from mmrl.bench_all import check_counts
from mmrl.config import ConfigError
from mmrl.noise import NoiseKey
from mmrl.registry import BENCHES
from vlm_rl.data import DataConfig, QuestionSet
from vlm_rl.eval_benchmarks import resolve_model
from vlm_rl.models import VLMAdapter
from vlm_rl.rollout import ToolRolloutConfig, TurnGenerator, rollout
from vlm_rl.vllm_engine import INSTALL_HINT, vllm_available

TARGET = 3.0


def _tokens_per_second(
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


@BENCHES.register("vlm")
def bench_vlm(rollouts: int = 64, model: str | None = None, vllm: bool = True) -> list[dict[str, Any]]:
    """`vllm=false` leaves the vLLM row out (it builds an engine, and vLLM allows one per process)."""
    check_counts(rollouts=rollouts)
    path = resolve_model(model)
    if not path.is_dir():
        raise ConfigError(
            f"config error: model = {model!r} is not a directory: give a VLM checkpoint folder "
            "(save_pretrained), or leave model out to time the shipped tiny model"
        )
    adapter = VLMAdapter.from_pretrained(path)
    name = str(path)
    adapter.model.eval()
    data = QuestionSet(DataConfig(heldout_size=rollouts), "heldout")
    questions = [data[i] for i in range(rollouts)]
    cfg = ToolRolloutConfig(max_new_tokens=48)
    torch.manual_seed(0)
    _tokens_per_second(adapter, questions[:4], cfg, batched=True)  # warm-up
    rows, conversations = [], []
    for label, batched in (("per-sample generate loop", False), ("batched multi-turn engine", True)):
        rate, tokens, trajectories = _tokens_per_second(adapter, questions, cfg, batched)
        tool = sum(t.used_tool for t in trajectories) / len(trajectories)
        rows.append({"variant": label, "tokens_per_second": rate, "tokens": tokens, "tool_ratio": tool})
        conversations.append([t.sequence.token_ids for t in trajectories])
    ratio = rows[1]["tokens_per_second"] / rows[0]["tokens_per_second"]
    rows[1] |= {"ratio": ratio, "target": TARGET, "target_op": ">="}
    vllm_note = (
        _vllm_row(adapter, path, questions, cfg, rows) if vllm else "vLLM backend: not timed (vllm=false)"
    )
    print(f"model: {name}; {rollouts} rollouts, up to {cfg.max_turns} turns of {cfg.max_new_tokens} tokens")
    print(f"{'variant':<28}{'tokens':>8}{'tokens/s':>11}{'tool use':>10}")
    for row in rows:
        print(
            f"{row['variant']:<28}{row['tokens']:>8}{row['tokens_per_second']:>11.1f}{row['tool_ratio']:>10.2f}"
        )
    verdict = "PASS" if ratio >= TARGET else "FAIL"
    print(f"batched / per-sample: {ratio:.2f}x  {verdict} (>= {TARGET:.0f}x)")
    same = conversations[0] == conversations[1]
    print("the same conversations in both (keyed sampling): " + ("yes" if same else "NO: compare with care"))
    rows[1]["same_conversations"] = same
    print(vllm_note)
    return rows


def _vllm_row(
    adapter: VLMAdapter,
    path: Path,
    questions: list,
    cfg: ToolRolloutConfig,
    rows: list[dict[str, Any]],
) -> str:
    """Time the vLLM backend on the same questions (appending its row) or say why it was not timed."""
    if not vllm_available():
        return f"vLLM backend: not timed ({INSTALL_HINT})"
    from vlm_rl.vllm_engine import VLLMTurnGenerator

    try:
        engine = VLLMTurnGenerator(path, adapter, cfg.max_tokens, cfg.max_images, kv_cache_gib=0.5)
    except ValueError as err:
        return f"vLLM backend: not timed ({err})"
    _tokens_per_second(adapter, questions[:4], cfg, batched=True, engine=engine)  # warm-up
    rate, tokens, trajectories = _tokens_per_second(adapter, questions, cfg, batched=True, engine=engine)
    tool = sum(t.used_tool for t in trajectories) / len(trajectories)
    rows.append(
        {
            "variant": "vLLM multi-turn engine",
            "tokens_per_second": rate,
            "tokens": tokens,
            "tool_ratio": tool,
            "ratio_to_batched": rate / rows[1]["tokens_per_second"],
        }
    )
    return (
        f"vLLM / batched transformers: {rate / rows[1]['tokens_per_second']:.2f}x (vLLM samples its own "
        "tokens from the same keys: the conversations differ, the rate is per generated token)"
    )
