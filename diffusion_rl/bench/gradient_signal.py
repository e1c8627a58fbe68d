"""`mmrl bench diffusion_gradient`: how much of each recipe's update is signal, from the same weights.

An iteration of a policy-gradient recipe estimates the direction that raises the expected reward,
and its rollouts make the estimate noisy. This bench draws `estimates` independent iterations of
each recipe of the `branch_grpo` trainer (fresh prompts and noise, the weights never stepped), all
from the same weights, and takes the gradient of each iteration's policy loss at ratio 1 (what its
first optimizer step follows). The KL term has no gradient there: the reference is those weights.
Per recipe:

- SNR: ||E g||^2 / E||g - E g||^2 for one iteration's gradient g, estimated without bias from the
  draws. Averaging n independent iterations multiplies it by n; scaling the advantages leaves it.
- alignment: cos(E g, E g_0) with the first recipe's (the baseline's) expected gradient, from
  independent draws, so noise does not inflate it. Below 1, the recipe climbs another objective.
- signal per second: SNR x alignment^2 / seconds per iteration, the rate at which the recipe's
  iterations gather signal along the baseline's direction. Its ratio to the baseline's is the
  bench's ratio: below 1, the recipe needs more wall-clock than the baseline to learn as much.

- push (with `direction`, finished runs from the same weights): the mean of -g . d over the root
  mean square of |g|, d the runs' mean move as a unit vector: the share of an update that points
  where those runs went. One number per draw, so it resolves with far fewer draws than the SNR of a
  whole gradient; its per-second ratio to the baseline's is printed beside the SNR's.

The same per segment of denoising steps (the gradient of the samples at those steps alone), so a
tree's credit can be read per depth. Intervals are 90%, from the delete-one jackknife over the
rounds of draws.
Recipes run in turns, one iteration each per round, so a change in the machine's load hits all.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

from diffusion_rl.branch_grpo import BranchGRPOTrainer, Sample, sample_weight
from diffusion_rl.config import BranchGRPOConfig
from diffusion_rl.loading import load
from mmrl.bench_all import print_table
from mmrl.config import ConfigError, load_config
from mmrl.registry import BENCHES
from mmrl.resources import check_memory

DEFAULT_CONFIGS = ["diffusion/flat_grpo", "diffusion/branchgrpo"]


def signal_noise(gram: torch.Tensor) -> tuple[float, float]:
    """(||E g||^2, E||g - E g||^2), both unbiased, from the Gram matrix [K, K] of K >= 2 independent
    draws of g: the mean inner product of two different draws, and half the mean squared distance
    between two."""
    k = gram.shape[0]
    if k < 2:
        raise ValueError(f"signal_noise needs at least 2 draws, got {k}")
    total, diagonal = float(gram.sum()), float(gram.trace())
    return (total - diagonal) / (k * (k - 1)), (diagonal - total / k) / (k - 1)


def alignment(cross: torch.Tensor, signal_a: float, signal_b: float) -> float:
    """cos(E g_a, E g_b) from `cross` [K, K], the inner products of independent draws of g_a and g_b
    (its mean is unbiased for <E g_a, E g_b>). NaN where a signal estimate is not positive."""
    if signal_a <= 0 or signal_b <= 0:
        return float("nan")
    return float(cross.mean()) / (signal_a * signal_b) ** 0.5


class Estimates(NamedTuple):
    """One recipe's draws: gradient [K, segments, P], seconds and trained denoising steps per draw."""

    grads: torch.Tensor
    seconds: list[float]
    trained_steps: list[int]


def _load(config: str, overrides: list[str], seed: int, run_dir: str) -> BranchGRPOConfig:
    cfg = load_config(
        config,
        [*overrides, f"seed={seed}", f"output_dir={run_dir}", "progress=false", "resume=false"],
    )
    if cfg.trainer != "branch_grpo":
        raise ConfigError(
            f"config error: configs: {config!r} uses trainer {cfg.trainer!r}; this bench measures the "
            "policy gradient of branch_grpo recipes (flat GRPO, BranchGRPO and their variants)"
        )
    return cfg


