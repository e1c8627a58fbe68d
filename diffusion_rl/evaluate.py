"""`mmrl eval diffusion`: several models side by side on one fixed set of prompts and seeds.

Every model draws the same images' noise (keyed by seed and prompt index), so differences between
models are paired: the table gives each model's mean per reward and, against the first model, the
mean paired difference with its standard error and how many prompts got better or worse. When every
prompt is one of the coloured-shapes world's (the default sets), each reward is also broken down by
prompt template (`count`, `position`, `pair`), as GenEval reports per task, so a change can be traced
to the kind of prompt it comes from. With ``objects=true`` the shipped `geneval_mini` scorer's count
head also reads every image: objects of each shape drawn and the asked objects of each shape found
(`AlignmentScorer.objects_by_shape`), paired like a reward, to see what a policy draws instead of
what it was asked. Models that are the same directory (``final/``) of runs whose configs differ
only in their seed are pooled as one method, each measure's change over seeds with its t interval,
and every two such methods compared with Welch's interval: the comparison a claim about a method
needs, where one seed's paired error says nothing of the spread over seeds. Results go to
``OUTPUT_DIR/eval_diffusion.json``, every prompt's score per model and reward to
``OUTPUT_DIR/prompt_scores.jsonl``, and a labelled image grid (rows: models, columns: the first
prompts) to ``OUTPUT_DIR/grid.png``.

    mmrl eval diffusion "models=[diffusion_rl/assets/tiny_flow,runs/diffusion/branchgrpo/final]" seeds=4

A model is any directory `diffusion_rl.loading.load` reads: the project's layout, a diffusers
pipeline, or a LoRA result (a run's ``final/`` trained with ``model.lora_rank > 0``), which is
evaluated on the base model its ``mmrl_lora.json`` names (``base_resolved``, else ``base``), with the
adapter merged in; to evaluate it on a base that has moved, write the new path as ``base`` there.
Every entry (its kind, its configs, a LoRA result's base and weights), the prompts and the rewards
(each tried on blank images of the prompts) are checked before any model is loaded or sampled.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diffusion_rl.alignment import load_scorer
from diffusion_rl.inputs import load_prompts
from diffusion_rl.loading import check_model_directory, load
from diffusion_rl.reward_config import REWARD_KEYS, check_options, check_reward_name, reward_mapping
from diffusion_rl.reward_terms import RewardFailed, build_reward, scored
from diffusion_rl.sampling import sample_ode
from diffusion_rl.shapes import heldout_prompts, parse_prompt, train_prompts
from mmrl.compare import mean_ci95, t_975
from mmrl.config import ConfigError, apply_overrides, build, check_output_dir, option, shipped_path
from mmrl.method_groups import group_methods, method_labels
from mmrl.registry import EVALUATORS
from mmrl.runlog import write_json
from mmrl.trainer import finite_or_named

BETTER_BY = 0.01  # a prompt counts as better / worse when its mean reward moves by more than this
BLANK_SIZE = 32  # side of the blank images each reward is tried on before sampling
MODEL_KINDS = (
    "a FlowPipeline directory (diffusion_rl/assets/tiny_flow), a diffusers pipeline or a run's final/"
)


@dataclass
class DiffusionEvalConfig:
    models: list[str] = option([], "model directories; paired differences are taken against the first")
    prompts: str = option("heldout", "'heldout' or 'train' (the shapes splits), or a file of prompts")
    num_prompts: int | None = option(None, "use the first N prompts of the set (null: all)", min=1)
    seeds: int = option(1, "images per prompt, each from its own noise", min=1)
    seed: int = option(0, "first noise seed; image s of prompt i uses seed + s", min=0)
    steps: int = option(20, "ODE sampling steps", min=1)
    guidance_scale: float = option(3.0, "classifier-free guidance", min=1.0)
    rewards: list = option(
        ["geneval_mini"],
        "rewards to score every image with (see `mmrl list`): names, or {name: ..., options: {...}} "
        "for a reward built with options",
    )
    objects: bool = option(
        False,
        "also read every image with geneval_mini's count head: objects drawn per image of each shape "
        "(objects.<shape>, objects.all) and the fraction of the asked objects of each shape found "
        "(found.<shape>, over the prompts asking for one); coloured-shapes prompts only",
    )
    grid_prompts: int = option(8, "prompts shown in grid.png (seed 0 of each)", min=0)
    output_dir: str = option("runs/eval/diffusion", "where eval_diffusion.json and grid.png go")


def prompt_set(name: str) -> list[str]:
    if name == "heldout":
        return heldout_prompts()
    if name == "train":
        return train_prompts()
    return load_prompts(name, "prompts")


def paired(reference: torch.Tensor, other: torch.Tensor) -> dict[str, float | None]:
    """Mean paired difference (other - reference) over prompts, its standard error (None for one
    prompt, so that eval_diffusion.json stays strict JSON), better / worse."""
    diff = other - reference
    se = float(diff.std() / math.sqrt(len(diff))) if len(diff) > 1 else None
    return {
        "diff": float(diff.mean()),
        "se": se,
        "better": int((diff > BETTER_BY).sum()),
        "worse": int((diff < -BETTER_BY).sum()),
    }


def prompt_templates(prompts: list[str]) -> list[str] | None:
    """Each prompt's template in the coloured-shapes grammar, or None when any prompt is outside it."""
    try:
        return [parse_prompt(prompt).template for prompt in prompts]
    except ValueError:
        return None


