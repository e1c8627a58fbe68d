"""What a run will need, before it starts: `mmrl train RECIPE --dry-run [--processes N]`.

A trainer that can plan itself overrides `Trainer.memory_plan(config, recipe, processes)`, returning
a `MemoryPlan`. It builds its networks from their config files on the meta device (nothing is
allocated and no weight is read, so a 12B model plans in seconds on a CPU) and runs each phase of
an iteration that holds tensors beyond the weights (the update's forward and backward at
`train.micro_batch` with its optimizer step, a rollout's model call on all its rows, decoding) under
`LiveTensorBytes`, which follows every tensor storage a phase creates until it is freed. The plan is
the memory of one process: every weight it holds (trained, frozen, copies such as a reference model
or an EMA), the gradients and optimizer states of the trained ones, and the largest phase's
activations.

Not counted: the allocator's fragmentation and caching, CUDA's context and kernels' workspaces, and
tensors a trainer keeps across phases that are small beside these (latents of a rollout tree, token
ids). The estimate is checked against allocations measured on a CPU run (tests/test_memory_plan.py).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from mmrl.config import read_yaml

GIB = 2**30


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of the tensor storages created under it and still alive, and their peak. Every op (of
    forward, backward and optimizer steps alike) is seen, so on the meta device this is the memory a
    real run of the same code would allocate, without allocating it."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # an output that shares an input's storage (a view, an in-place op) allocates nothing
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and id(tensor.untyped_storage()) not in inputs:
                self.add(tensor.untyped_storage())
        return out

    def add(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self.seen:
            return
        size = storage.nbytes()
        self.seen.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self.free, key, size)

    def free(self, key: int, size: int) -> None:
        self.seen.discard(key)
        self.live -= size


@dataclass
class PhasePeak:
    """A phase's peak: the trained module's weights and optimizer states it was given, and the most
    bytes its own tensors (activations, gradients, temporaries) held at once, of which `gradients` are
    the trained module's gradients (an update's)."""

    weights: int
    optimizer: int
    transient: int
    gradients: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.optimizer + self.transient


EIGHT_BIT_MIN_SIZE = 4096  # AdamW8bit keeps float32 moments for tensors with fewer elements
EIGHT_BIT_BLOCK = 256  # elements per float32 scale of an 8-bit moment


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, name: str = "adamw") -> int:
    """Bytes of the states `optimizer` holds after a step; for `adamw_8bit` (an AdamW on the meta
    device stands in for it) what bitsandbytes' AdamW8bit holds for the same parameters: per moment,
    a byte per element and a float32 scale per block, and two 256-entry float32 code books that every
    parameter shares."""
    if name == "adamw_8bit":
        sizes = [p.numel() for group in optimizer.param_groups for p in group["params"]]
        quantised = [n for n in sizes if n >= EIGHT_BIT_MIN_SIZE]
        moments = sum(2 * (n + math.ceil(n / EIGHT_BIT_BLOCK) * 4) for n in quantised)
        return (
            moments
            + (2 * 256 * 4 if quantised else 0)
            + sum(2 * n * 4 for n in sizes if n < EIGHT_BIT_MIN_SIZE)
        )
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


class RealIndicesOnMeta(TorchDispatchMode):
    """Run a model on the meta device with its integer inputs (token ids, masks, image grids) real on
    the CPU: an integer tensor sent to the meta device stays on the CPU, and an op that mixes the two
    gives meta tensors. Code that reads those values (`.item()`, `.tolist()`: a VLM's image token
    counts, multimodal positions, variable-length attention) then runs as on a real device, while
    everything a float passes through is meta and allocates nothing."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and str(kwargs.get("device")) == "meta":
            source = args[0]
            if source.device.type == "cpu" and not source.is_floating_point():
                return source.clone()
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(t.device.type == "meta" for t in tensors) and any(t.device.type == "cpu" for t in tensors):

            def to_meta(value: object) -> object:
                real = isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dim() > 0
                return value.to("meta") if real else value

            args, kwargs = tree_map(to_meta, (args, kwargs))
        return func(*args, **kwargs)


