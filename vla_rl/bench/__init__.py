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

The rows' targets are judged, and printed, by the shared bench harness (`mmrl.bench_all.ratio_rows`);
`step_rates` measures rows (a), (b), (c) and (e), `decision_costs` row (d).

Repeats run the variants in turn and keep the median, so load from other processes hits all alike.
Steps where a vector env auto-resets a finished episode are not counted as steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mmrl.bench_all import check_counts, print_table, ratio_rows
from mmrl.config import ConfigError, check_device
from mmrl.registry import BENCHES
from vla_rl.bench.decision_costs import branching_row
from vla_rl.bench.step_rates import (
    BATCHING_TARGET,
    POLICY_TARGET,
    median_rates,
    metaworld_rows,
    rate_row,
    single_runner,
    vector_runner,
)
from vla_rl.branching import BranchPlan
from vla_rl.policy import VLAConfig, VLAPolicy, task_vocabulary

METAWORLD_TASK = "metaworld/pick-place-v3"


def reading(row: dict[str, Any]) -> dict[str, Any]:
    """The shared harness's reading of a row's ratio (`mmrl.bench_all.ratio_rows`): its verdict, and its
    target as the tables print it."""
    (out,) = ratio_rows("vla", [{k: row[k] for k in ("ratio", "target", "target_op")}])
    return out


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
        "raw": vector_runner(task, num_envs, "state", size, None),
        "policy": vector_runner(task, num_envs, "rgb", size, policy),
        "rgb": vector_runner(task, num_envs, "rgb", size, None),
        "raw_one": single_runner(task, "state", size, None),
        "policy_one": single_runner(task, "rgb", size, single_policy),
    }
    try:
        rates = median_rates({key: run for key, (run, _) in made.items()}, steps, repeats)
    finally:
        for _, close in made.values():
            close()
    plan = BranchPlan(branch_group_size, branch_every, tuple(branching))
    branched = branching_row(policy, task, num_envs, steps, branch_groups, plan, repeats)
    metaworld = []
    if metaworld_task and metaworld_skipped is None:
        metaworld = metaworld_rows(metaworld_task, num_envs, steps, repeats, size, policy.device)

    n = num_envs
    raw = f"raw: state obs, random actions, {n} envs"
    rgb = f"raw: rgb {size}px obs, random actions, {n} envs"
    in_loop = f"policy in the loop, rgb {size}px, {n} envs"
    rows = [
        rate_row("(a)", in_loop, rates["policy"], rgb, rates["rgb"], POLICY_TARGET),
        rate_row("(a)", in_loop, rates["policy"], raw, rates["raw"], None),
        rate_row(
            "(b)",
            f"rgb {size}px obs, random actions, {n} envs",
            rates["rgb"],
            raw,
            rates["raw"],
            None,
        ),
        rate_row(
            "(c)",
            f"SyncVectorEnv of {n}, state obs",
            rates["raw"],
            "one env, state obs",
            rates["raw_one"],
            None,
        ),
        rate_row(
            "(c)",
            f"policy in the loop, {n} envs, batched act",
            rates["policy"],
            "policy in the loop, one env",
            rates["policy_one"],
            BATCHING_TARGET,
        ),
        *metaworld,
    ]
    rows = [row | {"verdict": reading(row)["verdict"]} for row in rows]
    branched["verdict"] = reading(branched)["verdict"]
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
                reading(row)["target"] or "-",
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
                reading(branched)["target"],
                branched["verdict"],
                f"{branched['seconds_per_decision'] * 1e3:.1f}",
                f"{branched['baseline_seconds_per_decision'] * 1e3:.1f}",
            ]
        ],
    )
    return [*rows, branched]