def measure_stats(
    values: torch.Tensor, reference: torch.Tensor | None, rows: torch.Tensor
) -> dict[str, float | None]:
    """A model's mean of one measure over the prompts in `rows` and, unless it is the reference, the
    paired stats there."""
    stats = {"mean": float(values[rows].mean())}
    if reference is not None:
        stats.update(paired(reference[rows], values[rows]))
    return stats


def check_models(models: list[str]) -> list[Path]:
    """Every `models` entry as a model directory, checked (kind, configs, a LoRA result's base and
    weights) before any model is loaded: a bad entry fails at once, named, not after the others ran."""
    if not models:
        raise ConfigError(
            "config error: models is empty; pass models=[DIR,DIR,...] (the first is the reference)"
        )
    if len(set(models)) != len(models):
        twice = next(m for m in models if models.count(m) > 1)
        raise ConfigError(f"config error: models lists {twice!r} twice; give each model once")
    paths = []
    for i, model in enumerate(models):
        path = shipped_path(model)
        if not path.is_dir():
            raise ConfigError(f"config error: models[{i}] = {model!r} is not a directory: give {MODEL_KINDS}")
        try:
            check_model_directory(path)
        except (ConfigError, FileNotFoundError) as err:
            raise ConfigError(f"config error: models[{i}] = {model!r}: {err}") from None
        paths.append(path)
    return paths


def build_rewards(entries: list[Any], prompts: list[str]) -> dict[str, Any]:
    """Each reward (a name, or a mapping with its options; labelled ``name`` or ``name(key=value)``),
    tried on blank images of `prompts`: an unknown name, bad options or a prompt a reward cannot score
    (outside geneval_mini's grammar, say) fails before any model is sampled."""
    blank = torch.full((len(prompts), 3, BLANK_SIZE, BLANK_SIZE), 0.5)
    reward_fns = {}
    for i, entry in enumerate(entries):
        key = f"rewards[{i}]"
        entry = reward_mapping(
            entry, key, REWARD_KEYS, "a reward name or {name: ..., options: ...}", "valid keys"
        )
        name = check_reward_name(entry.get("name"), f"{key}.name")
        options = check_options(entry.get("options", {}), f"{key}.options")
        label = name + (f"({', '.join(f'{k}={v}' for k, v in options.items())})" if options else "")
        reward_fns[label] = build_reward(name, options, f"{key}.")
        try:
            scored(label, reward_fns[label], blank, prompts)
        except RewardFailed as err:
            raise ConfigError(
                f"config error: {key}: {err}; choose prompts it understands, another reward, or start its "
                "server"
            ) from None
    return reward_fns


