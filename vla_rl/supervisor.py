"""The scripted expert watching the robot, a stand-in for a person who takes over when the policy strays.

At every policy step the supervisor compares the policy's action with what the scripted expert would do
in the same privileged state: the RMS difference over the action entries (each in [-1, 1]). A step
whose gap exceeds `threshold` strays. A `TakeoverRule` says when straying hands the robot to the
expert; the expert then drives `takeover_steps` steps and hands back (the policy starts a fresh chunk).
Two triggers, used alone or together:

- `patience` (`intervention.patience`): the expert takes over at the `patience`-th consecutive straying
  step, and drives that very step (the policy's action there never runs). Meant for deterministic
  actions, where a straying step is a real disagreement.
- `window` (`intervention.window`, the vla recipes' rule): the expert takes over from the next step
  once the mean gap over the last `window` executed policy steps exceeds `threshold`. A mean
  rather than consecutive steps, because training actions are sampled and noisy. The recipes'
  threshold (1.0) was set from the BC base sampling with the recipes' `std_scale`: it fires in every
  failing episode and in a few of the successful ones, where 0.6 fired in most of them (so the expert
  drove most episodes the policy would have finished alone). The right threshold depends on the task
  and the policy: `mmrl eval vla gap_window=W` reports, per episode, the largest W-step mean gap by
  outcome, and which thresholds fire in every failed episode and in no successful one.

With `release_guard`, the supervisor also looks before each policy step: a policy about to open the
gripper (last action entry < 0) where that drops what it holds away from the goal
(`Expert.release_fails`) is stopped, and the expert drives from that step. The gap rules react too late
for that: one opposite gripper entry moves the RMS gap by 0.9 and the cube falls in the next step.
Independently, if the episode has not succeeded after `deadline` steps (0: never), the expert takes over
once. At most `max_per_episode` take-overs happen per episode (None: no limit).

`TakeoverConfig` is the config section of a rule, one shape for training (`intervention.*` of the vla
recipes) and evaluation (`intervention.*` of `mmrl eval vla`), with one set of defaults: the
recipes' window rule.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from mmrl.config import ConfigError, option


@dataclass(frozen=True)
class TakeoverRule:
    """When the expert takes over and for how long (module docstring); 0 turns a trigger off."""

    threshold: float  # RMS gap to the expert's action that counts as straying
    takeover_steps: int  # steps the expert drives per take-over, the one it takes over at included
    patience: int = 0  # consecutive straying policy steps; the expert drives the last of them
    window: int = 0  # policy steps whose mean gap is compared; the expert drives from the next step
    deadline: int = 0  # steps after which, still without success, the expert takes over once
    max_per_episode: int | None = None  # take-overs per episode at most (None: no limit)
    release_guard: bool = False  # stop an opening of the gripper that drops the object away from its goal

    def __post_init__(self) -> None:
        if self.takeover_steps < 1 or min(self.patience, self.window, self.deadline) < 0:
            raise ValueError(f"{self}: takeover_steps must be >= 1, patience, window and deadline >= 0")


@dataclass
class TakeoverConfig:
    """The `intervention` section: whether the scripted expert supervises, and its `TakeoverRule`."""

    enabled: bool = option(False, "let the scripted expert take over when the policy strays")
    threshold: float = option(
        1.0,
        "RMS gap to the expert's action that counts as straying: a step's with intervention.patience, "
        "the mean over the last intervention.window policy steps with intervention.window",
        min=0.0,
    )
    window: int = option(
        8,
        "policy steps over which the gap is averaged; the expert takes over from the next step once the "
        "mean exceeds the threshold (0: off; meant for sampled actions)",
        min=0,
    )
    patience: int = option(
        0,
        "consecutive straying policy steps at which the expert takes over, driving the last of them "
        "(0: off; meant for deterministic actions)",
        min=0,
    )
    takeover_steps: int = option(12, "steps the expert drives before handing control back", min=1)
    deadline: int = option(
        0, "steps after which, still without success, the expert takes over once (0: never)", min=0
    )
    max_per_episode: int = option(4, "take-overs per episode at most (0: no limit)", min=0)
    release_guard: bool = option(
        False,
        "also take over before the policy opens the gripper where that drops the held object away "
        "from its goal (PickPlace; the last action entry is the gripper, < 0 opens)",
    )

    def __post_init__(self) -> None:
        if self.enabled and not (self.window or self.patience or self.deadline or self.release_guard):
            raise ConfigError(
                "config error: intervention.enabled = true, but intervention.window, intervention.patience "
                "and intervention.deadline are 0 and intervention.release_guard is false, so the expert "
                "never takes over: set one, e.g. intervention.window=8"
            )

    def rule(self) -> TakeoverRule | None:
        """The rule the supervisor applies, or None when the expert does not supervise."""
        if not self.enabled:
            return None
        return TakeoverRule(
            self.threshold,
            self.takeover_steps,
            patience=self.patience,
            window=self.window,
            deadline=self.deadline,
            max_per_episode=self.max_per_episode or None,
            release_guard=self.release_guard,
        )


def action_gap(action: np.ndarray, expert_action: np.ndarray) -> float:
    """RMS difference of two actions (in float64)."""
    gap = np.asarray(action, np.float64) - np.asarray(expert_action, np.float64)
    return float(np.sqrt(np.mean(gap * gap)))


class Supervisor:
    """`rule` applied to `n` environments at once; the episode runner (`vla_rl.episodes`) calls it."""

    def __init__(self, rule: TakeoverRule, n: int) -> None:
        self.rule = rule
        self.expert_steps_left = np.zeros(n, dtype=np.int64)
        self.count = np.zeros(n, dtype=np.int64)  # take-overs this episode
        self.straying = np.zeros(n, dtype=np.int64)  # consecutive straying policy steps
        self.deadline_used = np.zeros(n, dtype=bool)
        self.gaps: list[deque[float]] = [deque(maxlen=rule.window) for _ in range(n)]

    def reset(self, j: int) -> None:
        """A new episode in env j: policy in control, no take-overs counted."""
        self.expert_steps_left[j] = self.count[j] = self.straying[j] = 0
        self.deadline_used[j] = False
        self.gaps[j].clear()

    def expert_drives(self, j: int) -> bool:
        """Whether the expert is in control of env j now."""
        return bool(self.expert_steps_left[j] > 0)

    def _exhausted(self, j: int) -> bool:
        return self.rule.max_per_episode is not None and self.count[j] >= self.rule.max_per_episode

    def before_policy_step(
        self, j: int, action: np.ndarray, expert_action: np.ndarray, release_fails: bool
    ) -> bool:
        """The policy is about to execute `action`; True when the expert drives this step instead: the
        release guard stops an opening where `release_fails`, or this is the `patience`-th consecutive
        straying step."""
        rule = self.rule
        if self._exhausted(j):
            return False
        if rule.release_guard and action[-1] < 0 and release_fails:
            self._take_over(j)
            return True
        if rule.patience:
            strays = action_gap(action, expert_action) > rule.threshold
            self.straying[j] = self.straying[j] + 1 if strays else 0
            if self.straying[j] >= rule.patience:
                self._take_over(j)
                return True
        return False

    def after_policy_step(
        self, j: int, steps_done: int, action: np.ndarray, expert_action: np.ndarray
    ) -> bool:
        """The policy executed `action` (the expert's was `expert_action`) and the episode goes on after
        `steps_done` steps; True when the expert drives from the next step (the window rule or the
        deadline)."""
        rule = self.rule
        if rule.window:
            self.gaps[j].append(action_gap(action, expert_action))
        if self._exhausted(j):
            return False
        strayed = (
            rule.window > 0
            and len(self.gaps[j]) == rule.window
            and float(np.mean(self.gaps[j])) > rule.threshold
        )
        late = rule.deadline > 0 and steps_done >= rule.deadline and not self.deadline_used[j]
        if not (strayed or late):
            return False
        self.deadline_used[j] |= late
        self._take_over(j)
        return True

    def _take_over(self, j: int) -> None:
        """Hand env j to the expert for `takeover_steps` steps; the straying counts start afresh after."""
        self.count[j] += 1
        self.expert_steps_left[j] = self.rule.takeover_steps
        self.straying[j] = 0
        self.gaps[j].clear()

    def after_expert_step(self, j: int) -> bool:
        """Count down a take-over by the step the expert is driving; True when control goes back to the
        policy from the next step."""
        self.expert_steps_left[j] -= 1
        return self.expert_steps_left[j] == 0
