"""Tiny end-to-end GRPO of the shared core: a 2-layer Qwen2 learns to reverse digit strings.

The task is small enough to train on a laptop CPU in about a minute, yet it goes through every
shared piece a real trainer uses: a transformers model (built from a config, or loaded with
``from_pretrained`` from a local directory), a sampler picking prompts, rollouts as trees whose
every random draw is keyed noise (a flat GRPO group is a tree of depth 1; ``rollout.split_positions``
branches at several tokens as in BranchGRPO), rewards, a registered advantage estimator, PPO-clip,
optional KL to the frozen start model, Accelerate (DDP across processes) and exact resume.

Prompt: ``<bos> d1 .. dK <sep>``; answer: the K digits reversed; reward: fraction of right digits.
``tiny_sft`` (``mmrl pretrain tiny_lm``) fits the same model to noisy demonstrations so that RL can
start from a model that already does something.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from transformers import Qwen2Config, Qwen2ForCausalLM

from mmrl.advantages import check_group_size
from mmrl.config import BaseConfig, ConfigError, describe_saved_model, option, read_json_object
from mmrl.losses import kl_to_reference, ppo_clip
from mmrl.noise import NoiseKey, keyed_rand_batch
from mmrl.registry import ADVANTAGES, SAMPLERS, TRAINERS
from mmrl.resources import ACTIVATION_FLOATS, check_enough_prompts, check_memory
from mmrl.trainer import Trainer
from mmrl.tree import RolloutTree, depthwise_node_advantages

DIGITS = 10
BOS, SEP = 10, 11
VOCAB = 12
MAX_PROMPT_DRAWS = 20_000_000  # random draws of the distinct-prompt loop: about two minutes


# ---------------------------------------------------------------------------------------------
# Config


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


@dataclass
class TinyRolloutConfig:
    prompts_per_step: int = option(8, "prompts per step on each process", min=1)
    split_positions: list[int] = option(
        [0], "answer positions where every node branches (flat GRPO: [0])", min=0
    )
    branch_factor: int = option(
        16,
        "children per node at each split (flat GRPO: the group size)",
        min=2,
        max=1024,
        why="groups hold 4 to 256",
    )
    temperature: float = option(1.0, "sampling temperature", min=1e-3)


@dataclass
class TinyGRPOTrainConfig:
    lr: float = option(1e-3, "AdamW learning rate", min=0.0)
    warmup_steps: int = option(0, "linear learning-rate warm-up steps", min=0)
    weight_decay: float = option(0.0, "AdamW weight decay", min=0.0)
    advantage: str = option(
        "grpo",
        "advantage estimator: a group one (flat rollouts) or tree_depthwise (any rollouts)",
        registry="advantage",
        kinds=("group", "tree"),
    )
    sampler: str = option("uniform", "prompt sampler", registry="sampler")
    ppo_epochs: int = option(2, "optimisation passes over each batch of rollouts", min=1)
    clip_low: float = option(0.2, "PPO ratio clip below 1", min=0.0, max=1.0)
    clip_high: float = option(0.28, "PPO ratio clip above 1", min=0.0)
    adv_clip: float = option(5.0, "advantages clipped to [-adv_clip, adv_clip]", min=0.0)
    kl_coef: float = option(0.0, "weight of the k3 KL to the frozen start model", min=0.0)
    max_grad_norm: float = option(1.0, "gradient clipping norm", min=0.0)
    nan_patience: int = option(3, "non-finite losses or gradients in a row before the run stops", min=1)


@dataclass
class TinyGRPOConfig(BaseConfig):
    trainer: str = option("tiny_grpo", "trainer name", registry="trainer")
    model: TinyModelConfig = dataclasses.field(default_factory=TinyModelConfig)
    task: TinyTaskConfig = dataclasses.field(default_factory=TinyTaskConfig)
    rollout: TinyRolloutConfig = dataclasses.field(default_factory=TinyRolloutConfig)
    train: TinyGRPOTrainConfig = dataclasses.field(default_factory=TinyGRPOTrainConfig)

    def __post_init__(self) -> None:
        bad = [p for p in self.rollout.split_positions if p >= self.task.digits]
        if (
            bad
            or sorted(set(self.rollout.split_positions)) != list(self.rollout.split_positions)
            or not self.rollout.split_positions
            or self.rollout.split_positions[0] != 0
        ):
            raise ConfigError(
                f"config error: rollout.split_positions = {self.rollout.split_positions} must be increasing, "
                f"start at 0 and stay below task.digits = {self.task.digits}"
            )
        if len(self.rollout.split_positions) == 1:
            check_group_size(self.train.advantage, self.rollout.branch_factor, "rollout.branch_factor")
        elif self.train.advantage != "tree_depthwise":
            raise ConfigError(
                f"config error: train.advantage = {self.train.advantage!r} scores leaves only, but "
                f"rollout.split_positions = {self.rollout.split_positions} builds trees whose shared edges "
                "need node advantages: use train.advantage=tree_depthwise, or split_positions=[0]"
            )
        check_task_size(self.task)


# ---------------------------------------------------------------------------------------------
# Task and model


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


def check_rollout_size(cfg: TinyGRPOConfig, model: Qwen2Config, processes: int, device: torch.device) -> None:
    """Refuse a step that would draw a prompt twice, or whose rollout trees and training forward
    cannot fit on `device`; run before the first rollout."""
    r = cfg.rollout
    check_enough_prompts(
        "rollout.prompts_per_step",
        r.prompts_per_step,
        processes,
        cfg.task.train_prompts,
        f"task.train_prompts = {cfg.task.train_prompts}",
        "lower rollout.prompts_per_step or raise task.train_prompts",
    )
    leaves = r.prompts_per_step * r.branch_factor ** len(r.split_positions)
    tokens = 2 * cfg.task.digits + 2
    check_memory(
        leaves * tokens * 4 * ACTIVATION_FLOATS * model.hidden_size * model.num_hidden_layers,
        f"a rollout batch of {r.prompts_per_step} prompts x {leaves // r.prompts_per_step} leaves "
        "(rollout.prompts_per_step x rollout.branch_factor^len(rollout.split_positions))",
        ["rollout.prompts_per_step", "rollout.branch_factor"],
        device,
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


# ---------------------------------------------------------------------------------------------
# Rollouts: keyed-noise sampling into trees


@torch.no_grad()
def sample_trees(
    model: torch.nn.Module,
    prompts: torch.Tensor,
    prompt_ids: list[int],
    rollout: TinyRolloutConfig,
    seed: int,
    step: int,
) -> list[RolloutTree]:
    """One tree per prompt: every node branches `branch_factor` ways at each split position.

    Token p of the node `n` of prompt `i` is drawn by Gumbel-max with uniform noise keyed by
    (seed, step, prompt id i, node n, stream p), so any node can be regenerated alone later.
    """
    k = prompts.shape[1]
    trees = [RolloutTree(root_state={"tokens": []}) for _ in prompt_ids]
    # frontier rows: (tree index, node id, tokens so far, log-probs so far on this node's edge)
    rows = [(t, 0) for t in range(len(trees))]
    tokens = prompt_tokens(prompts)
    answer: list[list[int]] = [[] for _ in rows]
    edge_tokens: list[list[int]] = [[] for _ in rows]
    edge_logps: list[list[float]] = [[] for _ in rows]
    splits = set(rollout.split_positions)
    for p in range(k):
        if p in splits:
            if p > 0:  # close the edges that end here
                for (t, node), toks, lps in zip(rows, edge_tokens, edge_logps, strict=True):
                    trees[t].nodes[node].action = toks
                    trees[t].nodes[node].old_logp = torch.tensor(lps)
            new_rows, new_tokens, new_answer = [], [], []
            for r, (t, node) in enumerate(rows):
                for _ in range(rollout.branch_factor):
                    child = trees[t].add_child(node, state={"tokens": list(answer[r])})
                    new_rows.append((t, child))
                    new_tokens.append(tokens[r])
                    new_answer.append(list(answer[r]))
            rows, tokens, answer = new_rows, torch.stack(new_tokens), new_answer
            edge_tokens = [[] for _ in rows]
            edge_logps = [[] for _ in rows]
        logits = model(input_ids=tokens).logits[:, -1, :DIGITS].float() / rollout.temperature
        keys = [NoiseKey(seed, step, prompt_ids[t], node, stream=p) for t, node in rows]
        uniform = keyed_rand_batch((DIGITS,), keys).clamp_(1e-20, 1.0 - 1e-7)
        gumbel = -torch.log(-torch.log(uniform))
        next_token = (logits + gumbel).argmax(-1)
        logp = torch.log_softmax(logits, -1).gather(-1, next_token.unsqueeze(-1)).squeeze(-1)
        tokens = torch.cat([tokens, next_token.unsqueeze(-1)], dim=1)
        for r in range(len(rows)):
            answer[r].append(int(next_token[r]))
            edge_tokens[r].append(int(next_token[r]))
            edge_logps[r].append(float(logp[r]))
    for (t, node), toks, lps, ans in zip(rows, edge_tokens, edge_logps, answer, strict=True):
        leaf = trees[t].nodes[node]
        leaf.action = toks
        leaf.old_logp = torch.tensor(lps)
        leaf.state = {"tokens": ans}
    return trees


def leaf_answers(tree: RolloutTree) -> tuple[list[int], torch.Tensor]:
    leaves = tree.leaves()
    return leaves, torch.tensor([tree.nodes[n].state["tokens"] for n in leaves], dtype=torch.long)


# ---------------------------------------------------------------------------------------------
# Trainer


@TRAINERS.register("tiny_grpo")
class TinyGRPOTrainer(Trainer):
    config_class = TinyGRPOConfig
    config: TinyGRPOConfig

    def setup(self) -> None:
        cfg = self.config
        self.heldout, self.train_prompts = split_prompts(cfg.task)
        model = build_model(cfg.model, cfg.task.digits)
        check_rollout_size(cfg, model.config, self.accelerator.num_processes, self.accelerator.device)
        self.reference = copy.deepcopy(model).requires_grad_(False) if cfg.train.kl_coef > 0 else None
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay
        )
        warmup = cfg.train.warmup_steps
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        # stepped once per optimisation step on every process (not wrapped: Accelerate's wrapper
        # would step it once per process)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda i: min(1.0, (i + 1) / (warmup + 1))
        )
        self.sampler = SAMPLERS.get(cfg.train.sampler)(len(self.train_prompts), seed=cfg.seed)

    def trainer_state(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])

    def evaluate(self) -> dict[str, float]:
        return heldout_metrics(self.accelerator.unwrap_model(self.model), self.heldout)

    def train_step(self, step: int) -> dict[str, Any]:
        cfg = self.config
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        # every rank draws the same indices (same sampler state) and takes its own slice
        chosen = self.sampler.sample(cfg.rollout.prompts_per_step * world)
        mine = chosen[rank::world]
        prompts = self.train_prompts[mine]
        policy = self.accelerator.unwrap_model(self.model)
        trees = sample_trees(policy, prompts, mine, cfg.rollout, cfg.seed, step)

        # rewards on leaves, advantages per edge (edge parent->node trained with A(node))
        all_answers, all_prompts, owners = [], [], []
        for t, tree in enumerate(trees):
            leaves, answers = leaf_answers(tree)
            rewards = reversal_reward(prompts[t].expand_as(answers), answers)
            for leaf, r in zip(leaves, rewards.tolist(), strict=True):
                tree.set_leaf_reward(leaf, r)
            all_answers.append(answers)
            all_prompts.append(prompts[t].expand_as(answers))
            owners += [(t, leaf) for leaf in leaves]
        answers, leaf_prompts = torch.cat(all_answers), torch.cat(all_prompts)
        leaf_rewards = reversal_reward(leaf_prompts, answers)
        node_adv = self.node_advantages(trees)

        # the sampler sees every process's groups, so its state stays identical on all ranks;
        # groups it filters out (e.g. dynamic_filter: all rewards equal) are not trained on
        per_group = leaf_rewards.view(len(trees), -1)
        gathered = self.gather([(mine, per_group.tolist())], "every process's group rewards")
        indices = [i for part in gathered for i in part[0]]
        rewards = torch.tensor([r for part in gathered for group in part[1] for r in group])
        group_ids = torch.arange(len(indices)).repeat_interleave(per_group.shape[1])
        keep = self.sampler.update(indices, rewards, group_ids)
        offset = sum(len(part[0]) for part in gathered[:rank])
        keep_mine = keep[offset : offset + len(trees)].float().repeat_interleave(per_group.shape[1])

        # token-level training targets: each token belongs to one edge; count it once
        old_logp, adv, mask = self.token_targets(trees, owners, node_adv)
        mask = mask * keep_mine.unsqueeze(-1)
        metrics: dict[str, Any] = {"groups_kept": keep.float().mean()}
        for _ in range(cfg.train.ppo_epochs):
            logp = answer_logprobs(self.model, leaf_prompts, answers, cfg.rollout.temperature)
            out = ppo_clip(
                logp,
                old_logp,
                adv,
                mask=mask,
                clip_low=cfg.train.clip_low,
                clip_high=cfg.train.clip_high,
                adv_clip=cfg.train.adv_clip,
            )
            loss = out.loss
            if self.reference is not None:
                with torch.no_grad():
                    ref_logp = answer_logprobs(self.reference, leaf_prompts, answers, cfg.rollout.temperature)
                kl = (kl_to_reference(logp, ref_logp, kind="k3") * mask).sum() / mask.sum().clamp(min=1)
                loss = loss + cfg.train.kl_coef * kl
                metrics["kl"] = kl.detach()
            if not self.all_finite(loss):
                return self.skip_step("non-finite loss", cfg.train.nan_patience)
            self.optimizer.zero_grad(set_to_none=True)
            self.backward(loss)
            grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), cfg.train.max_grad_norm)
            if not self.all_finite(grad_norm):
                return self.skip_step("non-finite gradient", cfg.train.nan_patience)
            self.optimizer.step()
        self.scheduler.step()
        self.nan_streak = 0

        self.write_samples(step, prompts, trees)
        metrics.update(
            reward=leaf_rewards.mean(),
            loss=loss.detach(),
            grad_norm=grad_norm,
            clip_fraction=out.metrics["clip_fraction"],
            approx_kl=out.metrics["approx_kl"],
            leaves_per_prompt=answers.shape[0] / len(trees),
            lr=self.scheduler.get_last_lr()[0],
        )
        return metrics

    def node_advantages(self, trees: list[RolloutTree]) -> dict[tuple[int, int], float]:
        """A(node) for every non-root node, keyed by (tree index, node id)."""
        cfg = self.config
        if cfg.train.advantage == "tree_depthwise":
            return depthwise_node_advantages(trees, "mean", cfg.train.adv_clip)
        leaves = [(t, leaf) for t, tree in enumerate(trees) for leaf in tree.leaves()]
        rewards = torch.tensor([trees[t].nodes[leaf].reward for t, leaf in leaves])
        groups = torch.tensor([t for t, _ in leaves])
        result = ADVANTAGES.get(cfg.train.advantage)(rewards, groups)
        values = result.values * result.loss_mask
        return {key: float(a) for key, a in zip(leaves, values, strict=True)}

    def token_targets(
        self, trees: list[RolloutTree], owners: list[tuple[int, int]], node_adv: dict[tuple[int, int], float]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Old log-prob, advantage and a count-once mask per (leaf, answer token)."""
        k = self.config.task.digits
        old_logp = torch.zeros(len(owners), k)
        adv = torch.zeros(len(owners), k)
        mask = torch.zeros(len(owners), k)
        counted: set[tuple[int, int]] = set()
        for row, (t, leaf) in enumerate(owners):
            position = k
            for _, child in reversed(trees[t].path_to(leaf)):
                node = trees[t].nodes[child]
                span = len(node.action)
                position -= span
                old_logp[row, position : position + span] = node.old_logp
                adv[row, position : position + span] = node_adv.get((t, child), 0.0)
                if (t, child) not in counted:
                    counted.add((t, child))
                    mask[row, position : position + span] = 1.0
        return old_logp, adv, mask

    def write_samples(self, step: int, prompts: torch.Tensor, trees: list[RolloutTree]) -> None:
        """A few answers per step and process, so ranks can be compared and runs inspected."""
        rank = self.accelerator.process_index
        path = self.samples_dir / f"rollouts_rank{rank}.jsonl"
        rows = []
        for prompt, tree in zip(prompts.tolist(), trees, strict=True):
            leaves, answers = leaf_answers(tree)
            rows.append(
                {
                    "step": step,
                    "prompt": prompt,
                    "answers": answers.tolist()[:4],
                    "rewards": [tree.nodes[n].reward for n in leaves][:4],
                }
            )
        with path.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)

    def train(self) -> dict[str, Any]:
        result = super().train()
        self.check_replicas_agree()
        return result

    def check_replicas_agree(self) -> None:
        """Data-parallel replicas must end identical; record each rank's parameter digest."""
        digest = hashlib.sha256()
        for tensor in self.accelerator.unwrap_model(self.model).state_dict().values():
            digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        digests = self.gather([digest.hexdigest()], "parameter digests")
        if self.is_main:
            (self.run_dir / "replicas.json").write_text(json.dumps({"param_sha256_by_rank": digests}))
            if len(set(digests)) > 1:
                raise RuntimeError(f"data-parallel replicas diverged: parameter digests {digests}")