@contextlib.contextmanager
def fused_attention_on_meta() -> Iterator[None]:
    """`F.scaled_dot_product_attention` on meta tensors as a fused kernel: the meta device would
    otherwise take the math path, which holds every attention matrix, where CPUs and GPUs run fused
    kernels that keep only the output and its log-sum-exp (flash attention). Grouped-query attention
    repeats the key/value heads first, as the CPU kernel does."""
    plain = F.scaled_dot_product_attention

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):  # noqa: ANN001, ANN202
        if query.device.type != "meta":
            return plain(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **kw)
        if kw.get("enable_gqa") and key.shape[-3] != query.shape[-3]:
            repeats = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(repeats, -3), value.repeat_interleave(repeats, -3)
        out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
        )
        return out

    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = plain


def measure_phase(
    run: Callable[[], object],
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    optimizer_name: str = "adamw",
) -> PhasePeak:
    """Peak memory of `run()` beside `module`'s weights and the existing states of `optimizer` (as
    the config's `optimizer_name` holds them). On meta tensors nothing is allocated."""
    tracker = LiveTensorBytes()
    with fused_attention_on_meta(), tracker:
        run()
    return PhasePeak(weight_bytes([module]), optimizer_state_bytes(optimizer, optimizer_name), tracker.peak)


def weight_bytes(modules: Iterable[torch.nn.Module]) -> int:
    """Bytes of the parameters and buffers of `modules`, each tensor once."""
    seen: set[int] = set()
    total = 0
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                total += tensor.numel() * tensor.element_size()
    return total


def parameter_count(modules: Iterable[torch.nn.Module], trainable: bool = False) -> int:
    seen: set[int] = set()
    total = 0
    for module in modules:
        for p in module.parameters():
            if id(p) not in seen and (p.requires_grad or not trainable):
                seen.add(id(p))
                total += p.numel()
    return total


def largest_blocks(module: torch.nn.Module) -> dict[str, int]:
    """Parameter count of the largest submodule of each class in `module`, by class name: what FSDP
    gathers at once for a block it wraps by that class."""
    counts: dict[str, int] = {}
    for sub in module.modules():
        name = type(sub).__name__
        counts[name] = max(counts.get(name, 0), parameter_count([sub]))
    return counts


