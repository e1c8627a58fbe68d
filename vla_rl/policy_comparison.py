"""`mmrl eval vla`: several policies side by side on the same seeded episodes (`vla_rl.evaluate`),
written to ``OUTPUT_DIR/eval_vla.json`` (and, with ``videos=K``, K GIFs per policy under
``OUTPUT_DIR/videos``):

    mmrl eval vla "policies=[vla_rl/assets/tiny_vla,runs/vla/habc/policy]" episodes=100

A policy directory may also be a LeRobot policy (ACT, Diffusion, ...; `vla_rl.lerobot_policy`),
recognised by the `type` field of its config.json.

Where the task's scripted expert names failure modes (`Expert.failure`: PickPlace's, and the Meta-World
tasks that carry an object), each failed episode is classified from the privileged states it visited,
and eval_vla.json counts them per policy.

With ``intervention.enabled=true`` the task's scripted expert supervises every episode and takes over
when the policy strays, by a rule of `vla_rl.supervisor` set in the same `intervention.*` section
(`TakeoverConfig`, its defaults the training recipes' rule) as training: when the RMS difference
between the policy's action and the expert's (over the 5 action entries, each in [-1, 1]), averaged
over the last `intervention.window` policy steps, exceeds `intervention.threshold` (or, with
`intervention.window=0 intervention.patience=P`, does so at P consecutive policy steps), the expert
executes `intervention.takeover_steps` actions, then hands back and the policy predicts a fresh chunk;
`intervention.release_guard=true` also stops a release of the gripper that drops the object away from
its goal. One hand-over counts as one intervention; success is then success *with* help, and the
intervention counts say how much help was needed.

With ``gap_window=W`` each episode also gets its largest mean RMS gap to the expert over W consecutive
policy steps, the quantity the training take-over rule compares with ``intervention.threshold``, and
the table says which thresholds fire in every failed episode and in no successful one. Run it on the
base a recipe starts from to set the threshold for a new task.

With ``rescue_at=[D,...]`` each policy's episodes run again once per D, with the expert taking over at
step D of every episode not yet successful and driving it to the end. A take-over helps training only
where the expert can still finish from the policy's state: the counts of failures rescued at each D
show how late that is (a scripted expert written for its own start state may not recover from a
policy's half-done grasp).
"""

from __future__ import annotations

import json
import re
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from mmrl.config import ConfigError, apply_overrides, build, check_output_dir, option, shipped_path
from mmrl.registry import EVALUATORS
from vla_rl.evaluate import TASK_HELP, Episodes, evaluate_episodes, wilson_interval, write_gif
from vla_rl.lerobot_policy import import_lerobot
from vla_rl.loading import is_lerobot_policy_dir, load
from vla_rl.supervisor import TakeoverConfig, TakeoverRule

RESCUE_STEPS = 1_000_000  # a rescue's take-over lasts to the episode's end


@dataclass
class VLAPoliciesEvalConfig:
    policies: list[str] = option(
        [], "VLAPolicy or LeRobot policy directories (save_pretrained), run on the same episodes"
    )
    task: str = option("PickPlace", TASK_HELP)
    episodes: int = option(100, "episodes per policy", min=1)
    seed: int = option(1_000_000, "reset seed of the first episode (then seed+1, ...)", min=0)
    num_envs: int = option(8, "environments stepped in lockstep, one batched policy call per step", min=1)
    deterministic: bool = option(
        True, "act with the clipped mean (false: sample, from a generator seeded by seed)"
    )
    intervention: TakeoverConfig = field(default_factory=TakeoverConfig)
    gap_window: int = option(
        0,
        "report each episode's largest mean RMS gap to the scripted expert over this many policy steps, "
        "by outcome: the values of intervention.threshold (with intervention.window equal to this) that "
        "fire in every failed episode and in no successful one (0: off)",
        min=0,
    )
    rescue_at: list[int] = option(
        [],
        "for each step D, the same episodes again with the scripted expert taking over after the policy's "
        "first D steps (if not yet successful) and driving to the end: how many of the policy's failures a "
        "take-over at D still saves (e.g. [15,30,45])",
    )
    videos: int = option(0, "GIFs of the first K episodes per policy (OUTPUT_DIR/videos)", min=0)
    video_size: int = option(128, "side of the GIF frames in pixels (front camera)", min=16)
    progress: bool = option(True, "show progress bars")
    output_dir: str = option("runs/eval/vla", "where eval_vla.json and videos/ go")