# ---------------------------------------------------------------------------------------------
# Supervised pretraining on noisy demonstrations (mmrl pretrain tiny_lm)


@dataclass
class TinySFTTrainConfig:
    lr: float = option(3e-3, "AdamW learning rate", min=0.0)
    batch_size: int = option(64, "demonstrations per step", min=1)
    label_noise: float = option(
        0.5, "probability that a demonstrated digit is replaced by a random one", min=0.0, max=1.0
    )


@dataclass
class TinySFTConfig(BaseConfig):
    trainer: str = option("tiny_sft", "trainer name", registry="trainer")
    model: TinyModelConfig = dataclasses.field(default_factory=TinyModelConfig)
    task: TinyTaskConfig = dataclasses.field(default_factory=TinyTaskConfig)
    train: TinySFTTrainConfig = dataclasses.field(default_factory=TinySFTTrainConfig)

    def __post_init__(self) -> None:
        check_task_size(self.task)


@TRAINERS.register("tiny_sft")
class TinySFTTrainer(Trainer):
    """Behaviour cloning on corrupted demonstrations; the result is saved with save_pretrained."""

    config_class = TinySFTConfig
    config: TinySFTConfig

    def setup(self) -> None:
        cfg = self.config
        self.heldout, self.train_prompts = split_prompts(cfg.task)
        model = build_model(cfg.model, cfg.task.digits)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.data_generator = torch.Generator().manual_seed(cfg.seed)

    def trainer_state(self) -> dict[str, Any]:
        return {"data_generator": self.data_generator.get_state()}

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        self.data_generator.set_state(state["data_generator"])

    def evaluate(self) -> dict[str, float]:
        return heldout_metrics(self.accelerator.unwrap_model(self.model), self.heldout)

    def train_step(self, step: int) -> dict[str, Any]:
        cfg = self.config
        g = self.data_generator
        index = torch.randint(0, len(self.train_prompts), (cfg.train.batch_size,), generator=g)
        prompts = self.train_prompts[index]
        targets = prompts.flip(-1).clone()
        noisy = torch.rand(targets.shape, generator=g) < cfg.train.label_noise
        targets[noisy] = torch.randint(0, DIGITS, (int(noisy.sum()),), generator=g)
        loss = -answer_logprobs(self.model, prompts, targets).mean()
        self.optimizer.zero_grad(set_to_none=True)
        self.backward(loss)
        self.optimizer.step()
        return {"loss": loss.detach()}

    def train(self) -> dict[str, Any]:
        result = super().train()
        if self.is_main:
            self.accelerator.unwrap_model(self.model).save_pretrained(self.run_dir / "model")
        return result
