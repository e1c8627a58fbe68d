"""The VLM section of `mmrl bench gpu` (see `mmrl.bench_gpu`): rollout tokens per second of
Qwen2.5-VL-3B at its published size with random weights (`mmrl replica qwen25vl_3b full=true
weights=true`, kept in the bench's work directory), the batched transformers engine against the vLLM
backend on the same zoom-task questions (target: vLLM at least 3x). A random model rarely writes a
tool call, so most conversations are one turn of `max_new_tokens`: the rate is of plain decoding with
images in the prompt. `scale="tiny"` runs the same code on the tiny replica.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mmrl.bench_gpu import GpuBenchOptions
from mmrl.registry import GPU_BENCH_SECTIONS
from vlm_rl.bench.rollout_speed import tokens_per_second, vllm_row
from vlm_rl.config import ToolRolloutConfig
from vlm_rl.data import DataConfig, QuestionSet
from vlm_rl.loading import load
from vlm_rl.replicas import qwen25vl_3b

VLLM_TARGET = 3.0
KV_CACHE_GIB = 16.0  # vLLM's cache at full size: room for every conversation at once


@GPU_BENCH_SECTIONS.register("vlm")
def rollout_rows(options: GpuBenchOptions, device: torch.device, workdir: Path) -> list[dict]:
    scale, rollouts, vllm = options.scale, options.rollouts, options.vllm
    path = workdir / f"qwen25vl_3b_{scale}"
    if not path.is_dir():
        partial = path.with_name(path.name + ".partial")
        qwen25vl_3b(partial, full=scale == "full", weights=True, device=str(device))
        partial.rename(path)  # a run killed while writing leaves no half model to reuse
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    adapter = load(path, dtype=dtype)
    adapter.model.to(device).eval()
    data = QuestionSet(DataConfig(heldout_size=rollouts), "heldout")
    questions = [data[i] for i in range(rollouts)]
    cfg = ToolRolloutConfig(max_new_tokens=128)
    tokens_per_second(adapter, questions[:4], cfg, batched=True)  # warm-up
    rate, tokens, _ = tokens_per_second(adapter, questions, cfg, batched=True)
    rows = [
        {
            "section": "vlm rollout",
            "variant": "batched transformers engine",
            "shape": f"{rollouts} rollouts, up to {cfg.max_new_tokens} tokens a turn",
            "tokens": tokens,
            "tokens_per_second": rate,
        }
    ]
    timed = (
        vllm_row(adapter, path, questions, cfg, rate, KV_CACHE_GIB if scale == "full" else 0.5)
        if vllm
        else "vLLM backend: not timed (vllm=false)"
    )
    if isinstance(timed, dict):
        ratio = timed.pop("ratio_to_batched")
        rows.append(
            {
                "section": "vlm rollout",
                **timed,
                "vllm_ratio": ratio,
                "vllm_target": VLLM_TARGET,
                "vllm_target_op": ">=",
            }
        )
    else:
        rows[0]["vllm"] = timed
    return rows
