"""`mmrl bench gpu`: the real architectures at full size with random weights, on one GPU.

Nothing is downloaded: every model is built from its published config (`mmrl replica`), with random
weights, which is all that speed and memory depend on. The families register the sections
(`mmrl.registry.GPU_BENCH_SECTIONS`), which run side by side in one run:

- ``denoiser``: an SD3.5-Medium and a FLUX.1-dev denoising step, bfloat16 against FP8 exploration
  (target: FP8 at least 1.5x faster) (`diffusion_rl.bench.real_models`);
- ``ranking``: the FP8 pool's reward ranking against bfloat16 on the same seeds (Kendall tau);
- ``tree``: flat GRPO against BranchGRPO on SD3.5-Medium (seconds per iteration, peak memory), and
  the `--dry-run` memory plan against the measured peak (target: within 20%);
- ``vlm``: Qwen2.5-VL-3B rollout tokens per second, batched transformers against vLLM (target: vLLM at
  least 3x) (`vlm_rl.bench.gpu_rollouts`).

Without CUDA it says so in one line and returns; ``device=cpu scale=tiny`` runs the same code on the
tiny replicas. Random-weight checkpoints the sections train or serve from are written once to
`workdir` and reused. The rows go to `output` as JSON.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from mmrl.bench_all import check_counts, jsonable, print_table, ratio_rows
from mmrl.config import ConfigError, check_device, check_output_dir
from mmrl.registry import BENCHES, GPU_BENCH_SECTIONS

SCALES = ("full", "tiny")
DEFAULT_OUTPUT = "runs/bench/gpu.json"
NEEDS_CUDA = (
    "mmrl bench gpu: needs CUDA, and torch.cuda.is_available() is False here; run it on a GPU machine "
    "(`mmrl bench gpu device=cpu scale=tiny` runs its code on the tiny replicas)"
)


@dataclass(frozen=True)
class GpuBenchOptions:
    """What every section is given besides the device and the work directory (`bench_gpu`'s options)."""

    scale: str
    iterations: int
    batch: int
    pool: int
    pool_prompts: int
    pool_steps: int
    rollouts: int
    vllm: bool


@BENCHES.register("gpu")
def bench_gpu(
    device: str = "cuda",
    scale: str = "full",
    sections: list[str] | None = None,
    iterations: int = 3,
    batch: int = 2,
    pool: int = 32,
    pool_prompts: int = 16,
    pool_steps: int = 10,
    rollouts: int = 64,
    vllm: bool = True,
    workdir: str = "runs/bench/gpu_models",
    output: str = DEFAULT_OUTPUT,
) -> list[dict[str, Any]]:
    """`sections` picks among denoiser, ranking, tree and vlm (default: all); `iterations` timed calls
    or training steps after a warm-up; `batch` latents per denoising step; `pool` seeds per prompt on
    `pool_prompts` prompts for the ranking, sampled with `pool_steps` ODE steps; `rollouts`
    conversations for the VLM rate."""
    known = GPU_BENCH_SECTIONS.names()
    chosen = known if sections is None else sections
    for name in chosen:
        if name not in known:
            raise ConfigError(
                f"config error: sections: unknown section {name!r}; choose from {', '.join(known)}"
            )
    if scale not in SCALES:
        raise ConfigError(
            f"config error: scale = {scale!r}: use full (the real sizes) or tiny (the replicas)"
        )
    check_counts(
        iterations=iterations,
        batch=batch,
        pool=pool,
        pool_prompts=pool_prompts,
        pool_steps=pool_steps,
        rollouts=rollouts,
    )
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(NEEDS_CUDA)
        return [{"section": "gpu", "skipped": NEEDS_CUDA}]
    where = torch.device(check_device(device))
    check_output_dir(Path(output).parent, "output (its folder)")
    models = Path(workdir)
    models.mkdir(parents=True, exist_ok=True)
    options = GpuBenchOptions(scale, iterations, batch, pool, pool_prompts, pool_steps, rollouts, vllm)

    rows: list[dict[str, Any]] = []
    seconds: dict[str, float] = {}
    for name in chosen:
        start = time.perf_counter()
        print(f"--- {name} ---", flush=True)
        new = GPU_BENCH_SECTIONS.get(name)(options, where, models)
        seconds[name] = time.perf_counter() - start
        for row in new:
            print("  " + ", ".join(f"{k}={_short(v)}" for k, v in row.items() if k != "section"), flush=True)
        rows += new
    table = ratio_rows("gpu", rows)
    print_table(
        f"mmrl bench gpu ({_device_name(where)}, {scale} size)",
        ["row", "ratio", "target", "verdict"],
        [[r["row"], f"{r['ratio']:.3f}x", r["target"] or "-", r["verdict"]] for r in table],
    )
    document = {
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": _device_name(where),
        "torch": torch.__version__,
        "options": {"scale": scale, "iterations": iterations, "batch": batch, "pool": pool},
        "section_seconds": seconds,
        "ratios": table,
        "rows": rows,
    }
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(jsonable(document), indent=1))
    print(f"wrote {path}")
    return rows


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
