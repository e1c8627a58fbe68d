"""Low-precision policy weights for exploration rollouts.

Sol-RL style exploration: sample many candidates cheaply with the policy's Linear and Conv2d layers quantised
(NVFP4 or FP8), then replay the chosen ones in BF16 for the update. `explore_precision` swaps the
quantised weights in and puts the exact originals back afterwards.

Precisions (in `PRECISIONS`, each value is a fake quantiser ``(Tensor) -> Tensor`` keeping shape/dtype):

* ``fp32``: unchanged.
* ``bf16``: values rounded to bf16 but kept in their dtype; pair with `autocast_context` for bf16 math.
* ``fp8``: per-tensor scaled E4M3. Real FP8 matmuls (``torch._scaled_mm``) on CUDA capability >= 8.9;
  elsewhere emulated by fake quantisation, with a warning.
* ``nvfp4``: native FP4 kernels; mmrl does not wire any up, so it raises and points to the emulation.
* ``nvfp4-emulated``: `nvfp4_fake_quantize`, runs anywhere.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mmrl.config import ConfigError, option
from mmrl.registry import PRECISIONS

E2M1_MAX = 6.0
E4M3_MAX = 448.0


def _finite_amax(x32: Tensor, what: str) -> Tensor:
    """max |x| as a 0-dim tensor; NaN/inf raise, since quantising them would hide a broken model."""
    amax = x32.abs().amax() if x32.numel() else x32.new_zeros(())
    if not bool(torch.isfinite(amax)):
        n_nan, n_inf = int(torch.isnan(x32).sum()), int(torch.isinf(x32).sum())
        raise ValueError(f"{what}: input has {n_nan} NaN and {n_inf} inf values; refusing to quantise them")
    return amax


def _pow2_ceil(value: float) -> float:
    """Smallest power of two >= value (1.0 for 0), exact: frexp gives value = m * 2**e with 0.5 <= m < 1."""
    mantissa, exponent = math.frexp(value)
    return math.ldexp(1.0, exponent - 1 if mantissa == 0.5 else exponent)


def _round_to_e2m1(v: Tensor) -> Tensor:
    """Nearest FP4 E2M1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6 with sign), saturating at +-6.

    The grid spacing is 0.5 below 2, 1 in [2, 4) and 2 in [4, 6]; dividing by it turns the grid into
    integers whose parity is the mantissa bit, so torch.round (half to even) rounds ties to the even
    mantissa: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
    """
    magnitude = v.abs().clamp(max=E2M1_MAX)
    step = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))
    return torch.copysign(torch.round(magnitude / step) * step, v)


def nvfp4_quantize(x: Tensor, block_size: int = 16) -> tuple[Tensor, Tensor, float]:
    """NVFP4-encode `x` along its last dim: ``(values, block_scales, tensor_scale)``, all float32.

    `values` (shape ``(*x.shape[:-1], n_blocks, block_size)``, zero-padded) hold E2M1 values, `block_scales`
    (``(*x.shape[:-1], n_blocks)``) hold E4M3 values, and `tensor_scale` is a power of two; the decoded
    tensor is ``values * block_scales[..., None] * tensor_scale``. See `nvfp4_fake_quantize` for the recipe.
    """
    if x.dim() < 1 or block_size < 1:
        raise ValueError(
            f"nvfp4 needs a tensor with a last dim and block_size >= 1, got shape "
            f"{tuple(x.shape)} and block_size {block_size}"
        )
    x32 = x.detach().float()
    amax = float(_finite_amax(x32, "nvfp4"))
    tensor_scale = _pow2_ceil(amax / (E2M1_MAX * E4M3_MAX))
    blocks = F.pad(x32, (0, -x32.shape[-1] % block_size)).unflatten(-1, (-1, block_size))
    # block amax <= amax <= 6 * 448 * tensor_scale, so the E4M3 cast never needs to saturate
    block_scales = (blocks.abs().amax(dim=-1) / (E2M1_MAX * tensor_scale)).to(torch.float8_e4m3fn).float()
    scale = (block_scales * tensor_scale).unsqueeze(-1)
    has_scale = scale > 0  # all-zero blocks, or blocks whose scale underflows E4M3, decode to zeros
    values = torch.where(has_scale, _round_to_e2m1(blocks / torch.where(has_scale, scale, 1.0)), 0.0)
    return values, block_scales, tensor_scale


@PRECISIONS.register("nvfp4-emulated")
def nvfp4_fake_quantize(x: Tensor, block_size: int = 16) -> Tensor:
    """NVFP4 quantise-dequantise of `x` (same shape and dtype; float32 math), to emulate FP4 rollouts.

    Recipe: blocks of `block_size` consecutive values along the last dim (padded internally with zeros),
    each value an FP4 E2M1 number, one E4M3 scale per block and one FP32 scale per tensor.

    * Tensor scale: ``amax / (6 * 448)`` rounded UP to a power of two (NVIDIA's recipe uses it unrounded).
      Rounding up keeps block scales <= 448; being a power of two makes ``q * s_block * s_tensor`` exact in
      fp32 (2 + 4 significant bits, so also exact in bf16) and makes the whole operation commute with
      power-of-two rescaling. Hence Q(Q(x)) == Q(x) bit for bit: in a second pass each block amax is
      ``6 * s_block * s_tensor`` (a rounded E4M3 scale is within 1/16 of exact, so the block max lands on
      6), which reproduces the same block scale, possibly with a power of two traded with the tensor
      scale.
    * Block scale: ``block_amax / (6 * s_tensor)`` cast to E4M3 (round to nearest even). Values are then
      divided by the combined scale and rounded to the nearest E2M1 value, ties to the even mantissa,
      saturating at +-6 (the block max can overshoot 6 by up to 1/16 after scale rounding).
    * Caveat: block scales in E4M3's subnormal range (below 2**-6: block amax under ~3.5e-5 to 7e-5 of
      the tensor amax, depending on where amax sits in its power of two) round coarsely, so those blocks
      lose precision and may change again under a second quantisation; block scales under half of E4M3's
      smallest subnormal flush the block to zero. Tensors with amax below ~1e-34 (fp32-subnormal scales)
      are out of scope.

    All-zero blocks give zeros; NaN or inf anywhere raises ValueError. Not differentiable: the result
    is detached (exploration rollouts need no gradients).
    """
    values, block_scales, tensor_scale = nvfp4_quantize(x, block_size)
    decoded = (values * (block_scales * tensor_scale).unsqueeze(-1)).flatten(-2)
    return decoded[..., : x.shape[-1]].to(x.dtype)


def _fp8_encode(x32: Tensor, amax: Tensor) -> tuple[Tensor, Tensor]:
    """Per-tensor E4M3 codes and the fp32 scale (amax / 448) that decodes them; no host sync."""
    scale = torch.where(amax > 0, amax / E4M3_MAX, 1.0).float()
    return (x32 / scale).to(torch.float8_e4m3fn), scale  # |x| / scale <= 448 up to fp32 rounding


@PRECISIONS.register("fp8")
def fp8_fake_quantize(x: Tensor) -> Tensor:
    """FP8 E4M3 quantise-dequantise with one per-tensor scale amax / 448 (float32 math, same dtype out).

    NaN or inf raises ValueError; the result is detached, like `nvfp4_fake_quantize`.
    """
    x32 = x.detach().float()
    codes, scale = _fp8_encode(x32, _finite_amax(x32, "fp8"))
    return (codes.float() * scale).to(x.dtype)


@PRECISIONS.register("fp32")
def _keep_fp32(x: Tensor) -> Tensor:
    """Full precision: the reference that the low-precision modes are compared against."""
    return x


@PRECISIONS.register("bf16")
def _round_to_bf16(x: Tensor) -> Tensor:
    """bf16-representable values in the original dtype, so the model runs unchanged otherwise."""
    return x.to(torch.bfloat16).to(x.dtype)


@PRECISIONS.register("nvfp4")
def _native_nvfp4(x: Tensor) -> Tensor:
    """Native FP4 needs kernels mmrl does not ship; fail loudly rather than silently emulate."""
    raise RuntimeError(
        "precision 'nvfp4' needs native FP4 matmul kernels (Blackwell GPU, CUDA capability >= 10.0, and an "
        "FP4 kernel library), which mmrl does not wire up; use 'nvfp4-emulated' for the same NVFP4 "
        "numerics via fake quantisation on any device"
    )


def _fp8_kernel_ok(weight: Tensor) -> bool:
    """torch._scaled_mm FP8 needs Ada/Hopper or newer and both weight dims divisible by 16."""
    return (
        weight.is_cuda
        and torch.cuda.get_device_capability(weight.device) >= (8, 9)
        and weight.shape[0] % 16 == 0
        and weight.shape[1] % 16 == 0
    )


def _fp8_linear_forward(layer: nn.Linear, original_weight: Tensor) -> Callable[[Tensor], Tensor]:
    """A Linear forward doing a real W8A8 FP8 matmul: per-tensor scaled E4M3 weight and input."""
    weight32 = original_weight.float()
    weight_codes, weight_scale = _fp8_encode(weight32, _finite_amax(weight32, "fp8"))

    def forward(x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        codes, scale = _fp8_encode(rows, rows.abs().amax())
        out = torch._scaled_mm(
            codes.contiguous(), weight_codes.t(), scale_a=scale, scale_b=weight_scale, out_dtype=x.dtype
        )
        if layer.bias is not None:
            out = out + layer.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return forward


@contextmanager
def explore_precision(
    model: nn.Module, precision: str, quantize_activations: bool = False
) -> Iterator[nn.Module]:
    """Run `model` with every nn.Linear and nn.Conv2d weight (subclasses too) in `precision`; a
    convolution's weight is quantised in blocks along its flattened (in_channels, kh, kw) dims.

    On enter each weight's data is replaced by its quantised value (the Parameter objects stay, so
    optimisers and tied weights keep working); on exit, also after an exception, the original tensors are
    put back untouched, so the weights are bit-identical. With `quantize_activations`, forward pre-hooks
    quantise each Linear's input in the same format too (W4A4 for NVFP4, as in Sol-RL); convolution
    inputs stay in full precision.

    "fp8" on CUDA capability >= 8.9 swaps in a real FP8 matmul, which always quantises inputs too (W8A8):
    that is what makes it fast. Elsewhere (convolutions, dims not divisible by 16, other devices) it is
    emulated, with a warning.
    """
    quantize = PRECISIONS.get(precision)
    layers = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear | nn.Conv2d) and m.weight.is_floating_point()
    ]
    originals: dict[int, tuple[nn.Parameter, Tensor]] = {}
    quantised: set[int] = set()
    swapped_forwards: list[nn.Linear] = []
    hooks = []
    emulated_fp8 = 0
    try:
        with torch.no_grad():
            for name, layer in layers:
                weight = layer.weight
                if id(weight) not in originals:
                    originals[id(weight)] = (weight, weight.data)
                # a forward set on the instance belongs to someone else (e.g. accelerate hooks): keep it
                if (
                    precision == "fp8"
                    and isinstance(layer, nn.Linear)
                    and "forward" not in vars(layer)
                    and _fp8_kernel_ok(weight)
                ):  # the FP8 matmul reads its own codes: no fake-quantised copy of the weight is made
                    try:
                        layer.forward = _fp8_linear_forward(layer, originals[id(weight)][1])
                    except ValueError as err:
                        raise ValueError(f"{name}.weight: {err}") from err
                    swapped_forwards.append(layer)
                    continue
                if id(weight) not in quantised:  # a weight tied between layers is quantised once
                    quantised.add(id(weight))
                    try:
                        weight.data = quantize(weight.data.flatten(1)).view_as(weight.data)
                    except ValueError as err:
                        raise ValueError(f"{name}.weight: {err}") from err
                emulated_fp8 += precision == "fp8"
                if isinstance(layer, nn.Conv2d):
                    continue
                if quantize_activations:
                    hooks.append(
                        layer.register_forward_pre_hook(lambda _module, args: (quantize(args[0]), *args[1:]))
                    )
        if emulated_fp8:
            warnings.warn(
                f"precision 'fp8' is emulated (fake quantisation) for {emulated_fp8} layer(s): real FP8 "
                "matmuls need Linear layers, CUDA capability >= 8.9 and weight dims divisible by 16",
                stacklevel=3,
            )
        yield model
    finally:
        for hook in hooks:
            hook.remove()
        for layer in swapped_forwards:
            del layer.forward
        for weight, original in originals.values():
            weight.data = original


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Floating-point tensors and parameters created inside are `dtype` (a full-size model built in
    bfloat16 takes half the memory of float32); the previous default comes back on exit."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def autocast_context(precision: str, device: torch.device | str) -> AbstractContextManager:
    """bf16 autocast for "bf16" (so matmuls really run in bf16), a no-op context for other precisions."""
    PRECISIONS.get(precision)
    if precision == "bf16":
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return nullcontext()


BaseDtype = Literal["auto", "float32", "bfloat16", "float16"]  # `model.base_dtype` of the LoRA trainers


def base_dtype_option() -> Any:
    """`model.base_dtype` of every trainer with LoRA (`lora_base_dtype`)."""
    return option(
        "auto",
        "dtype of the frozen base weights under LoRA (model.lora_rank > 0): auto is bfloat16 on a CUDA "
        "device that supports it and float32 elsewhere; the forward runs in this dtype, the adapter, its "
        "products and its optimizer state in float32",
    )


def check_base_dtype(name: str, lora_rank: int) -> None:
    """Refuse a low `model.base_dtype` without LoRA, where every weight trains (in float32)."""
    if lora_rank == 0 and name not in ("auto", "float32"):
        raise ConfigError(
            f"config error: model.base_dtype = {name!r} holds the frozen base of a LoRA run in that dtype, "
            "but model.lora_rank = 0 trains every weight (in float32): set model.lora_rank > 0 or "
            "model.base_dtype=auto"
        )


def lora_base_dtype(name: str, lora_rank: int, device: torch.device | str | None) -> torch.dtype:
    """The dtype a run keeps its frozen base weights in (`model.base_dtype`): float32 without LoRA;
    with it the named dtype, where "auto" is bfloat16 on a CUDA device with bfloat16 support and float32
    on anything else (a CPU holds a bfloat16 base only when asked). `device` None is the device a
    `--dry-run` plan is made for: a GPU with bfloat16."""
    if lora_rank == 0:
        return torch.float32
    if name != "auto":
        return getattr(torch, name)
    if device is None:
        return torch.bfloat16
    device = torch.device(device)
    return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32


def base_dtype_note(model: Any) -> str:
    """What a `--dry-run` plan of a LoRA run says of the dtype it holds the frozen base in."""
    if model.base_dtype == "auto":
        return (
            "the frozen base is planned in bfloat16 (model.base_dtype = auto, as on a GPU with bfloat16; "
            "on a CPU auto holds it in float32: plan that with model.base_dtype=float32)"
        )
    return f"the frozen base is planned in {model.base_dtype} (model.base_dtype)"


def keep_adapter_in_float32(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """The trained (adapter) parameters in float32 whatever dtype their base layer has: peft creates
    them in the base's dtype; `params` is returned."""
    for param in params:
        if param.dtype != torch.float32:
            param.data = param.data.float()
    return params
