"""`mmrl bench vla`: what the policy in the loop, camera images and vectorising cost per env step.

All variants step the same task, side by side in one run, and count env steps per second against
raw MuJoCo stepping (state observations, random actions, N envs in lockstep through gymnasium's
SyncVectorEnv):

- (a) policy in the loop: rgb observations and one batched `VLAPolicy.act` per lockstep step (chunks
  of `n_action_steps` actions, so the network runs every few steps), against raw stepping with the
  same rgb observations: what the policy costs, target at least 0.5x; and against raw stepping with
  state observations, which adds the camera's cost (reported, no target: the VLA needs images, and
  software rendering on a CPU costs more than the physics);
- (b) rgb observations with random actions: the rendering cost alone, no policy, no target;
- (c) vectorised: SyncVectorEnv of N envs against one plain env (state observations; lockstep on one
  core, so about 1x is expected, no target), and N envs with one batched act against one env with a
  policy call per step (target at least 1x: batching must not lose);
- (d) snapshot-branched GRPO groups (`vla_rl.branching`) against the same groups replayed from reset:
  env steps per trained decision (an executed chunk), target at most 1x, and seconds per trained
  decision. The baseline rebuilds every leaf of the branched trees by resetting with its seed and
  replaying its actions, running the policy on the rows that start a chunk (as a flat group samples
  them), so both sides end with the same trees; the replay is checked to end every leaf where the
  branched run did. The groups' episodes are cut at `steps` env steps.
- (e) Meta-World (`metaworld_task`, when Meta-World is installed): the policy in the loop on that task
  (rgb, N envs, a policy built for its proprioception and actions) against raw stepping of the same
  task with rgb observations (target at least 0.5x, as (a)) and with state observations (no target);
  and rgb stepping with the frames drawn from simplified meshes (as the tasks render) against the
  full meshes (`full_meshes=True`; no target).

Repeats run the variants in turn and keep the median, so load from other processes hits all alike.
Steps where a vector env auto-resets a finished episode are not counted as steps.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmrl.bench_all import check_counts, print_table
from mmrl.config import ConfigError, check_device
from mmrl.registry import BENCHES
from vla_rl.branching import BranchedGroups, BranchPlan, branched_rollouts
from vla_rl.episodes import Controller, Obs, evaluating, run_episodes
from vla_rl.online import Episode
from vla_rl.policy import VLAConfig, VLAPolicy, task_vocabulary

POLICY_TARGET = 0.5  # policy-in-the-loop steps/s over raw stepping with the same observations, at least
BATCHING_TARGET = 1.0  # N envs with batched act over one env, at least
BRANCHING_TARGET = 1.0  # env steps per trained decision, branched over replayed from reset, at most
METAWORLD_TASK = "metaworld/pick-place-v3"


def _vector_runner(
    task: str, num_envs: int, obs_mode: str, image_size: int, policy: VLAPolicy | None, **make_kwargs: Any
) -> tuple[Callable[[int], int], Callable[[], None]]:
    """A function running `n` lockstep steps of a SyncVectorEnv (random actions, or the policy's),
    returning the env steps taken, and a closer; `make_kwargs` go to the task's constructor."""
    import functools

    import gymnasium as gym

    import sim

    make = functools.partial(sim.make, task, obs_mode=obs_mode, image_size=image_size, **make_kwargs)
    envs = gym.vector.SyncVectorEnv([make] * num_envs)
    action_shape = (num_envs, *envs.single_action_space.shape)
    rng = np.random.default_rng(0)
    obs, info = envs.reset(seed=0)
    state = {"obs": obs, "instructions": list(info["instruction"]), "resetting": np.zeros(num_envs, bool)}
    if policy is not None:
        policy.reset()

    def run(n: int) -> int:
        taken = 0
        for _ in range(n):
            if policy is None:
                actions = rng.uniform(-1, 1, action_shape).astype(np.float32)
            else:
                actions = policy.act(state["obs"], state["instructions"])
            obs, _, terminated, truncated, info = envs.step(actions)
            taken += int(num_envs - state["resetting"].sum())
            if policy is not None and state["resetting"].any():  # new episodes: predict fresh chunks
                policy.reset(np.flatnonzero(state["resetting"]))
            state["obs"], state["instructions"] = obs, list(info["instruction"])
            state["resetting"] = terminated | truncated
        return taken

    return run, envs.close


def _single_runner(
    task: str, obs_mode: str, image_size: int, policy: VLAPolicy | None
) -> tuple[Callable[[int], int], Callable[[], None]]:
    """The same for one plain env (reset by hand when an episode ends)."""
    import sim

    env = sim.make(task, obs_mode=obs_mode, image_size=image_size)
    action_shape = env.action_space.shape
    rng = np.random.default_rng(0)
    obs, info = env.reset(seed=0)
    state = {"obs": obs, "instruction": info["instruction"], "seed": 0}
    if policy is not None:
        policy.reset()

    def run(n: int) -> int:
        for _ in range(n):
            if policy is None:
                action = rng.uniform(-1, 1, action_shape).astype(np.float32)
            else:
                action = policy.act(state["obs"], state["instruction"])
            obs, _, terminated, truncated, info = env.step(action)
            if terminated or truncated:
                state["seed"] += 1
                obs, info = env.reset(seed=state["seed"])
                if policy is not None:
                    policy.reset()
            state["obs"], state["instruction"] = obs, info["instruction"]
        return n

    return run, env.close


def _median_rates(runners: dict[str, Callable[[int], int]], steps: int, repeats: int) -> dict[str, float]:
    """Median env steps per second of each runner over `repeats` rounds, runners timed in turn."""
    for run in runners.values():
        run(2)  # warm-up: renderer contexts, first forward
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            start = time.perf_counter()
            taken = run(steps)
            samples[name].append(taken / (time.perf_counter() - start))
    return {name: statistics.median(rates) for name, rates in samples.items()}


def _row(section: str, name: str, rate: float, baseline: str, base: float, target: float | None) -> dict:
    ratio = rate / base
    verdict = "-" if target is None else ("PASS" if ratio >= target else "FAIL")
    return {
        "section": section,
        "name": name,
        "steps_per_s": rate,
        "baseline": baseline,
        "baseline_steps_per_s": base,
        "ratio": ratio,
        "target": target,
        "target_op": ">=",
        "verdict": verdict,
    }


def _metaworld_rows(
    task: str, num_envs: int, steps: int, repeats: int, size: int, device: torch.device
) -> list[dict[str, Any]]:
    """Rows (e): an untrained policy shaped for the Meta-World task in the loop, against raw stepping."""
    import sim

    env = sim.make(task)
    proprio_dim, action_dim = env.get_wrapper_attr("proprio_dim"), env.action_space.shape[0]
    words = task_vocabulary([env.get_wrapper_attr("instruction")])
    env.close()
    config = VLAConfig(vocabulary=words, proprio_dim=proprio_dim, action_dim=action_dim, image_size=size)
    policy = VLAPolicy(config).to(device).eval()
    made = {
        "raw": _vector_runner(task, num_envs, "state", size, None),
        "rgb": _vector_runner(task, num_envs, "rgb", size, None),
        "rgb_full": _vector_runner(task, num_envs, "rgb", size, None, full_meshes=True),
        "policy": _vector_runner(task, num_envs, "rgb", size, policy),
    }
    try:
        rates = _median_rates({key: run for key, (run, _) in made.items()}, steps, repeats)
    finally:
        for _, close in made.values():
            close()
    name = f"{task}: policy in the loop, rgb {size}px, {num_envs} envs"
    rgb = f"{task}: rgb {size}px obs, random actions"
    raw = f"{task}: state obs, random actions"
    full = f"{task}: rgb {size}px obs from the full meshes, random actions"
    return [
        _row("(e)", name, rates["policy"], rgb, rates["rgb"], POLICY_TARGET),
        _row("(e)", name, rates["policy"], raw, rates["raw"], None),
        _row("(e)", rgb, rates["rgb"], full, rates["rgb_full"], None),
    ]


class ReplayChunks(Controller):
    """Replays recorded episodes (one per reset seed, in order), calling the policy on the rows where
    an episode sampled a chunk, as the flat group that replays them from reset would."""

    def __init__(self, policy: VLAPolicy, episodes: list[Episode]) -> None:
        self.policy, self.episodes = policy, episodes
        self.first, self.size = 0, 0

    def start(self, size: int) -> None:
        self.first, self.size = self.first + self.size, size
        self.t = np.zeros(size, dtype=np.int64)

    def propose(self, obs: list[Obs], instructions: list[str], rows: list[int]) -> np.ndarray:
        episodes = self.episodes[self.first : self.first + self.size]
        starts = [j for j in rows if episodes[j].chunk_step[self.t[j]] == 0]
        if starts:
            batch = {key: np.stack([obs[j][key] for j in starts]) for key in ("state", "image")}
            self.policy(self.policy.prepare(batch, [instructions[j] for j in starts])).sample()
        actions = np.zeros((self.size, episodes[0].actions.shape[1]), np.float32)
        for j in rows:
            actions[j] = episodes[j].actions[self.t[j]]
        return actions

    def executed(self, j: int) -> int:
        self.t[j] += 1
        return int(self.episodes[self.first + j].chunk_step[self.t[j] - 1])


def _branching_row(
    policy: VLAPolicy, task: str, num_envs: int, steps: int, groups: int, plan: BranchPlan, repeats: int
) -> dict[str, Any]:
    """Row (d): branched groups and their replay from reset, timed in turn `repeats` times (medians)."""
    import sim

    size = policy.config.image_size
    kwargs = {"obs_mode": "state+rgb", "image_size": size, "max_episode_steps": steps}
    envs = [sim.make(task, **kwargs) for _ in range(num_envs)]
    seconds: dict[str, list[float]] = {"branched": [], "replayed": []}
    try:
        with evaluating(policy):
            for _ in range(repeats):
                start = time.perf_counter()
                tree = branched_rollouts(policy, envs, range(groups), range(groups), plan, (0, 0, 0), 0.3)
                seconds["branched"].append(time.perf_counter() - start)
                start = time.perf_counter()
                outcomes = run_episodes(
                    envs, [leaf.seed for leaf in tree.leaves], ReplayChunks(policy, tree.leaves)
                )
                seconds["replayed"].append(time.perf_counter() - start)
    finally:
        for env in envs:
            env.close()
    for leaf, outcome in zip(tree.leaves, outcomes, strict=True):
        if (outcome.steps, outcome.success) != (leaf.length, leaf.success):
            raise RuntimeError(
                f"the replay of a branched episode (seed {leaf.seed}) ended after {outcome.steps} steps "
                f"(success {outcome.success}), the branched run after {leaf.length} ({leaf.success}): "
                "a snapshot did not restore the whole state"
            )
    return _decision_row(tree, sum(o.steps for o in outcomes), seconds)


def _decision_row(
    tree: BranchedGroups, replayed_steps: int, seconds: dict[str, list[float]]
) -> dict[str, Any]:
    """Row (d) from the branched trees, the replay's env steps and both sides' seconds."""
    decisions = sum(len(edge.decisions) for *_, edge in tree.edges())
    ratio = tree.env_steps / replayed_steps
    branched_s, replayed_s = (statistics.median(seconds[k]) / decisions for k in ("branched", "replayed"))
    return {
        "section": "(d)",
        "name": "snapshot-branched GRPO groups",
        "env_steps_per_decision": tree.env_steps / decisions,
        "baseline": "replayed from reset",
        "baseline_env_steps_per_decision": replayed_steps / decisions,
        "ratio": ratio,
        "target": BRANCHING_TARGET,
        "target_op": "<=",
        "verdict": "PASS" if ratio <= BRANCHING_TARGET else "FAIL",
        "seconds_per_decision": branched_s,
        "baseline_seconds_per_decision": replayed_s,
        "seconds_ratio": branched_s / replayed_s,
        "seconds_target": None,
        "decisions": decisions,
    }


@BENCHES.register("vla")
def bench_vla(
    steps: int = 100,
    num_envs: int = 8,
    repeats: int = 3,
    task: str = "PickPlace",
    image_size: int | None = None,
    model: str | None = None,
    device: str = "cpu",
    branch_groups: int = 1,
    branch_group_size: int = 8,
    branch_every: int = 5,
    branching: list[int] | None = None,
    metaworld_task: str = METAWORLD_TASK,
) -> list[dict[str, Any]]:
    """Env steps per second: raw stepping, policy in the loop, rgb rendering, N envs vs one; and env
    steps and seconds per trained decision of snapshot-branched GRPO groups against replay from reset;
    print the tables and return their rows. `steps` lockstep steps per variant and repeat (one-env
    variants take `steps` steps too; the groups' episodes at most `steps` steps); `model` a VLAPolicy
    directory, else an untrained policy of the default architecture (the speed does not depend on
    the weights), run on `device`. Row (d) runs `branch_groups` groups of `branch_group_size` leaves,
    branching every `branch_every` chunks into `branching` children by depth (default [2, 2, 2]). Rows
    (e) step `metaworld_task` (empty: none; without Meta-World installed, one line says so)."""
    import sim

    check_counts(
        steps=steps,
        num_envs=num_envs,
        repeats=repeats,
        branch_groups=branch_groups,
        branch_group_size=branch_group_size,
        branch_every=branch_every,
    )
    branching = [2, 2, 2] if branching is None else branching
    if not branching or min(branching) < 1:
        raise ConfigError(f"config error: branching = {branching}: give children per depth, each at least 1")
    device = check_device(device, "device")
    try:
        task = sim.task_id(task)
    except ValueError as err:
        raise ConfigError(f"config error: task = {task!r}: {err}") from None
    from sim import metaworld

    metaworld_skipped = None
    if metaworld_task and not metaworld.installed():
        metaworld_skipped = f"(e) Meta-World rows skipped: Meta-World is not installed ({metaworld.INSTALL})"
    elif metaworld_task:
        try:
            metaworld_task = sim.task_id(metaworld_task)
        except ValueError as err:
            raise ConfigError(f"config error: metaworld_task = {metaworld_task!r}: {err}") from None
    torch.manual_seed(0)
    if model:
        if not Path(model).is_dir():
            raise FileNotFoundError(
                f"model={model!r} is not a directory written by VLAPolicy.save_pretrained"
            )
        policy = VLAPolicy.from_pretrained(model)
        name = model
    else:
        policy = VLAPolicy(VLAConfig(vocabulary=task_vocabulary(), image_size=image_size or 96))
        name = "untrained VLAPolicy, default architecture"
    policy.to(device).eval()
    if image_size is not None and image_size != policy.config.image_size:
        raise ConfigError(
            f"config error: image_size = {image_size}, but the policy takes "
            f"{policy.config.image_size}px images"
        )
    size = policy.config.image_size
    # the policy keeps one chunk queue per batch size, so the one-env variant gets its own copy
    single_policy = VLAPolicy(policy.config)
    single_policy.load_state_dict(policy.state_dict())
    single_policy.to(device).eval()

    made = {
        "raw": _vector_runner(task, num_envs, "state", size, None),
        "policy": _vector_runner(task, num_envs, "rgb", size, policy),
        "rgb": _vector_runner(task, num_envs, "rgb", size, None),
        "raw_one": _single_runner(task, "state", size, None),
        "policy_one": _single_runner(task, "rgb", size, single_policy),
    }
    try:
        rates = _median_rates({key: run for key, (run, _) in made.items()}, steps, repeats)
    finally:
        for _, close in made.values():
            close()
    plan = BranchPlan(branch_group_size, branch_every, tuple(branching))
    branched = _branching_row(policy, task, num_envs, steps, branch_groups, plan, repeats)
    metaworld_rows = []
    if metaworld_task and metaworld_skipped is None:
        metaworld_rows = _metaworld_rows(metaworld_task, num_envs, steps, repeats, size, policy.device)

    n = num_envs
    raw = f"raw: state obs, random actions, {n} envs"
    rgb = f"raw: rgb {size}px obs, random actions, {n} envs"
    rows = [
        _row(
            "(a)",
            f"policy in the loop, rgb {size}px, {n} envs",
            rates["policy"],
            rgb,
            rates["rgb"],
            POLICY_TARGET,
        ),
        _row("(a)", f"policy in the loop, rgb {size}px, {n} envs", rates["policy"], raw, rates["raw"], None),
        _row(
            "(b)",
            f"rgb {size}px obs, random actions, {n} envs",
            rates["rgb"],
            raw,
            rates["raw"],
            None,
        ),
        _row(
            "(c)",
            f"SyncVectorEnv of {n}, state obs",
            rates["raw"],
            "one env, state obs",
            rates["raw_one"],
            None,
        ),
        _row(
            "(c)",
            f"policy in the loop, {n} envs, batched act",
            rates["policy"],
            "policy in the loop, one env",
            rates["policy_one"],
            BATCHING_TARGET,
        ),
        *metaworld_rows,
    ]
    where = f"{policy.device}, {torch.get_num_threads()} torch threads, median of {repeats} x {steps} steps"
    print(f"policy: {name}; task {task}; chunks of {policy.config.n_action_steps} actions per policy call")
    print_table(
        f"VLA env steps per second ({where})",
        ["variant", "steps/s", "baseline", "baseline steps/s", "ratio", "target", "verdict"],
        [
            [
                f"{row['section']} {row['name']}",
                f"{row['steps_per_s']:.1f}",
                row["baseline"],
                f"{row['baseline_steps_per_s']:.1f}",
                f"{row['ratio']:.2f}x",
                "-" if row["target"] is None else f">= {row['target']}x",
                row["verdict"],
            ]
            for row in rows
        ],
    )
    if metaworld_skipped:
        print(metaworld_skipped)
    print(
        f"(d): {branch_groups} GRPO groups of {plan.group_size} leaves, branched every {plan.every} chunks "
        f"into {list(plan.branching)} children by depth, episodes of at most {steps} steps, "
        f"{branched['decisions']} trained decisions"
    )
    print_table(
        f"VLA GRPO groups: env steps and ms per trained decision ({n} envs, median of {repeats})",
        ["variant", "steps", "baseline", "baseline steps", "ratio", "target", "verdict", "ms", "baseline ms"],
        [
            [
                f"(d) {branched['name']}",
                f"{branched['env_steps_per_decision']:.2f}",
                branched["baseline"],
                f"{branched['baseline_env_steps_per_decision']:.2f}",
                f"{branched['ratio']:.2f}x",
                f"<= {BRANCHING_TARGET}x",
                branched["verdict"],
                f"{branched['seconds_per_decision'] * 1e3:.1f}",
                f"{branched['baseline_seconds_per_decision'] * 1e3:.1f}",
            ]
        ],
    )
    return [*rows, branched]
