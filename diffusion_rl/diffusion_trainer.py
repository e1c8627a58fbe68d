"""What every text-to-image trainer shares, whatever its objective: prompts and reward, the pipeline
(full fine-tune or LoRA), the frozen reference, the optimizer, the prompt sampler, rewards gathered
over processes, the EMA of the trained weights, held-out evaluation and the saved result.

`BranchGRPOTrainer` (`diffusion_rl.trainer`: PPO on SDE steps of denoising trees) and
`DiffusionNFTTrainer` (`diffusion_rl.nft_trainer`: forward-process training on clean samples) add
their rollout and update. A config for this class has the sections `model`, `rollout` (with
`prompts_per_step` and `image_size`), `train` (with `lr`, `kl_coef`, `sampler`, `sampler_options`,
`ema_decay`), `reward` and `eval`, and a `prompt_file`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch

from diffusion_rl.models import FlowPipeline
from diffusion_rl.rewards import RewardServerError
from diffusion_rl.sampling import evaluate_alignment
from diffusion_rl.shapes import train_prompts
from mmrl.config import ConfigError, shipped_path
from mmrl.registry import REWARDS, UnknownNameError
from mmrl.samplers import build_sampler
from mmrl.trainer import Trainer, TrainingStopped
from mmrl.tree import RolloutTree

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


class StepRewards(NamedTuple):
    """Every process's leaf rewards of a step, in rank order."""

    rewards: torch.Tensor
    groups: torch.Tensor  # per leaf: its tree's slot (group j is the prompt chosen[j])
    offset: int  # where this process's leaves start


def load_prompts(prompt_file: str | None) -> list[str]:
    if prompt_file is None:
        return train_prompts()
    path = Path(prompt_file)
    if not path.is_file():
        raise ConfigError(
            f"config error: prompt_file = {prompt_file!r} does not exist; give a text file with one "
            "prompt per line, or null for the built-in shapes prompts"
        )
    prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ConfigError(f"config error: prompt_file = {prompt_file!r} holds no prompts (one per line)")
    return prompts


def resolve_model_path(path: str) -> Path:
    """A model directory as given (relative to the working directory), or relative to the repository."""
    found = shipped_path(path)
    if found.is_dir():
        return found
    raise ConfigError(
        f"config error: model.path = {path!r} is not a directory; run `mmrl pretrain diffusion` "
        "and pass model.path=runs/pretrain/diffusion/pipeline, or give a local model directory"
    )


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
        self.prompts = load_prompts(cfg.prompt_file)
        try:
            self.reward_fn = REWARDS.get(cfg.reward.name)(**cfg.reward.options)
        except UnknownNameError as err:
            raise ConfigError(f"config error: reward.name: {err}") from None
        except TypeError as err:
            raise ConfigError(f"config error: reward.options = {cfg.reward.options}: {err}") from None
        model_dir = resolve_model_path(cfg.model.path)
        try:
            self.pipe = FlowPipeline.from_pretrained(model_dir)
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError(f"config error: model.path = {cfg.model.path!r}: {err}") from None
        self.pipe.to(self.accelerator.device)
        if cfg.rollout.image_size is not None:
            try:
                self.pipe.set_image_size(cfg.rollout.image_size)
            except ValueError as err:
                raise ConfigError(
                    f"config error: rollout.image_size = {cfg.rollout.image_size}: {err}"
                ) from None
        self.check_size()
        self.reference = None
        if cfg.train.kl_coef > 0:
            self.reference = copy.deepcopy(self.pipe.denoiser).requires_grad_(False)
        if cfg.model.lora_rank > 0:
            from peft import LoraConfig

            self.pipe.denoiser.requires_grad_(False)
            self.pipe.denoiser.add_adapter(
                LoraConfig(
                    r=cfg.model.lora_rank,
                    lora_alpha=cfg.model.lora_alpha or cfg.model.lora_rank,
                    init_lora_weights="gaussian",
                    target_modules=LORA_TARGETS,
                )
            )
        self.trained_params = [p for p in self.pipe.denoiser.parameters() if p.requires_grad]
        self.ema = [p.detach().clone() for p in self.trained_params] if cfg.train.ema_decay > 0 else None
        self.prepare_model_and_optimizer(
            self.pipe.denoiser, self.trained_params, lr=cfg.train.lr, weight_decay=0.0
        )
        self.sampler = build_sampler(
            cfg.train.sampler, cfg.train.sampler_options, len(self.prompts), cfg.seed, "train.sampler_options"
        )
        self.uncond_one = self.pipe.encode_prompts([""])

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
        """Rewards of the leaves (`latents`, tree-major; `prompts` one per tree) and their images."""
        images = self.pipe.decode(latents)
        leaf_prompts = [prompts[t] for t, tree in enumerate(trees) for _ in tree.leaves()]
        try:
            rewards = self.reward_fn(images, prompts=leaf_prompts).float().cpu()
        except RewardServerError as err:
            raise TrainingStopped(f"reward server failed: {err}") from err
        return rewards, images

    def gather_rewards(self, slots: list[int], rewards: torch.Tensor) -> StepRewards:
        """Every process's leaf rewards, so that the sampler's state stays the same on every process
        and group statistics span them all."""
        gathered = self.gather([(slots, rewards.tolist())], "every process's leaf rewards")
        all_slots = torch.tensor([s for part in gathered for s in part[0]])
        leaves_per_tree = len(rewards) // len(slots)
        rank = self.accelerator.process_index
        return StepRewards(
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

    def evaluate(self) -> dict[str, float]:
        cfg = self.config.eval
        with self.ema_weights():
            return evaluate_alignment(self.pipe, cfg.prompts, cfg.steps, cfg.guidance_scale, self.config.seed)

    def train(self) -> dict[str, Any]:
        result = super().train()
        if self.is_main:
            self.save_result()
        return result

    def save_result(self) -> None:
        """The trained model (EMA weights when train.ema_decay > 0): a full pipeline (save_pretrained), or
        a LoRA result that plain diffusers loads at the trained strength with `pipe.load_lora_weights`
        and that names its base model (model.path) for `FlowPipeline.from_pretrained`."""
        out = self.run_dir / "final"
        denoiser = self.accelerator.unwrap_model(self.model)
        with self.ema_weights():
            if self.config.model.lora_rank > 0:
                self.pipe.save_lora_weights(out, denoiser, self.config.model.path)
            else:
                self.pipe.with_denoiser(denoiser).save_pretrained(out)
