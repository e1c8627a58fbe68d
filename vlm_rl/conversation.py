"""One conversation of a tool-using VLM, turn by turn: its prompt, the tokens a generation call gives
it, how a turn closes (an answer, a tool call whose crop becomes the next turn, or a limit), and how a
saved conversation is rebuilt. `vlm_rl.rollout` runs many of them together in waves.

Conversations are kept as token ids (`Segment`s) and are never re-tokenized: what the policy sampled
is exactly what it is trained on, with its log-probs at sampling time. Tool results (image or error
text) are tokens the model did not choose and are masked out of the loss.

A conversation ends with an answer (the assistant turn closes with ``<|im_end|>``), or cleanly at a
limit: `max_turns` (a tool call on the last allowed turn is not run), `max_images`, `max_tokens` (the
whole conversation) or `truncated` (a turn used `max_new_tokens` without closing). The reason is
recorded. Malformed tool calls never raise: the error text goes back to the model and is counted.

`tool_mode` turns the same model into the reference policies of an evaluation: "always" starts the
first turn with ``<tool_call>`` (a forced token, not trained), "never" forbids that token.

A turn may take several generation calls (paused after `segment_tokens`, to branch a tree or end a
step mid-turn); `sampled_turns` and `replay_conversation` save and rebuild an unfinished conversation
without pickling its images; `fork` copies one for a branch.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from PIL import Image

from mmrl.noise import NoiseKey
from mmrl.rewards import extract_answer
from vlm_rl.config import ToolMode, ToolRolloutConfig
from vlm_rl.data import Question, question_text
from vlm_rl.models import IM_END, TOOL_CALL_END, Generation, Segment, VLMAdapter
from vlm_rl.tools import CropSettings, ImageStore, ToolStats, first_tool_call

TOOL_CALL_START = "<tool_call>"
END_REASONS = ("answer", "max_turns", "max_images", "max_tokens", "truncated")
ENDINGS = ("", *END_REASONS)  # how a saved conversation ended, by code ("" while running)


class TurnGenerator(Protocol):
    """What generates one assistant turn for a batch of conversations: `VLMAdapter` (transformers)
    or `vlm_rl.vllm_engine.VLLMTurnGenerator`."""

    def generate_turn(
        self,
        sequences: Sequence[Segment],
        max_new_tokens: int,
        keys: Sequence[NoiseKey] | None = None,
        temperature: float = 1.0,
        stop_tokens: Sequence[str] = ...,
        banned_tokens: Sequence[str] = (),
        prefix_groups: Sequence[int] | None = None,
    ) -> Generation: ...


@dataclass
class Trajectory:
    """One conversation: its tokens, which of them the policy sampled, and what happened."""

    sequence: Segment
    loss_mask: list[bool]  # True at tokens the policy sampled (trained), False at prompt and observations
    old_log_probs: list[float]  # log-probs at sampling time (0 where loss_mask is False)
    options: Sequence[str]
    store: ImageStore
    turns: int = 0
    tool_stats: ToolStats = field(default_factory=ToolStats)
    answer_text: str = ""  # the text of the last assistant turn
    ended: str = ""  # one of END_REASONS; "" while running
    calls: int = 0  # generation calls so far (a paused turn takes several): the sampling key's node
    turn_ids: list[int] = field(default_factory=list)  # the open turn's sampled tokens (paused mid-turn)

    @property
    def used_tool(self) -> bool:
        """Whether the model saw a crop. A call that only got an error back does not count: the answer
        was made without the tool, and the adaptive reward's credit for trying the tool (a wrong answer
        with a zoom ranks above a wrong direct answer) must not be reachable by writing a broken call."""
        return self.tool_stats.successes > 0

    @property
    def generated_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def answer(self) -> str | None:
        """The option letter the conversation ends on (None without a readable answer)."""
        return extract_answer(self.answer_text, self.options) if self.ended == "answer" else None

    def append(self, segment: Segment, sampled: bool, log_probs: Sequence[float] | None = None) -> None:
        self.sequence = self.sequence + segment
        self.loss_mask += [sampled] * len(segment)
        self.old_log_probs += list(log_probs) if log_probs is not None else [0.0] * len(segment)


def prompt_segment(
    adapter: VLMAdapter, question: Question, system_prompt: str | None, image: Image.Image | None = None
) -> Segment:
    """The conversation's start: (system turn,) the user turn with the image and the question, the
    assistant header. Rollouts and demonstrations both begin with exactly these tokens."""
    text = question_text(question.question, question.options)
    return adapter.prompt_token_ids(text, image or question.image, system_prompt)


def start_conversations(
    adapter: VLMAdapter, questions: Sequence[Question], cfg: ToolRolloutConfig, tool_mode: ToolMode = "auto"
) -> list[Trajectory]:
    """One conversation per question, before its first turn: the prompt (and the forced tokens)."""
    settings = CropSettings(cfg.coordinate_space, cfg.crop_padding, cfg.crop_min_size)
    trajectories = []
    for q in questions:
        image = q.image
        prompt = prompt_segment(adapter, q, cfg.system_prompt, image)
        store = ImageStore(image, settings)
        trajectories.append(Trajectory(prompt, [False] * len(prompt), [0.0] * len(prompt), q.options, store))
    forced = forced_tokens(adapter, tool_mode)
    for trajectory in trajectories:
        trajectory.append(Segment(forced), sampled=False)  # the first turn starts with them
    return trajectories


def forced_tokens(adapter: VLMAdapter, tool_mode: ToolMode) -> list[int]:
    """The tokens the first turn starts with, not sampled: ``<tool_call>`` for "always"."""
    return adapter.token_ids_of([TOOL_CALL_START]) if tool_mode == "always" else []


def call_limit(trajectory: Trajectory, cfg: ToolRolloutConfig, segment_tokens: int = 0) -> int:
    """How many tokens a conversation may take from its next generation call: what is left of its turn
    (`max_new_tokens`) and of its conversation (`max_tokens`), at most `segment_tokens` (> 0) where
    turns pause. Each conversation keeps its own limits, whatever else shares its call."""
    limit = min(cfg.max_new_tokens - len(trajectory.turn_ids), cfg.max_tokens - len(trajectory.sequence))
    return min(limit, segment_tokens) if segment_tokens else limit


def take_generated(
    adapter: VLMAdapter,
    trajectory: Trajectory,
    out: Generation,
    row: int,
    count: int,
    cfg: ToolRolloutConfig,
    forced: list[int],
) -> list[float]:
    """Append row `row` of a generation call to its conversation, keeping the `count` tokens its
    `call_limit` allowed (a batched call runs as long as its longest row may), and close the turn as
    its end says: a stop token, the turn's limit (truncated), the conversation's (max_tokens), or
    neither (paused). Returns the kept tokens' log-probs."""
    ids, log_probs = out.token_ids[row][:count], out.log_probs[row][:count].tolist()
    stopped = out.stopped[row] and len(out.token_ids[row]) <= count
    cut = ""
    if len(trajectory.turn_ids) + len(ids) >= cfg.max_new_tokens:
        cut = "truncated"
    elif len(trajectory.sequence) + len(ids) >= cfg.max_tokens:
        cut = "max_tokens"
    trajectory.calls += 1
    extend_turn(adapter, trajectory, ids, log_probs, stopped, cut, cfg, forced)
    return log_probs


