"""Replay buffer for online fine-tuning that keeps three kinds of data apart, because HABC credits them
differently:

- "policy": segments the policy executed, with their episode's final outcome (critics and actor learn
  from these, weighted by the outcome);
- "intervention": segments the expert executed after taking over (demonstrations for the actor, never
  credited with the outcome of an episode the policy had put in trouble);
- "failure": whole failed episodes, both kinds of step, flagged per step (for relabelling and analysis).

An episode is split into maximal runs of policy or expert steps; a failed episode is also kept whole,
so its steps appear in two kinds. Each kind holds at most `capacity[kind]` transitions and evicts its
oldest segments first. A segment stores one more observation than actions (the observation after its
last action), so s' needs no second copy of the observations.
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

from vla_rl.lerobot_format import ACTION_KEY, DatasetWriter

KINDS = ("policy", "intervention", "failure")
FIELDS = ("action", "reward", "is_intervention", "chunk_step")  # per-step arrays of a Segment, saved as such


@dataclass
class Segment:
    """Consecutive steps start .. start+length-1 of one episode."""

    episode: int  # buffer-wide episode id
    start: int
    task: str
    outcome: bool  # the episode's final success
    done: bool  # the segment's last step ended the episode by termination (no bootstrapping from s')
    obs: dict[str, np.ndarray]  # length + 1 rows
    action: np.ndarray  # (length, action_dim)
    reward: np.ndarray  # (length,) float32
    is_intervention: np.ndarray  # (length,) bool
    # (length,) int64: the step's index in the action chunk it was executed from (0 where the policy
    # sampled the chunk); -1 for expert steps, whose actions are a function of their own state
    chunk_step: np.ndarray

    @property
    def length(self) -> int:
        return len(self.action)

    def slice(self, lo: int, hi: int, done: bool) -> Segment:
        """Steps lo .. hi-1 of this segment (with the observation after step hi-1)."""
        return Segment(
            self.episode,
            self.start + lo,
            self.task,
            self.outcome,
            done,
            {k: v[lo : hi + 1] for k, v in self.obs.items()},
            self.action[lo:hi],
            self.reward[lo:hi],
            self.is_intervention[lo:hi],
            self.chunk_step[lo:hi],
        )


def _runs(flags: np.ndarray) -> list[tuple[int, int]]:
    """[lo, hi) ranges over which `flags` is constant."""
    edges = [0, *(np.flatnonzero(flags[1:] != flags[:-1]) + 1).tolist(), len(flags)]
    return list(zip(edges[:-1], edges[1:], strict=True))


def _split(batch_size: int, mix: Mapping[str, float]) -> dict[str, int]:
    """How many of a batch each kind gets: proportional to `mix`, remainders to the largest fractions
    (fixed counts rather than random ones, so a batch's make-up does not vary)."""
    unknown = set(mix) - set(KINDS)
    if unknown or any(w < 0 for w in mix.values()) or sum(mix.values()) <= 0:
        raise ValueError(f"mix {dict(mix)}: weights must be >= 0 with a positive sum, over the kinds {KINDS}")
    total = sum(mix.values())
    exact = {k: batch_size * w / total for k, w in mix.items()}
    counts = {k: int(v) for k, v in exact.items()}
    for k in sorted(exact, key=lambda k: counts[k] - exact[k])[: batch_size - sum(counts.values())]:
        counts[k] += 1
    return counts


class ReplayBuffer:
    """FIFO stores of segments, one per kind (see the module docstring), sampled as transitions."""

    def __init__(self, capacity: int | Mapping[str, int]) -> None:
        self.capacity = dict.fromkeys(KINDS, capacity) if isinstance(capacity, int) else dict(capacity)
        if set(self.capacity) != set(KINDS) or min(self.capacity.values()) < 1:
            raise ValueError(f"capacity {capacity}: one positive number of transitions for each of {KINDS}")
        self.segments: dict[str, deque[Segment]] = {kind: deque() for kind in KINDS}
        self._sizes = dict.fromkeys(KINDS, 0)
        self.next_episode = 0

    def sizes(self) -> dict[str, int]:
        """Transitions held per kind."""
        return dict(self._sizes)

    def add_episode(
        self,
        obs: Mapping[str, np.ndarray],
        action: np.ndarray,
        success: bool,
        task: str,
        is_intervention: np.ndarray | None = None,
        reward: np.ndarray | None = None,
        terminated: bool | None = None,
        chunk_step: np.ndarray | None = None,
    ) -> int:
        """Store an episode of T steps and return its id.

        `obs` holds T + 1 observations per key (the last one after the final action), named like the
        dataset features ("observation.state", "observation.image" as uint8 (H, W, C)); `action` is (T, A).
        `reward` defaults to 0 per step and `success` at the last one; `terminated` (whether the last
        step ended the episode rather than a time limit) defaults to `success`. `chunk_step` (T,) is each
        policy step's index in the action chunk it came from (0 where the chunk was sampled; -1 on expert
        steps); it defaults to 0 on every policy step (a policy that decides every step).
        """
        action = np.array(action, dtype=np.float32)  # copies: the caller may reuse its arrays
        steps = len(action)
        obs = {k: np.array(v) for k, v in obs.items()}
        wrong = {k: len(v) for k, v in obs.items() if len(v) != steps + 1}
        if steps == 0 or wrong:
            raise ValueError(
                f"an episode of {steps} actions needs {steps + 1} observations per key; got {wrong}"
            )
        flags = np.zeros(steps, bool) if is_intervention is None else np.array(is_intervention, bool)
        if reward is None:
            reward = np.zeros(steps, np.float32)
            reward[-1] = float(success)
        if chunk_step is None:
            chunk_step = np.where(flags, -1, 0)
        chunk_step = np.array(chunk_step, np.int64)
        if flags.shape != (steps,) or np.shape(reward) != (steps,) or chunk_step.shape != (steps,):
            raise ValueError(f"is_intervention, reward and chunk_step need one value per step ({steps})")
        terminated = bool(success) if terminated is None else bool(terminated)
        episode = self.next_episode
        self.next_episode += 1
        whole = Segment(
            episode,
            0,
            task,
            bool(success),
            terminated,
            obs,
            action,
            np.array(reward, np.float32),
            flags,
            chunk_step,
        )
        for lo, hi in _runs(flags):
            self._push(
                "intervention" if flags[lo] else "policy", whole.slice(lo, hi, terminated and hi == steps)
            )
        if not success:
            self._push("failure", whole)
        return episode

    def _push(self, kind: str, segment: Segment) -> None:
        store = self.segments[kind]
        store.append(segment)
        self._sizes[kind] += segment.length
        while self._sizes[kind] > self.capacity[kind]:
            self._sizes[kind] -= store.popleft().length

    def sample(self, batch_size: int, mix: Mapping[str, float], generator: torch.Generator) -> dict[str, Any]:
        """A batch of transitions, `mix` giving each kind's share (e.g. {"policy": 3, "intervention": 1}).

        Returns "obs" and "next_obs" (dicts of tensors; images uint8 (B, C, H, W)), "action", "reward",
        "done", "outcome" (the episode's success as 0/1), "is_intervention", "episode" (buffer episode
        id), "kind" (index into KINDS) and "task" (list of instructions), kinds in KINDS order. The
        outcome comes with every transition; HABC credits it only where is_intervention is False. Draws
        come only from `generator`, so a seeded generator gives the same batch.
        """
        picks: list[tuple[int, Segment, int]] = []
        for kind, count in _split(batch_size, mix).items():
            if count == 0:
                continue
            store = self.segments[kind]
            if not store:
                raise ValueError(
                    f"the mix asks for {kind!r} transitions but the buffer has none ({self.sizes()})"
                )
            ends = np.cumsum([s.length for s in store])
            for index in torch.randint(int(ends[-1]), (count,), generator=generator).tolist():
                at = int(np.searchsorted(ends, index, side="right"))
                picks.append((KINDS.index(kind), store[at], index - int(ends[at]) + store[at].length))
        picks.sort(key=lambda p: p[0])

        def stack(rows: list[np.ndarray]) -> torch.Tensor:
            batch = torch.from_numpy(np.stack(rows))
            return batch.permute(0, 3, 1, 2) if batch.dtype == torch.uint8 and batch.ndim == 4 else batch

        keys = picks[0][1].obs.keys() if picks else ()
        return {
            "obs": {k: stack([s.obs[k][t] for _, s, t in picks]) for k in keys},
            "next_obs": {k: stack([s.obs[k][t + 1] for _, s, t in picks]) for k in keys},
            "action": stack([s.action[t] for _, s, t in picks]),
            "reward": torch.tensor([s.reward[t] for _, s, t in picks], dtype=torch.float32),
            "done": torch.tensor([s.done and t == s.length - 1 for _, s, t in picks]),
            "outcome": torch.tensor([float(s.outcome) for _, s, t in picks]),
            "is_intervention": torch.tensor([bool(s.is_intervention[t]) for _, s, t in picks]),
            "episode": torch.tensor([s.episode for _, s, t in picks], dtype=torch.int64),
            "kind": torch.tensor([k for k, _, _ in picks], dtype=torch.int64),
            "task": [s.task for _, s, _ in picks],
        }

    def save(self, directory: str | Path) -> None:
        """Write buffer.safetensors (each kind's arrays, segments concatenated) and buffer.json (the rest),
        each through a temporary file, so that a resumed run continues with exactly this buffer."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, np.ndarray] = {}
        meta: dict[str, Any] = {"capacity": self.capacity, "next_episode": self.next_episode, "kinds": {}}
        for kind, store in self.segments.items():
            if not store:
                continue
            obs_keys = list(store[0].obs)
            for key in obs_keys:
                tensors[f"{kind}/obs/{key}"] = np.concatenate([s.obs[key] for s in store])
            for field in FIELDS:
                tensors[f"{kind}/{field}"] = np.concatenate([getattr(s, field) for s in store])
            meta["kinds"][kind] = {
                "obs_keys": obs_keys,
                "segments": [
                    {
                        "episode": s.episode,
                        "start": s.start,
                        "task": s.task,
                        "outcome": s.outcome,
                        "done": s.done,
                        "length": s.length,
                    }
                    for s in store
                ],
            }
        save_file(tensors, str(directory / "buffer.safetensors.tmp"))
        os.replace(directory / "buffer.safetensors.tmp", directory / "buffer.safetensors")
        (directory / "buffer.json.tmp").write_text(json.dumps(meta))
        os.replace(directory / "buffer.json.tmp", directory / "buffer.json")

    @classmethod
    def load(cls, directory: str | Path) -> ReplayBuffer:
        """The buffer `save` wrote to `directory`."""
        directory = Path(directory)
        for name in ("buffer.json", "buffer.safetensors"):
            if not (directory / name).is_file():
                raise FileNotFoundError(f"replay buffer file {directory / name} is missing")
        meta = json.loads((directory / "buffer.json").read_text())
        tensors = load_file(str(directory / "buffer.safetensors"))
        buffer = cls(meta["capacity"])
        buffer.next_episode = meta["next_episode"]
        for kind, saved in meta["kinds"].items():
            obs_at = act_at = 0
            for s in saved["segments"]:
                n = s["length"]
                obs = {
                    k: tensors[f"{kind}/obs/{k}"][obs_at : obs_at + n + 1].copy() for k in saved["obs_keys"]
                }
                rest = [tensors[f"{kind}/{f}"][act_at : act_at + n].copy() for f in FIELDS]
                buffer._push(
                    kind, Segment(s["episode"], s["start"], s["task"], s["outcome"], s["done"], obs, *rest)
                )
                obs_at, act_at = obs_at + n + 1, act_at + n
        return buffer

    def export(self, writer: DatasetWriter) -> int:
        """Write the stored episodes to a dataset and return how many were written.

        A failed episode is written whole; others are put back together from their policy and
        intervention segments; what eviction broke apart is written as separate pieces. The writer's
        features must be the observation keys plus "action". Frames the expert did not execute are
        marked policy_executed.
        """
        pieces: dict[int, list[Segment]] = {}
        for kind in ("policy", "intervention"):
            for s in self.segments[kind]:
                pieces.setdefault(s.episode, []).append(s)
        for s in self.segments["failure"]:
            pieces[s.episode] = [s]
        written = 0
        for episode in sorted(pieces):
            run: list[Segment] = []
            for s in [*sorted(pieces[episode], key=lambda s: s.start), None]:
                if run and (s is None or s.start != run[-1].start + run[-1].length):
                    self._write_run(writer, run)
                    written, run = written + 1, []
                if s is not None:
                    run.append(s)
        return written

    @staticmethod
    def _write_run(writer: DatasetWriter, run: list[Segment]) -> None:
        for s in run:
            for t in range(s.length):
                frame = {k: v[t] for k, v in s.obs.items()} | {ACTION_KEY: s.action[t]}
                expert = bool(s.is_intervention[t])
                writer.add_frame(frame, is_intervention=expert, policy_executed=not expert)
        writer.save_episode(run[0].task, success=run[0].outcome, source="policy")
