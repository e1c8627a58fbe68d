"""The digit-reversal task and its model, shared by the tiny demo trainers (`tiny_grpo`, `tiny_sft`).

Prompt: ``<bos> d1 .. dK <sep>``; answer: the K digits reversed; reward: fraction of right digits. The
model is a small transformers Qwen2ForCausalLM, built from a config or loaded with ``from_pretrained``
from a directory `mmrl pretrain tiny_lm` wrote.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import Qwen2Config, Qwen2ForCausalLM

from mmrl.config import ConfigError, describe_saved_model, option, read_json_object
from mmrl.resources import check_memory
from mmrl.trainer import Trainer

DIGITS = 10
BOS, SEP = 10, 11
VOCAB = 12
MAX_PROMPT_DRAWS = 20_000_000  # random draws of the distinct-prompt loop beyond which a task is refused


@dataclass
class TinyModelConfig:
    path: str | None = option(None, "local directory saved with save_pretrained; null builds a new model")
    hidden_size: int = option(64, "width of the new model", min=8)
    layers: int = option(2, "transformer layers of the new model", min=1)
    heads: int = option(4, "attention heads of the new model", min=1)


@dataclass
class TinyTaskConfig:
    digits: int = option(4, "digits per prompt", min=1, max=16)
    train_prompts: int = option(4096, "training prompts", min=1)
    heldout_prompts: int = option(256, "held-out prompts for evaluation", min=1)
    data_seed: int = option(1234, "seed of the generated prompt set (fixed across runs)", min=0)


def check_task_size(task: TinyTaskConfig) -> None:
    """Refuse a prompt set that cannot exist, would take minutes to draw or cannot fit in memory:
    `make_prompts` draws distinct strings by rejection, so its loop grows without bound near the
    number of strings there are."""
    space = DIGITS**task.digits
    wanted = task.train_prompts + task.heldout_prompts
    if wanted > space:
        raise ConfigError(
            f"config error: task.train_prompts + task.heldout_prompts = {wanted} distinct prompts, but only "
            f"{space} strings of task.digits = {task.digits} digits exist: lower task.train_prompts or "
            "raise task.digits"
        )
    # tuples in a set and a list while drawing, then the tensor
    check_memory(
        wanted * (128 + 16 * task.digits),
        f"the prompt set of {wanted} prompts (task.train_prompts + task.heldout_prompts)",
        ["task.train_prompts", "task.heldout_prompts"],
    )
    free = space - task.heldout_prompts  # expected draws: space * (H(free) - H(free - n))
    draws = task.heldout_prompts + space * math.log1p(task.train_prompts / (free - task.train_prompts + 0.5))
    if draws > MAX_PROMPT_DRAWS:
        raise ConfigError(
            f"config error: drawing task.train_prompts = {task.train_prompts} distinct prompts of "
            f"task.digits = {task.digits} digits takes about {draws / 1e6:.0f} million random draws "
            f"(allowed: {MAX_PROMPT_DRAWS // 1_000_000} million, a few minutes): lower task.train_prompts"
            + (" or raise task.digits" if task.train_prompts > free / 2 else "")
        )


def make_prompts(n: int, digits: int, seed: int, exclude: set[tuple[int, ...]] | None = None) -> torch.Tensor:
    """`n` distinct digit strings from a fixed seed, none of them in `exclude`."""
    generator = torch.Generator().manual_seed(seed)
    seen = set(exclude or ())
    rows = []
    limit = DIGITS**digits - len(seen)
    if n > limit:
        raise ConfigError(
            f"config error: asked for {n} distinct prompts of {digits} digits; only {limit} exist"
        )
    while len(rows) < n:
        row = tuple(torch.randint(0, DIGITS, (digits,), generator=generator).tolist())
        if row not in seen:
            seen.add(row)
            rows.append(row)
    return torch.tensor(rows, dtype=torch.long)


def split_prompts(task: TinyTaskConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(held-out, training) prompts: fixed by `task.data_seed`, disjoint."""
    heldout = make_prompts(task.heldout_prompts, task.digits, task.data_seed)
    train = make_prompts(
        task.train_prompts, task.digits, task.data_seed + 1, exclude={tuple(r) for r in heldout.tolist()}
    )
    return heldout, train


