"""A small vision-language-action policy: camera image + instruction + proprioception -> action chunk.

LeRobot-style split: `VLAConfig` (a dataclass saved as config.json) and `VLAPolicy` (the torch module,
weights and normalisation statistics saved as model.safetensors).

- Image: a 3-layer CNN (GroupNorm, ReLU) on the 96x96 camera frame, then a spatial softmax that turns
  each of `keypoints` feature maps into the expected (x, y) of its activation: where things are is what
  a pick-and-place policy needs, and it is cheap.
- Instruction: word embeddings, read by a GRU, so that word order ("the red cube on the green pad") is
  kept. The vocabulary of a new policy holds the sim tasks' instruction templates and colours plus
  every word of the instructions of the task it is built for (`task_vocabulary`); it is saved in
  config.json. A word outside it reads as <unk>, with a warning naming it (once); fine-tuning adds the
  task's new words with `add_words`, their embeddings starting as <unk>'s.
- Proprioception: the first `proprio_dim` entries of the state (end-effector pose and velocity,
  gripper opening), standardised with the demonstrations' statistics. Never object poses: the policy
  must find the cube in the image.
- Auxiliary head (training only, `state_index`): a linear map from the image keypoints and instruction
  state to privileged object positions of the simulator (the instructed cube's and pad's), standardised.
  Behaviour cloning alone taught the encoder to find the objects poorly: the base's failed releases
  lay centimetres from the pad (docs/results.md, "Robot base"). The labels are free in simulation; the
  head is never used to act.
- Head: an MLP over the concatenated features gives, for each of `horizon` future actions, the mean and
  the (state-dependent, bounded) standard deviation of a `ClippedGaussian` over [-1, 1].

At inference `act` executes the first `n_action_steps` actions of a chunk before predicting the next
(chunk execution, as LeRobot's action queue): an executed action is always an action of a sampled chunk,
so its log-probability under `log_prob` is exactly that of the behaviour, which RL needs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from mmrl.config import ConfigError, describe_saved_model, read_json_object

PAD, UNK = "<pad>", "<unk>"
# The instruction templates of sim/tasks.py (one "{}" per colour); tests check that every instruction
# the tasks produce is covered by the vocabulary built from these.
INSTRUCTION_TEMPLATES = (
    "move the gripper to the {} ball",
    "push the {} cube onto the {} circle",
    "put the {} cube on the {} pad",
)
CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def instruction_words(text: str) -> list[str]:
    """The words of an instruction as the policy reads them (lower case, split at white space)."""
    return text.lower().split()


def task_vocabulary(instructions: Iterable[str] = ()) -> list[str]:
    """PAD, UNK, then every word of the sim tasks' instructions (templates and colours) and of
    `instructions` (those of the task a new policy is built for, e.g. an external task's), sorted."""
    from sim.env import PALETTE  # the robot extra: only building a new policy needs it

    words = {w for template in INSTRUCTION_TEMPLATES for w in template.split() if w != "{}"}
    words |= {w for text in instructions for w in instruction_words(text)}
    return [PAD, UNK, *sorted(words | set(PALETTE))]


@dataclass
class VLAConfig:
    """Everything needed to rebuild a `VLAPolicy` (saved as config.json)."""

    vocabulary: list[str] = field(
        default_factory=list
    )  # [PAD, UNK, words...]; `task_vocabulary`, `add_words`
    image_size: int = 96  # square camera frames, pixels
    proprio_dim: int = 9
    action_dim: int = 5
    horizon: int = 8  # actions per predicted chunk
    n_action_steps: int = 4  # actions of a chunk executed by `act` before it predicts the next chunk
    channels: list[int] = field(default_factory=lambda: [16, 32, 32])  # conv widths (strides 2, 2, 1, ...)
    keypoints: int = 32  # spatial-softmax keypoints
    state_index: list[int] = field(default_factory=list)  # env state entries the auxiliary head predicts
    word_dim: int = 32
    text_dim: int = 64  # GRU state size
    max_words: int = 12  # longer instructions are cut
    hidden: int = 256  # fusion MLP width
    min_std: float = 0.02  # bounds of the action standard deviation
    max_std: float = 1.0

    def __post_init__(self) -> None:
        problems = []
        if self.vocabulary[:2] != [PAD, UNK]:
            problems.append(f"vocabulary must start with {PAD!r}, {UNK!r} (got {self.vocabulary[:2]})")
        if self.image_size < 16:
            problems.append(f"image_size = {self.image_size}; at least 16")
        for name in ("proprio_dim", "action_dim", "horizon", "keypoints", "word_dim", "text_dim", "hidden"):
            if getattr(self, name) < 1:
                problems.append(f"{name} = {getattr(self, name)}; at least 1")
        if not 1 <= self.n_action_steps <= self.horizon:
            problems.append(f"n_action_steps = {self.n_action_steps}; between 1 and horizon = {self.horizon}")
        if not self.channels or min(self.channels) < 1:
            problems.append(f"channels = {self.channels}; a non-empty list of positive widths")
        if not 0 < self.min_std < self.max_std:
            problems.append(f"min_std = {self.min_std}, max_std = {self.max_std}; need 0 < min_std < max_std")
        if problems:
            raise ValueError("VLAConfig: " + "; ".join(problems))


class ClippedGaussian:
    """Independent Gaussians per action entry whose samples are clipped to [-1, 1].

    The mass beyond a bound sits on the bound, so an action exactly at -1 or 1 (a saturated expert
    command, or a clipped sample) has a finite log-probability: log P(u <= -1) or log P(u >= 1), and an
    interior action has the Gaussian log-density. Mixing densities and point masses is a proper
    likelihood (density against Lebesgue measure plus atoms at the bounds), and a given action always
    takes the same branch, so likelihood ratios and weighted log-likelihoods stay exact. Unlike a tanh
    squash, the mean is unconstrained and the bounds need no epsilon.
    """

    low, high = -1.0, 1.0

    def __init__(self, mean: Tensor, std: Tensor) -> None:
        self.mean, self.std = mean, std
        self.state_loss: Tensor | None = None  # the policy's auxiliary loss, when it computed one

    def mode(self) -> Tensor:
        """The deterministic action: the clipped mean."""
        return self.mean.clamp(self.low, self.high)

    def scaled(self, factor: float) -> ClippedGaussian:
        """The same mean with the std times `factor`: a narrower distribution to explore with."""
        return ClippedGaussian(self.mean, self.std * factor)

    def sample(self, noise: Tensor | None = None, generator: torch.Generator | None = None) -> Tensor:
        """Clipped mean + std * noise; pass standard-normal `noise` (e.g. keyed noise) to replay a draw."""
        if noise is None:
            noise = torch.randn(
                self.mean.shape, generator=generator, device=self.mean.device, dtype=self.mean.dtype
            )
        return (self.mean + self.std * noise).clamp(self.low, self.high)

    def log_prob(self, action: Tensor) -> Tensor:
        """Elementwise log-probability (same shape as the mean)."""
        z = (action - self.mean) / self.std
        inside = -0.5 * z.square() - self.std.log() - _LOG_SQRT_2PI
        below = torch.special.log_ndtr((self.low - self.mean) / self.std)
        above = torch.special.log_ndtr((self.mean - self.high) / self.std)
        return torch.where(action <= self.low, below, torch.where(action >= self.high, above, inside))


class SpatialSoftmax(nn.Module):
    """Feature maps (B, C, H, W) -> the expected (x, y) in [-1, 1] of each map's softmax: (B, 2C)."""

    def __init__(self, height: int, width: int) -> None:
        super().__init__()
        ys, xs = torch.meshgrid(torch.linspace(-1, 1, height), torch.linspace(-1, 1, width), indexing="ij")
        self.register_buffer("grid", torch.stack([xs.flatten(), ys.flatten()], -1), persistent=False)

    def forward(self, features: Tensor) -> Tensor:
        attention = features.flatten(2).softmax(-1)  # (B, C, H*W)
        return (attention @ self.grid).flatten(1)


class VLAPolicy(nn.Module):
    """Image + instruction + proprioception -> a `ClippedGaussian` over the next `horizon` actions.

    A batch is a dict: "image" uint8 (B, 3, H, W), "proprio" float (B, proprio_dim), "tokens" long
    (B, max_words) from `tokenize`. `prepare` builds one from environment observations.
    """

    def __init__(self, config: VLAConfig) -> None:
        super().__init__()
        self.config = config
        layers: list[nn.Module] = []
        width, size = 3, config.image_size
        for i, out in enumerate(config.channels):
            stride = 2 if i < 2 else 1
            layers += [nn.Conv2d(width, out, 3, stride, 1), nn.GroupNorm(math.gcd(8, out), out), nn.ReLU()]
            width, size = out, (size - 1) // stride + 1
        layers.append(nn.Conv2d(width, config.keypoints, 1))
        self.image_encoder = nn.Sequential(*layers, SpatialSoftmax(size, size))
        self.embed = nn.Embedding(len(config.vocabulary), config.word_dim, padding_idx=0)
        self.text_encoder = nn.GRU(config.word_dim, config.text_dim, batch_first=True)
        features = 2 * config.keypoints + config.text_dim + config.proprio_dim
        self.trunk = nn.Sequential(
            nn.Linear(features, config.hidden),
            nn.LayerNorm(config.hidden),
            nn.ReLU(),
            nn.Linear(config.hidden, config.hidden),
            nn.ReLU(),
        )
        self.head = nn.Linear(config.hidden, 2 * config.horizon * config.action_dim)
        self.register_buffer("proprio_mean", torch.zeros(config.proprio_dim))
        self.register_buffer("proprio_std", torch.ones(config.proprio_dim))
        self.state_head: nn.Linear | None = None
        if config.state_index:
            self.state_head = nn.Linear(2 * config.keypoints + config.text_dim, len(config.state_index))
            self.register_buffer("state_mean", torch.zeros(len(config.state_index)))
            self.register_buffer("state_std", torch.ones(len(config.state_index)))
        self._word_index = {word: i for i, word in enumerate(config.vocabulary)}
        self._reported_unknown: set[str] = set()  # words `tokenize` has warned about
        self._queue: np.ndarray | None = None  # (B, horizon, action_dim) chunks being executed by `act`
        self._cursor = np.zeros(0, dtype=np.int64)  # next action of each row's chunk

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    def set_normalization(self, mean: np.ndarray | Tensor, std: np.ndarray | Tensor) -> None:
        """Statistics of the full env state (e.g. the demonstrations'): the proprioception entries
        standardise the input, the `state_index` entries the auxiliary targets. Tiny stds are floored."""
        mean = torch.as_tensor(mean, dtype=torch.float32)
        std = torch.as_tensor(std, dtype=torch.float32).clamp(min=1e-3)
        self.proprio_mean.copy_(mean[: self.config.proprio_dim])
        self.proprio_std.copy_(std[: self.config.proprio_dim])
        if self.state_head is not None:
            self.state_mean.copy_(mean[self.config.state_index])
            self.state_std.copy_(std[self.config.state_index])

    # ----- inputs --------------------------------------------------------------------------------
    def tokenize(self, instructions: Sequence[str]) -> Tensor:
        """Word ids (B, max_words), PAD after the words; words outside the vocabulary become UNK, and
        the first time a word does, a warning names it: the policy cannot tell it from other unknowns."""
        unk = self._word_index[UNK]
        tokens = torch.zeros(len(instructions), self.config.max_words, dtype=torch.long)
        unknown: set[str] = set()
        for row, text in enumerate(instructions):
            words = instruction_words(text)[: self.config.max_words]
            unknown.update(w for w in words if w not in self._word_index)
            ids = [self._word_index.get(w, unk) for w in words]
            tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        new = sorted(unknown - self._reported_unknown)
        if new:
            self._reported_unknown.update(new)
            warnings.warn(
                f"the policy's vocabulary lacks {', '.join(map(repr, new))}: read as {UNK}. Fine-tune it "
                "on the task (`vla_online` adds the task's words) or pretrain a policy for the task",
                stacklevel=2,
            )
        return tokens

    def add_words(self, words: Iterable[str]) -> list[str]:
        """Grow the vocabulary by the `words` it lacks (appended in sorted order, so the same call on
        the same policy gives the same ids) and return them. Their embeddings start as UNK's, so the
        policy acts as before until training tells them apart. Call it before building an optimizer."""
        new = sorted({w for w in words if w not in self._word_index})
        if not new:
            return []
        old = self.embed.weight
        grown = nn.Embedding(
            len(old) + len(new), old.shape[1], padding_idx=0, device=old.device, dtype=old.dtype
        )
        with torch.no_grad():
            grown.weight[: len(old)] = old
            grown.weight[len(old) :] = old[self._word_index[UNK]]
        self.embed = grown
        self.config = dataclasses.replace(self.config, vocabulary=[*self.config.vocabulary, *new])
        self._word_index = {word: i for i, word in enumerate(self.config.vocabulary)}
        return new

    def prepare(self, obs: Mapping[str, np.ndarray], instructions: Sequence[str]) -> dict[str, Tensor]:
        """A batch from stacked env observations: "image" (B, H, W, 3) uint8 and "proprio" or "state"
        (the first proprio_dim entries are used)."""
        proprio = obs["proprio"] if "proprio" in obs else obs["state"][..., : self.config.proprio_dim]
        return {
            "image": torch.as_tensor(obs["image"], device=self.device).permute(0, 3, 1, 2),
            "proprio": torch.as_tensor(proprio, dtype=torch.float32, device=self.device),
            "tokens": self.tokenize(instructions).to(self.device),
        }

    # ----- model ---------------------------------------------------------------------------------
    def forward(self, batch: Mapping[str, Tensor]) -> ClippedGaussian:
        """The action-chunk distribution, mean and std of shape (B, horizon, action_dim).

        With a "state" entry (B, state_dim) in the batch and an auxiliary head, the distribution also
        carries `state_loss`: the mean squared error of the standardised `state_index` entries."""
        cfg = self.config
        image = batch["image"].float() / 127.5 - 1.0
        tokens = batch["tokens"]
        lengths = (tokens != 0).sum(1).clamp(min=1).cpu()
        packed = nn.utils.rnn.pack_padded_sequence(
            self.embed(tokens), lengths, batch_first=True, enforce_sorted=False
        )
        text = self.text_encoder(packed)[1][0]
        proprio = (batch["proprio"] - self.proprio_mean) / self.proprio_std
        scene = torch.cat([self.image_encoder(image), text], -1)
        hidden = self.trunk(torch.cat([scene, proprio], -1))
        mean, raw_std = self.head(hidden).view(-1, 2, cfg.horizon, cfg.action_dim).unbind(1)
        std = cfg.min_std + (cfg.max_std - cfg.min_std) * torch.sigmoid(raw_std)
        dist = ClippedGaussian(mean, std)
        if self.state_head is not None and "state" in batch:
            target = (batch["state"][:, cfg.state_index] - self.state_mean) / self.state_std
            dist.state_loss = (self.state_head(scene) - target).square().mean()
        return dist

    def log_prob(self, batch: Mapping[str, Tensor], actions: Tensor, mask: Tensor | None = None) -> Tensor:
        """Log-probability (B,) of action chunks (B, horizon, action_dim), summed over the steps where
        `mask` (B, horizon) is True (all if None) and over action entries."""
        per_entry = self(batch).log_prob(actions)
        if mask is not None:
            per_entry = per_entry * mask.unsqueeze(-1).to(per_entry.dtype)
        return per_entry.sum((1, 2))

    # ----- acting in an environment --------------------------------------------------------------
    def reset(self, indices: Sequence[int] | np.ndarray | None = None) -> None:
        """Drop the chunks being executed (all, or those of the given batch rows), e.g. after an
        episode ends in a vector env, so that the next `act` predicts a fresh chunk for them."""
        if indices is None:
            self._queue = None
        elif self._queue is not None:
            self._cursor[np.asarray(indices, dtype=np.int64)] = self.config.n_action_steps

    @torch.no_grad()
    def act(
        self,
        obs: Mapping[str, np.ndarray],
        instruction: str | Sequence[str],
        deterministic: bool = True,
        generator: torch.Generator | None = None,
    ) -> np.ndarray:
        """The next action (action_dim,) for one env's observation, or (B, action_dim) for a vector env's
        stacked observations with B instructions. Deterministic (the default, as for a LeRobot policy):
        the clipped mean; else a sample from `generator`."""
        obs, instruction, single = as_batch(obs, instruction)
        size = len(obs["image"])
        if self._queue is None or len(self._queue) != size:
            self._queue = np.zeros((size, self.config.horizon, self.config.action_dim), np.float32)
            self._cursor = np.full(size, self.config.n_action_steps, dtype=np.int64)
        stale = np.flatnonzero(self._cursor >= self.config.n_action_steps)
        if len(stale):
            rows = {k: np.asarray(v)[stale] for k, v in obs.items()}
            dist = self(self.prepare(rows, [str(instruction[i]) for i in stale]))
            chunk = dist.mode() if deterministic else dist.sample(generator=generator)
            self._queue[stale] = chunk.float().cpu().numpy()
            self._cursor[stale] = 0
        actions = self._queue[np.arange(size), self._cursor]
        self._cursor += 1
        return actions[0] if single else actions

    @torch.no_grad()
    def sample_chunks(
        self,
        obs: Mapping[str, np.ndarray],
        instructions: Sequence[str],
        generator: torch.Generator,
        std_scale: float = 1.0,
    ) -> np.ndarray:
        """Action chunks (B, horizon, action_dim) sampled with `generator` from the distribution with
        its std times `std_scale` (exploration in training rollouts)."""
        dist = self(self.prepare(obs, instructions)).scaled(std_scale)
        return dist.sample(generator=generator).float().cpu().numpy()

    # ----- saving --------------------------------------------------------------------------------
    def save_pretrained(self, directory: str | Path) -> None:
        """config.json and model.safetensors (weights and normalisation statistics) in `directory`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG_NAME).write_text(json.dumps(dataclasses.asdict(self.config), indent=1))
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(state, directory / WEIGHTS_NAME, metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: str | torch.device = "cpu") -> VLAPolicy:
        """Load a policy written by `save_pretrained` (a local directory, never the network).

        Another model's directory, or a malformed or mismatched file, is a ConfigError that says what
        was found; a missing file is a FileNotFoundError."""
        directory = Path(directory)
        remake = (
            "give a directory written by VLAPolicy.save_pretrained (e.g. the policy/ folder of "
            "`mmrl pretrain vla`)"
        )
        missing = [name for name in (CONFIG_NAME, WEIGHTS_NAME) if not (directory / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{directory} has no {' or '.join(missing)}: {remake}")
        saved = read_json_object(directory / CONFIG_NAME, remake)
        fields = {f.name for f in dataclasses.fields(VLAConfig)}
        if "vocabulary" not in saved or not set(saved) <= fields:
            raise ConfigError(f"{directory} holds {describe_saved_model(saved)}, not a VLAPolicy: {remake}")
        try:
            policy = cls(VLAConfig(**saved))
            policy.load_state_dict(load_file(directory / WEIGHTS_NAME))
        except (OSError, ValueError, TypeError, RuntimeError, SafetensorError) as err:
            reason = " ".join(str(err).split())  # load_state_dict lists every key: keep the start
            reason = reason if len(reason) <= 300 else reason[:300] + " ..."
            raise ConfigError(f"{directory}: the policy does not load ({reason}): {remake}") from None
        return policy.to(device).eval()


def as_batch(
    obs: Mapping[str, np.ndarray], instruction: str | Sequence[str]
) -> tuple[dict[str, np.ndarray], Sequence[str], bool]:
    """`act`'s input as a batch: (stacked observations, one instruction per row, whether it was one env's)."""
    if np.asarray(obs["image"]).ndim == 3:
        return {k: np.asarray(v)[None] for k, v in obs.items()}, [str(instruction)], True
    if isinstance(instruction, str):
        raise ValueError("a batch of observations needs one instruction per row (a list or array)")
    return dict(obs), instruction, False


def random_shift(images: Tensor, pad: int, generator: torch.Generator) -> Tensor:
    """Shift each image (B, C, H, W) by up to `pad` pixels in x and y, repeating the border (DrQ-style
    augmentation): with a few hundred demonstrations a CNN otherwise memorises where things were in
    the training frames instead of learning to find them."""
    if pad <= 0:
        return images
    size_h, size_w = images.shape[-2:]
    padded = nn.functional.pad(images.float(), (pad, pad, pad, pad), mode="replicate").to(images.dtype)
    offsets = torch.randint(0, 2 * pad + 1, (len(images), 2), generator=generator).tolist()
    return torch.stack([padded[i, :, y : y + size_h, x : x + size_w] for i, (y, x) in enumerate(offsets)])


def chunk_nll(dist: ClippedGaussian, actions: Tensor, mask: Tensor) -> Tensor:
    """Behaviour-cloning loss: the mean negative log-probability per action entry of the unpadded steps
    of action chunks (B, horizon, action_dim) under the policy's chunk distribution."""
    logp = (dist.log_prob(actions) * mask.unsqueeze(-1).to(actions.dtype)).sum()
    return -logp / (mask.sum() * actions.shape[-1]).clamp(min=1)


__all__ = [
    "ClippedGaussian",
    "VLAConfig",
    "VLAPolicy",
    "as_batch",
    "chunk_nll",
    "instruction_words",
    "random_shift",
    "task_vocabulary",
]
