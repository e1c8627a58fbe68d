"""Seeded short runs of every training recipe and their fingerprints (metrics, held-out numbers and a
summary of every final weight tensor), pinned in tests/pinned/runs.json so that a refactor that changes
what a recipe computes fails `tests/test_pinned_runs.py`.

Even on the same kernels (tests/fixed_isa.py), processors of other models round some float sums
differently, so a fingerprint is compared to float rounding, not bit for bit: numbers within RTOL
(relative) or ATOL, each weight tensor's norm and its projection on a fixed random sign vector within
WEIGHT_RTOL of its norm; integers, strings and the structure exactly.

Re-record (only when a change of numbers is intended, and say so in the commit):
    python tests/pinned_runs.py --record
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
import zlib
from pathlib import Path
from typing import Any

import fixed_isa  # noqa: I001  (before torch: the pinned kernels)
import torch
from safetensors.torch import load_file

from mmrl.cli import load_plugins
from mmrl.config import load_config
from mmrl.registry import TRAINERS

PINNED = Path(__file__).parent / "pinned" / "runs.json"

TINY_CORE = [
    "model.path=null",
    "model.hidden_size=32",
    "task.train_prompts=64",
    "task.heldout_prompts=8",
    "rollout.prompts_per_step=2",
]
TINY_DIFFUSION = ["rollout.prompts_per_step=1", "rollout.steps=6", "eval.prompts=2", "eval.steps=4"]
TINY_VLM = [
    "train.questions_per_step=2",
    "train.group_size=4",
    "data.train_size=16",
    "data.heldout_size=4",
    "eval_every=0",
]
TINY_VLA = [
    "rollout.env_steps=48",
    "rollout.num_envs=2",
    "train.demo_episodes=3",
    "train.updates=3",
    "train.batch_size=16",
    "critic.updates=3",
    "critic.batch_size=32",
    "eval.episodes=2",
    "eval.num_envs=2",
    "eval_every=0",
]
RUNS: dict[str, list[str]] = {
    "core/tiny_grpo": TINY_CORE,
    "core/tiny_branch_grpo": TINY_CORE,
    "diffusion/branchgrpo": [*TINY_DIFFUSION, "rollout.split_steps=[0,2]"],
    "diffusion/branchgrpo_fp4": [
        *TINY_DIFFUSION,
        "rollout.split_steps=[0,2]",
        "explore.branch_factor=3",
        "explore.keep=4",
    ],
    "diffusion/branchgrpo_flat_credit": TINY_DIFFUSION,
    "diffusion/branchgrpo_mix": [*TINY_DIFFUSION, "rollout.split_steps=[0,2]"],
    "diffusion/branchgrpo_quick": [*TINY_DIFFUSION, "rollout.split_steps=[0,1,2]", "prune.depths=[2]"],
    "diffusion/flat_grpo": [*TINY_DIFFUSION, "rollout.branch_factor=4"],
    "diffusion/nft": [*TINY_DIFFUSION, "rollout.group_size=4"],
    "diffusion/sol_rl": [*TINY_DIFFUSION, "rollout.group_size=4", "explore.pool=8", "explore.steps=3"],
    "vlm/tool_grpo": TINY_VLM,
    "vlm/tool_grpo_cost": TINY_VLM,
    "vlm/tool_grpo_tree": [*TINY_VLM, "rollout.tree.branching=[2,2]"],  # group_size 4: [4, 2] would be flat
    "vla/awr": TINY_VLA,
    "vla/bc": TINY_VLA,
    "vla/dagger": TINY_VLA,
    "vla/grpo": [*TINY_VLA, "rollout.group_size=2"],
    "vla/habc": TINY_VLA,
}
STEPS = 2
TIMING_WORDS = ("time", "seconds", "per_s", "_sec", "elapsed", "wall")
RTOL, ATOL = 1e-2, 1e-5  # metrics and held-out numbers
WEIGHT_RTOL = 1e-4  # each tensor's summary, relative to its norm


def weights_summary(run_dir: Path) -> dict[str, list[Any]]:
    """Per tensor of the final checkpoint ("file:name"): dtype and shape, its float64 L2 norm and its
    projection on a random +-1 vector seeded by its name (any change of the tensor moves it)."""
    final = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    summary = {}
    for file in sorted(final.glob("*.safetensors")):
        tensors = load_file(file)
        for name in sorted(tensors):
            t = tensors[name].double().reshape(-1)
            signs = torch.randint(
                0, 2, t.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))
            )
            projection = float((t * (2 * signs - 1)).sum())
            key = f"{file.name}:{name}"
            summary[key] = [str(tensors[name].dtype), list(tensors[name].shape), float(t.norm()), projection]
    return summary


def differences(got: Any, expected: Any, where: str = "") -> list[str]:
    """Where `got` differs from `expected` beyond float rounding (RTOL, ATOL): numbers, nested dicts and
    lists, anything else exactly."""
    if isinstance(expected, dict) and isinstance(got, dict):
        if got.keys() != expected.keys():
            return [f"{where}: keys {sorted(got)} != {sorted(expected)}"]
        return [d for key in expected for d in differences(got[key], expected[key], f"{where}.{key}")]
    if isinstance(expected, list) and isinstance(got, list):
        if len(got) != len(expected):
            return [f"{where}: {len(got)} items != {len(expected)}"]
        return [
            d
            for i, (a, b) in enumerate(zip(got, expected, strict=True))
            for d in differences(a, b, f"{where}[{i}]")
        ]
    if isinstance(expected, float) and isinstance(got, float):
        return (
            []
            if math.isclose(got, expected, rel_tol=RTOL, abs_tol=ATOL)
            else [f"{where}: {got!r} != {expected!r}"]
        )
    return [] if got == expected and type(got) is type(expected) else [f"{where}: {got!r} != {expected!r}"]


def weight_differences(got: dict[str, list[Any]], expected: dict[str, list[Any]]) -> list[str]:
    """The tensors whose dtype, shape, norm or projection differ beyond WEIGHT_RTOL of the norm."""
    if got.keys() != expected.keys():
        return [f"tensors {sorted(got.keys() ^ expected.keys())} are in one run only"]
    out = []
    for name, (dtype, shape, norm, projection) in expected.items():
        got_dtype, got_shape, got_norm, got_projection = got[name]
        tolerance = WEIGHT_RTOL * norm + 1e-7
        if (got_dtype, got_shape) != (dtype, shape):
            out.append(f"{name}: {got_dtype} {got_shape} != {dtype} {shape}")
        elif abs(got_norm - norm) > tolerance or abs(got_projection - projection) > tolerance:
            out.append(
                f"{name}: norm {got_norm!r} != {norm!r} or projection {got_projection!r} != {projection!r}"
            )
    return out


def _numbers(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics row without timings; NaN written as the string 'nan' so that equality holds."""
    kept = {}
    for key, value in row.items():
        if any(word in key for word in TIMING_WORDS):
            continue
        if isinstance(value, float) and math.isnan(value):
            value = "nan"
        kept[key] = value
    return kept