def reversal_reward(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """Fraction of answer digits equal to the reversed prompt."""
    return (answers == prompts.flip(-1)).float().mean(-1)


def prompt_tokens(prompts: torch.Tensor) -> torch.Tensor:
    n = prompts.shape[0]
    return torch.cat([torch.full((n, 1), BOS), prompts, torch.full((n, 1), SEP)], dim=1)


def load_saved_model(path: str) -> Qwen2ForCausalLM:
    """The digit-reversal model saved at `path` (model.path); any other directory is a ConfigError that
    says what it holds. The kind is checked before loading: from another model's config transformers
    builds a default Qwen2 of billions of parameters, and weights the file lacks it starts at random."""
    directory = Path(path)
    fix = (
        "give the model/ folder that `mmrl pretrain tiny_lm` writes (runs/pretrain/tiny_lm/model), or "
        "model.path=null for an untrained model"
    )
    if not (directory / "config.json").is_file():
        raise ConfigError(f"config error: model.path = {path!r} has no config.json: {fix}")
    try:
        saved = read_json_object(directory / "config.json", fix)
    except ConfigError as err:
        raise ConfigError(f"config error: model.path = {path!r}: {err}") from None
    if saved.get("model_type") != "qwen2" or saved.get("vocab_size") != VOCAB:
        if saved.get("model_type") == "qwen2":
            found = f"a qwen2 model with vocab_size {saved.get('vocab_size')!r}"
        else:
            found = describe_saved_model(saved)
        raise ConfigError(
            f"config error: model.path = {path!r} holds {found}, but tiny_grpo and tiny_sft need the "
            f"digit-reversal Qwen2ForCausalLM (model_type 'qwen2', vocab_size {VOCAB}): {fix}"
        )
    try:
        model, info = Qwen2ForCausalLM.from_pretrained(directory, output_loading_info=True)
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as err:
        reason = " ".join(str(err).split())
        raise ConfigError(
            f"config error: model.path = {path!r}: its qwen2 model does not load ({reason}): {fix}"
        ) from None
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise ConfigError(
            f"config error: model.path = {path!r}: its weights lack {len(missing)} of the model's tensors "
            f"(e.g. {missing[0]!r}), so they were saved from another model: {fix}"
        )
    return model


def build_model(config: TinyModelConfig, digits: int) -> Qwen2ForCausalLM:
    if config.path:
        return load_saved_model(config.path)
    if config.hidden_size % config.heads:
        raise ConfigError(
            f"config error: model.hidden_size = {config.hidden_size} must be divisible by "
            f"model.heads = {config.heads}"
        )
    qwen = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=config.hidden_size,
        intermediate_size=2 * config.hidden_size,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        num_key_value_heads=config.heads,
        max_position_embeddings=2 * digits + 2,
        tie_word_embeddings=True,
        bos_token_id=BOS,
        eos_token_id=SEP,
        pad_token_id=SEP,
    )
    return Qwen2ForCausalLM(qwen)


def answer_logprobs(
    model: torch.nn.Module, prompts: torch.Tensor, answers: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Per-token log-probs [N, K] of `answers` given `prompts` (one teacher-forced forward).

    Answers are digits, so the distribution is over the digit tokens only."""
    tokens = torch.cat([prompt_tokens(prompts), answers], dim=1)
    k = answers.shape[1]
    logits = model(input_ids=tokens).logits[:, -k - 1 : -1, :DIGITS].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, answers.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def greedy_answers(model: torch.nn.Module, prompts: torch.Tensor) -> torch.Tensor:
    tokens = prompt_tokens(prompts)
    for _ in range(prompts.shape[1]):
        next_token = model(input_ids=tokens).logits[:, -1, :DIGITS].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, next_token], dim=1)
    return tokens[:, -prompts.shape[1] :]


def heldout_metrics(model: torch.nn.Module, prompts: torch.Tensor) -> dict[str, float]:
    answers = greedy_answers(model, prompts)
    reward = reversal_reward(prompts, answers)
    return {"heldout_reward": reward.mean().item(), "heldout_exact": (reward == 1).float().mean().item()}


class DigitReversalTrainer(Trainer):
    """What the demo trainers share: the fixed prompt sets, the model of ``model`` (built or loaded) and
    the greedy held-out evaluation. A subclass prepares its training of the model in `setup_training`."""

    heldout: torch.Tensor
    train_prompts: torch.Tensor

    def setup(self) -> None:
        cfg = self.config
        self.heldout, self.train_prompts = split_prompts(cfg.task)
        self.setup_training(build_model(cfg.model, cfg.task.digits))

    def setup_training(self, model: Qwen2ForCausalLM) -> None:
        """Check sizes, build the optimizer (`prepare_model_and_optimizer`) and what a step needs."""
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        return heldout_metrics(self.accelerator.unwrap_model(self.model), self.heldout)
