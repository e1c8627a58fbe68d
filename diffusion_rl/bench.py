"""`mmrl bench diffusion`: flat GRPO vs BranchGRPO variants on the same model, side by side.

Every variant trains the same number of leaves per prompt (16) on the same prompts; the table
prints model evaluations (NFE) and wall-clock per iteration as ratios to flat GRPO (16 samples per
prompt, each from its own initial noise, as Flow-GRPO and DanceGRPO compute them; the DanceGRPO
choice of one shared initial noise saves the first evaluation and is printed beside it), with the
targets from the BranchGRPO paper, and the FP4 exploration pass's rollout time per candidate
against full precision (emulated FP4 does the same matmuls as full precision, so on a CPU that ratio
only shows the timing noise; it is reported as measured). The Mix row takes its untrained ODE
stretches two steps per evaluation (`rollout.ode_stride=2`), as its recipe does.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

import torch

from diffusion_rl.branch_rollout import plan_for, rollout_trees
from diffusion_rl.models import FlowPipeline
from diffusion_rl.shapes import vocabulary
from diffusion_rl.trainer import BranchGRPOTrainer
from mmrl.bench_all import check_counts
from mmrl.config import load_config
from mmrl.precision import explore_precision
from mmrl.registry import BENCHES

FLAT = ["rollout.split_steps=[0]", "rollout.branch_factor=16", "train.advantage=grpo"]
VARIANTS = {
    # name: (overrides, NFE target, wall-clock target) -- targets as ratios to the first row
    "flat GRPO": (FLAT + ["rollout.shared_initial_noise=false"], None, None),
    "flat, shared initial noise": (FLAT, None, None),
    "BranchGRPO": ([], 0.65, 0.71),
    "BranchGRPO depth-pruned": (["prune.depths=[4]"], 0.65, 0.45),
    "BranchGRPO Mix": (
        ["rollout.sde_window=[0,2]", "rollout.ode_stride=2", "prune.depths=[4]"],
        0.65,
        0.21,
    ),
}


def _trainer(overrides: list[str], run_dir: str, model_dir: str) -> BranchGRPOTrainer:
    config = load_config(
        "diffusion/branchgrpo",
        [f"output_dir={run_dir}", f"model.path={model_dir}", "progress=false", *overrides],
    )
    trainer = BranchGRPOTrainer(config)
    trainer.seed_everything()
    trainer.setup()
    return trainer


def _time_steps(trainers: dict[str, BranchGRPOTrainer], iterations: int) -> dict[str, dict[str, float]]:
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
            nfe[name] = float(metrics["nfe"])
    base = times[next(iter(trainers))]
    return {
        name: {
            "seconds": statistics.median(times[name]),
            "time_ratio": statistics.median(t / b for t, b in zip(times[name], base, strict=True)),
            "nfe": nfe[name],
        }
        for name in trainers
    }


def _verdict(ratio: float, target: float | None) -> str:
    if target is None:
        return "-"
    return ("PASS" if ratio <= target else "FAIL") + f" (<= {target:.2f}x)"


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
            name: _trainer(overrides, f"{tmp}/{i}", f"{tmp}/model")
            for i, (name, (overrides, _, _)) in enumerate(VARIANTS.items())
        }
        timed = _time_steps(trainers, iterations)
        for name, (_, nfe_target, time_target) in VARIANTS.items():
            rows.append(
                {"variant": name, **timed[name], "nfe_target": nfe_target, "time_target": time_target}
            )
        fp4 = _explore_timing(_trainer([], f"{tmp}/fp4", f"{tmp}/model"), iterations)
    base = rows[0]
    print(
        f"{'variant':<26}{'NFE/prompt':>11}{'NFE ratio':>11}  {'verdict':<18}"
        f"{'s/iter':>8}{'time ratio':>12}  verdict"
    )
    for row in rows:
        row["nfe_ratio"] = row["nfe"] / base["nfe"]
        print(
            f"{row['variant']:<26}{row['nfe']:>11.0f}{row['nfe_ratio']:>10.3f}x  "
            f"{_verdict(row['nfe_ratio'], row['nfe_target']):<18}"
            f"{row['seconds']:>8.2f}{row['time_ratio']:>11.3f}x  "
            f"{_verdict(row['time_ratio'], row['time_target'])}"
        )
    print(
        f"\nFP4 exploration rollout, seconds per candidate ({fp4['device']}): full precision "
        f"{fp4['full']:.4f}, {fp4['precision']} {fp4['low']:.4f} -> ratio {fp4['low'] / fp4['full']:.2f}x"
        + (
            " (emulated: the weights are quantised once per pass and the matmuls stay in full precision,"
            " so this ratio is the same work timed twice; real FP4 kernels need a GPU)"
            if fp4["precision"].endswith("emulated")
            else ""
        )
    )
    rows.append({"variant": "fp4 explore", **fp4})
    return rows


def _explore_timing(trainer: BranchGRPOTrainer, iterations: int) -> dict[str, Any]:
    """Rollout seconds per leaf of one exploration tree per prompt, quantised vs full precision."""
    cfg = trainer.config
    plan = plan_for(cfg.rollout)
    prompts = trainer.prompts[: cfg.rollout.prompts_per_step]
    ids = list(range(len(prompts)))
    cond = trainer.pipe.encode_prompts(prompts)
    uncond = trainer.uncond_one[[0] * len(prompts)]
    leaves = len(plan.leaf_keys()) * len(prompts)

    def run() -> float:
        start = time.perf_counter()
        rollout_trees(trainer.pipe, cond, uncond, ids, plan, cfg.rollout, cfg.seed, 0)
        return (time.perf_counter() - start) / leaves

    run()
    full = statistics.median(run() for _ in range(iterations))
    with explore_precision(trainer.pipe.denoiser, cfg.explore.precision):
        run()
        low = statistics.median(run() for _ in range(iterations))
    return {"full": full, "low": low, "precision": cfg.explore.precision, "device": str(trainer.pipe.device)}
