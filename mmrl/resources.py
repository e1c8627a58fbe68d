"""Order-of-magnitude guards on sizes: refuse a config whose rollout batch, tree or data set cannot fit
in memory, in one line that names the keys to lower, before anything of that size is allocated.

Trainers estimate the bytes their largest structure will hold from their config (approximately: the
point is to refuse configs 10 or 100 times too big, not to predict usage) and call `check_memory`.
The memory available is the device's free memory (CUDA), or the machine's available RAM; the
environment variable ``MMRL_MEMORY_LIMIT_GB`` replaces it, e.g. to allow a run that swaps or to
keep one small on a shared machine.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence

import torch

from mmrl.config import ConfigError

LIMIT_ENV = "MMRL_MEMORY_LIMIT_GB"
GIB = 2**30
# fp32 values a transformer's training forward keeps per token, hidden unit and layer (rough, from the
# tiny Qwen2 of the core task): activations = tokens x hidden x layers x this x 4 bytes
ACTIVATION_FLOATS = 32


def available_memory(device: str | torch.device = "cpu") -> tuple[int, str]:
    """Bytes a run may use on `device`, and who says so (for the error message)."""
    limit = os.environ.get(LIMIT_ENV, "").strip()
    if limit:
        try:
            gib = float(limit)
        except ValueError:
            gib = -1.0
        if not gib > 0:
            raise ConfigError(
                f"config error: environment variable {LIMIT_ENV} = {limit!r} is not a positive number of "
                f"GiB: set it to e.g. 16, or unset it to use the memory this machine has"
            )
        return int(gib * GIB), f"{LIMIT_ENV} allows"
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"{device} has"
    try:
        import psutil
    except ImportError:  # a plain install has no psutil: physical memory, an upper bound
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "this machine has"
    return psutil.virtual_memory().available, "this machine has"


def check_memory(need: float, what: str, keys: Sequence[str], device: str | torch.device = "cpu") -> None:
    """Raise ConfigError if `need` bytes exceed what `device` has available.

    `what` says what needs the memory and how it grows with the config (e.g. "a rollout batch of
    8 prompts x 16 leaves (rollout.prompts_per_step x rollout.branch_factor^splits)"); `keys` are
    the config keys that make it smaller."""
    have, source = available_memory(device)
    if need > have:
        raise ConfigError(
            f"config error: {what} needs about {need / GIB:.1f} GiB; {source} {have / GIB:.1f} GiB "
            f"available: lower {_either(keys)} (or set {LIMIT_ENV} if the estimate is too high)"
        )


def check_replica_weights_fit(name: str, build: Callable[[], Iterable[torch.nn.Module]], device: str) -> None:
    """Refuse (ConfigError) `mmrl replica NAME full=true weights=true` when the full-size random weights
    in bfloat16 do not fit in the memory `device` has available, before any is allocated: `build` makes
    the replica's networks, here on the meta device, which counts their bytes and allocates nothing."""
    from mmrl.memory_plan import weight_bytes
    from mmrl.precision import default_dtype

    with torch.device("meta"), default_dtype(torch.bfloat16):
        need = weight_bytes(build())
    have, source = available_memory(device)
    if need > have:
        raise ConfigError(
            f"config error: mmrl replica {name} full=true weights=true builds {need / GIB:.1f} GiB of random "
            f"bfloat16 weights on device={device}; {source} {have / GIB:.1f} GiB available: give a device "
            f"with more memory, or weights=false for the configs alone (what --dry-run plans from), or set "
            f"{LIMIT_ENV} if the memory is there"
        )


def check_enough_prompts(
    key: str, per_step: int, processes: int, available: int, source: str, fix: str
) -> None:
    """Refuse a step that would draw a prompt twice: `per_step` (config key `key`) on each of
    `processes` processes from a set of `available` (described by `source`, e.g. "the 540 built-in
    prompts"); `fix` says what to change."""
    if per_step * processes > available:
        raise ConfigError(
            f"config error: {key} = {per_step} x {processes} process(es) is more than {source}, so a step "
            f"would draw some twice: {fix}"
        )


def _either(keys: Sequence[str]) -> str:
    return " or ".join(keys) if len(keys) < 3 else f"{', '.join(keys[:-1])} or {keys[-1]}"
