"""What every text-to-image trainer shares, whatever its objective: prompts and reward, the pipeline
(full fine-tune or LoRA), the frozen reference, the optimizer, the prompt sampler, rewards gathered
over processes, the EMA of the trained weights, held-out evaluation and the saved result.

`BranchGRPOTrainer` (`diffusion_rl.branch_grpo`: PPO on SDE steps of denoising trees) and
`DiffusionNFTTrainer` (`diffusion_rl.nft`: forward-process training on clean samples) add
their rollout and update. A config for this class has the sections `model`, `rollout` (with
`prompts_per_step` and `image_size`), `train` (with `lr`, `kl_coef`, `sampler`, `sampler_options`,
`ema_decay`), `reward` and `eval`, and a `prompt_file`.

Rewards: `reward` is one registered reward or weighted `terms` (`diffusion_rl.config.RewardConfig`);
`score` computes every term on the leaves, z-scores each within its tree when `reward.normalize` is
group, and trains on the weighted sum; `reward_metrics` gives each term's raw mean (reward_<name>).
`eval.gold_reward` is scored on the held-out samples beside the trained terms but never trained on;
a run whose trained reward rose while the gold reward fell beyond noise (the first and last
evaluations share prompts and noise, so the change is paired prompt by prompt, its standard error
from the per-prompt scores kept in `heldout_scores.json`) is flagged in eval.json (`divergence`).
"""

from __future__ import annotations

import copy
import functools
import json
import sys
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch

from diffusion_rl.inputs import (
    check_gold_reward,
    check_prompt_tokens,
    located_heldout_prompts,
    located_prompts,
    resolve_model_path,
    trainable_denoiser,
)
from diffusion_rl.loading import load
from diffusion_rl.reward_config import weight_at
from diffusion_rl.reward_server import check_reward_server
from diffusion_rl.reward_terms import (
    RewardFailed,
    build_reward,
    build_reward_terms,
    combine_rewards,
    reward_hacking_record,
    scored,
)
from diffusion_rl.sampling import evaluate_alignment, evaluation_prompts
from mmrl.checkpoint import STEP_PREFIX, list_checkpoints
from mmrl.config import ConfigError
from mmrl.credit import GroupedRewards
from mmrl.memory_plan import MemoryPlan
from mmrl.precision import lora_base_dtype
from mmrl.rewards import RewardFn
from mmrl.run_stops import TrainingStopped
from mmrl.runlog import write_json
from mmrl.samplers import build_sampler
from mmrl.trainer import Trainer
from mmrl.tree import RolloutTree

GOLD_KEY = "gold"  # held-out metric heldout_gold
DIVERGENCE_KEY = "divergence"  # eval.json entry of the reward-hacking check
HELDOUT_SCORES_FILE = "heldout_scores.json"  # per-prompt held-out scores of the before and after evaluations
# latent-sized tensors a sample's denoiser forward holds at its peak (rough, tiny UNet): size checks
FORWARD_LATENTS = 64
TRAINING_LATENTS = 512  # the same with gradients


def update_summary(stats: list[tuple[int, dict[str, Any], float]], grad_norms: list[float]) -> dict[str, Any]:
    """The metrics of an update from its micro-batches' (size, loss metrics, loss), weighted by size,
    and the mean gradient norm of its optimizer steps."""
    total = sum(n for n, _, _ in stats)
    merged = {k: sum(n * float(m[k]) for n, m, _ in stats) / total for k in stats[0][1]}
    return {
        "loss": sum(n * value for n, _, value in stats) / total,
        "grad_norm": sum(grad_norms) / len(grad_norms),
        **merged,
    }


def split_evenly(items: list[Any], parts: int) -> list[list[Any]]:
    """`items` cut into `parts` consecutive pieces whose sizes differ by at most one."""
    size, extra = divmod(len(items), parts)
    bounds = [i * size + min(i, extra) for i in range(parts + 1)]
    return [items[bounds[i] : bounds[i + 1]] for i in range(parts)]