def seed_spread(values: list[float]) -> dict[str, Any]:
    """Mean over seeds, sample standard deviation and the t-based 95% interval of the mean."""
    mean, std = statistics.fmean(values), statistics.stdev(values)
    return {"mean": mean, "std": std, "ci95": mean_ci95(mean, std, len(values)), "values": values}


def welch(first: list[float], second: list[float]) -> dict[str, Any]:
    """Mean of `second` minus mean of `first`, with Welch's 95% interval (unequal variances; the
    Welch-Satterthwaite degrees of freedom)."""
    share_a, share_b = statistics.variance(first) / len(first), statistics.variance(second) / len(second)
    se = math.sqrt(share_a + share_b)
    diff = statistics.fmean(second) - statistics.fmean(first)
    if se == 0:  # every seed equal in both: no spread to weigh
        df = float(len(first) + len(second) - 2)
    else:
        df = (share_a + share_b) ** 2 / (share_a**2 / (len(first) - 1) + share_b**2 / (len(second) - 1))
    half = t_975(df) * se
    return {"diff": diff, "se": se, "df": df, "ci95": [diff - half, diff + half]}


def method_changes(models: dict[str, Any], names: list[str]) -> tuple[dict[str, dict], dict[str, dict]]:
    """Seeds of one method, pooled: models after the first that are the same directory (``final/``) of
    runs whose config.yaml files differ only in their seed (as `mmrl report --compare` groups runs).
    For each method of two or more seeds, every measure's paired change against the first model over
    its seeds (mean, std, 95% t interval, each seed's; per template where all have it); for each
    pair of such methods, the later one's mean change minus the earlier one's with Welch's interval
    (keyed "LATER minus EARLIER")."""
    candidates = [shipped_path(name) for name in names[1:]]
    run_dirs = [p.parent if (p.parent / "config.yaml").is_file() else p for p in candidates]
    groups, seeds = group_methods(run_dirs)
    members = [
        [i for i in group if candidates[i].name == name]
        for group in groups
        for name in dict.fromkeys(candidates[i].name for i in group)
    ]
    pooled = []
    for group in members:
        group_seeds = [seeds[i] for i in group]
        if len(group) < 2 or None in group_seeds or len(set(group_seeds)) < len(group_seeds):
            continue  # one seed (its row is the model's own), or runs that are not distinct seeds
        pooled.append(group)
    labels = method_labels([[run_dirs[i] for i in group] for group in pooled])
    methods = {}
    for label, group in zip(labels, pooled, strict=True):
        entries = [models[names[1 + i]] for i in group]
        change = {}
        for measure, stats in entries[0].items():
            change[measure] = seed_spread([entry[measure]["diff"] for entry in entries])
            parts = stats.get("by_template", {})
            templates = [t for t in parts if all(t in e[measure]["by_template"] for e in entries)]
            if templates:
                change[measure]["by_template"] = {
                    t: seed_spread([entry[measure]["by_template"][t]["diff"] for entry in entries])
                    for t in templates
                }
        methods[label] = {
            "models": [names[1 + i] for i in group],
            "seeds": [seeds[i] for i in group],
            "change": change,
        }
    between = {}
    for later, b in enumerate(labels):
        for a in labels[:later]:
            first, second = methods[a]["change"], methods[b]["change"]
            between[f"{b} minus {a}"] = {
                measure: welch(first[measure]["values"], second[measure]["values"])
                for measure in first
                if measure in second
            }
    return methods, between


