"""The text-to-image sections of `mmrl bench gpu` (see `mmrl.bench_gpu`).

- Denoising step, bfloat16 against FP8 exploration: the SD3.5-Medium and FLUX.1-dev transformers at
  their published sizes with random weights (built from `diffusion_rl.replicas` configs, nothing
  downloaded), one model call on a batch of 1024 px latents, timed in bfloat16 and then with every
  Linear layer through `explore_precision(..., "fp8")`, which runs real FP8 matmuls
  (`torch._scaled_mm`) where the GPU has them.
- The FP8 pool's reward ranking against bfloat16 on the same seeds: the shipped shapes model (the
  one trained model here) samples a pool per prompt from the same initial noises in both precisions;
  Kendall tau between the two rankings of each prompt's `geneval_mini` rewards, averaged over prompts.
- Flat GRPO against BranchGRPO, and the memory plan against the allocator: the
  `diffusion/sd35m_pickscore_lora` recipe (flat GRPO, 16 samples per prompt) and the same recipe with
  BranchGRPO's tree (16 leaves from splits at steps 0, 2, 4 and 6) train on SD3.5-Medium and PickScore
  with random weights; seconds per iteration and the peak memory of each, and the `--dry-run` plan's
  expected peak over the training phases (the timed steps never evaluate) against the measured one
  (target: within 20%).

`scale="tiny"` runs the same code on the tiny replicas, which is what the tests do on a CPU.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from diffusion_rl.alignment import geneval_mini
from diffusion_rl.inputs import resolve_model_path
from diffusion_rl.loading import load
from diffusion_rl.quantized_exploration import kendall_tau
from diffusion_rl.replicas import save_replica
from diffusion_rl.sampling import heldout_subset, sample_ode
from diffusion_rl.shapes import heldout_prompts
from mmrl.bench_gpu import GpuBenchOptions
from mmrl.config import load_config
from mmrl.precision import _fp8_kernel_ok, default_dtype, explore_precision
from mmrl.registry import GPU_BENCH_SECTIONS, TRAINERS

FAMILIES = ("sd35m", "flux_dev")
IMAGE_SIZE = {"full": 1024, "tiny": 64}
PROMPT = "a photo of a red square"
FP8_TARGET = 1.5  # bfloat16 seconds / FP8 seconds of one denoising step
PLAN_TARGET = 0.2  # |plan / measured peak - 1|
RECIPE = "diffusion/sd35m_pickscore_lora"
TREE = [  # 16 leaves per prompt, as the recipe has 16 samples; depth-wise advantages for the shared edges
    "rollout.split_steps=[0,2,4,6]",
    "rollout.branch_factor=2",
    "train.advantage=tree_depthwise",
]
TINY_SIZES = ["rollout.image_size=64", "rollout.steps=8", "train.micro_batch=4"]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(run: Callable[[], Any], device: torch.device, iterations: int) -> float:
    """Median wall-clock of `run()` over `iterations` calls after one warm-up call."""
    run()
    times = []
    for _ in range(iterations):
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fp8_layers(model: nn.Module) -> tuple[int, int]:
    """(Linear layers that get a real FP8 matmul here, all Linear layers)."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return sum(_fp8_kernel_ok(m.weight) for m in linears), len(linears)


@GPU_BENCH_SECTIONS.register("denoiser")
def denoiser_step_rows(options: GpuBenchOptions, device: torch.device, workdir: Path) -> list[dict]:
    """One denoising step of each family's transformer, bfloat16 against FP8 (module docstring)."""
    o = options
    rows = [_denoiser_step_row(name, o.scale, device, o.iterations, o.batch) for name in FAMILIES]
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


@torch.no_grad()
def _denoiser_step_row(name: str, scale: str, device: torch.device, iterations: int, batch: int) -> dict:
    with tempfile.TemporaryDirectory() as configs:
        save_replica(name, configs, full=scale == "full", weights=False)
        with torch.device(device), default_dtype(torch.bfloat16):
            pipe = load(configs, weights=False)
    pipe.set_image_size(IMAGE_SIZE[scale])
    cond = pipe.encode_prompts([PROMPT] * batch)
    x = torch.randn(batch, *pipe.latent_shape(), device=device, dtype=torch.bfloat16)
    sigma = torch.full((batch,), 0.5, device=device, dtype=torch.bfloat16)

    def step() -> None:
        pipe.velocity(x, sigma, cond, 3.5 if pipe.guidance_embedded else 1.0)

    bf16 = median_seconds(step, device, iterations)
    real, linears = fp8_layers(pipe.denoiser)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the emulated layers are counted in the row instead
        with explore_precision(pipe.denoiser, "fp8"):
            fp8 = median_seconds(step, device, iterations)
    side = pipe.latent_shape()[-1] * pipe.vae_scale
    return {
        "section": "denoiser step",
        "name": name,
        "shape": f"{batch} x {side} px",
        "parameters": sum(p.numel() for p in pipe.denoiser.parameters()),
        "bf16_seconds": bf16,
        "fp8_seconds": fp8,
        "fp8_linear_layers": f"{real} of {linears} with FP8 kernels",
        "speedup_ratio": bf16 / fp8,
        # emulated FP8 does full-precision matmuls: its ratio says nothing about FP8 kernels
        "speedup_target": FP8_TARGET if real else None,
        "speedup_target_op": ">=",
    }