class DiffusionTrainer(Trainer):
    """The shared setup and bookkeeping (see the module docstring); subclasses implement
    `check_size`, `train_step` and whatever their update needs."""

    config: Any

    def setup(self) -> None:
        cfg = self.config
        training = located_prompts(cfg.prompt_file)
        heldout = located_heldout_prompts(cfg.eval)
        self.prompts = [prompt for _, prompt in training]
        self.heldout_prompts = None if cfg.eval.prompt_file is None else [prompt for _, prompt in heldout]
        self.reward_terms = build_reward_terms(cfg.reward)
        self.reward_fn = self.reward_terms[0].fn  # the one reward (terms: see `score`)
        self.last_reward_metrics: dict[str, float] = {}
        self.last_heldout_scores: dict[str, list[float]] = {}  # per prompt, of the latest evaluation
        self.gold_reward_fn = None
        gold = cfg.eval.gold_reward
        check_gold_reward(cfg)
        if gold is not None:
            self.gold_reward_fn = build_reward(gold["name"], gold["options"], "eval.gold_reward.")
        self.check_reward_servers()
        model_dir = resolve_model_path(cfg.model.path)
        base_dtype = lora_base_dtype(cfg.model.base_dtype, cfg.model.lora_rank, self.accelerator.device)
        try:
            self.pipe = load(
                model_dir, denoiser_dtype=base_dtype, frozen_dtype=getattr(torch, cfg.model.frozen_dtype)
            )
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError(f"config error: model.path = {cfg.model.path!r}: {err}") from None
        self.pipe.set_base_dtype(base_dtype)
        if cfg.rollout.image_size is not None:
            try:
                self.pipe.set_image_size(cfg.rollout.image_size)
            except ValueError as err:
                raise ConfigError(
                    f"config error: rollout.image_size = {cfg.rollout.image_size}: {err}"
                ) from None
        truncated = check_prompt_tokens(self.pipe, [*training, *heldout])
        if truncated is not None and self.is_main:
            print(f"warning: {truncated}", file=sys.stderr)
        self.check_size()
        self.pipe.call_rows = cfg.rollout.call_rows
        if cfg.model.cache_prompt_embeddings:  # before the denoiser goes to the device
            self.pipe.cache_prompts(  # a LoRA result is the adapter: the encoders are not needed again
                [*self.prompts, *evaluation_prompts(cfg.eval.prompts, self.heldout_prompts), ""],
                self.accelerator.device,
                release_encoders=cfg.model.lora_rank > 0,
            )
        self.pipe.to(self.accelerator.device)
        self.reference = None
        if cfg.train.kl_coef > 0:
            self.reference = copy.deepcopy(self.pipe.denoiser).requires_grad_(False)
        self.trained_params = trainable_denoiser(self.pipe.denoiser, cfg.model)
        self.ema = [p.detach().clone() for p in self.trained_params] if cfg.train.ema_decay > 0 else None
        self.prepare_model_and_optimizer(
            self.pipe.denoiser, self.trained_params, lr=cfg.train.lr, weight_decay=0.0
        )
        self.sampler = build_sampler(
            cfg.train.sampler, cfg.train.sampler_options, len(self.prompts), cfg.seed, "train.sampler_options"
        )
        self.uncond_one = self.pipe.encode_prompts([""])

    def check_reward_servers(self) -> None:
        """Refuse, before anything is written, a trained or gold reward whose server does not answer a
        request now (`check_reward_server`); mid-run a failing server stops the run instead."""
        cfg = self.config
        if cfg.reward.terms is None:
            keys = ["reward"]
        else:
            keys = [f"reward.terms[{i}]" for i in range(len(self.reward_terms))]
        rewards = [(key, term.fn) for key, term in zip(keys, self.reward_terms, strict=True)]
        if self.gold_reward_fn is not None:
            rewards.append(("eval.gold_reward", self.gold_reward_fn))
        for key, fn in rewards:
            check_reward_server(fn, self.prompts[0], key)

    @classmethod
    def memory_plan(cls, config: Any, recipe: str, processes: int) -> MemoryPlan:
        from diffusion_rl.memory_plan import diffusion_memory_plan

        return diffusion_memory_plan(config, recipe, processes, cls.planned_rollout)

    def check_size(self) -> None:
        """Refuse a step that cannot fit on the device, before the model is trained (a ConfigError)."""
        raise NotImplementedError

    def trainer_state(self) -> dict[str, Any]:
        state = {"sampler": self.sampler.state_dict()}
        if self.ema is not None:
            state["ema"] = self.ema
        return state

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
        if self.ema is not None:
            for ema, saved in zip(self.ema, state["ema"], strict=True):
                ema.copy_(saved)

    # -- prompts and rewards --------------------------------------------------------------------

    def pick_prompts(self) -> tuple[list[int], list[int], list[str]]:
        """The step's draw (the same on every process: same sampler state), this process's slots in
        it (unique across processes: the trees' noise ids and advantage groups) and their prompts."""
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        n = self.config.rollout.prompts_per_step
        chosen = self.sampler.sample(n * world)
        slots = list(range(rank, n * world, world))
        return chosen, slots, [self.prompts[chosen[s]] for s in slots]

    def score(
        self, trees: list[RolloutTree], latents: torch.Tensor, prompts: list[str]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rewards of the leaves (`latents`, tree-major; `prompts` one per tree) and their images.

        One reward: its values. Terms (or `reward.normalize: group`): every term on every leaf, each
        z-scored within its tree (a prompt's group) when normalised, summed with the terms' weights;
        each term's raw mean is kept for `reward_metrics`."""
        images = self.pipe.decode(latents)
        leaf_prompts = [prompts[t] for t, tree in enumerate(trees) for _ in tree.leaves()]
        reward = self.config.reward
        if reward.terms is None and reward.normalize == "none":
            self.last_reward_metrics = {}
            return self.call_reward(self.reward_terms[0].name, self.reward_fn, images, leaf_prompts), images
        terms = (
            self.reward_terms
            if reward.terms is not None
            else [self.reward_terms[0]._replace(fn=self.reward_fn)]
        )
        raw = {term.label: self.call_reward(term.name, term.fn, images, leaf_prompts) for term in terms}
        self.last_reward_metrics = {f"reward_{name}": values.mean().item() for name, values in raw.items()}
        sizes = [len(tree.leaves()) for tree in trees]
        weights = {term.label: weight_at(term.weight, self.step_number) for term in terms}
        scheduled = [term.label for term in terms if isinstance(term.weight, dict)]
        self.last_reward_metrics |= {f"reward_weight_{label}": weights[label] for label in scheduled}
        return combine_rewards(raw, weights, sizes, reward.normalize), images

    @staticmethod
    def call_reward(name: str, fn: RewardFn, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """`scored` in a training step, where a failing reward stops the run (TrainingStopped: the
        trainer keeps the checkpoint of the last completed step and records why in stopped.json)."""
        try:
            return scored(name, fn, images, prompts)
        except RewardFailed as err:
            raise TrainingStopped(str(err)) from err

    def reward_metrics(self) -> dict[str, float]:
        """Each trained term's raw mean over the leaves of the last `score` call (reward_<name>) and each
        scheduled term's weight in it (reward_weight_<label>);
        empty for one reward without `reward.normalize`, whose values are the trained reward itself."""
        return dict(self.last_reward_metrics)

    def gather_rewards(self, slots: list[int], rewards: torch.Tensor) -> GroupedRewards:
        """Every process's leaf rewards, so that the sampler's state stays the same on every process
        and group statistics span them all."""
        gathered = self.gather([(slots, rewards.tolist())], "every process's leaf rewards")
        all_slots = torch.tensor([s for part in gathered for s in part[0]])
        leaves_per_tree = len(rewards) // len(slots)
        rank = self.accelerator.process_index
        return GroupedRewards(
            rewards=torch.tensor([r for part in gathered for r in part[1]]),
            groups=all_slots.repeat_interleave(leaves_per_tree),
            offset=sum(len(part[1]) for part in gathered[:rank]),
        )

    # -- weights: EMA, swapping, evaluation and the result ---------------------------------------

    def update_ema(self) -> None:
        """Move the EMA of the trained weights towards them (after every optimizer step)."""
        if self.ema is None:
            return
        with torch.no_grad():
            for ema, p in zip(self.ema, self.trained_params, strict=True):
                ema.lerp_(p, 1 - self.config.train.ema_decay)

    @contextmanager
    def swapped_weights(self, values: Sequence[torch.Tensor] | None) -> Iterator[None]:
        """Copy `values` into the trained weights for the duration (no-op for None)."""
        if values is None:
            yield
            return
        live = [p.detach().clone() for p in self.trained_params]
        with torch.no_grad():
            for p, value in zip(self.trained_params, values, strict=True):
                p.copy_(value)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, saved in zip(self.trained_params, live, strict=True):
                    p.copy_(saved)

    def ema_weights(self) -> AbstractContextManager[None]:
        """The EMA weights in the model for the duration (no-op without EMA)."""
        return self.swapped_weights(self.ema)

    def heldout_rewards(self) -> dict[str, RewardFn]:
        """The rewards the held-out samples are also scored by, as heldout_<key>: with terms, a gold
        reward or eval.prompt_file, every trained term (by label) and the gold reward (key `GOLD_KEY`);
        else none (heldout_alignment alone)."""
        if self.config.reward.terms is None and self.gold_reward_fn is None and self.heldout_prompts is None:
            return {}
        if self.config.reward.terms is None:
            rewards = {self.reward_terms[0].label: self.reward_fn}
        else:
            rewards = {term.label: term.fn for term in self.reward_terms}
        if self.gold_reward_fn is not None:
            rewards[GOLD_KEY] = self.gold_reward_fn
        return rewards

    def trained_heldout_key(self) -> str:
        """The held-out metric of the trained reward: heldout_reward (the weighted sum of the terms'
        held-out means) with terms, heldout_<name> for one reward."""
        if self.config.reward.terms is not None:
            return "heldout_reward"
        return f"heldout_{self.reward_terms[0].label}"

    def evaluate(self) -> dict[str, float]:
        """heldout_alignment (geneval_mini) of ODE samples for the fixed held-out prompts and noise, and
        with terms or a gold reward also heldout_<term>, heldout_reward (terms) and heldout_gold. With
        eval.prompt_file, its prompts scored by the trained reward(s) and the gold reward only. The
        per-prompt scores stay in `last_heldout_scores` for the reward-hacking check. A reward that
        fails ends the run or the command (`evaluation_stop`)."""
        try:
            return self.heldout_metrics()
        except RewardFailed as err:
            raise self.evaluation_stop(str(err)) from None

    def evaluation_stop(self, failure: str) -> Exception:
        """What a reward failing in a held-out evaluation ends in. Without a started run (`mmrl eval`):
        a one-line error. In a run: a stop recorded in stopped.json that keeps the checkpoints and says
        how to evaluate again; when the run has reached `steps` (the evaluation after training), its
        result (`final/`) is written first."""
        if not self.run_started:
            return ConfigError(
                f"in the held-out evaluation, {failure}: fix the reward (or start its server) and run "
                "`mmrl eval` again"
            )
        kept = list_checkpoints(self.checkpoint_dir)
        checkpoint = kept[-1] if kept else None
        step = int(checkpoint.name.removeprefix(STEP_PREFIX)) if checkpoint is not None else 0
        again = f"`mmrl eval {self.run_dir / 'config.yaml'}` evaluates it once the reward works"
        if checkpoint is None:
            where = "no checkpoint is written yet: launch the run again once the reward works"
        elif step >= self.config.steps:
            if self.is_main:
                self.save_result()
            where = (
                f"training is done: the result is saved in {self.result_dir} and the checkpoint of step "
                f"{step} in {checkpoint}; {again}"
            )
        else:
            where = f"the newest checkpoint is {checkpoint}: resume=true continues from it, and {again}"
        reason = f"in the held-out evaluation, {failure}"
        self.record_stop(step, reason, checkpoint)
        return TrainingStopped(f"{reason}; {where}")

    def heldout_metrics(self) -> dict[str, float]:
        """`evaluate`'s metrics; RewardFailed for a reward that fails on the held-out samples."""
        cfg = self.config.eval
        names = {term.label: term.name for term in self.reward_terms}  # the registered reward of a key
        if cfg.gold_reward is not None:
            names[GOLD_KEY] = cfg.gold_reward["name"]
        rewards = {
            key: functools.partial(scored, names[key], fn) for key, fn in self.heldout_rewards().items()
        }
        per_prompt: dict[str, list[float]] = {}
        self.last_heldout_scores = per_prompt
        with self.ema_weights():
            if not rewards:
                return evaluate_alignment(
                    self.pipe, cfg.prompts, cfg.steps, cfg.guidance_scale, self.config.seed
                )
            metrics = evaluate_alignment(
                self.pipe,
                cfg.prompts,
                cfg.steps,
                cfg.guidance_scale,
                self.config.seed,
                rewards=rewards,
                prompts=self.heldout_prompts,
                per_prompt=per_prompt,
            )
        keys = [f"heldout_{term.label}" for term in self.reward_terms]
        if self.config.reward.terms is not None and all(key in metrics for key in keys):
            # the weights of the last step, so that every evaluation sums one objective
            weights = [weight_at(term.weight, self.config.steps) for term in self.reward_terms]
            metrics["heldout_reward"] = sum(w * metrics[key] for w, key in zip(weights, keys, strict=True))
            if all(key in per_prompt for key in keys):
                columns = zip(*(per_prompt[key] for key in keys), strict=True)
                per_prompt["heldout_reward"] = [
                    sum(w * v for w, v in zip(weights, row, strict=True)) for row in columns
                ]
        return metrics

    def write_eval(self, key: str, metrics: dict[str, float]) -> None:
        """eval.json[key], and with a gold reward the before and after evaluations' per-prompt scores
        in `HELDOUT_SCORES_FILE`, which the reward-hacking check pairs."""
        super().write_eval(key, metrics)
        if not self.is_main or key not in ("before", "after") or self.gold_reward_fn is None:
            return
        path = self.run_dir / HELDOUT_SCORES_FILE
        saved = json.loads(path.read_text()) if path.is_file() else {}
        saved[key] = self.last_heldout_scores
        write_json(path, saved, indent=None)

    @property
    def result_dir(self) -> Path:
        """Where `save_result` writes the trained model once the run reaches `steps`."""
        return self.run_dir / "final"

    def superseded_result(self) -> tuple[Path, Path] | None:
        """(`final/`, where it moves) when this launch continues the run past an earlier result: a run
        killed before its new end must not leave the earlier model under the name of the run's result."""
        start = self.resume_from.step if self.resume_from is not None else 0
        if not self.result_dir.exists() or start >= self.config.steps:
            return None
        return self.result_dir, self.run_dir / f"final-before-step-{start:08d}"

    def prepare_run_dir(self) -> None:
        super().prepare_run_dir()
        moved = self.superseded_result()
        if moved is not None and moved[1].exists():
            raise ConfigError(
                f"{moved[0]} is the result of an earlier launch and {moved[1]} exists too: move one of "
                "them out of the run directory before continuing the run"
            )

    def start_run_dir(self) -> None:
        super().start_run_dir()
        moved = self.superseded_result()
        if self.is_main and moved is not None:
            moved[0].rename(moved[1])
            print(
                f"moved {moved[0]} to {moved[1]}: this launch continues the run to step "
                f"{self.config.steps} and writes a new final/ when it gets there",
                file=sys.stderr,
            )

    def train(self) -> dict[str, Any]:
        result = super().train()
        if self.is_main:
            self.save_result()
            self.check_reward_hacking()
        return result

    def check_reward_hacking(self) -> dict[str, Any] | None:
        """With a gold reward: whether the trained reward's held-out score rose and the gold score fell
        from the first evaluation (eval.json `before`) to the last (`after`), written to
        eval.json[`DIVERGENCE_KEY`] with both changes, and a warning line when it did."""
        if self.gold_reward_fn is None:
            return None
        path = self.run_dir / "eval.json"
        evals = json.loads(path.read_text()) if path.is_file() else {}
        scores_path = self.run_dir / HELDOUT_SCORES_FILE
        scores = json.loads(scores_path.read_text()) if scores_path.is_file() else {}
        record = reward_hacking_record(
            evals.get("before"),
            evals.get("after"),
            self.trained_heldout_key(),
            f"heldout_{GOLD_KEY}",
            self.config.eval.divergence_margin,
            scores.get("before"),
            scores.get("after"),
        )
        if record is None:
            return None
        self.write_eval(DIVERGENCE_KEY, record)
        if record["gold_fell"]:
            gold = self.config.eval.gold_reward["name"]
            noise = (
                ""
                if not record["gold_se"]
                else f" ({-record['gold_delta'] / record['gold_se']:.1f} paired s.e.)"
            )
            what, moved = (
                ("reward hacking suspected", "rose")
                if record["reward_hacking_suspected"]
                else ("the run degraded", "moved")
            )
            print(
                f"warning: {what}: the trained reward's {record['trained_metric']} {moved} by "
                f"{record['trained_delta']:+.4f} while the gold reward {gold} (heldout_gold) fell by "
                f"{record['gold_delta']:+.4f}{noise} from the first to the last evaluation; inspect the "
                f"samples in {self.samples_dir} (eval.json: {DIVERGENCE_KEY})",
                file=sys.stderr,
            )
        return record

    def save_result(self) -> None:
        """The trained model (EMA weights when train.ema_decay > 0): a full pipeline (save_pretrained), or
        a LoRA result that plain diffusers loads at the trained strength with `pipe.load_lora_weights`
        and that names its base model (model.path) for `diffusion_rl.loading.load`. It is written into
        a temporary sibling renamed into place, so a write that fails (a full disk) or is killed never
        leaves a half-written `final/`; a result there before stays until the new one replaces it."""
        import os
        import shutil

        out = self.result_dir
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        replaced = out.with_name(f".{out.name}.replaced-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        denoiser = self.accelerator.unwrap_model(self.model)
        try:
            with self.ema_weights():
                if self.config.model.lora_rank > 0:
                    self.pipe.save_lora_weights(tmp, denoiser, self.config.model.path)
                else:
                    self.pipe.with_denoiser(denoiser).save_pretrained(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if out.exists():
            os.replace(out, replaced)
        os.replace(tmp, out)
        shutil.rmtree(replaced, ignore_errors=True)
