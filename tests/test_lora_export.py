"""LoRA results load in plain diffusers at the trained strength.

For every model family the trainer takes (the project's own layout: the shipped tiny UNet base and a
tiny SD3-transformer base; tiny SD1.x and SD3 diffusers pipelines), a result is written by the
trainer's final save with lora_alpha != rank and non-zero LoRA weights. A separate Python process
that imports only torch, diffusers and safetensors loads the base, calls `load_lora_weights` on the
result and computes the denoiser's output on fixed inputs, which must match the trained denoiser's.
Without the adapter metadata diffusers would take alpha = rank and the outputs would differ.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffusion_rl.branch_grpo import BranchGRPOTrainer
from diffusion_rl.loading import load
from diffusion_rl.models import LORA_FILE, FlowPipeline
from diffusion_rl.shapes import vocabulary
from mmrl.cli import load_plugins
from mmrl.config import REPO_ROOT, ConfigError, load_config
from tests.test_diffusers_pipelines import save_sd1, save_sd3
from tests.tiny_flow import SMALL as SMALL_SD3

load_plugins()
RANK, ALPHA = 4, 12.0  # diffusers' default (alpha = rank) would apply a third of the trained change

# Run in a fresh interpreter: argv = family, base directory, LoRA result, inputs file, outputs file.
PLAIN_DIFFUSERS = r"""
import sys
from pathlib import Path

import torch
from diffusers import (
    DDIMScheduler,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
    UNet2DConditionModel,
)
from safetensors.torch import load_file, save_file
from transformers import CLIPTextModelWithProjection, CLIPTokenizer

family, base, result, inputs_file, outputs_file = sys.argv[1:]
base = Path(base)
inputs = load_file(inputs_file)


@torch.no_grad()
def run(denoiser):
    if isinstance(denoiser, UNet2DConditionModel):
        return denoiser(inputs["x"], inputs["t"], encoder_hidden_states=inputs["embeds"]).sample
    return denoiser(
        hidden_states=inputs["x"],
        timestep=inputs["t"],
        encoder_hidden_states=inputs["embeds"],
        pooled_projections=inputs["pooled"],
    ).sample


outputs = {}
if family in ("sd1", "sd3"):
    if family == "sd1":
        pipe = StableDiffusionPipeline.from_pretrained(base)
    else:
        pipe = StableDiffusion3Pipeline.from_pretrained(base, text_encoder_3=None, tokenizer_3=None)
    denoiser = pipe.unet if family == "sd1" else pipe.transformer