def check_config(cfg: VLAPoliciesEvalConfig) -> str:
    """Fail before any rollout on a bad task, policy list or output_dir; return the full task id."""
    check_output_dir(cfg.output_dir, "output_dir")
    if min(cfg.rescue_at, default=1) < 1 or len(set(cfg.rescue_at)) < len(cfg.rescue_at):
        raise ConfigError(
            f"config error: rescue_at = {cfg.rescue_at}: give distinct step numbers >= 1, "
            "e.g. rescue_at=[15,30]"
        )
    if cfg.rescue_at and cfg.intervention.enabled:
        raise ConfigError(
            "config error: rescue_at pairs each take-over with the policy alone, but "
            "intervention.enabled=true has the expert help in every episode: drop one of the two"
        )
    if not cfg.policies:
        raise ConfigError(
            "config error: policies is empty; pass policies=[DIR,DIR,...] (VLAPolicy directories)"
        )
    # a shipped policy (vla_rl/assets/tiny_vla) is found from any working directory
    cfg.policies = [str(shipped_path(path)) for path in cfg.policies]
    for path in cfg.policies:
        if cfg.policies.count(path) > 1:
            raise ConfigError(f"config error: policies lists {path!r} twice; give each policy once")
        if not Path(path).is_dir():
            raise ConfigError(
                f"config error: policies: {path!r} is not a directory; give directories written by "
                "VLAPolicy.save_pretrained (e.g. RUN/policy of `mmrl pretrain vla`) or LeRobot policies"
            )
        if is_lerobot_policy_dir(path):
            try:
                import_lerobot()
            except ImportError as err:
                raise ConfigError(f"config error: policies: {path!r} is a LeRobot policy: {err}") from None
    try:
        import sim
    except ImportError as err:
        raise ConfigError(f"mmrl eval vla needs the robot extra (pip install -e '.[robot]'): {err}") from None
    try:
        return sim.task_id(cfg.task)
    except ValueError as err:
        raise ConfigError(f"config error: task = {cfg.task!r}: {err}") from None


def rescue(run: Callable[..., Episodes], step: int, alone: np.ndarray) -> dict[str, Any]:
    """`run`'s episodes again (`evaluate_episodes` with the policy, task and seeds bound), the expert taking
    over at `step` and driving to the end; paired with `alone` (each episode's success without help):
    failures it rescued, successes it lost."""
    takeover = TakeoverRule(0.0, takeover_steps=RESCUE_STEPS, deadline=step, max_per_episode=1)
    helped = run(takeover=takeover).success
    return {
        "step": step,
        "successes": int(helped.sum()),
        "episodes": len(helped),
        "rescued": int((helped & ~alone).sum()),
        "failures": int((~alone).sum()),
        "lost": int((alone & ~helped).sum()),
    }


def summarise(result: Episodes, gap_window: int = 0) -> dict[str, Any]:
    """Success with its Wilson interval, episode lengths and intervention counts, plus per-episode lists;
    with `gap_window`, the expert gaps by outcome (`gap_summary`)."""
    n = len(result.seeds)
    successes = int(result.success.sum())
    low, high = wilson_interval(successes, n)
    summary = {
        "success_rate": successes / n,
        "success_ci_low": low,
        "success_ci_high": high,
        "successes": successes,
        "episodes": n,
        "mean_steps": float(result.steps.mean()),
        "median_steps": float(statistics.median(result.steps.tolist())),
        "interventions": int(result.interventions.sum()),
        "interventions_per_episode": float(result.interventions.mean()),
        "episodes_with_interventions": int((result.interventions > 0).sum()),
        "expert_steps": int(result.expert_steps.sum()),
        "expert_step_fraction": float(result.expert_steps.sum() / max(1, result.steps.sum())),
        "failures": dict(Counter(result.failures.values()).most_common()),
        "per_episode": {
            "seed": list(result.seeds),
            "success": result.success.tolist(),
            "steps": result.steps.tolist(),
            "interventions": result.interventions.tolist(),
            "expert_steps": result.expert_steps.tolist(),
            "failure": [result.failures.get(k) for k in range(n)],
        },
    }
    if gap_window:
        summary["expert_gap"] = gap_summary(result, gap_window)
        summary["per_episode"]["expert_gap"] = [result.expert_gaps.get(k) for k in range(n)]
    return summary


def gap_summary(result: Episodes, window: int) -> dict[str, Any]:
    """The window rule fires in an episode whose largest gap exceeds the threshold: thresholds from the
    successes' largest gap up to the failures' smallest fire in every failed episode and no successful
    one. A failed episode too short for a value is one the rule cannot catch."""
    outcomes = [(bool(ok), result.expert_gaps.get(k)) for k, ok in enumerate(result.success)]
    success_gaps = [g for ok, g in outcomes if ok and g is not None]
    failure_gaps = [g for ok, g in outcomes if not ok and g is not None]
    successes_max = max(success_gaps, default=None)
    return {
        "window": window,
        "successes_max": successes_max,
        "failures_min": min(failure_gaps, default=None),
        "failures": sum(not ok for ok, _ in outcomes),
        "failures_fired_at_successes_max": sum(g > (successes_max or 0.0) for g in failure_gaps),
    }