def extend_turn(
    adapter: VLMAdapter,
    trajectory: Trajectory,
    ids: list[int],
    log_probs: list[float],
    stopped: bool,
    cut: str,
    cfg: ToolRolloutConfig,
    forced: list[int],
) -> None:
    """Append sampled tokens to the open turn; a turn that stopped, or was `cut` at a limit without
    stopping ("truncated" or "max_tokens"; "" pauses it), closes: it ends the conversation with an
    answer or at the limit, or runs its tool call. `forced`: the unsampled tokens the turn started
    with."""
    trajectory.append(Segment(ids), sampled=True, log_probs=log_probs)
    trajectory.turn_ids += ids
    if not (stopped or cut):
        return  # paused: the next generation call continues this turn
    trajectory.answer_text = adapter.decode(forced + trajectory.turn_ids)
    trajectory.turns += 1
    trajectory.turn_ids = []
    tool_end, answer_end = adapter.token_ids_of([TOOL_CALL_END, IM_END])
    if not stopped:
        trajectory.ended = cut
    elif ids[-1] == answer_end:
        trajectory.ended = "answer"
    elif ids[-1] == tool_end:
        run_tool(adapter, trajectory, cfg)


def sampled_turns(trajectory: Trajectory) -> list[tuple[list[int], list[float]]]:
    """Each assistant turn's sampled tokens and their log-probs, in order (the last one may be open):
    the runs of trained tokens, which observations (or the end) always separate."""
    turns: list[tuple[list[int], list[float]]] = []
    previous = False
    for token, log_prob, sampled in zip(
        trajectory.sequence.token_ids, trajectory.old_log_probs, trajectory.loss_mask, strict=True
    ):
        if sampled and not previous:
            turns.append(([], []))
        if sampled:
            turns[-1][0].append(token)
            turns[-1][1].append(log_prob)
        previous = sampled
    return turns


