"""GRPO for tool-using VLMs with rollout-guided adaptive rewards (`tool_grpo`).

One step, top to bottom in `ToolGRPOTrainer.train_step`:

1. the sampler picks questions (default: Beta-Thompson on each question's correctness, VADE-style,
   so questions the policy gets right about half the time come first);
2. `group_size` multi-turn rollouts per question in one loop (`vlm_rl.rollout`), sampling noise
   keyed by (seed, step, rollout), so a rollout does not depend on the batch it was generated in; its
   schedule (`vlm_rl.schedules`) says what starts, branches and carries over: flat groups; with
   `rollout.tree.enabled` trees whose branches share their prefix, still `group_size` leaves per
   question; with `rollout.partial.enabled` (APRIL) more groups in flight than a step trains, the step
   training the first `questions_per_step` complete ones and carrying the others, tokens and log-probs
   included, into the next step;
3. rewards from the whole group (`vlm_rl.rewards.adaptive_tool`: a correct direct answer beats a
   correct zoom when the question is answerable without one, a zoom wins when it is not);
4. groups whose rewards are all equal teach nothing and are dropped (dynamic filtering); the
   sampler's posterior absorbs every group's correctness;
5. group-normalised advantages (`train.advantage`), the policy loss (`train.loss`, PPO-clip by
   default) on every token the policy sampled (observation tokens are masked), `train.minibatches`
   optimizer steps per rollout batch. Tree rollouts need a tree estimator: leaf rewards are fused up
   each tree, every node is scored, and each leaf's whole conversation is trained with, at every
   token, the advantage of the segment (node) it lies in.

Metrics every step: reward, accuracy and tool-usage ratio (also per question kind where the data names
kinds), accuracy with and without the tool, tool-call errors by kind, tokens per answer, how rollouts
ended, groups kept; tree steps add prefilled and decoded tokens, nodes and branch points per question;
partial steps add the staleness of the trained conversations, the share of their tokens an older
policy sampled, and the conversations dropped for staleness.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mmrl.config import ConfigError, shipped_path
from mmrl.credit import assign_credit
from mmrl.losses import kl_to_reference
from mmrl.memory_plan import MemoryPlan
from mmrl.registry import LOSSES, REWARDS, TRAINERS, UnknownNameError
from mmrl.samplers import build_sampler, keep_groups
from mmrl.trainer import Trainer
from mmrl.tree import RolloutTree
from vlm_rl.config import ToolGRPOConfig, check_rollout_size
from vlm_rl.conversation import Trajectory
from vlm_rl.data import QuestionSet
from vlm_rl.heldout_eval import evaluate_questions
from vlm_rl.loading import load
from vlm_rl.models import VLMAdapter
from vlm_rl.policy_weights import trainable_policy
from vlm_rl.rollout import generate, metrics_by_kind, rollout_metrics
from vlm_rl.schedules import CarriedGroups, Groups, StepGroups, TreeRollout, Trees
from vlm_rl.vllm_engine import INSTALL_HINT, VLLMTurnGenerator, vllm_available


def load_policy(path: str) -> VLMAdapter:
    """A local checkpoint; a missing or unusable one is a config error naming model.path."""
    try:
        return load(shipped_path(path))
    except (FileNotFoundError, ValueError) as err:
        parts = Path(path).parts  # the recipes' own outputs: runs/pretrain/NAME/model
        is_recipe_output = len(parts) == 4 and parts[:2] == ("runs", "pretrain") and parts[3] == "model"
        hint = f"; run `mmrl pretrain {parts[2]}` first" if is_recipe_output else ""
        raise ConfigError(f"config error: model.path = {path!r}: {err}{hint}") from None


@TRAINERS.register("tool_grpo")
class ToolGRPOTrainer(Trainer):
    config_class = ToolGRPOConfig
    config: ToolGRPOConfig

    def setup(self) -> None:
        cfg = self.config
        try:
            self.reward_fn = REWARDS.get(cfg.reward.name)(**cfg.reward.options)
        except UnknownNameError as err:
            raise ConfigError(f"config error: reward.name: {err}") from None
        except (TypeError, ValueError) as err:
            raise ConfigError(f"config error: reward.options = {cfg.reward.options}: {err}") from None
        self.adapter = load_policy(cfg.model.path).to(self.accelerator.device)
        self.train_set = QuestionSet(cfg.data, "train")
        heldout = QuestionSet(cfg.data, "heldout")
        check_rollout_size(
            cfg,
            self.adapter.model.config,
            (len(self.train_set), len(heldout)),
            self.accelerator.num_processes,
            self.accelerator.device,
        )
        self.train_set.check_images(self.adapter)  # refused now, not at the step that draws it
        heldout.check_images(self.adapter)
        self.heldout = [heldout[i] for i in range(len(heldout))]
        self.engine = None
        if cfg.rollout.backend == "vllm":
            if not vllm_available():
                raise ConfigError(f"config error: rollout.backend = 'vllm': {INSTALL_HINT}")
            try:
                self.engine = VLLMTurnGenerator(
                    cfg.model.path,
                    self.adapter,
                    max_model_len=cfg.rollout.max_tokens,
                    max_images=cfg.rollout.max_images,
                    kv_cache_gib=cfg.rollout.vllm_kv_cache_gib,
                    gpu_memory_fraction=cfg.rollout.vllm_gpu_memory_fraction,
                    sleep=cfg.rollout.vllm_sleep,
                )
            except ValueError as err:  # a model this vLLM build cannot run
                raise ConfigError(f"config error: rollout.backend = 'vllm': {err}") from None
        self.sampler = build_sampler(
            cfg.train.sampler,
            cfg.train.sampler_options,
            len(self.train_set),
            cfg.seed,
            "train.sampler_options",
        )
        self.carried = None
        if cfg.rollout.partial.enabled:
            if self.accelerator.num_processes > 1:
                raise ConfigError(
                    "config error: rollout.partial.enabled = true runs on one process (the conversations "
                    "a process carries are its own, and a checkpoint holds the main process's trainer "
                    "state): launch one process, or set rollout.partial.enabled=false"
                )
            self.carried = CarriedGroups(
                self.adapter,
                self.train_set,
                cfg.rollout,
                cfg.train.questions_per_step,
                cfg.train.group_size,
                cfg.seed,
            )
        self.reference, trained = trainable_policy(
            self.adapter, cfg.model, cfg.train.kl_coef, self.accelerator.device
        )
        self.prepare_model_and_optimizer(self.adapter.model, trained, lr=cfg.train.lr, weight_decay=0.0)
        self.policy_loss = LOSSES.get(cfg.train.loss)

    @classmethod
    def memory_plan(cls, config: Any, recipe: str, processes: int) -> MemoryPlan:
        from vlm_rl.memory_plan import tool_grpo_memory_plan

        return tool_grpo_memory_plan(config, recipe, processes)

    def trainer_state(self) -> dict[str, Any]:
        state = {"sampler": self.sampler.state_dict()}
        if self.carried is not None:  # the conversations carried into the next step
            state["partial"] = self.carried.state_dict()
        return state

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
        if self.carried is not None and "partial" in state:  # a run started without partial carries none
            self.carried.load_state_dict(state["partial"])

    def sync_engine(self) -> None:
        """vLLM samples with the policy's current weights (they change at every optimizer step and at
        a resume)."""
        if self.engine is not None:
            self.engine.load_weights(self.adapter.model)

    def release_engine(self) -> None:
        """The rollouts are done: vLLM gives its GPU memory to the update (`rollout.vllm_sleep`)."""
        if self.engine is not None:
            self.engine.sleep()

    def evaluate(self) -> dict[str, float]:
        self.adapter.model.eval()
        self.sync_engine()
        results = evaluate_questions(
            self.adapter, self.heldout, self.config.rollout, self.config.eval_modes, engine=self.engine
        )
        self.release_engine()
        return results

    def schedule(self, step: int) -> Groups | Trees | CarriedGroups:
        """What this step's rollout starts, branches and carries over: the carried groups go on and
        new ones fill up (one process), or the sampler's questions start as flat groups or trees."""
        cfg = self.config
        if self.carried is not None:
            return self.carried.begin(step, self.sampler.sample)
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        n, g = cfg.train.questions_per_step, cfg.train.group_size
        chosen = self.sampler.sample(n * world)  # the same on every process (same sampler state)
        slots = list(range(rank, n * world, world))
        questions = [self.train_set[chosen[s]] for s in slots]
        step_groups = StepGroups(cfg.seed, step, g, slots, chosen)
        if cfg.rollout.tree.enabled:
            return Trees(self.adapter, questions, cfg.rollout, step_groups)
        return Groups.start(self.adapter, questions, cfg.rollout, step_groups)

    def train_step(self, step: int) -> dict[str, Any]:
        cfg = self.config
        g = cfg.train.group_size
        self.adapter.model.eval()
        self.sync_engine()
        schedule = self.schedule(step)
        step_rollouts = schedule.rollouts(generate(self.adapter, schedule, cfg.rollout, self.engine))
        self.release_engine()
        chosen, slots, trajectories = step_rollouts.chosen, step_rollouts.slots, step_rollouts.trajectories
        tree = step_rollouts.tree
        questions = [self.train_set[chosen[s]] for s in slots]
        answers = [q.answer for q in questions for _ in range(g)]
        correct = [t.answer == a for t, a in zip(trajectories, answers, strict=True)]
        group_ids = [s for s in slots for _ in range(g)]
        rewards = self.reward_fn(
            [t.answer_text if t.ended == "answer" else "" for t in trajectories],
            answers=answers,
            options=[t.options for t in trajectories],
            used_tool=[t.used_tool for t in trajectories],
            group_ids=group_ids,
        ).float()

        # every process sees every group, so the sampler's state stays identical on all of them
        gathered = self.gather(
            [(slots, rewards.tolist(), [float(c) for c in correct])], "every process's rewards"
        )
        all_slots = [s for part in gathered for s in part[0]]
        all_rewards = torch.tensor([r for part in gathered for r in part[1]])
        all_correct = torch.tensor([c for part in gathered for c in part[2]])
        group_of_rollout = torch.tensor(all_slots).repeat_interleave(g)  # group j: question chosen[j]
        self.sampler.update(chosen, all_correct, group_of_rollout)
        keep = torch.ones(len(chosen), dtype=torch.bool)
        if cfg.train.filter_equal_groups:
            keep = keep_groups(all_rewards, group_of_rollout, num_groups=len(chosen))
        advantages = self.advantages(tree, rewards, slots, keep)
        if isinstance(advantages, torch.Tensor):
            trained = int((advantages != 0).sum())
        else:
            trained = sum(bool(a.any()) for a in advantages)

        prefixes = None
        if cfg.train.shared_prefix:
            prefixes = shared_prefixes(trajectories, g) if tree is None else tree_shared_prefixes(tree)
        metrics = self.optimise(trajectories, advantages, step, prefixes)
        metrics |= rollout_metrics(trajectories, correct)
        metrics |= metrics_by_kind(trajectories, correct, [q.kind for q in questions for _ in range(g)])
        metrics |= {
            "skipped_steps": self.skipped_steps,
            "reward": rewards.mean(),
            "groups_kept": keep.float().mean(),
            "trained_sequences": trained,
        }
        return metrics | step_rollouts.metrics

    def advantages(
        self, tree: TreeRollout | None, rewards: torch.Tensor, slots: list[int], keep: torch.Tensor
    ) -> torch.Tensor | list[torch.Tensor]:
        """This process's advantages (`mmrl.credit.assign_credit` on each question's group, a depth-1
        tree, or its rollout tree), 0 for dropped groups: one per rollout where each is trained whole
        with its leaf's advantage, or per leaf every token's A(node) of its segment (node credit on a
        tree)."""
        cfg = self.config.train
        g = cfg.group_size
        if tree is None:
            trees = [
                RolloutTree.flat(None, [None] * g, rewards[k * g : (k + 1) * g]) for k in range(len(slots))
            ]
            leaf_nodes = [k % g + 1 for k in range(len(rewards))]
        else:
            tree.set_leaf_rewards(rewards)
            trees, leaf_nodes = tree.trees, tree.leaf_nodes
        credit = assign_credit(trees, cfg.advantage, clip=cfg.adv_clip)
        kept = keep[torch.tensor(slots)].float()
        if tree is None or credit.per_leaf:
            values = torch.tensor([credit.leaves[(k // g, leaf)] for k, leaf in enumerate(leaf_nodes)])
            return values * kept.repeat_interleave(g)
        return [a * kept[k // g] for k, a in enumerate(tree.token_advantages(credit.nodes))]

    def optimise(
        self,
        trajectories: list[Trajectory],
        advantages: torch.Tensor | list[torch.Tensor],
        step: int,
        prefixes: list[tuple[int, int]] | None = None,
    ) -> dict[str, Any]:
        """The policy loss on the sampled tokens, `train.minibatches` optimizer steps over a keyed
        shuffle; a non-finite loss or gradient skips the step (`Trainer.skip_step`). `advantages`: one
        per sequence, or (tree rollouts) one per token of each sequence. `prefixes`: per sequence, the
        (group, length) of a prefix it shares with the rest of its group, scored once per micro-batch;
        the shuffle then deals out whole groups, so that a group's rows meet in one micro-batch."""
        cfg = self.config.train
        generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + step)
        if prefixes is None:
            order = torch.randperm(len(trajectories), generator=generator).tolist()
            parts = [order[i :: cfg.minibatches] for i in range(cfg.minibatches)]
        else:
            members: dict[int, list[int]] = {}
            for k, (group, _) in enumerate(prefixes):
                members.setdefault(group, []).append(k)
            groups = list(members.values())
            order = [k for g in torch.randperm(len(groups), generator=generator).tolist() for k in groups[g]]
            size = -(-len(order) // cfg.minibatches)
            parts = [part for i in range(cfg.minibatches) if (part := order[i * size : (i + 1) * size])]
        self.adapter.model.train()
        stats: list[tuple[int, dict[str, Any], float]] = []
        grad_norms = []
        for part in parts:
            self.optimizer.zero_grad(set_to_none=True)
            tokens = sum(trajectories[i].generated_tokens for i in part)
            for start in range(0, len(part), cfg.micro_batch):
                rows = part[start : start + cfg.micro_batch]
                loss, metrics = self.micro_batch_loss(
                    [trajectories[i] for i in rows],
                    advantages[rows] if torch.is_tensor(advantages) else [advantages[i] for i in rows],
                    None if prefixes is None else [prefixes[i] for i in rows],
                )
                if not self.all_finite(loss):
                    self.skip_step("non-finite loss", cfg.nan_patience)
                weight = sum(trajectories[i].generated_tokens for i in rows) / max(tokens, 1)
                if cfg.aggregation == "sequence_mean":
                    weight = len(rows) / len(part)
                self.backward(loss * weight)
                stats.append((len(rows), metrics, float(loss.detach())))
            grad_norms.append(float(self.apply_gradients(cfg.max_grad_norm, cfg.nan_patience)))
        total = sum(count for count, _, _ in stats)
        merged = {k: sum(c * float(m[k]) for c, m, _ in stats) / total for k in stats[0][1]}
        return {
            "loss": sum(c * v for c, _, v in stats) / total,
            "grad_norm": sum(grad_norms) / len(grad_norms),
        } | merged

    def micro_batch_loss(
        self,
        trajectories: list[Trajectory],
        advantages: torch.Tensor | list[torch.Tensor],
        prefixes: list[tuple[int, int]] | None = None,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        cfg = self.config
        sequences = [t.sequence for t in trajectories]
        length = max(len(sequence) for sequence in sequences)
        mask = torch.zeros(len(trajectories), length, dtype=torch.bool)
        old = torch.zeros(len(trajectories), length)
        for row, t in enumerate(trajectories):
            mask[row, : len(t.loss_mask)] = torch.tensor(t.loss_mask)
            old[row, : len(t.old_log_probs)] = torch.tensor(t.old_log_probs)
        if not torch.is_tensor(advantages):  # per token: [B, L] like the log-probs
            per_token = torch.zeros(len(trajectories), length)
            for row, values in enumerate(advantages):
                per_token[row, : len(values)] = values
            advantages = per_token
        device = self.adapter.device
        mask, old = mask.to(device), old.to(device)
        if prefixes is None:
            batch = self.adapter.collate(sequences, "right")

            def log_probs(model: torch.nn.Module) -> torch.Tensor:
                return self.adapter.token_log_probs(
                    batch, mask, model=model, temperature=cfg.rollout.temperature
                )
        else:
            groups, lengths = [group for group, _ in prefixes], [length for _, length in prefixes]

            def log_probs(model: torch.nn.Module) -> torch.Tensor:
                return self.adapter.shared_token_log_probs(
                    sequences, lengths, groups, mask, model=model, temperature=cfg.rollout.temperature
                )

        logp = log_probs(self.model)
        out = self.policy_loss(
            logp,
            old,
            advantages.to(device),
            mask,
            clip_low=cfg.train.clip_low,
            clip_high=cfg.train.clip_high,
            aggregation=cfg.train.aggregation,
        )
        loss, metrics = out.loss, dict(out.metrics)
        if self.reference is not None:
            with torch.no_grad():
                ref = log_probs(self.reference)
            kl = (kl_to_reference(logp, ref, kind="k3") * mask).sum() / mask.sum().clamp(min=1)
            loss = loss + cfg.train.kl_coef * kl
            metrics["kl"] = kl.detach()
        return loss, metrics

    def train(self) -> dict[str, Any]:
        try:
            result = super().train()
            if self.is_main:
                self.adapter.save_pretrained(self.run_dir / "model")
            return result
        finally:  # setup may have failed before the engine existed
            if getattr(self, "engine", None) is not None:
                self.engine.close()


def shared_prefixes(trajectories: list[Trajectory], group_size: int) -> list[tuple[int, int]]:
    """Flat groups: the G rollouts of a question share its prompt (every token before the first one the
    policy sampled; all of a conversation that ended at max_tokens before sampling any, as all of its
    group did). Per trajectory: (group index, prompt length)."""
    return [
        (k // group_size, next((i for i, sampled in enumerate(t.loss_mask) if sampled), len(t.loss_mask)))
        for k, t in enumerate(trajectories)
    ]


def tree_shared_prefixes(tree: TreeRollout) -> list[tuple[int, int]]:
    """Tree rollouts: sibling leaves share their parent's whole conversation (prompt, the turns above
    the branch, their observations). Per leaf: (an id of its parent node, where the leaf's own tokens
    start)."""
    parents: dict[tuple[int, int], int] = {}
    prefixes = []
    for k, node_id in enumerate(tree.leaf_nodes):
        node = tree.trees[k // tree.group_size].nodes[node_id]
        group = parents.setdefault((k // tree.group_size, node.parent_id), len(parents))
        prefixes.append((group, node.state.start))
    return prefixes
