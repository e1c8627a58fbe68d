"""Batched multi-turn rollouts with a crop tool: generate until a tool call or an answer, run the tool,
show its result as a new turn, go on.

Every active conversation of a batch generates together (left-padded, KV cache within a turn; the
conversation is prefilled again at the next turn, after the tool's image was appended). Conversations
are kept as token ids (`Segment`s) and are never re-tokenized: what the policy sampled is exactly what
it is trained on, with its log-probs at sampling time. Tool results (image or error text) are tokens
the model did not choose and are masked out of the loss.

A rollout ends with an answer (the assistant turn closes with ``<|im_end|>``), or cleanly at a limit:
`max_turns` (a tool call on the last allowed turn is not run), `max_images`, `max_tokens` (the whole
conversation) or `truncated` (a turn used `max_new_tokens` without closing). The reason is recorded.
Malformed tool calls never raise: the error text goes back to the model and is counted.

`tool_mode` turns the same model into the reference policies of an evaluation: "always" starts the
first turn with ``<tool_call>`` (a forced token, not trained), "never" forbids that token.

A rollout can stop early and go on later (partial rollouts, `vlm_rl.partial_rollout`):
`continue_rollout` takes conversations already started and stops after a wave when told enough is
done, at a turn boundary or, with `segment_tokens`, mid-turn; `sampled_turns` and
`replay_conversation` save and rebuild an unfinished conversation without pickling its images.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, get_args

import torch
from PIL import Image

from mmrl.config import ConfigError, option
from mmrl.noise import NoiseKey
from mmrl.rewards import extract_answer
from vlm_rl.data import Question, question_text
from vlm_rl.models import IM_END, TOOL_CALL_END, Generation, Segment, VLMAdapter
from vlm_rl.tools import CropSettings, ImageStore, ToolStats, first_tool_call

TOOL_CALL_START = "<tool_call>"
ToolMode = Literal["auto", "always", "never"]
TOOL_MODES = get_args(ToolMode)
END_REASONS = ("answer", "max_turns", "max_images", "max_tokens", "truncated")


@dataclass
class TreeRolloutConfig:
    enabled: bool = option(
        False, "a question's group is a tree: branches continue from their shared prefix (TreePO-style)"
    )
    branching: list[int] = option(
        [4, 2],
        "children per branch point by depth: the prompt's first, then each later split (1 past the end); a "
        "finished branch hands its unused leaves back to its parent, so groups keep train.group_size leaves",
        min=1,
    )
    segment_tokens: int = option(
        0, "also split a turn after this many generated tokens (0: split only at turn boundaries)", min=0
    )


@dataclass
class PartialRolloutConfig:
    enabled: bool = option(
        False,
        "APRIL-style: launch more groups than a step trains, end the step once enough groups finished, "
        "carry the unfinished conversations into the next step",
    )
    over_provision: float = option(
        0.5, "extra groups launched, as a fraction of train.questions_per_step", min=0.0
    )
    max_staleness: int = option(
        2,
        "a carried conversation whose first token is more than this many policy versions old is dropped "
        "(counted) and its question relaunched",
        min=0,
    )
    segment_tokens: int = option(
        0,
        "also pause a turn after this many generated tokens, so a step can end mid-turn once enough groups "
        "are complete (0: steps end at turn boundaries; each pause prefills the conversation again)",
        min=0,
    )


@dataclass
class ToolRolloutConfig:
    max_turns: int = option(3, "assistant turns per rollout: tool calls plus the answer", min=1)
    max_new_tokens: int = option(48, "tokens one assistant turn may generate", min=1)
    max_tokens: int = option(1024, "tokens a whole conversation may hold (prompt and images included)", min=8)
    max_images: int = option(3, "images a conversation may hold, the original included", min=1)
    temperature: float = option(1.0, "sampling temperature", min=1e-3)
    coordinate_space: Literal["auto", "normalized", "pixels", "resized"] = option(
        "auto", "how the model writes boxes: [0,1] fractions, pixels, pixels of the resized view, or auto"
    )
    crop_padding: float = option(0.0, "fraction of a box's size added on each side of a crop", min=0.0)
    crop_min_size: int = option(28, "smallest crop side in original pixels (smaller boxes grow)", min=1)
    system_prompt: str | None = option(None, "system turn explaining the tool (real models need one)")
    backend: Literal["transformers", "vllm"] = option(
        "transformers", "what generates the turns: the policy's transformers model, or vLLM (optional)"
    )
    vllm_kv_cache_gib: float | None = option(
        2.0,
        "memory vLLM keeps for its key/value cache, GiB (backend vllm; on GPU and on CPU); null with "
        "vllm_gpu_memory_fraction",
        min=0.01,
    )
    vllm_gpu_memory_fraction: float | None = option(
        None,
        "share of the GPU's memory vLLM may take for its weights and key/value cache (its "
        "gpu_memory_utilization), the rest left to training; replaces vllm_kv_cache_gib (set that to null)",
        min=0.01,
        max=1.0,
    )
    vllm_sleep: bool = option(
        False,
        "free vLLM's GPU memory (weights and key/value cache) while the policy updates, and wake it with "
        "the new weights before the next rollouts (vLLM's sleep mode; a CUDA GPU only)",
    )
    tree: TreeRolloutConfig = field(default_factory=TreeRolloutConfig)
    partial: PartialRolloutConfig = field(default_factory=PartialRolloutConfig)

    def __post_init__(self) -> None:
        if (self.vllm_kv_cache_gib is None) == (self.vllm_gpu_memory_fraction is None):
            raise ConfigError(
                f"config error: rollout.vllm_kv_cache_gib = {self.vllm_kv_cache_gib} and "
                f"rollout.vllm_gpu_memory_fraction = {self.vllm_gpu_memory_fraction}: give exactly one "
                "(the key/value cache in GiB, or vLLM's share of the GPU) and set the other to null"
            )


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


@torch.no_grad()
def rollout(
    adapter: VLMAdapter,
    questions: Sequence[Question],
    cfg: ToolRolloutConfig,
    keys: Sequence[NoiseKey] | None,
    tool_mode: ToolMode = "auto",
    engine: TurnGenerator | None = None,
) -> list[Trajectory]:
    """One conversation per question (repeat a question for a group). `keys[i]` keys the sampling
    noise of conversation i (its turn goes in the key's `node`); None decodes greedily. `engine`
    generates the turns (default: the adapter's transformers model; or a `VLLMTurnGenerator`)."""
    trajectories = start_conversations(adapter, questions, cfg, tool_mode)
    continue_rollout(adapter, trajectories, cfg, keys, tool_mode, engine)
    return trajectories


@torch.no_grad()
def continue_rollout(
    adapter: VLMAdapter,
    trajectories: Sequence[Trajectory],
    cfg: ToolRolloutConfig,
    keys: Sequence[NoiseKey] | None,
    tool_mode: ToolMode = "auto",
    engine: TurnGenerator | None = None,
    segment_tokens: int = 0,
    enough: Callable[[], bool] | None = None,
) -> None:
    """Generate the unfinished conversations on, in place, in waves: each wave is one generation call
    for every unfinished conversation.

    `keys[i]` keys conversation i; the number of generation calls it has had so far goes in the key's
    `node`, so a conversation continued later (partial rollouts) never reuses the noise of a token it
    already sampled, and one that runs in one piece is keyed by its turns as `rollout` keys it.
    `enough`, asked after every wave, ends the rollout early (every unfinished conversation has had a
    wave, so one launched for this call samples its first token in it); `segment_tokens` > 0 pauses a
    turn after that many tokens (the next wave continues it), so that it can end mid-turn. The
    conversations it leaves unfinished can be continued by a later call."""
    banned = [TOOL_CALL_START] if tool_mode == "never" else []
    forced = forced_tokens(adapter, tool_mode)
    active = [i for i, t in enumerate(trajectories) if not t.ended]
    while active:
        for i in active:  # rows at the token limit end; the others go on
            if len(trajectories[i].sequence) >= cfg.max_tokens:
                trajectories[i].ended = "max_tokens"
        active = [i for i in active if not trajectories[i].ended]
        if not active:
            break
        counts = [call_limit(trajectories[i], cfg, segment_tokens) for i in active]
        turn_keys = None
        if keys is not None:
            turn_keys = [
                NoiseKey(k.seed, k.step, k.prompt, trajectories[i].calls)
                for i, k in ((i, keys[i]) for i in active)
            ]
        out = (engine or adapter).generate_turn(
            [trajectories[i].sequence for i in active],
            max(counts),
            keys=turn_keys,
            temperature=cfg.temperature,
            banned_tokens=banned,
        )
        for row, i in enumerate(active):
            trajectory = trajectories[i]
            take_generated(
                adapter, trajectory, out, row, counts[row], cfg, forced if trajectory.turns == 0 else []
            )
        active = [i for i in active if not trajectories[i].ended]
        if enough is not None and enough():
            break


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


def rollout_metrics(trajectories: Sequence[Trajectory], correct: Sequence[bool]) -> dict[str, float]:
    """Accuracy, tool use and its errors, accuracy with and without tools, tokens per answer, endings."""
    n = len(trajectories)
    used = [t.used_tool for t in trajectories]
    with_tool = [c for c, u in zip(correct, used, strict=True) if u]
    without = [c for c, u in zip(correct, used, strict=True) if not u]
    metrics = {
        "accuracy": sum(correct) / max(n, 1),
        "tool_ratio": sum(used) / max(n, 1),
        "accuracy_with_tool": sum(with_tool) / len(with_tool) if with_tool else float("nan"),
        "accuracy_without_tool": sum(without) / len(without) if without else float("nan"),
        "tokens_per_answer": sum(t.generated_tokens for t in trajectories) / max(n, 1),
        "turns": sum(t.turns for t in trajectories) / max(n, 1),
    }
    metrics |= sum((t.tool_stats for t in trajectories), ToolStats()).as_metrics()
    metrics |= {
        f"ended_{reason}": sum(t.ended == reason for t in trajectories) / max(n, 1) for reason in END_REASONS
    }
    return metrics


def metrics_by_kind(
    trajectories: Sequence[Trajectory], correct: Sequence[bool], kinds: Sequence[str]
) -> dict[str, float]:
    """``accuracy_{kind}`` and ``tool_ratio_{kind}`` for each question kind present (the synthetic
    task's global / detail): whether the policy zooms where a zoom is needed shows only per kind."""
    metrics = {}
    for kind in sorted(set(kinds) - {""}):
        rows = [i for i, k in enumerate(kinds) if k == kind]
        part = rollout_metrics([trajectories[i] for i in rows], [correct[i] for i in rows])
        metrics |= {f"accuracy_{kind}": part["accuracy"], f"tool_ratio_{kind}": part["tool_ratio"]}
    return metrics