@dataclass
class MemoryPlan:
    """One process's memory and work for an iteration of a recipe, and its batch on `processes`."""

    recipe: str
    processes: int
    parameters: int
    trainable: int
    gradients: int  # bytes of the trained parameters' gradients (part of the update's transient peak)
    other_weights: dict[str, int]  # bytes of weights outside the trained module, by name
    phases: dict[str, PhasePeak]  # each phase's peak, the trained module's weights included
    # other bytes held throughout: buffers, data, simulators
    held: dict[str, int] = field(default_factory=dict)
    work: dict[str, str] = field(default_factory=dict)  # per iteration
    batch: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    blocks: dict[str, int] = field(default_factory=dict)  # the trained module's `largest_blocks`
    notes: list[str] = field(default_factory=list)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda name: self.phases[name].total)

    @property
    def peak_bytes(self) -> int:
        """The largest phase plus every weight outside it and what is held throughout: the expected peak
        allocation of a process."""
        return self.peak_bytes_of(self.phases)

    def peak_bytes_of(self, phases: Iterable[str]) -> int:
        """The expected peak of a run that goes through only `phases` (e.g. training without its
        evaluations)."""
        held = sum(self.other_weights.values()) + sum(self.held.values())
        return held + max(self.phases[name].total for name in phases)

    def as_dict(self) -> dict[str, object]:
        peak = self.phases[self.peak_phase]
        return {
            "recipe": self.recipe,
            "processes": self.processes,
            "parameters": self.parameters,
            "trainable_parameters": self.trainable,
            "bytes": {
                "weights": peak.weights + sum(self.other_weights.values()),
                "gradients": self.gradients,
                "optimizer_states": peak.optimizer,
                "activations_and_gradients": peak.transient,
                "peak": self.peak_bytes,
            },
            "other_weights": dict(self.other_weights),
            "held": dict(self.held),
            "phases": {name: phase.total for name, phase in self.phases.items()},
            "peak_phase": self.peak_phase,
            "work_per_iteration": dict(self.work),
            "batch": list(self.batch),
            "warnings": list(self.warnings),
            "notes": list(self.notes),
        }

    def format(self) -> str:
        peak = self.phases[self.peak_phase]
        gib = human_bytes
        width = max(28, *(len(name) + 2 for name in self.phases))
        lines = [
            f"plan for {self.recipe} on {self.processes} process(es), per process (in the dtypes the run "
            "keeps; no allocator overhead):",
            f"  parameters        {self.parameters:>15,d}",
            f"  trainable         {self.trainable:>15,d}",
            f"  weights           {gib(peak.weights + sum(self.other_weights.values()))}"
            + "".join(f"\n    {name:<16}{gib(size)}" for name, size in self.other_weights.items()),
            f"  gradients         {gib(self.gradients)}  (while the update runs)",
            f"  optimizer states  {gib(peak.optimizer)}",
            f"  activations       {gib(peak.transient)}  (and any gradients and temporaries of the largest "
            f"phase: {self.peak_phase})",
            *(f"  {name:<18}{gib(size)}" for name, size in self.held.items()),
            f"  expected peak     {gib(self.peak_bytes)}",
            "  phases (the trained module, its optimizer states and the phase's own tensors at its peak):",
            *(f"    {name:<{width}}{gib(phase.total)}" for name, phase in self.phases.items()),
            "per iteration:",
            *(f"  {name}: {value}" for name, value in self.work.items()),
            "batch:",
            *(f"  {line}" for line in self.batch),
        ]
        lines += [f"note: {line}" for line in self.notes]
        lines += [f"warning: {line}" for line in self.warnings]
        return "\n".join(lines)

    def sharded(self, launch: LaunchConfig) -> MemoryPlan:
        """This plan on `launch`'s processes. With FSDP every process holds 1/N of the trained module's
        weights (its frozen parts included), gradients and optimizer states, and gathers whole blocks
        of the wrapped classes in the compute dtype for each model call (two at once while the next
        is prefetched; every block when the run does not reshard after forward). Weights outside the
        trained module (frozen encoders, reward models, reference and EMA copies) stay whole."""
        n = launch.processes
        plan = replace(self, processes=n, held=dict(self.held), notes=list(self.notes))
        if not launch.fsdp:
            return plan
        if not self.blocks:
            raise ValueError("this trainer's plan cannot be sharded: it trains in one process")
        missing = [name for name in launch.wrap_classes if name not in self.blocks]
        if missing:
            known = sorted(name for name in self.blocks if name.endswith(("Block", "Layer")))
            raise ValueError(
                f"fsdp_transformer_layer_cls_to_wrap names {', '.join(missing)}, which the model does not "
                f"have; its block classes: {', '.join(known) or 'none'}"
            )
        plan.phases = {
            name: PhasePeak(
                phase.weights // n,
                phase.optimizer // n,
                phase.transient - phase.gradients + phase.gradients // n,
                phase.gradients // n,
            )
            for name, phase in self.phases.items()
        }
        plan.gradients = self.gradients // n
        whole = self.trained_module_parameters()
        held = max(phase.weights for phase in self.phases.values())  # a phase with the module on the device
        element = launch.compute_bytes or round(held / whole)
        if launch.reshard_after_forward:
            gathered = 2 * max(self.blocks[name] for name in launch.wrap_classes)
        else:
            gathered = whole
        plan.held["FSDP gathered blocks"] = gathered * element
        plan.notes.append(
            f"FSDP over {n} processes: the trained module's weights, gradients and optimizer states are "
            "1/N each; weights outside it are whole in every process"
        )
        if launch.compute_bytes == 2:
            plan.notes.append(
                f"{launch.mixed_precision} mixed precision: activations are planned in the dtype of the "
                "weights they come from (float32 for trained weights, the frozen base's dtype under LoRA); "
                "under autocast most of the float32 ones are half that"
            )
        if launch.offload_params:
            plan.notes.append("fsdp_offload_params: the sharded states above live in CPU memory instead")
        return plan

    def trained_module_parameters(self) -> int:
        """Parameters of the trained module, frozen parts included (its own entry in `blocks`)."""
        return max(self.blocks.values(), default=0)


