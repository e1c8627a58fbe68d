"""Row (d) of `mmrl bench vla`: env steps and seconds per trained decision (an executed chunk) of
snapshot-branched GRPO groups (`vla_rl.branching`) against the same trees replayed from reset; the
ratio's target is judged by `vla_rl.bench`."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from vla_rl.branching import BranchedGroups, BranchPlan, branched_rollouts
from vla_rl.episodes import Controller, Obs, evaluating, run_episodes
from vla_rl.online import Episode
from vla_rl.policy import VLAPolicy

BRANCHING_TARGET = 1.0  # env steps per trained decision, branched over replayed from reset, at most


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


def branching_row(
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
    return decision_row(tree, sum(o.steps for o in outcomes), seconds)


def decision_row(
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
        "seconds_per_decision": branched_s,
        "baseline_seconds_per_decision": replayed_s,
        "seconds_ratio": branched_s / replayed_s,
        "seconds_target": None,
        "decisions": decisions,
    }