def _trainer(cfg: BranchGRPOConfig) -> BranchGRPOTrainer:
    trainer = BranchGRPOTrainer(cfg)
    trainer.seed_everything()
    trainer.setup()
    trainer.start_run_dir()
    return trainer


def _direction(runs: list[str], trainer: BranchGRPOTrainer) -> torch.Tensor:
    """The mean of the runs' moves (final weights minus the bench's start weights), flattened like
    the trained parameters, as a unit vector. Each run must have started from the bench's model."""
    if trainer.config.model.lora_rank > 0:
        raise ConfigError(
            "config error: direction: the recipes train a LoRA adapter, and a finished run's weights hold "
            "it merged; give direction only for recipes that train every weight (model.lora_rank = 0)"
        )
    start_path = Path(str(trainer.config.model.path)).resolve()
    names = [name for name, p in trainer.pipe.denoiser.named_parameters() if p.requires_grad]
    start = dict(trainer.pipe.denoiser.named_parameters())
    total = torch.zeros(sum(start[name].numel() for name in names), dtype=torch.float64)
    for run in runs:
        config = Path(run) / "config.yaml"
        if not config.is_file() or not (Path(run) / "final").is_dir():
            raise ConfigError(f"config error: direction: {run!r} is not a finished run (config.yaml, final/)")
        origin = load_config(str(config)).model.path
        if Path(str(origin)).resolve() != start_path:
            raise ConfigError(
                f"config error: direction: run {run!r} started from {origin!r}, the bench from "
                f"{trainer.config.model.path!r}: give runs that started where the bench does"
            )
        final = dict(load(Path(run) / "final").denoiser.named_parameters())
        total += torch.cat([(final[name] - start[name]).detach().double().flatten() for name in names])
    return (total / total.norm()).float()


def _segment_bounds(cfgs: list[BranchGRPOConfig], segments: list[int] | None) -> list[tuple[int, int]]:
    """[start, end) step ranges: `segments` as starts, default every recipe's split steps."""
    steps = {cfg.rollout.steps for cfg in cfgs}
    if len(steps) != 1:
        raise ConfigError(
            f"config error: configs: the recipes take {sorted(steps)} denoising steps; give them one "
            "rollout.steps (in overrides) so that their segments and gradients compare"
        )
    total = steps.pop()
    starts = sorted(set(segments) if segments else {s for cfg in cfgs for s in cfg.rollout.split_steps} | {0})
    if starts[0] != 0 or starts[-1] >= total:
        raise ConfigError(
            f"config error: segments = {segments}: give the first step of each segment, starting at 0 "
            f"and below rollout.steps = {total}, e.g. [0, {total // 2}]"
        )
    return list(zip(starts, [*starts[1:], total], strict=True))


def _draw(
    trainer: BranchGRPOTrainer, step: int, bounds: list[tuple[int, int]]
) -> tuple[torch.Tensor, float, int]:
    """One iteration's policy-loss gradient per segment [segments, P], its seconds and trained steps."""
    started = time.perf_counter()
    groups, cond, uncond, _ = trainer.collect_samples(step)
    samples: list[Sample] = [sample for group in groups for sample in group]  # siblings stay together
    sigmas = trainer.pipe.sigmas(trainer.config.rollout.steps)
    split_steps = set(trainer.plan.split_steps)
    micro = trainer.config.train.micro_batch
    params = trainer.trained_params
    grads = torch.zeros(len(bounds), sum(p.numel() for p in params))
    for s, (start, end) in enumerate(bounds):
        for p in params:
            p.grad = None
        part = [sample for sample in samples if start <= sample[1].step < end]
        for i in range(0, len(part), micro):
            chunk = part[i : i + micro]
            loss, _ = trainer.chunk_loss(chunk, cond, uncond, sigmas, split_steps)
            (loss * sample_weight(chunk) / sample_weight(samples)).backward()  # its share of the mean
        if part:
            grads[s] = torch.cat(
                [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().cpu() for p in params]
            )
    return grads, time.perf_counter() - started, len(samples)