@dataclass(frozen=True)
class LaunchConfig:
    """What `mmrl train --dry-run --launch FILE` reads from an Accelerate config file."""

    processes: int
    fsdp: bool = False
    wrap_classes: tuple[str, ...] = ()
    reshard_after_forward: bool = True
    offload_params: bool = False
    mixed_precision: str = "no"

    @property
    def compute_bytes(self) -> int | None:
        """Bytes per element of the weights a model call uses (None: the stored dtype's)."""
        return 2 if self.mixed_precision in ("bf16", "fp16") else None

    @classmethod
    def from_file(cls, path: str | Path) -> LaunchConfig:
        """Read `accelerate launch --config_file` YAML; ValueError for a file that is not one."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(
                f"{path} is not a file; give an Accelerate config such as configs/accelerate/*.yaml"
            )
        data = read_yaml(path)  # a ConfigError (a ValueError) for a file that is not YAML
        if "num_processes" not in data:
            raise ValueError(f"{path} has no num_processes: it is not an Accelerate config")
        processes = data["num_processes"]
        if not isinstance(processes, int) or processes < 1:
            raise ValueError(f"{path}: num_processes = {processes!r}; give a whole number of at least 1")
        fsdp = data.get("distributed_type") == "FSDP"
        options = data.get("fsdp_config") or {}
        if not isinstance(options, dict):
            raise ValueError(
                f"{path}: fsdp_config = {options!r} must be a section (a mapping of fsdp_* keys)"
            )
        wrap = options.get("fsdp_transformer_layer_cls_to_wrap") or ()
        if isinstance(wrap, str):
            wrap = tuple(part.strip() for part in wrap.split(","))
        elif not isinstance(wrap, list | tuple) or not all(isinstance(name, str) for name in wrap):
            raise ValueError(
                f"{path}: fsdp_config.fsdp_transformer_layer_cls_to_wrap = {wrap!r} must name the block "
                "classes FSDP wraps: a class name, names separated by commas, or a list of names (e.g. "
                "JointTransformerBlock)"
            )
        if fsdp and not wrap:
            raise ValueError(
                f"{path}: FSDP without fsdp_transformer_layer_cls_to_wrap; name the blocks to shard by"
            )
        strategy = str(options.get("fsdp_sharding_strategy", "FULL_SHARD")).upper()
        reshard = options.get("fsdp_reshard_after_forward", strategy not in ("SHARD_GRAD_OP", "2"))
        if isinstance(reshard, str):  # FSDP1 configs name the sharding strategy here
            reshard = reshard.upper() not in ("SHARD_GRAD_OP", "2")
        offload = options.get("fsdp_offload_params", False)
        for name, value in (("fsdp_reshard_after_forward", reshard), ("fsdp_offload_params", offload)):
            if not isinstance(value, bool):
                raise ValueError(f"{path}: fsdp_config.{name} = {value!r} must be true or false")
        return cls(
            processes=processes,
            fsdp=fsdp,
            wrap_classes=tuple(wrap),
            reshard_after_forward=reshard,
            offload_params=offload,
            mixed_precision=str(data.get("mixed_precision", "no")),
        )


def human_bytes(size: int) -> str:
    """`size` bytes in GiB from 1 GiB up, else in MiB, right-aligned."""
    return f"{size / GIB:8.2f} GiB" if size >= GIB else f"{size / 2**20:8.2f} MiB"


def per_process_sizes(
    key: str, per_process: int, recipe_processes: int | None, processes: int
) -> tuple[list[str], list[str]]:
    """Lines about a per-process batch size `key` on `processes`, against the number of processes the
    recipe's sizes were written for (`processes` key of the config; None: any), and warnings when the
    effective batch changes."""
    total = per_process * processes
    lines = [f"{key} = {per_process} per process: {total} in all on {processes} process(es)"]
    warnings: list[str] = []
    if recipe_processes is None or recipe_processes == processes:
        return lines, warnings
    intended = per_process * recipe_processes
    if intended % processes == 0:
        keep = intended // processes
        lines.append(
            f"the recipe is written for {recipe_processes} process(es) ({intended} in all): "
            f"{key}={keep} keeps that on {processes}"
        )
    else:
        lines.append(
            f"the recipe is written for {recipe_processes} process(es) ({intended} in all), which "
            f"{processes} process(es) cannot split evenly"
        )
    warnings.append(
        f"on {processes} process(es) the effective {key} is {total}, not the recipe's {intended}: "
        "group statistics and the learning rate's scale change"
    )
    return lines, warnings
