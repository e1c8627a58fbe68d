"""`mmrl report RUN ... --displacement`: how far runs moved their weights from where they started, and
how much of that move their seeds share.

A run's displacement is its final weights minus its start (`model.path` of its config), over every
tensor of the safetensors files in `final/`. Seeds of one method follow the same expected update and
differ in the noise of their rollouts, so each seed's displacement is a shared part plus a part of its
own. In high dimension the own parts of two seeds are nearly orthogonal to each other and to the
shared part, so with c the mean cosine between two seeds' displacements of length L:

- shared part: sqrt(c) * L, the length of the move the method makes whatever the seed;
- own part: sqrt(1 - c) * L, the random walk its noisy updates add;
- between methods A and B, cos(A, B) / sqrt(c_A * c_B) is the cosine between their shared parts:
  near 1, they climb in the same direction, one further than the other. Only runs of different
  seeds are paired: runs of one seed draw the same prompts and noise.

Runs are grouped into methods as `--compare` groups them (`compare.group_methods`). Tensors are read
one at a time from every run, so memory holds one tensor per run, not whole models.
"""

from __future__ import annotations

import itertools
import math
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from mmrl.bench_all import print_table
from mmrl.config import ConfigError
from mmrl.method_groups import chosen_labels, distinct_runs, group_methods, run_config


def weight_files(run: Path) -> list[tuple[Path, Path]]:
    """(final, start) pairs of the run's safetensors files: every file under `final/` and the file at
    the same relative path under the config's `model.path`."""
    final = run / "final"
    files = sorted(final.rglob("*.safetensors")) if final.is_dir() else []
    if not files:
        raise ConfigError(
            f"run {str(run)!r} has no final weights ({final}/*.safetensors): let it finish first"
        )
    config = run / "config.yaml"
    model = (run_config(run) or {}).get("model")
    start = model.get("path") if isinstance(model, dict) else None
    if not start or not Path(start).is_dir():
        raise ConfigError(
            f"run {str(run)!r}: its start, model.path = {start!r} in {config}, is not a directory here; "
            "run from the folder the run was launched in"
        )
    pairs = []
    for file in files:
        origin = Path(start) / file.relative_to(final)
        if not origin.is_file():
            raise ConfigError(f"run {str(run)!r}: {file} has no counterpart {origin} in its start model")
        pairs.append((file, origin))
    return pairs


def _open_weights(stack: ExitStack, path: Path) -> Any:
    """`path` opened with safetensors for the length of `stack`; ConfigError naming it when it is not a
    whole safetensors file (one cut short by a copy, say)."""
    try:
        return stack.enter_context(safe_open(path, "pt"))
    except (SafetensorError, OSError) as err:
        raise ConfigError(
            f"{str(path)!r} is not a readable safetensors file ({err}): copy it again whole, or leave its "
            "run out"
        ) from None


def displacement_gram(runs: list[Path]) -> torch.Tensor:
    """[runs, runs] inner products of the runs' displacements (float64), read tensor by tensor. Every
    run must hold the same files and tensors."""
    pairs = [weight_files(run) for run in runs]
    names = [[final.relative_to(run / "final") for final, _ in p] for run, p in zip(runs, pairs, strict=True)]
    for run, own in zip(runs[1:], names[1:], strict=True):
        if own != names[0]:
            raise ConfigError(f"runs {str(runs[0])!r} and {str(run)!r} saved different weight files")
    gram = torch.zeros(len(runs), len(runs), dtype=torch.float64)
    for index in range(len(names[0])):
        with ExitStack() as stack:
            finals = [_open_weights(stack, p[index][0]) for p in pairs]
            starts = [_open_weights(stack, p[index][1]) for p in pairs]
            keys = set(finals[0].keys())
            for run, final, start in zip(runs, finals, starts, strict=True):
                if set(final.keys()) != keys or not keys <= set(start.keys()):
                    raise ConfigError(
                        f"run {str(run)!r}: {names[0][index]} holds other tensors than the first run's final "
                        "weights or its start's (a LoRA adapter has no start to compare with: merge it first)"
                    )
            for key in sorted(keys):
                moves = torch.stack(
                    [
                        (f.get_tensor(key).double() - s.get_tensor(key).double()).flatten()
                        for f, s in zip(finals, starts, strict=True)
                    ]
                )
                gram += moves @ moves.T
    return gram


def displacement_summary(
    run_dirs: list[str | Path], labels: list[str] | None = None, seed_keys: list[str] | None = None
) -> dict[str, Any]:
    """Per method: seeds, mean displacement length, cosines between its seeds, shared and own parts;
    per pair of methods: mean cosine between their runs and between their shared parts."""
    runs = distinct_runs(run_dirs)
    members, seeds = group_methods(runs, seed_keys)
    names = chosen_labels(runs, members, labels)
    gram = displacement_gram(runs)
    length = gram.diagonal().sqrt()
    cos = gram / (length[:, None] * length[None, :]).clamp(min=1e-30)

    methods, shared_cos = [], []
    for name, indices in zip(names, members, strict=True):
        between = [float(cos[i, j]) for i, j in itertools.combinations(indices, 2)]
        mean_length = float(length[indices].mean())
        c = sum(between) / len(between) if between else None
        shared_cos.append(c)
        methods.append(
            {
                "method": name,
                "runs": [str(runs[i]) for i in indices],
                "length": mean_length,
                "cos_between_seeds": c,
                "cos_range": [min(between), max(between)] if between else None,
                "shared": None if c is None else math.sqrt(max(c, 0.0)) * mean_length,
                "own": None if c is None else math.sqrt(max(1.0 - c, 0.0)) * mean_length,
            }
        )
    pairs = []
    for (a, ia), (b, ib) in itertools.combinations(enumerate(members), 2):
        # runs of one seed draw the same prompts and noise (and a continued run shares its start):
        # only runs of different seeds are independent
        between = [float(cos[i, j]) for i in ia for j in ib if seeds[i] is None or seeds[i] != seeds[j]]
        cross = sum(between) / len(between) if between else None
        ca, cb = shared_cos[a], shared_cos[b]
        both = cross is not None and ca is not None and cb is not None and ca > 0 and cb > 0
        pairs.append(
            {
                "methods": [names[a], names[b]],
                "pairs_of_runs": len(between),
                "cos": cross,
                "shared_alignment": cross / math.sqrt(ca * cb) if both else None,
            }
        )
    return {"methods": methods, "pairs": pairs}


def print_displacement(summary: dict[str, Any]) -> None:
    def number(value: float | None) -> str:
        return "-" if value is None else f"{value:.3g}"

    print_table(
        "weights moved from the start (final - model.path): shared by the seeds and their own",
        ["method", "seeds", "length", "cos between seeds [range]", "shared", "own"],
        [
            [
                m["method"],
                str(len(m["runs"])),
                number(m["length"]),
                "-"
                if m["cos_range"] is None
                else f"{m['cos_between_seeds']:.3f} [{m['cos_range'][0]:.3f}, {m['cos_range'][1]:.3f}]",
                number(m["shared"]),
                number(m["own"]),
            ]
            for m in summary["methods"]
        ],
    )
    if summary["pairs"]:
        print_table(
            "between methods: cosine of their runs' moves (runs of different seeds) and of their shared "
            "parts",
            ["method", "method", "pairs of runs", "cos", "shared parts' cos"],
            [
                [*p["methods"], str(p["pairs_of_runs"]), number(p["cos"]), number(p["shared_alignment"])]
                for p in summary["pairs"]
            ],
        )