else:  # the project's layout: a pipeline built from its diffusers / transformers component folders
    text_encoder = CLIPTextModelWithProjection.from_pretrained(base / "text_encoder")
    tokenizer = CLIPTokenizer.from_pretrained(base / "tokenizer")
    if family == "own_unet":
        denoiser = UNet2DConditionModel.from_pretrained(base / "unet")
        pipe = StableDiffusionPipeline(
            vae=None,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            unet=denoiser,
            scheduler=DDIMScheduler(),
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
    else:
        denoiser = SD3Transformer2DModel.from_pretrained(base / "transformer")
        pipe = StableDiffusion3Pipeline(
            transformer=denoiser,
            scheduler=FlowMatchEulerDiscreteScheduler(),
            vae=None,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            text_encoder_2=None,
            tokenizer_2=None,
            text_encoder_3=None,
            tokenizer_3=None,
        )
    # the bare denoiser takes the same file with load_lora_adapter and its folder as prefix
    folder = "unet" if family == "own_unet" else "transformer"
    bare = type(denoiser).from_pretrained(base / folder)
    bare.load_lora_adapter(result, prefix=folder, use_safetensors=True)
    outputs["bare"] = run(bare)
outputs["base"] = run(denoiser)
pipe.load_lora_weights(result)
outputs["loaded"] = run(denoiser)
save_file(outputs, outputs_file)
project = ("mmrl", "diffusion_rl", "vlm_rl", "vla_rl", "sim")
leaked = sorted(m for m in sys.modules if m.split(".")[0] in project)
assert not leaked, f"the plain-diffusers check imported project code: {leaked}"
"""


def make_base(family: str, root: Path) -> Path:
    """The base model directory of `family`, made under `root` (the shipped tiny base is used as is)."""
    if family == "own_unet":
        return REPO_ROOT / "diffusion_rl" / "assets" / "tiny_flow"
    if family == "own_sd3":
        FlowPipeline.tiny(vocabulary(), SMALL_SD3).save_pretrained(root / "own_sd3")
        return root / "own_sd3"
    return {"sd1": save_sd1, "sd3": save_sd3}[family](root / family)


def save_lora_result(run_dir: Path, base: Path | str, seed: int = 0) -> BranchGRPOTrainer:
    """A trainer set up for LoRA (RANK, ALPHA) on `base`, its LoRA up-projections set to random
    non-zero values (training from zero would move them by little), saved by the trainer's final save
    into run_dir/final."""
    cfg = load_config(
        "diffusion/flat_grpo",
        [
            f"output_dir={run_dir}",
            f"model.path={base}",
            f"model.lora_rank={RANK}",
            f"model.lora_alpha={ALPHA}",
            "rollout.prompts_per_step=1",
            "rollout.steps=4",
            "rollout.branch_factor=2",
            "rollout.sde=ddim",  # valid for the flow models too; the SD1.x UNet needs it
            "reward.name=jpeg_compressibility",
        ],
    )
    trainer = BranchGRPOTrainer(cfg)
    trainer.setup()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in trainer.pipe.denoiser.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    trainer.save_result()
    return trainer


def fixed_inputs(denoiser: torch.nn.Module) -> dict[str, torch.Tensor]:
    config = denoiser.config
    g = torch.Generator().manual_seed(1)
    side = config.sample_size
    inputs = {
        "x": torch.randn(2, config.in_channels, side, side, generator=g),
        "t": torch.tensor([700.0, 250.0]),
    }
    if "cross_attention_dim" in config:  # UNet2DConditionModel
        inputs["embeds"] = torch.randn(2, 8, config.cross_attention_dim, generator=g)
    else:
        inputs["embeds"] = torch.randn(2, 8, config.joint_attention_dim, generator=g)
        inputs["pooled"] = torch.randn(2, config.pooled_projection_dim, generator=g)
    return inputs


@torch.no_grad()
def denoiser_output(denoiser: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    if "pooled" not in inputs:
        return denoiser(inputs["x"], inputs["t"], encoder_hidden_states=inputs["embeds"]).sample
    return denoiser(
        hidden_states=inputs["x"],
        timestep=inputs["t"],
        encoder_hidden_states=inputs["embeds"],
        pooled_projections=inputs["pooled"],
    ).sample


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# the default run keeps one denoiser of each kind in each layout (our UNet, diffusers' SD3); the other two
# pairs take the same export path and are slow
@pytest.mark.parametrize(
    "family",
    [
        "own_unet",
        pytest.param("own_sd3", marks=pytest.mark.slow),
        pytest.param("sd1", marks=pytest.mark.slow),
        "sd3",
    ],
)
def test_plain_diffusers_loads_the_lora_result_at_the_trained_strength(tmp_path, family):
    base = make_base(family, tmp_path)
    trainer = save_lora_result(tmp_path / "run", base)
    result = tmp_path / "run" / "final"
    record = json.loads((result / LORA_FILE).read_text())
    assert record["base"] == str(base) and Path(record["base_resolved"]) == base.resolve()
    assert (record["lora_rank"], record["lora_alpha"]) == (RANK, ALPHA)

    inputs = fixed_inputs(trainer.pipe.denoiser)
    trained = denoiser_output(trainer.pipe.denoiser, inputs)
    save_file(inputs, tmp_path / "inputs.safetensors")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            PLAIN_DIFFUSERS,
            family,
            str(base),
            str(result),
            "inputs.safetensors",
            "out.safetensors",
        ],
        cwd=tmp_path,  # not the repository: the project's packages are not importable there
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    outputs = load_file(tmp_path / "out.safetensors")
    assert relative_error(outputs["base"], trained) > 1e-2  # the adapter changes the output by far more
    assert relative_error(outputs["loaded"], trained) < 1e-4
    if "bare" in outputs:
        assert relative_error(outputs["bare"], trained) < 1e-4


def test_the_project_reads_a_lora_result_as_its_base_with_the_adapter_merged(tmp_path):
    base = make_base("own_sd3", tmp_path)
    trainer = save_lora_result(tmp_path / "run", base)
    inputs = fixed_inputs(trainer.pipe.denoiser)
    loaded = load(tmp_path / "run" / "final")
    assert not hasattr(loaded.denoiser, "peft_config")  # merged: a plain model, trainable like any base
    trained = denoiser_output(trainer.pipe.denoiser, inputs)
    assert relative_error(denoiser_output(loaded.denoiser, inputs), trained) < 1e-5

    # a base moved away: the recorded absolute path is gone, "base" as rewritten by the user is used
    record = json.loads((tmp_path / "run" / "final" / LORA_FILE).read_text())
    base.rename(tmp_path / "moved")
    with pytest.raises(ConfigError, match="base model .* is not a directory"):
        load(tmp_path / "run" / "final")
    record["base"] = str(tmp_path / "moved")
    (tmp_path / "run" / "final" / LORA_FILE).write_text(json.dumps(record))
    moved = load(tmp_path / "run" / "final")
    assert relative_error(denoiser_output(moved.denoiser, inputs), trained) < 1e-5