@GPU_BENCH_SECTIONS.register("ranking")
def fp8_ranking_rows(options: GpuBenchOptions, device: torch.device, workdir: Path) -> list[dict]:
    """Kendall tau of each prompt's pool rewards, FP8 against bfloat16 on the same seeds, on the
    shipped shapes model (no guidance, ODE: how Sol-RL draws its pool)."""
    prompts, pool, steps = options.pool_prompts, options.pool, options.pool_steps
    pipe = load(resolve_model_path("diffusion_rl/assets/tiny_flow")).to(device)
    reward = geneval_mini(device=str(device))
    chosen = heldout_subset(prompts)
    repeated = [p for p in chosen for _ in range(pool)]
    ids = list(range(len(repeated)))  # one noise key per pool member: the same in both precisions

    def pool_rewards() -> torch.Tensor:
        images = sample_ode(pipe, repeated, steps, 1.0, seed=0, prompt_ids=ids)
        return reward(images, repeated).view(prompts, pool)

    with torch.autocast(device.type, dtype=torch.bfloat16):
        bf16 = pool_rewards()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with explore_precision(pipe.denoiser, "fp8"):
                fp8 = pool_rewards()
    taus = [kendall_tau(a, b) for a, b in zip(bf16, fp8, strict=True)]
    real, linears = fp8_layers(pipe.denoiser)
    return [
        {
            "section": "fp8 pool ranking",
            "name": "shipped shapes model",
            "shape": f"{prompts} prompts x {pool} seeds, {steps} steps",
            "kendall_tau": statistics.mean(taus),
            "kendall_tau_min": min(taus),
            "mean_reward_bf16": bf16.mean().item(),
            "mean_reward_fp8": fp8.mean().item(),
            "fp8_linear_layers": f"{real} of {linears} with FP8 kernels",
        }
    ]


def random_models(scale: str, device: torch.device, workdir: Path) -> dict[str, Path]:
    """SD3.5-Medium and PickScore with random weights (kept in `workdir`, reused by later runs), and a
    prompt file."""
    paths = {}
    for name in ("sd35m", "pickscore"):
        path = workdir / f"{name}_{scale}"
        if not path.is_dir():
            partial = path.with_name(path.name + ".partial")
            save_replica(name, partial, full=scale == "full", weights=True, device=str(device))
            partial.rename(path)  # a run killed while writing leaves no half model to reuse
        paths[name] = path
    prompts = workdir / "prompts.txt"
    prompts.write_text("\n".join(heldout_prompts()[:64]) + "\n")
    paths["prompts"] = prompts
    return paths


def peak_bytes_during(run: Callable[[], Any], device: torch.device) -> int | None:
    """The most bytes the CUDA allocator held during `run()` beyond what it held before; None on a
    CPU, whose allocator keeps no such count."""
    if device.type != "cuda":
        run()
        return None
    synchronize(device)
    gc.collect()  # the previous variant's trainer, if a reference cycle still holds it
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


@GPU_BENCH_SECTIONS.register("tree")
def tree_rows(options: GpuBenchOptions, device: torch.device, workdir: Path) -> list[dict]:
    """Flat GRPO (the recipe) and BranchGRPO on the same random SD3.5-Medium: seconds per iteration,
    peak memory, and the dry-run plan against that peak (module docstring)."""
    scale, iterations = options.scale, options.iterations
    paths = random_models(scale, device, workdir)
    common = [
        f"model.path={paths['sd35m']}",
        f"reward.options.model_path={paths['pickscore']}",
        f"prompt_file={paths['prompts']}",
        f"eval.prompt_file={paths['prompts']}",
        "eval.gold_reward=null",
        "progress=false",
        *(TINY_SIZES if scale == "tiny" else []),
    ]
    rows = [
        _train_variant(variant, [*common, *overrides], device, iterations)
        for variant, overrides in (("flat GRPO (recipe)", []), ("BranchGRPO", TREE))
    ]
    flat, tree = rows
    tree["time_ratio"] = tree["seconds_per_iteration"] / flat["seconds_per_iteration"]
    tree["time_target"] = None  # reported: BranchGRPO's published gain is at other settings
    if flat["peak_gib"] is not None:
        tree["memory_vs_flat"] = tree["peak_gib"] / flat["peak_gib"]
    return rows


def _train_variant(variant: str, overrides: list[str], device: torch.device, iterations: int) -> dict:
    """Build the trainer and run `iterations` + 1 steps (the first warms up), from an empty GPU."""
    seconds: list[float] = []
    metrics: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as run_dir:
        config = load_config(RECIPE, [*overrides, f"output_dir={run_dir}"])
        trainer_class = TRAINERS.get(config.trainer)
        plan = trainer_class.memory_plan(config, RECIPE, 1)
        # the timed steps train and never evaluate: the plan's peak over the same phases
        trained_phases = [name for name in plan.phases if not name.startswith("evaluation")]
        plan_bytes = plan.peak_bytes_of(trained_phases)

        def train() -> None:
            trainer = trainer_class(config)
            trainer.seed_everything()
            trainer.setup()
            for step in range(iterations + 1):
                synchronize(device)
                start = time.perf_counter()
                metrics.update(trainer.train_step(step))
                synchronize(device)
                seconds.append(time.perf_counter() - start)
                if not torch.isfinite(torch.tensor(float(metrics["loss"]))):
                    raise RuntimeError(f"{variant}: the loss is not finite at step {step}")

        peak = peak_bytes_during(train, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    r = config.rollout
    return {
        "section": "tree vs flat",
        "variant": variant,
        "shape": f"{r.prompts_per_step} prompts, {r.steps} steps, {r.image_size} px",
        "seconds_per_iteration": statistics.median(seconds[1:]),
        "nfe": metrics["nfe"],
        "peak_gib": None if peak is None else peak / 2**30,
        "plan_peak_gib": plan_bytes / 2**30,
        "plan_gap_ratio": None if peak is None else abs(plan_bytes / peak - 1),
        "plan_gap_target": None if peak is None else PLAN_TARGET,
    }