def object_measures(
    images: torch.Tensor, prompts: list[str], seeds: int, scorer: Any
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """`DiffusionEvalConfig.objects`: per prompt (mean over its seeds' images, which come prompt-major)
    objects drawn of each shape and in all, and the fraction of the asked objects of each shape
    found; and, for each found.<shape>, the prompts that ask for that shape (its stats cover those;
    a shape no prompt asks for has no found.<shape>)."""
    specs = [parse_prompt(prompt) for prompt in prompts for _ in range(seeds)]
    drawn, found, asked = scorer.objects_by_shape(images, specs)
    per_prompt = {f"objects.{shape}": values for shape, values in drawn.items()}
    per_prompt["objects.all"] = torch.stack(list(drawn.values())).sum(0)
    rows = {}
    for shape, mask in asked.items():
        if mask.any():  # a shape no prompt asks for has nothing to be found
            per_prompt[f"found.{shape}"] = found[shape]
            rows[f"found.{shape}"] = mask.view(len(prompts), seeds)[:, 0]
    return {name: v.view(len(prompts), seeds).mean(dim=1) for name, v in per_prompt.items()}, rows


def evaluate_models(cfg: DiffusionEvalConfig) -> dict[str, Any]:
    """Sample every model on the same prompts and noise; score with every reward; compare to the first."""
    paths = check_models(cfg.models)
    check_output_dir(cfg.output_dir, "output_dir")
    prompts = prompt_set(cfg.prompts)[: cfg.num_prompts]
    reward_fns = build_rewards(cfg.rewards, prompts)
    templates = prompt_templates(prompts)
    scorer = None
    if cfg.objects:
        if templates is None:
            raise ConfigError(
                "config error: objects=true reads objects of the coloured-shapes world, but "
                f"prompts={cfg.prompts!r} holds prompts outside its grammar; use prompts=heldout or "
                "train (or a file of such prompts), or objects=false"
            )
        scorer = load_scorer()
    repeated = [p for p in prompts for _ in range(cfg.seeds)]
    per_model: dict[str, dict[str, torch.Tensor]] = {}
    measure_rows: dict[str, torch.Tensor] = {}  # measures that cover only some prompts: which ones
    grids = []
    for i, (model, path) in enumerate(zip(cfg.models, paths, strict=True)):
        try:
            pipe = load(path)
        except (ConfigError, FileNotFoundError) as err:  # weights that the checks cannot see without loading
            raise ConfigError(f"config error: models[{i}] = {model!r}: {err}") from None
        # image s of every prompt shares noise seed `seed + s` across models: the comparison is paired
        images = torch.stack(
            [
                sample_ode(pipe, prompts, cfg.steps, cfg.guidance_scale, cfg.seed + s)
                for s in range(cfg.seeds)
            ],
            dim=1,
        )  # [prompts, seeds, 3, H, W]
        grids.append(images[: cfg.grid_prompts, 0])
        flat = images.flatten(0, 1)
        scores = {}
        for name, fn in reward_fns.items():
            try:
                values = scored(name, fn, flat, repeated)
            except RewardFailed as err:
                raise ConfigError(
                    f"config error: {err}, scoring {model!r}'s images: nothing is written; fix the reward "
                    "(or start its server) and run again"
                ) from None
            scores[name] = values.view(len(prompts), cfg.seeds).mean(dim=1)
        if scorer is not None:
            measures, measure_rows = object_measures(flat, prompts, cfg.seeds, scorer)
            scores.update(measures)
        per_model[model] = scores

    reference = per_model[cfg.models[0]]
    results: dict[str, Any] = {
        "prompts": cfg.prompts,
        "num_prompts": len(prompts),
        "seeds": cfg.seeds,
        "steps": cfg.steps,
        "guidance_scale": cfg.guidance_scale,
        "models": {},
    }
    everywhere = torch.ones(len(prompts), dtype=torch.bool)
    template_rows = (
        {t: torch.tensor([t == other for other in templates]) for t in sorted(set(templates))}
        if templates is not None
        else {}
    )
    for model, scores in per_model.items():
        entry = {}
        for name, values in scores.items():
            first = None if model == cfg.models[0] else reference[name]
            covered = measure_rows.get(name, everywhere)
            entry[name] = measure_stats(values, first, covered)
            if name in measure_rows:
                entry[name] = {"prompts": int(covered.sum()), **entry[name]}
            if template_rows:
                entry[name]["by_template"] = {}
                for template, rows in template_rows.items():
                    rows = rows & covered
                    if rows.any():
                        entry[name]["by_template"][template] = {
                            "prompts": int(rows.sum()),
                            **measure_stats(values, first, rows),
                        }
        results["models"][model] = entry
    results["methods"], results["between_methods"] = method_changes(results["models"], cfg.models)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    finite_or_named(results, "the evaluation", "eval_diffusion.json")
    write_json(out / "eval_diffusion.json", results)
    with open(out / "prompt_scores.jsonl", "w") as f:
        for i, prompt in enumerate(prompts):
            row: dict[str, Any] = {"prompt": prompt}
            if templates is not None:
                row["template"] = templates[i]
            row["scores"] = {
                model: {
                    name: float(values[i])
                    for name, values in scores.items()
                    if name not in measure_rows or measure_rows[name][i]
                }
                for model, scores in per_model.items()
            }
            f.write(json.dumps(row) + "\n")
    if cfg.grid_prompts:
        save_labelled_grid(grids, cfg.models, prompts[: cfg.grid_prompts], out / "grid.png")
    return results


def save_labelled_grid(rows: list[torch.Tensor], labels: list[str], prompts: list[str], path: Path) -> None:
    """One row of images per model, each column one prompt (titled)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = len(prompts)
    fig, axes = plt.subplots(
        len(rows), columns, figsize=(1.4 * columns, 1.5 * len(rows)), squeeze=False, constrained_layout=True
    )
    for r, (images, label) in enumerate(zip(rows, labels, strict=True)):
        for c in range(columns):
            ax = axes[r][c]
            ax.imshow(images[c].permute(1, 2, 0).cpu().numpy(), interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(prompts[c], fontsize=6, wrap=True)
            if c == 0:
                ax.set_ylabel("/".join(Path(label).parts[-2:]), fontsize=6)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_se(se: float | None) -> str:
    return "n/a (one prompt)" if se is None else f"{se:.4f}"


def format_table(results: dict[str, Any]) -> str:
    lines = [
        f"{results['num_prompts']} {results['prompts']} prompts x {results['seeds']} seeds, "
        f"{results['steps']} ODE steps, guidance {results['guidance_scale']}"
    ]
    for model, entry in results["models"].items():
        for name, stats in entry.items():
            text = f"  {model:<48} {name:<16} {stats['mean']:.4f}"
            if "diff" in stats:
                text += (
                    f"   {stats['diff']:+.4f} +- {format_se(stats['se'])} vs the first"
                    f"   better/worse {stats['better']}/{stats['worse']}"
                )
            lines.append(text)
            for template, part in stats.get("by_template", {}).items():
                label = f"  {template} ({part['prompts']})"
                text = f"  {'':<48} {label:<16} {part['mean']:.4f}"
                if "diff" in part:
                    text += f"   {part['diff']:+.4f} +- {format_se(part['se'])}"
                lines.append(text)
    if results.get("methods"):
        lines.append("seeds of one method, change against the first: mean [95% t interval over seeds]")
    for label, method in results.get("methods", {}).items():
        lines.append(f"  {label} ({len(method['models'])} seeds)")
        for name, change in method["change"].items():
            lines.append(f"  {'':<4} {name:<44} {format_interval(change['mean'], change['ci95'])}")
            for template, part in change.get("by_template", {}).items():
                lines.append(f"  {'':<8} {template:<40} {format_interval(part['mean'], part['ci95'])}")
    for pair, changes in results.get("between_methods", {}).items():
        lines.append(f"  {pair} (Welch's 95% interval)")
        for name, welch_stats in changes.items():
            lines.append(f"  {'':<4} {name:<44} {format_interval(welch_stats['diff'], welch_stats['ci95'])}")
    return "\n".join(lines)


def format_interval(mean: float, ci95: list[float]) -> str:
    return f"{mean:+.4f} [{ci95[0]:+.4f}, {ci95[1]:+.4f}]"


@EVALUATORS.register("diffusion")
def eval_diffusion(overrides: list[str]) -> dict[str, Any]:
    cfg = build(DiffusionEvalConfig, apply_overrides({}, overrides))
    results = evaluate_models(cfg)
    print(format_table(results))
    return results
