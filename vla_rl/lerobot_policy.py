"""LeRobot policies (ACT, Diffusion, SmolVLA, ...) in the sim evaluation, with `VLAPolicy`'s `act`.

`LeRobotPolicy.from_pretrained(DIR)` loads a directory written by LeRobot >= 0.4: the policy's
`save_pretrained` (config.json, model.safetensors) plus its pre/post-processors' `save_pretrained`
(policy_preprocessor.json, policy_postprocessor.json and their state files: the normalisation
statistics), as `lerobot-train` leaves them in `checkpoints/*/pretrained_model`. `mmrl eval vla`
takes such a directory in `policies=[...]` next to VLAPolicy directories: `vla_rl.loading.load` tells
the two apart by the `type` field of a LeRobot config.json ("act", "diffusion", ...), which VLAPolicy's
lacks.

The sim's observations are mapped to the policy's `input_features` as LeRobot's own gym evaluation
does: `image` (H, W, 3) uint8 -> the one VISUAL feature (`observation.image` or
`observation.images.*`), (3, H, W) float in [0, 1]; `proprio` (or the first entries of `state`) ->
`observation.state`; the instruction -> `task`. The pre-processor normalises, the policy's
`select_action` runs, the post-processor un-normalises, and actions are clipped to the sim's [-1, 1].

LeRobot keeps one action queue (and observation history) for the whole batch, but `reset(rows)`
must give some rows a fresh chunk while the others go on. So the adapter keeps a copy of that
per-episode state per *cohort*, the rows last reset together; each cohort acts with its own state,
and rows that have left a cohort are still fed to it (their actions are dropped) so that its queued
tensors keep their batch size (each cohort is one `select_action` call per step). A row thus gets
the actions LeRobot would give it alone (exactly so for a deterministic policy such as ACT).

Fine-tuning (`mmrl train vla/smolvla_habc`): a flow-matching policy (SmolVLA) samples whole action
chunks for the rollouts (`sample_chunks`, its noise drawn from the rollout's generator), and learns by
a weighted flow-matching loss on action chunks (`chunk_loss`): each target step's velocity error,
weighted by the method's per-step weight (HABC's advantage weights, AWR's, 1 for BC). Without
log-probabilities such a policy cannot take GRPO's likelihood ratio, so GRPO refuses it.

SmolVLA (LeRobot's smolvla extra: transformers < 5) builds its VLM from the config, tokenizer and
processor files at its config's `vlm_model_name` even when the weights come from the checkpoint:
a hub id (SmolVLM2 for `lerobot/smolvla_base`) needs the hub or its local cache, so offline point
`vlm_model_name` in config.json at a local copy of those files.

LeRobot is an optional extra that pins an older torch; see docs/robot.md (LeRobot policies) for a
separate environment next to torch 2.13.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from mmrl.losses import aggregate_loss
from vla_rl.policy import as_batch

INSTALL_HINT = (
    "LeRobot policies need LeRobot >= 0.4 (pip install 'mmrl[lerobot]'); LeRobot pins an older torch, "
    "so install it into a separate venv with torch==2.13.0 and torchvision==0.28.0 from PyPI, "
    "`pip install --no-deps lerobot==0.4.4` and its other requirements (docs/robot.md: LeRobot policies)"
)
PREPROCESSOR, POSTPROCESSOR = "policy_preprocessor.json", "policy_postprocessor.json"
FLOW_MATCHING = ("smolvla",)  # LeRobot policy types the trainer can fine-tune (chunk sampling and loss)


def import_lerobot() -> dict[str, Any]:
    """The LeRobot entry points the adapter uses; ImportError with the install recipe if unusable."""
    try:
        from lerobot.configs.policies import PreTrainedConfig
        from lerobot.configs.types import FeatureType
        from lerobot.policies.factory import get_policy_class, make_pre_post_processors
    except Exception as err:  # missing, too old, or broken (a torchvision that does not match torch)
        raise ImportError(f"{INSTALL_HINT}. Importing LeRobot failed: {err!r}") from err
    return {
        "PreTrainedConfig": PreTrainedConfig,
        "FeatureType": FeatureType,
        "get_policy_class": get_policy_class,
        "make_pre_post_processors": make_pre_post_processors,
    }


@dataclass
class LeRobotActingConfig:
    """What the evaluation needs to know (LeRobot's own config is `LeRobotPolicy.policy.config`)."""

    policy_type: str
    image_key: str  # the VISUAL input feature the camera frame goes to
    image_size: int  # square frames: the envs are made with this size
    state_key: str | None  # the STATE input feature, if the policy reads proprioception
    state_dim: int
    action_dim: int
    horizon: int  # actions per predicted chunk
    n_action_steps: int  # actions of a chunk executed before the next is predicted


@dataclass
class _Cohort:
    rows: np.ndarray  # batch rows this state acts for (rows reset later belong to a newer cohort)
    state: dict[str, Any]  # the policy's per-episode attributes (action queue, observation history)


class LeRobotPolicy(nn.Module):
    """A LeRobot policy with `VLAPolicy`'s `act` / `reset` / `config.image_size`, so that the episode loop
    (`vla_rl.episodes.PolicyActs`) runs it like a VLAPolicy."""

    def __init__(self, policy: nn.Module, preprocessor: Any, postprocessor: Any) -> None:
        super().__init__()
        feature_type = import_lerobot()["FeatureType"]
        cfg = policy.config
        images = [k for k, f in cfg.input_features.items() if f.type is feature_type.VISUAL]
        states = [k for k, f in cfg.input_features.items() if f.type is feature_type.STATE]
        other = [
            k
            for k, f in cfg.input_features.items()
            if f.type not in (feature_type.VISUAL, feature_type.STATE)
        ]
        problems = []
        if len(images) != 1:
            problems.append(f"{len(images)} camera inputs {images}, the sim renders one")
        elif cfg.input_features[images[0]].shape[1] != cfg.input_features[images[0]].shape[2]:
            problems.append(
                f"{images[0]} is {tuple(cfg.input_features[images[0]].shape)}, the sim's is square"
            )
        if len(states) > 1:
            problems.append(f"{len(states)} state inputs {states}, the sim gives one proprioception vector")
        if other:
            problems.append(f"inputs the sim's camera mode does not give: {other}")
        if problems:
            raise ValueError(f"LeRobot policy {cfg.type!r} does not fit the sim tasks: {'; '.join(problems)}")
        self.policy, self.preprocessor, self.postprocessor = policy, preprocessor, postprocessor
        self.config = LeRobotActingConfig(
            policy_type=cfg.type,
            image_key=images[0],
            image_size=int(cfg.input_features[images[0]].shape[-1]),
            state_key=states[0] if states else None,
            state_dim=int(cfg.input_features[states[0]].shape[0]) if states else 0,
            action_dim=int(cfg.output_features["action"].shape[0]),
            horizon=int(getattr(cfg, "chunk_size", getattr(cfg, "horizon", 1))),
            n_action_steps=int(cfg.n_action_steps),
        )
        # Per-episode state: the instance attributes that are not nn.Module bookkeeping or the config.
        # A fresh copy is taken now, right after reset(), so that new cohorts never share it.
        self._state_keys = [k for k in vars(policy) if k not in vars(nn.Module()) and k != "config"]
        policy.reset()
        self._fresh = copy.deepcopy({k: vars(policy)[k] for k in self._state_keys})
        self._cohorts: list[_Cohort] | None = None
        self._size = 0

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: str | torch.device = "cpu") -> LeRobotPolicy:
        """Load a LeRobot policy directory (local files only) with its processors onto `device`."""
        lerobot = import_lerobot()
        directory = Path(directory)
        missing = [
            n
            for n in ("config.json", "model.safetensors", PREPROCESSOR, POSTPROCESSOR)
            if not (directory / n).is_file()
        ]
        if missing:
            raise FileNotFoundError(
                f"{directory} has no {', '.join(missing)}: give a LeRobot (>= 0.4) policy directory with its "
                "processors, e.g. checkpoints/last/pretrained_model of lerobot-train, or call "
                "save_pretrained(DIR) on the policy and on both processors (make_pre_post_processors). "
                "Checkpoints of LeRobot < 0.4 keep the statistics in the model: convert them with "
                "python -m lerobot.processor.migrate_policy_normalization --pretrained-path DIR"
            )
        config = lerobot["PreTrainedConfig"].from_pretrained(directory, local_files_only=True)
        config.device = str(device)
        policy = lerobot["get_policy_class"](config.type).from_pretrained(directory, config=config)
        steps = json.loads((directory / PREPROCESSOR).read_text()).get("steps", [])
        overrides = {"device_processor": {"device": str(device)}}
        has_device_step = any(s.get("registry_name") == "device_processor" for s in steps)
        preprocessor, postprocessor = lerobot["make_pre_post_processors"](
            config,
            pretrained_path=str(directory),
            preprocessor_overrides=overrides if has_device_step else {},
        )
        return cls(policy, preprocessor, postprocessor).eval()

    @property
    def device(self) -> torch.device:
        return torch.device(self.policy.config.device)

    def prepare(self, obs: Mapping[str, np.ndarray], instructions: Sequence[str]) -> dict[str, Any]:
        """LeRobot's raw observation batch (before the pre-processor) from stacked env observations:
        "image" (B, H, W, 3) uint8 and "proprio" or "state" (the first state_dim entries are used)."""
        cfg = self.config
        image = torch.as_tensor(np.asarray(obs["image"]))
        if image.dtype != torch.uint8 or tuple(image.shape[1:]) != (cfg.image_size, cfg.image_size, 3):
            raise ValueError(
                f"images are {tuple(image.shape)} {image.dtype}; the policy wants (B, {cfg.image_size}, "
                f"{cfg.image_size}, 3) uint8 (make the envs with image_size={cfg.image_size})"
            )
        batch: dict[str, Any] = {cfg.image_key: image.permute(0, 3, 1, 2).float() / 255.0}
        if cfg.state_key is not None:
            state = np.asarray(obs["proprio"] if "proprio" in obs else obs["state"][..., : cfg.state_dim])
            if state.shape[-1] != cfg.state_dim:
                raise ValueError(
                    f"the policy reads {cfg.state_dim} state entries, the env gives {state.shape[-1]}"
                )
            batch[cfg.state_key] = torch.as_tensor(state, dtype=torch.float32)
        batch["task"] = [str(text) for text in instructions]
        return batch

    def reset(self, indices: Sequence[int] | np.ndarray | None = None) -> None:
        """Forget the queued actions and observation history of all rows, or of the given rows only."""
        if indices is None:
            self._cohorts = None
        elif self._cohorts is not None and len(indices):
            self._cohorts.append(_Cohort(np.asarray(indices, dtype=np.int64), copy.deepcopy(self._fresh)))

    @torch.no_grad()
    def act(
        self,
        obs: Mapping[str, np.ndarray],
        instruction: str | Sequence[str],
        deterministic: bool = True,
        generator: torch.Generator | None = None,
    ) -> np.ndarray:
        """The next action (action_dim,) for one env's observation, or (B, action_dim) for stacked ones.

        LeRobot policies have no separate mean action (ACT is deterministic, Diffusion always samples),
        so `deterministic` is ignored; with a `generator`, each call seeds the policy's noise from it,
        so that a seeded evaluation repeats."""
        obs, instruction, single = as_batch(obs, instruction)
        size = len(obs["image"])
        if self._cohorts is None or size != self._size:
            self._cohorts, self._size = [_Cohort(np.arange(size), copy.deepcopy(self._fresh))], size
        owner = np.zeros(size, dtype=np.int64)  # the newest cohort of each row acts for it
        for i, cohort in enumerate(self._cohorts):
            owner[cohort.rows] = i
        self._cohorts = [c for i, c in enumerate(self._cohorts) if (owner[c.rows] == i).any()]
        batch = self.prepare(obs, instruction)
        actions = np.zeros((size, self.config.action_dim), dtype=np.float32)
        seed = None if generator is None else int(torch.randint(2**62, (1,), generator=generator))
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            for cohort in self._cohorts:  # oldest first: a newer cohort overwrites the rows it took
                rows = cohort.rows
                part = {k: [v[r] for r in rows] if isinstance(v, list) else v[rows] for k, v in batch.items()}
                vars(self.policy).update(cohort.state)
                action = self.postprocessor(self.policy.select_action(self.preprocessor(part)))
                cohort.state = {k: vars(self.policy)[k] for k in self._state_keys}
                actions[rows] = action.float().cpu().numpy().reshape(len(rows), -1)
        actions = np.clip(actions, -1.0, 1.0)
        return actions[0] if single else actions

    # ----- fine-tuning (flow-matching policies) ----------------------------------------------------
    def _flow_model(self) -> Any:
        """The LeRobot policy, if `sample_chunks` and `chunk_loss` work for it (a flow-matching head)."""
        if self.config.policy_type not in FLOW_MATCHING:
            raise ValueError(
                f"fine-tuning needs a flow-matching LeRobot policy ({', '.join(FLOW_MATCHING)}); "
                f"{self.config.policy_type!r} is supported in evaluation only"
            )
        return self.policy

    def _noise(self, rows: int, generator: torch.Generator) -> Tensor:
        """Standard-normal noise for `rows` chunks, padded to the model's action width, from `generator`."""
        cfg = self.policy.config
        shape = (rows, self.config.horizon, cfg.max_action_dim)
        return torch.randn(shape, generator=generator).to(self.device)

    @torch.no_grad()
    def sample_chunks(
        self,
        obs: Mapping[str, np.ndarray],
        instructions: Sequence[str],
        generator: torch.Generator,
        std_scale: float = 1.0,
    ) -> np.ndarray:
        """Sampled action chunks (B, horizon, action_dim) in the sim's units, clipped to [-1, 1]: the
        flow is integrated from noise drawn from `generator`, so a seeded generator repeats them.
        `std_scale` must be 1: a flow-matching policy has no std to scale."""
        policy = self._flow_model()
        if std_scale != 1.0:
            raise ValueError(f"std_scale = {std_scale}: a flow-matching policy samples at its own spread (1)")
        batch = self.preprocessor(self.prepare(obs, instructions))
        chunks = policy.predict_action_chunk(batch, noise=self._noise(len(instructions), generator))
        return np.clip(self.postprocessor(chunks).float().cpu().numpy(), -1.0, 1.0)

    def chunk_loss(
        self,
        batch: Mapping[str, Any],
        actions: Tensor,
        mask: Tensor,
        weight: Tensor,
        generator: torch.Generator,
    ) -> Tensor:
        """The weighted flow-matching loss of action chunks (B, horizon, action_dim) in the sim's units
        given the raw observations `batch` (`prepare`): each target step's mean squared velocity error
        over the action entries, times `weight` (B, horizon), summed where `mask` (B, horizon) and
        divided by the number of masked-in steps. Noise and flow times come from `generator`."""
        from lerobot.utils.constants import ACTION, OBS_LANGUAGE_ATTENTION_MASK, OBS_LANGUAGE_TOKENS

        policy = self._flow_model()
        inputs = self.preprocessor({**batch, ACTION: actions.to(self.device)})
        images, image_masks = policy.prepare_images(inputs)
        seed = int(torch.randint(2**62, (1,), generator=generator))
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)  # the model draws its own noise and flow times
            losses = policy.model.forward(
                images,
                image_masks,
                inputs[OBS_LANGUAGE_TOKENS],
                inputs[OBS_LANGUAGE_ATTENTION_MASK],
                policy.prepare_state(inputs),
                policy.prepare_action(inputs),
            )
        per_step = losses[..., : self.config.action_dim].mean(-1)  # (B, horizon)
        return aggregate_loss(weight.to(per_step.device) * per_step, mask.to(per_step.device), "token_mean")

    def save_pretrained(self, directory: str | Path) -> None:
        """The policy and both processors, as `from_pretrained` (and LeRobot itself) read them back."""
        for part in (self.policy, self.preprocessor, self.postprocessor):
            part.save_pretrained(directory)


__all__ = ["LeRobotActingConfig", "LeRobotPolicy", "import_lerobot"]
