"""Keyed (counter-based) deterministic noise: every random draw of a rollout can be regenerated from its key.

A draw is keyed by (run seed, training step, prompt, tree node, stream). The key is hashed into a
63-bit integer (BLAKE2b of the fields, in order) and a `torch.Generator` is re-seeded with it right
before the draw, so the tensor depends on the key alone: not on what was drawn before, on batch
composition or on process rank. This is what lets an FP4 exploration pass be replayed in BF16 from
the very same noise, or a single tree node be regenerated without redoing its siblings. `stream`
separates different uses of one node (the denoising sub-step inside a node, initial latent vs.
Gumbel noise for token sampling, ...).

Draws are reproducible per device type only: CPU generators run mt19937 and CUDA generators run
Philox, so the same key gives different (equally valid) tensors on CPU and on GPU. Replays must
run on the same device type as the original draw. On CPU, mt19937 keeps only the low 32 bits of the
seed, so two distinct keys share a CPU stream with probability about 2**-32 per pair; CUDA uses all
64 bits.

Values are always drawn in float32 and then cast, so a bf16 draw equals the cast of the fp32 draw.
Casting can round uniforms just below 1.0 up to exactly 1.0 in low precision: take logs (Gumbel
noise) in float32.

The seed derivation is part of the on-disk format of a run: changing `noise_seed` breaks the replay
of every run recorded before the change.
"""

from __future__ import annotations

import hashlib
import numbers
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch

_MAX_FIELD = (1 << 64) - 1  # fields are packed as uint64
_FIELDS_LE = struct.Struct("<5Q")

ShapeLike = int | Sequence[int]


@dataclass(frozen=True, slots=True)
class NoiseKey:
    """Where a random draw belongs: run seed, training step, prompt, tree node and stream (use)."""

    seed: int
    step: int
    prompt: int
    node: int
    stream: int = 0

    def __post_init__(self) -> None:
        values = (self.seed, self.step, self.prompt, self.node, self.stream)
        if all(type(value) is int and 0 <= value <= _MAX_FIELD for value in values):
            return  # the common case, kept cheap: keys are built per node and per draw
        for field in fields(self):
            value = getattr(self, field.name)
            is_int = isinstance(value, numbers.Integral) and not isinstance(value, bool)
            if not (is_int and 0 <= value <= _MAX_FIELD):
                raise ValueError(
                    f"noise key field {field.name!r} must be an int in [0, 2**64), got {value!r}"
                )
            object.__setattr__(self, field.name, int(value))  # numpy / other integer types -> int

    def seed_int(self) -> int:
        """The 63-bit generator seed: BLAKE2b-64 of the five fields as little-endian uint64, in order.

        A cryptographic hash rather than a hand-rolled mixer (e.g. splitmix64 rounds) because in Python
        it is also the cheaper one, and per-key overhead is what a batch of small per-node draws pays.
        """
        fields_le = _FIELDS_LE.pack(self.seed, self.step, self.prompt, self.node, self.stream)
        digest = hashlib.blake2b(fields_le, digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1


def noise_seed(seed: int, step: int, prompt: int, node: int, stream: int = 0) -> int:
    """The 63-bit generator seed of one key; raises ValueError unless every field is a non-negative int."""
    return NoiseKey(seed, step, prompt, node, stream).seed_int()


_thread_local = threading.local()


def _generator(device: torch.device) -> torch.Generator:
    """One cached generator per device and thread: re-seeding one is cheap, building one is not."""
    generators = _thread_local.__dict__.setdefault("generators", {})
    if device not in generators:
        generators[device] = torch.Generator(device=device)
    return generators[device]


def _resolve_device(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _as_size(shape: ShapeLike) -> torch.Size:
    return torch.Size([shape]) if isinstance(shape, int) else torch.Size(shape)


def _keyed_fill(
    fill: Callable[..., torch.Tensor],
    shape: torch.Size,
    keys: Sequence[NoiseKey],
    device: str | torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Fill row i of a float32 [len(keys), *shape] tensor from key i alone, then cast to dtype."""
    device = _resolve_device(device)
    generator = _generator(device)
    out = torch.empty((len(keys), *shape), device=device, dtype=torch.float32)
    seeds = [key.seed_int() for key in keys]
    for row, seed in zip(out.unbind(0), seeds, strict=True):
        generator.manual_seed(seed)
        fill(row, generator=generator)
    return out.to(dtype)


def keyed_randn_batch(
    shape: ShapeLike,
    keys: Sequence[NoiseKey],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """[len(keys), *shape] standard normal noise whose row i depends only on keys[i] (and the device type),
    so any row of a batch of tree nodes can later be re-drawn alone (with keys=[keys[i]])."""
    return _keyed_fill(torch.Tensor.normal_, _as_size(shape), keys, device, dtype)


def keyed_rand_batch(
    shape: ShapeLike,
    keys: Sequence[NoiseKey],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """[len(keys), *shape] uniform [0, 1) noise keyed like `keyed_randn_batch` (e.g. Gumbel noise for
    one sampling step of a batch of sequences)."""
    return _keyed_fill(torch.Tensor.uniform_, _as_size(shape), keys, device, dtype)