def metric_rows(run_dir: Path) -> list[dict[str, Any]]:
    """A run's metrics.jsonl rows without timings (`_numbers`): equal for two runs that computed the
    same numbers, as an exact resume must."""
    return [_numbers(json.loads(line)) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def fingerprint(recipe: str, overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """Run `recipe` for STEPS steps on the pinned kernels into `run_dir` and return what it computed."""
    with fixed_isa.pinned_kernels():
        config = load_config(
            recipe,
            [*overrides, f"steps={STEPS}", f"checkpoint_every={STEPS}", "progress=false"]
            + [f"output_dir={run_dir}"],
        )
        TRAINERS.get(config.trainer)(config).train()
    metrics = metric_rows(run_dir)
    evaluation = json.loads((run_dir / "eval.json").read_text())
    return {
        "metrics": metrics,
        "eval": {k: _numbers(v) for k, v in evaluation.items()},
        "weights": weights_summary(run_dir),
    }


def robot_loops(folder: Path) -> dict[str, Any]:
    """What the robot episode loops compute from the shipped base: evaluation (greedy, sampled, and
    supervised by the expert) and a recorded demonstration dataset with action noise."""
    from mmrl.config import shipped_path
    from vla_rl.dataset import RobotDataset
    from vla_rl.evaluate import evaluate_episodes
    from vla_rl.policy import VLAPolicy
    from vla_rl.recording import record_episodes
    from vla_rl.supervisor import TakeoverRule

    with fixed_isa.pinned_kernels():
        policy = VLAPolicy.from_pretrained(shipped_path("vla_rl/assets/tiny_vla"))
        out: dict[str, Any] = {}
        for name, options in {
            "greedy": {},
            "sampled": {"deterministic": False},
            "supervised": {"takeover": TakeoverRule(0.5, 10, patience=3)},
        }.items():
            result = evaluate_episodes(
                policy, "PickPlace", 4, 1_000_000, num_envs=2, progress=False, **options
            )
            out[f"eval_{name}"] = {
                "success": result.success.tolist(),
                "steps": result.steps.tolist(),
                "interventions": result.interventions.tolist(),
                "expert_steps": result.expert_steps.tolist(),
            }
        record_episodes(
            "PickPlace", None, 2, 5, folder / "demos", obs_mode="state+rgb", image_size=32, action_noise=0.1
        )
        dataset = RobotDataset(folder / "demos")
        digest = hashlib.sha256()
        for index in range(len(dataset.episodes)):
            episode = dataset.episode(index)
            for key in sorted(k for k in episode if k != "task"):
                values = episode[key].contiguous().reshape(-1).view(torch.uint8)
                digest.update(key.encode() + values.numpy().tobytes())
            digest.update(episode["task"].encode())
        out["demonstrations"] = {"frames": len(dataset), "hash": digest.hexdigest()}
        return out


def record(names: list[str]) -> None:
    import tempfile

    problem = fixed_isa.fixed_isa_problem()
    if problem:
        sys.exit(f"not recording: {problem}")
    load_plugins()
    pinned = json.loads(PINNED.read_text()) if PINNED.is_file() else {}
    if not names or "robot_loops" in names:
        with tempfile.TemporaryDirectory() as tmp:
            pinned["robot_loops"] = robot_loops(Path(tmp))
        names = [n for n in names if n != "robot_loops"] if names else list(RUNS)
    for recipe in names:
        with tempfile.TemporaryDirectory() as tmp:
            pinned[recipe] = fingerprint(recipe, RUNS[recipe], Path(tmp) / "run")
            print(recipe, len(pinned[recipe]["weights"]), "tensors", flush=True)
    PINNED.parent.mkdir(exist_ok=True)
    PINNED.write_text(pins_text(dict(sorted(pinned.items()))))


TENSOR_SUMMARY = re.compile(r"\[\s*\"([\w.]+)\",\s*\[([\d,\s]*)\],\s*([^,\s]+),\s*([^\]\s]+)\s*\]")


def pins_text(pinned: dict[str, Any]) -> str:
    """The pins as indented JSON with one line per weight tensor's summary (a diff then shows which)."""
    return TENSOR_SUMMARY.sub(_one_line, json.dumps(pinned, indent=1)) + "\n"


def _one_line(match: re.Match[str]) -> str:
    dtype, shape, norm, projection = match.groups()
    dims = ", ".join(part.strip() for part in shape.split(",") if part.strip())
    return f'["{dtype}", [{dims}], {norm}, {projection}]'


if __name__ == "__main__":
    if sys.argv[1:2] != ["--record"]:
        sys.exit(__doc__)
    record(sys.argv[2:])