def _measures(
    grams: list[torch.Tensor], crosses: list[torch.Tensor], seconds: list[float]
) -> list[list[float]]:
    """Per recipe: SNR, alignment with the baseline (recipe 0) and signal per second."""
    base_signal, _ = signal_noise(grams[0])
    out = []
    for i, (gram, cross) in enumerate(zip(grams, crosses, strict=True)):
        signal, noise = signal_noise(gram)
        snr = signal / noise if noise > 0 else float("nan")
        cos = 1.0 if i == 0 else alignment(cross, signal, base_signal)
        out.append([snr, cos, snr * cos**2 / seconds[i]])
    return out


def _interval(point: float, left_out: list[float]) -> list[float]:
    """The 90% interval around `point` from the delete-one jackknife's standard error."""
    k = len(left_out)
    mean = sum(left_out) / k
    se = ((k - 1) / k * sum((v - mean) ** 2 for v in left_out)) ** 0.5
    return [point - 1.645 * se, point + 1.645 * se]


def _pushes(
    projections: list[torch.Tensor], squares: list[torch.Tensor], seconds: list[float]
) -> list[list[float]]:
    """Per recipe: the push along the direction (mean of -g . d over the root mean square of |g|: the
    share of an update that points along d), push per second, and its ratio to the baseline's."""
    out = []
    for i, (projection, square) in enumerate(zip(projections, squares, strict=True)):
        push = float(projection.mean() / square.mean().sqrt()) if float(square.mean()) > 0 else float("nan")
        out.append([push, push / seconds[i]])
    for row in out[1:]:
        row.append(row[1] / out[0][1] if out[0][1] > 0 else float("nan"))
    return out


def _summary(
    draws: list[Estimates], labels: list[str], direction: torch.Tensor | None
) -> list[dict[str, Any]]:
    """Per recipe and segment ("all" first): SNR, alignment with the baseline's same segment, signal
    per second and its ratio to the baseline's, and with a `direction` the push along it; each with a
    jackknife interval over the rounds."""
    seconds = [statistics.median(d.seconds) for d in draws]
    k, n_segments = draws[0].grads.shape[:2]
    rows = []
    for segment in [None, *range(n_segments)]:
        vectors = [(d.grads.sum(1) if segment is None else d.grads[:, segment]).double() for d in draws]
        grams = [v @ v.T for v in vectors]
        crosses = [v @ vectors[0].T for v in vectors]
        projections = [] if direction is None else [-(v @ direction.double()) for v in vectors]

        def measure(
            keep: list[int], grams=grams, crosses=crosses, projections=projections
        ) -> list[list[float]]:
            idx = torch.tensor(keep)
            values = _measures([g[idx][:, idx] for g in grams], [c[idx][:, idx] for c in crosses], seconds)
            for row in values[1:]:
                row.append(row[2] / values[0][2] if values[0][2] > 0 else float("nan"))
            if projections:
                pushes = _pushes([p[idx] for p in projections], [g.diagonal()[idx] for g in grams], seconds)
                for row, push in zip(values, pushes, strict=True):
                    row += push
            return values

        point = measure(list(range(k)))
        left_out = [measure([j for j in range(k) if j != i]) for i in range(k)]
        for i, label in enumerate(labels):
            row: dict[str, Any] = {
                "variant": label,
                "segment": "all" if segment is None else segment,
                "seconds": seconds[i],
                "trained_steps": statistics.mean(draws[i].trained_steps),
            }
            names = ["snr", "alignment", "signal_per_second"] + (["ratio"] if i else [])
            if direction is not None:
                names += ["push", "push_per_second"] + (["push_ratio"] if i else [])
            for m, name in enumerate(names):
                key = f"segment_{name}" if name.endswith("ratio") and segment is not None else name
                row[key] = point[i][m]
                row[f"{name}_interval"] = _interval(point[i][m], [loo[i][m] for loo in left_out])
            rows.append(row)
    return rows