def policy_label(index: int, path: str) -> str:
    """A file-name-safe label for a policy directory, unique by its index."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", str(Path(path))).strip("_.") or "policy"
    return f"{index}-{safe}"


def evaluate_policies(cfg: VLAPoliciesEvalConfig) -> dict[str, Any]:
    """Run every policy on the same seeded episodes; write eval_vla.json (and GIFs) to output_dir."""
    task = check_config(cfg)
    takeover = cfg.intervention.rule()
    out = Path(cfg.output_dir)
    results: dict[str, Any] = {
        "task": task,
        "episodes": cfg.episodes,
        "seed": cfg.seed,
        "deterministic": cfg.deterministic,
        "interventions": cfg.intervention.enabled,
        "takeover": asdict(cfg.intervention) if cfg.intervention.enabled else None,
        "policies": {},
    }
    reference: np.ndarray | None = None
    gifs: list[tuple[list[np.ndarray], list[bool], Path]] = []  # written once every policy has run
    for index, path in enumerate(cfg.policies):
        policy = load(path)
        run = partial(
            evaluate_episodes,
            policy,
            task,
            cfg.episodes,
            cfg.seed,
            num_envs=cfg.num_envs,
            deterministic=cfg.deterministic,
            progress=cfg.progress,
        )
        episodes = run(
            takeover=takeover, videos=cfg.videos, video_size=cfg.video_size, gap_window=cfg.gap_window
        )
        entry = summarise(episodes, cfg.gap_window)
        entry["rescue"] = [rescue(run, step, episodes.success) for step in cfg.rescue_at]
        if reference is None:
            reference = episodes.success
        else:  # paired on the same episodes: where this policy and the first disagree
            entry["vs_first"] = {
                "better": int((episodes.success & ~reference).sum()),
                "worse": int((~episodes.success & reference).sum()),
            }
        videos = []
        for k, (frames, by_expert) in sorted(episodes.videos.items()):
            outcome = "success" if episodes.success[k] else "failure"
            name = f"episode{k:03d}_seed{episodes.seeds[k]}_{outcome}.gif"
            gif = out / "videos" / policy_label(index, path) / name
            gifs.append((frames, by_expert, gif))
            videos.append(str(gif))
        entry["videos"] = videos
        results["policies"][path] = entry
    out.mkdir(parents=True, exist_ok=True)
    for frames, by_expert, gif in gifs:
        write_gif(frames, by_expert, gif)
    (out / "eval_vla.json").write_text(json.dumps(results, indent=1))
    return results


def format_table(results: dict[str, Any]) -> str:
    """One line per policy: success with its 95% interval, episode lengths, interventions."""
    help_note = ", expert takeovers on (success is with help)" if results["interventions"] else ""
    lines = [
        f"{results['task']}: {results['episodes']} episodes, reset seeds {results['seed']}.."
        f"{results['seed'] + results['episodes'] - 1}, "
        f"{'deterministic' if results['deterministic'] else 'sampled'} actions{help_note}",
        f"  {'policy':<40}{'success':>9}{'95% CI':>17}{'mean len':>10}{'median len':>12}"
        f"{'takeovers':>11}{'expert steps':>14}{'vs first +/-':>14}",
    ]
    for path, entry in results["policies"].items():
        vs = entry.get("vs_first")
        paired = f"+{vs['better']}/-{vs['worse']}" if vs else "-"
        interval = f"[{entry['success_ci_low']:.3f}, {entry['success_ci_high']:.3f}]"
        lines.append(
            f"  {path:<40}{entry['successes']:>4}/{entry['episodes']:<4}{interval:>17}"
            f"{entry['mean_steps']:>10.1f}{entry['median_steps']:>12.1f}"
            f"{entry['interventions']:>11}{entry['expert_steps']:>14}{paired:>14}"
        )
        if entry["failures"]:
            lines.append("      failures: " + ", ".join(f"{how} {n}" for how, n in entry["failures"].items()))
        if "expert_gap" in entry:
            lines.append("      " + format_gaps(entry["expert_gap"]))
        for r in entry["rescue"]:
            lines.append(
                f"      expert takes over at step {r['step']}: {r['successes']}/{r['episodes']} succeed, "
                f"{r['rescued']} of the {r['failures']} failures rescued, {r['lost']} successes lost"
            )
    return "\n".join(lines)


def format_gaps(gap: dict[str, Any]) -> str:
    """One sentence: which window-rule thresholds fire in every failed episode and no successful one."""

    def value(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    head = (
        f"largest mean gap to the expert over {gap['window']} policy steps: successes up to "
        f"{value(gap['successes_max'])}, failures from {value(gap['failures_min'])}"
    )
    if gap["failures"] == 0:
        return head + " (no failed episode)"
    low = gap["successes_max"] or 0.0
    fired = gap["failures_fired_at_successes_max"]
    if fired == gap["failures"]:
        return head + f": intervention.threshold in [{low:.3f}, {gap['failures_min']:.3f}) separates them"
    return head + f": at {low:.3f}, the window rule fires in {fired} of {gap['failures']} failed episodes"


@EVALUATORS.register("vla")
def eval_vla(overrides: list[str]) -> dict[str, Any]:
    """`mmrl eval vla policies=[...] ...`: print the side-by-side table and write eval_vla.json."""
    cfg = build(VLAPoliciesEvalConfig, apply_overrides({}, overrides))
    results = evaluate_policies(cfg)
    print(format_table(results))
    print(f"wrote {Path(cfg.output_dir) / 'eval_vla.json'}")
    return results