def replay_conversation(
    adapter: VLMAdapter,
    question: Question,
    cfg: ToolRolloutConfig,
    turns: Sequence[tuple[Sequence[int], Sequence[float]]],
    ended: str,
    calls: int,
    tool_mode: ToolMode = "auto",
) -> Trajectory:
    """Rebuild a conversation from its `sampled_turns`, how it `ended` ("" while running) and its
    generation `calls`, by running its steps again: the prompt, each turn, the crop tool on each call.
    Its images come back from the question and the deterministic crops, never from a pickle. A
    conversation that does not replay to the same end (the rollout config changed) is a ValueError."""
    (trajectory,) = start_conversations(adapter, [question], cfg, tool_mode)
    forced = forced_tokens(adapter, tool_mode)
    stops = adapter.token_ids_of([TOOL_CALL_END, IM_END])
    for index, (ids, log_probs) in enumerate(turns):
        stopped = bool(ids) and ids[-1] in stops
        if trajectory.ended or not (stopped or index == len(turns) - 1):
            raise ValueError(f"turn {index} of a saved conversation cannot follow the turns before it")
        cut = (
            ended if not stopped and index == len(turns) - 1 and ended in ("truncated", "max_tokens") else ""
        )
        first = forced if trajectory.turns == 0 else []
        extend_turn(adapter, trajectory, list(ids), list(log_probs), stopped, cut, cfg, first)
    if not trajectory.ended and ended == "max_tokens":  # ended before a wave, at the token limit
        trajectory.ended = ended
    if trajectory.ended != ended:
        raise ValueError(
            f"a saved conversation that ended {ended or 'not yet'!r} replays to "
            f"{trajectory.ended or 'running'!r}: resume with the rollout settings it was generated with"
        )
    trajectory.calls = calls
    return trajectory


class SavedConversations:
    """Conversations as flat tensors (`TENSOR_KEYS`), for a trainer state: per conversation its
    generation calls, how it ended, its length and its `sampled_turns` (tokens, log-probs)."""

    TENSOR_KEYS = ("calls", "ended", "turns", "lengths", "turn_lengths", "token_ids", "log_probs")

    @staticmethod
    def state_dict(trajectories: Sequence[Trajectory]) -> dict[str, torch.Tensor]:
        turns = [sampled_turns(t) for t in trajectories]
        flat_turns = [turn for conversation in turns for turn in conversation]

        def longs(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long)

        return {
            "calls": longs([t.calls for t in trajectories]),
            "ended": longs([ENDINGS.index(t.ended) for t in trajectories]),
            "turns": longs([len(t) for t in turns]),
            "lengths": longs([len(t.sequence) for t in trajectories]),
            "turn_lengths": longs([len(ids) for ids, _ in flat_turns]),
            "token_ids": longs([token for ids, _ in flat_turns for token in ids]),
            # float64 holds any sampler's log-probs exactly (the transformers backend's are fp32)
            "log_probs": torch.tensor([lp for _, lps in flat_turns for lp in lps], dtype=torch.float64),
        }

    def __init__(self, state: dict[str, Any]) -> None:
        token_ids = split(state["token_ids"].tolist(), state["turn_lengths"].tolist())
        log_probs = split(state["log_probs"].tolist(), state["turn_lengths"].tolist())
        self.turns = split(list(zip(token_ids, log_probs, strict=True)), state["turns"].tolist())
        self.calls, self.ended, self.lengths = (state[k].tolist() for k in ("calls", "ended", "lengths"))

    def replay(self, adapter: VLMAdapter, question: Question, cfg: ToolRolloutConfig, c: int) -> Trajectory:
        """Conversation `c`, rebuilt by `replay_conversation`; one that replays to another length is a
        ValueError."""
        trajectory = replay_conversation(
            adapter, question, cfg, self.turns[c], ENDINGS[self.ended[c]], self.calls[c]
        )
        if len(trajectory.sequence) != self.lengths[c]:
            raise ValueError(
                f"a saved conversation of {self.lengths[c]} tokens replays to {len(trajectory.sequence)}: "
                "resume with the model and rollout settings it was generated with"
            )
        return trajectory


def split(values: list, lengths: list[int]) -> list[list]:
    """`values` cut into consecutive pieces of `lengths`."""
    pieces, start = [], 0
    for length in lengths:
        pieces.append(values[start : start + length])
        start += length
    return pieces


def run_tool(adapter: VLMAdapter, trajectory: Trajectory, cfg: ToolRolloutConfig) -> None:
    """Run the tool call that ends the last turn and append its result, or end at a limit."""
    if trajectory.turns >= cfg.max_turns:
        trajectory.ended = "max_turns"
        return
    if len(trajectory.store) >= cfg.max_images:
        trajectory.ended = "max_images"
        return
    call = first_tool_call(trajectory.answer_text)  # the turn ends with </tool_call>: never None
    sizes = [image.size for image in trajectory.sequence.images]  # as the model saw them
    observation = trajectory.store.crop(call, sizes)
    trajectory.tool_stats.record(observation)
    segment = adapter.observation_token_ids(observation.image if observation.ok else observation.text)
    if len(trajectory.sequence) + len(segment) > cfg.max_tokens:
        trajectory.ended = "max_tokens"
        return
    trajectory.append(segment, sampled=False)


def fork(trajectory: Trajectory) -> Trajectory:
    """A copy a branch can extend without touching its parent's (images are shared, never edited)."""
    store = copy.copy(trajectory.store)
    store.images, store.boxes = list(store.images), list(store.boxes)
    stats = trajectory.tool_stats
    return replace(
        trajectory,
        loss_mask=list(trajectory.loss_mask),
        old_log_probs=list(trajectory.old_log_probs),
        turn_ids=list(trajectory.turn_ids),
        store=store,
        tool_stats=ToolStats(stats.calls, stats.successes, Counter(stats.errors)),
    )