@BENCHES.register("diffusion_gradient")
def bench_diffusion_gradient(
    configs: list[str] | None = None,
    overrides: list[str] | None = None,
    estimates: int = 16,
    segments: list[int] | None = None,
    direction: list[str] | None = None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """`configs`: branch_grpo recipes or YAML files (a run's config.yaml works), the first the
    baseline; `overrides` apply to all (e.g. model.path=... to start from a run's final weights);
    `segments`: the first denoising step of each segment (default: the recipes' split steps);
    `direction`: finished runs from the same start, whose mean move also measures each recipe's push
    along it (the share of an update that points there, per iteration and per second)."""
    configs = list(configs or DEFAULT_CONFIGS)
    if estimates < 3:
        raise ConfigError(
            f"config error: estimates = {estimates}: must be at least 3 (the intervals leave one out of two "
            "or more); 16 or more for intervals narrower than the values"
        )
    if len(configs) < 2:
        raise ConfigError(
            f"config error: configs = {configs}: give a baseline and at least one recipe to compare"
        )
    labels = [Path(c).parent.name if c.endswith("config.yaml") else c for c in configs]
    labels = [f"{label} ({i})" if labels.count(label) > 1 else label for i, label in enumerate(labels)]
    with tempfile.TemporaryDirectory() as tmp:
        # each recipe its own seed: its draws of prompts and noise are independent of the others'
        cfgs = [
            _load(config, list(overrides or []), seed + 1000 * i, f"{tmp}/{i}")
            for i, config in enumerate(configs)
        ]
        paths = {str(cfg.model.path) for cfg in cfgs}
        if len(paths) != 1:
            raise ConfigError(
                f"config error: configs start from different weights ({', '.join(sorted(paths))}): set "
                "one model.path in overrides"
            )
        bounds = _segment_bounds(cfgs, segments)
        trainers = [_trainer(cfg) for cfg in cfgs]
        towards = None if not direction else _direction(direction, trainers[0])
        size = sum(p.numel() for p in trainers[0].trained_params)
        check_memory(
            4.0 * size * len(bounds) * estimates * len(trainers),
            f"{estimates} gradients x {len(bounds)} segments x {len(trainers)} recipes of {size} parameters",
            ["estimates", "segments"],
        )
        draws = [Estimates(torch.zeros(estimates, len(bounds), size), [], []) for _ in trainers]
        for k in range(estimates):
            for trainer, record in zip(trainers, draws, strict=True):
                grads, seconds, trained = _draw(trainer, k, bounds)
                record.grads[k] = grads
                record.seconds.append(seconds)
                record.trained_steps.append(trained)
            print(f"draw {k + 1}/{estimates}", flush=True)
    rows = _summary(draws, labels, towards)
    for row in rows:
        start, end = bounds[0][0], bounds[-1][1]
        if row["segment"] != "all":
            start, end = bounds[row["segment"]]
        row["steps"] = f"{start}-{end - 1}"

    def interval(values: list[float]) -> str:
        return f"[{values[0]:.3g}, {values[1]:.3g}]"

    def cell(row: dict[str, Any], name: str, digits: str = ".3g") -> str:
        value = row.get(name, row.get(f"segment_{name}"))
        if value is None:
            return "-"
        return f"{value:{digits}} {interval(row[f'{name}_interval'])}"

    header = ["recipe", "steps", "s/iter", "trained steps", "SNR [90%]", "alignment [90%]", "ratio [90%]"]
    if towards is not None:
        header += ["push [90%]", "push/s ratio [90%]"]
    print_table(
        f"mmrl bench diffusion_gradient: {estimates} draws per recipe from {next(iter(paths))}",
        header,
        [
            [
                row["variant"],
                row["steps"],
                f"{row['seconds']:.2f}",
                f"{row['trained_steps']:.0f}",
                cell(row, "snr"),
                cell(row, "alignment", ".2f"),
                cell(row, "ratio"),
            ]
            + ([cell(row, "push"), cell(row, "push_ratio")] if towards is not None else [])
            for row in rows
        ],
    )
    return rows
