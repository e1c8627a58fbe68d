"""Tiny end-to-end GRPO of the shared core: a 2-layer Qwen2 learns to reverse digit strings.

The task (`mmrl.examples.digits`) is small enough to train on a laptop CPU, yet the run goes through
every shared piece a real trainer uses: a transformers model, a sampler picking prompts, rollouts as
trees whose every random draw is keyed noise (a flat GRPO group is a tree of depth 1;
``rollout.split_positions`` branches at several tokens as in BranchGRPO), rewards, a registered
advantage estimator and policy loss, optional KL to the frozen start model, Accelerate (DDP across
processes) and exact resume. `tiny_sft` (``mmrl pretrain tiny_lm``) makes the model it starts from.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from mmrl.advantages import check_group_size
from mmrl.config import BaseConfig, ConfigError, option
from mmrl.credit import Credit, assign_credit
from mmrl.examples.digits import (
    DIGITS,
    DigitReversalTrainer,
    TinyModelConfig,
    TinyTaskConfig,
    answer_logprobs,
    check_task_size,
    prompt_tokens,
    reversal_reward,
)
from mmrl.losses import kl_to_reference
from mmrl.noise import NoiseKey, keyed_rand_batch
from mmrl.registry import ADVANTAGES, LOSSES, TRAINERS
from mmrl.resources import ACTIVATION_FLOATS, check_enough_prompts, check_memory
from mmrl.runlog import truncate_after
from mmrl.samplers import build_sampler
from mmrl.tree import RolloutTree

# ---------------------------------------------------------------------------------------------
# Config


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
        "advantage estimator: a tree one (node credit, e.g. tree_depthwise), or a group one (flat credit: "
        "each tree's leaves are one group and every leaf's whole answer is trained with its advantage, "
        "which on a branching tree is flat GRPO on the leaves)",
        registry="advantage",
        kinds=("group", "tree"),
    )
    loss: str = option("ppo_clip", "policy loss", registry="loss", kinds=("policy",))
    sampler: str = option("uniform", "prompt sampler", registry="sampler")
    sampler_options: dict = option({}, "keyword options of the sampler, e.g. {success_threshold: 0.5}")
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
        r = self.rollout
        if len(r.split_positions) == 1:
            check_group_size(self.train.advantage, r.branch_factor, "rollout.branch_factor")
        elif ADVANTAGES.tag(self.train.advantage, "group_size") == "odd" and r.branch_factor % 2 == 0:
            raise ConfigError(
                f"config error: {self.train.advantage} needs an odd number of leaves per tree, but "
                f"rollout.branch_factor = {r.branch_factor} with {len(r.split_positions)} splits gives "
                f"{r.branch_factor ** len(r.split_positions)}: use an odd rollout.branch_factor or a tree "
                "estimator (train.advantage=tree_depthwise)"
            )
        check_task_size(self.task)


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
    # frontier rows: (tree index, node id); per row its answer so far and its open edge's tokens, log-probs
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
class TinyGRPOTrainer(DigitReversalTrainer):
    config_class = TinyGRPOConfig
    config: TinyGRPOConfig

    def setup_training(self, model: Qwen2ForCausalLM) -> None:
        cfg = self.config
        check_rollout_size(cfg, model.config, self.accelerator.num_processes, self.accelerator.device)
        self.reference = copy.deepcopy(model).requires_grad_(False) if cfg.train.kl_coef > 0 else None
        warmup = cfg.train.warmup_steps
        self.prepare_model_and_optimizer(
            model,
            lr=cfg.train.lr,
            weight_decay=cfg.train.weight_decay,
            lr_factor=lambda i: min(1.0, (i + 1) / (warmup + 1)),
        )
        self.policy_loss = LOSSES.get(cfg.train.loss)
        self.samples_from: int | None = None  # the step of this launch's first sample rows
        self.sampler = build_sampler(
            cfg.train.sampler,
            cfg.train.sampler_options,
            len(self.train_prompts),
            cfg.seed,
            "train.sampler_options",
        )

    def trainer_state(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])

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
            all_answers.append(answers)
            all_prompts.append(prompts[t].expand_as(answers))
            owners += [(t, leaf) for leaf in leaves]
        answers, leaf_prompts = torch.cat(all_answers), torch.cat(all_prompts)
        leaf_rewards = reversal_reward(leaf_prompts, answers)
        for (t, leaf), r in zip(owners, leaf_rewards.tolist(), strict=True):
            trees[t].set_leaf_reward(leaf, r)
        credit = assign_credit(trees, cfg.train.advantage, clip=cfg.train.adv_clip)

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
        old_logp, adv, mask = self.token_targets(trees, owners, credit)
        mask = mask * keep_mine.unsqueeze(-1)
        metrics: dict[str, Any] = {"groups_kept": keep.float().mean()}
        for _ in range(cfg.train.ppo_epochs):
            logp = answer_logprobs(self.model, leaf_prompts, answers, cfg.rollout.temperature)
            out = self.policy_loss(
                logp,
                old_logp,
                adv,
                mask,
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
            grad_norm = self.optimizer_step(loss, cfg.train.max_grad_norm, cfg.train.nan_patience)
        self.scheduler.step()

        self.write_samples(step, prompts, trees)
        metrics.update(
            reward=leaf_rewards.mean(),
            loss=loss.detach(),
            grad_norm=grad_norm,
            leaves_per_prompt=answers.shape[0] / len(trees),
            lr=self.scheduler.get_last_lr()[0],
        )
        metrics.update({k: v for k, v in out.metrics.items() if k in ("clip_fraction", "approx_kl")})
        return metrics

    def token_targets(
        self, trees: list[RolloutTree], owners: list[tuple[int, int]], credit: Credit
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Old log-prob, advantage and mask per (leaf, answer token).

        Node credit trains each edge once, with A(edge's node). Flat credit (a group estimator) trains
        every leaf's whole answer with the leaf's advantage, so a shared edge counts once per leaf below it.
        """
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
                adv[row, position : position + span] = credit.path_advantage((t, leaf), (t, child))
                if credit.per_leaf or (t, child) not in counted:
                    counted.add((t, child))
                    mask[row, position : position + span] = 1.0
        return old_logp, adv, mask

    def write_samples(self, step: int, prompts: torch.Tensor, trees: list[RolloutTree]) -> None:
        """A few answers per step and process, so ranks can be compared and runs inspected."""
        rank = self.accelerator.process_index
        path = self.samples_dir / f"rollouts_rank{rank}.jsonl"
        if self.samples_from is None:  # this launch's first rows
            self.samples_from = step
            truncate_after(path, step - 1)  # what a launch killed past its checkpoint wrote
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
