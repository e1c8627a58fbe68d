"""`mmrl bench diffusion`: flat GRPO vs BranchGRPO variants, DiffusionNFT and Sol-RL on the same
model, side by side.

Every variant trains the same number of samples per prompt (16) on the same prompts with the same
20-step schedule; the table prints full-precision model evaluations (NFE) and wall-clock per
iteration as ratios to flat GRPO (16 samples per prompt, each from its own initial noise, as
Flow-GRPO and DanceGRPO compute them; the DanceGRPO choice of one shared initial noise saves the
first evaluation and is printed beside it), with the targets from the BranchGRPO paper where it has
them. DiffusionNFT samples as its recipe does (deterministic ODE, no guidance: one model pass per
evaluation where the GRPO variants make two) and trains on the clean samples; Sol-RL adds a pool of
64 candidates per prompt in emulated NVFP4 with 10 steps (its low-precision evaluations are printed
apart). Then the rollout time per candidate of each exploration pass against full precision
(emulated FP4 does the same matmuls as full precision, so on a CPU those ratios only show the timing
noise; they are reported as measured). The Mix row takes its untrained ODE stretches two steps per
evaluation (`rollout.ode_stride=2`), as its recipe does.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

import torch

from diffusion_rl.branch_grpo import BranchGRPOTrainer
from diffusion_rl.branch_rollout import TreePlan, plan_for, rollout_trees
from diffusion_rl.config import RolloutConfig
from diffusion_rl.models import FlowPipeline
from diffusion_rl.nft import DiffusionNFTTrainer
from diffusion_rl.shapes import vocabulary
from diffusion_rl.trainer import DiffusionTrainer
from mmrl.bench_all import check_counts, print_table, ratio_rows
from mmrl.config import load_config
from mmrl.precision import explore_precision
from mmrl.registry import BENCHES, TRAINERS

FLAT = ["rollout.split_steps=[0]", "rollout.branch_factor=16", "train.advantage=grpo"]
NFT = [
    "rollout.steps=20",
    "rollout.group_size=16",
    "rollout.prompts_per_step=4",
    "reward.name=geneval_mini",  # every row trains the same reward (the nft recipe trains shapes_strict)
    "reward.options={}",
    "eval.gold_reward=null",  # the nft recipe's gold, geneval_mini, is trained here
]
VARIANTS = {
    # name: (recipe, overrides, NFE target, wall-clock target) -- targets as ratios to the first row
    "flat GRPO": ("diffusion/branchgrpo", FLAT + ["rollout.shared_initial_noise=false"], None, None),
    "flat, shared initial noise": ("diffusion/branchgrpo", FLAT, None, None),
    "BranchGRPO": ("diffusion/branchgrpo", [], 0.65, 0.71),
    "BranchGRPO depth-pruned": ("diffusion/branchgrpo", ["prune.depths=[4]"], 0.65, 0.45),
    "BranchGRPO Mix": (
        "diffusion/branchgrpo",
        ["rollout.sde_window=[0,2]", "rollout.ode_stride=2", "prune.depths=[4]"],
        0.65,
        0.21,
    ),
    "DiffusionNFT": ("diffusion/nft", NFT, None, None),
    "Sol-RL (NFT on 16 of 64)": ("diffusion/sol_rl", NFT + ["explore.steps=10"], None, None),
}


def _trainer(recipe: str, overrides: list[str], run_dir: str, model_dir: str) -> DiffusionTrainer:
    config = load_config(
        recipe, [f"output_dir={run_dir}", f"model.path={model_dir}", "progress=false", *overrides]
    )
    trainer = TRAINERS.get(config.trainer)(config)
    trainer.seed_everything()
    trainer.setup()
    return trainer


def _time_steps(trainers: dict[str, DiffusionTrainer], iterations: int) -> dict[str, dict[str, float]]:
    """Per variant: median seconds per iteration, median of its per-round time ratios to the first
    variant, and NFE per prompt, after one warm-up iteration. The variants take turns every round and
    each ratio divides two times of the same round, so a change in the machine's load between rounds
    cancels out of the ratio instead of landing on whichever variant ran then."""
    times: dict[str, list[float]] = {name: [] for name in trainers}
    nfe: dict[str, float] = {}
    for trainer in trainers.values():
        trainer.train_step(0)
    for step in range(1, iterations + 1):
        for name, trainer in trainers.items():
            start = time.perf_counter()
            metrics = trainer.train_step(step)
            times[name].append(time.perf_counter() - start)
            nfe[name] = (float(metrics["nfe"]), float(metrics.get("explore_nfe", 0.0)))
    base = times[next(iter(trainers))]
    return {
        name: {
            "seconds": statistics.median(times[name]),
            "time_ratio": statistics.median(t / b for t, b in zip(times[name], base, strict=True)),
            "nfe": nfe[name][0],
            "low_precision_nfe": nfe[name][1],
        }
        for name in trainers
    }


@BENCHES.register("diffusion")
def bench_diffusion(iterations: int = 5) -> list[dict[str, Any]]:
    check_counts(iterations=iterations)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        # An untrained small SD3-architecture model keeps the bench short: the ratios come from the
        # tree shapes and what each variant trains, not from the weights.
        FlowPipeline.tiny(vocabulary()).save_pretrained(f"{tmp}/model")
        trainers = {
            name: _trainer(recipe, overrides, f"{tmp}/{i}", f"{tmp}/model")
            for i, (name, (recipe, overrides, _, _)) in enumerate(VARIANTS.items())
        }
        timed = _time_steps(trainers, iterations)
        for name, (_, _, nfe_target, time_target) in VARIANTS.items():
            rows.append(
                {"variant": name, **timed[name], "nfe_target": nfe_target, "time_target": time_target}
            )
        pools = {
            "BranchGRPO + FP4 trees": _explore_timing(
                _trainer("diffusion/branchgrpo", [], f"{tmp}/fp4", f"{tmp}/model"), iterations
            ),
            "Sol-RL pool": _pool_timing(trainers["Sol-RL (NFT on 16 of 64)"], iterations),
        }
    for row in rows:
        row["nfe_ratio"] = row["nfe"] / rows[0]["nfe"]
    print_table(
        f"mmrl bench diffusion: per iteration, median of {iterations}",
        ["variant", "NFE/prompt", "low-precision NFE", "s/iter"],
        [
            [row["variant"], f"{row['nfe']:.0f}", f"{row['low_precision_nfe']:.0f}", f"{row['seconds']:.2f}"]
            for row in rows
        ],
    )
    explore_rows = [
        {
            "variant": f"{name} explore",
            **pool,
            "precision_ratio": pool["low"] / pool["full"],
            "precision_target": None,
        }
        for name, pool in pools.items()
    ]
    print_table(
        "rollout seconds per candidate, full against low precision",
        ["variant", "device", "full", "precision", "low"],
        [
            [row["variant"], row["device"], f"{row['full']:.4f}", row["precision"], f"{row['low']:.4f}"]
            for row in explore_rows
        ],
    )
    if any(row["precision"].endswith("emulated") for row in explore_rows):
        print(
            "emulated precisions quantise the weights once per pass and keep the matmuls in full "
            "precision, so their ratio is the same work timed twice; real FP4 kernels need a GPU"
        )
    rows += explore_rows
    ratios = ratio_rows("diffusion", rows)
    print_table(
        "ratios to flat GRPO (NFE, time) and to full precision (precision)",
        ["row", "ratio", "target", "verdict"],
        [[r["row"], f"{r['ratio']:.3f}x", r["target"] or "-", r["verdict"]] for r in ratios],
    )
    return rows


def _explore_timing(trainer: BranchGRPOTrainer, iterations: int) -> dict[str, Any]:
    """Rollout seconds per leaf of one BranchGRPO exploration tree per prompt, quantised vs full."""
    cfg = trainer.config
    plan = plan_for(cfg.rollout)
    return _rollout_timing(
        trainer, plan, cfg.rollout, cfg.explore.precision, len(plan.leaf_keys()), iterations
    )


def _pool_timing(trainer: DiffusionNFTTrainer, iterations: int) -> dict[str, Any]:
    """Rollout seconds per candidate of Sol-RL's pool (its plan: pool size and exploration steps, no
    guidance), quantised vs full precision."""
    cfg = trainer.config
    return _rollout_timing(
        trainer, trainer.pool_plan, trainer.pool_sampling, cfg.explore.precision, cfg.explore.pool, iterations
    )


def _rollout_timing(
    trainer: DiffusionTrainer,
    plan: TreePlan,
    rollout: RolloutConfig,
    precision: str,
    per_prompt: int,
    iterations: int,
) -> dict[str, Any]:
    """Median seconds per sample (`per_prompt` per prompt) of rolling out `plan` for the trainer's first
    prompts, in full precision and with the denoiser in `precision`."""
    cfg = trainer.config
    prompts = trainer.prompts[: cfg.rollout.prompts_per_step]
    ids = list(range(len(prompts)))
    cond = trainer.pipe.encode_prompts(prompts)
    uncond = trainer.uncond_one[[0] * len(prompts)]

    def run() -> float:
        start = time.perf_counter()
        rollout_trees(trainer.pipe, cond, uncond, ids, plan, rollout, cfg.seed, 0)
        return (time.perf_counter() - start) / (per_prompt * len(prompts))

    run()
    full = statistics.median(run() for _ in range(iterations))
    with explore_precision(trainer.pipe.denoiser, precision):
        run()
        low = statistics.median(run() for _ in range(iterations))
    return {"full": full, "low": low, "precision": precision, "device": str(trainer.pipe.device)}
