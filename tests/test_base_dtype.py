"""A LoRA run's frozen base in `model.base_dtype`: for the denoiser and the VLM, the base's weights in
bfloat16 and the adapter and its optimizer states in float32; a step's gradients those of the float32
base within bfloat16's rounding; the plan's weights smaller by half the base; exact resume; the result
loads as before; and a low base dtype without LoRA is refused."""

from __future__ import annotations

import json

import pytest
import torch
from pinned_runs import TINY_DIFFUSION, TINY_VLM
from safetensors.torch import load_file
from tiny_flow import SMALL
from transformers import Qwen2VLForConditionalGeneration

from diffusion_rl.inputs import trainable_denoiser
from diffusion_rl.loading import load as load_pipeline
from diffusion_rl.models import FlowPipeline
from diffusion_rl.shapes import vocabulary
from mmrl.cli import load_plugins
from mmrl.config import ConfigError, load_config
from mmrl.registry import TRAINERS
from vlm_rl.loading import load as load_vlm
from vlm_rl.policy_weights import add_lora, merged_state_dict

load_plugins()
DIFFUSION_LORA = [*TINY_DIFFUSION, "rollout.branch_factor=4", "model.lora_rank=4", "progress=false"]
VLM_LORA = [*TINY_VLM, "model.lora_rank=4", "progress=false", "train.lr=1e-2"]


@pytest.fixture(scope="module")
def sd3_base(tmp_path_factory):
    """A small SD3-transformer flow model (the family of SD3.5 and FLUX, whose bases LoRA runs hold in
    bfloat16), saved as the trainers read it."""
    path = tmp_path_factory.mktemp("sd3") / "base"
    FlowPipeline.tiny(vocabulary(), SMALL).save_pretrained(path)
    return path


def trained(recipe: str, run_dir, *overrides: str):
    config = load_config(recipe, [f"output_dir={run_dir}", *overrides])
    trainer = TRAINERS.get(config.trainer)(config)
    trainer.train()
    return trainer


def split_by_training(module: torch.nn.Module) -> tuple[set[torch.dtype], set[torch.dtype]]:
    """(dtypes of the frozen floating-point parameters, dtypes of the trained ones)."""
    frozen = {p.dtype for p in module.parameters() if not p.requires_grad and p.is_floating_point()}
    return frozen, {p.dtype for p in module.parameters() if p.requires_grad}


def optimizer_dtypes(optimizer: torch.optim.Optimizer) -> set[torch.dtype]:
    return {v.dtype for state in optimizer.state.values() for v in state.values() if v.dim() > 0}


def test_a_bfloat16_denoiser_base_keeps_the_adapter_and_its_states_in_float32(sd3_base, tmp_path):
    trainer = trained(
        "diffusion/flat_grpo",
        tmp_path / "run",
        *DIFFUSION_LORA,
        f"model.path={sd3_base}",
        "steps=1",
        "model.base_dtype=bfloat16",
        "model.cache_prompt_embeddings=true",
    )
    assert split_by_training(trainer.pipe.denoiser) == ({torch.bfloat16}, {torch.float32})
    # the prompts were encoded once; a LoRA run's result is the adapter, so the encoders are released
    assert {p.device.type for p in trainer.pipe.text_encoder.parameters()} == {"meta"}
    assert optimizer_dtypes(trainer.optimizer) == {torch.float32}
    # the result is a LoRA adapter in float32 that the loader merges into the (float32) base as before
    assert {t.dtype for t in load_file(tmp_path / "run/final/pytorch_lora_weights.safetensors").values()} == {
        torch.float32
    }
    assert load_pipeline(tmp_path / "run/final").denoiser.dtype == torch.float32


def lora_gradients(base, base_dtype: torch.dtype) -> list[torch.Tensor]:
    """The gradients of the same LoRA adapter (B made non-zero) on the denoiser of `base` held in
    `base_dtype`, for one loss on fixed inputs."""
    pipe = load_pipeline(base)
    pipe.set_base_dtype(base_dtype)
    config = load_config("diffusion/flat_grpo", ["model.lora_rank=4"]).model
    torch.manual_seed(0)
    params = trainable_denoiser(pipe.denoiser, config)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, *pipe.latent_shape(), generator=g)
    velocity = pipe.velocity(x, torch.tensor([0.3, 0.8]), pipe.encode_prompts(["a red square", "two cats"]))
    assert velocity.dtype == torch.float32
    velocity.square().mean().backward()
    return [p.grad for p in params]


def test_a_lora_step_on_a_bfloat16_base_has_the_float32_base_s_gradients(sd3_base):
    exact, low = lora_gradients(sd3_base, torch.float32), lora_gradients(sd3_base, torch.bfloat16)
    assert len(exact) == len(low) > 0 and all(g.dtype == torch.float32 for g in low)
    for a, b in zip(exact, low, strict=True):
        assert (a - b).norm() <= 0.05 * a.norm() + 1e-6  # bfloat16 keeps 8 bits of mantissa
    flat = torch.cat([g.flatten() for g in exact]), torch.cat([g.flatten() for g in low])
    assert torch.nn.functional.cosine_similarity(*flat, dim=0) > 0.999


def test_the_plan_holds_the_base_in_half_the_bytes():
    weights = {}
    for dtype in ("float32", "bfloat16"):
        config = load_config("diffusion/flat_grpo", ["model.lora_rank=4", f"model.base_dtype={dtype}"])
        plan = TRAINERS.get(config.trainer).memory_plan(config, "flat_grpo", 1)
        weights[dtype] = plan.phases[plan.peak_phase].weights
        adapter = plan.trainable * 4
    assert weights["bfloat16"] == (weights["float32"] - adapter) // 2 + adapter
    assert "planned in bfloat16 (model.base_dtype)" in " ".join(plan.notes)


def final_denoiser(run_dir) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "final/pytorch_lora_weights.safetensors")


def test_a_bfloat16_base_resumes_exactly(sd3_base, tmp_path):
    overrides = [*DIFFUSION_LORA, f"model.path={sd3_base}", "model.base_dtype=bfloat16", "checkpoint_every=1"]
    trained("diffusion/flat_grpo", tmp_path / "straight", *overrides, "steps=2")
    trained("diffusion/flat_grpo", tmp_path / "stopped", *overrides, "steps=1")
    with pytest.warns(UserWarning, match="config changes"):
        trained("diffusion/flat_grpo", tmp_path / "stopped", *overrides, "steps=2", "resume=true")
    straight, resumed = final_denoiser(tmp_path / "straight"), final_denoiser(tmp_path / "stopped")
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


@pytest.mark.parametrize("recipe", ["diffusion/flat_grpo", "vlm/tool_grpo"])
def test_a_low_base_dtype_without_lora_is_refused(recipe):
    with pytest.raises(ConfigError, match=r"model.base_dtype = 'bfloat16'.*model.lora_rank > 0"):
        load_config(recipe, ["model.base_dtype=bfloat16"])


def test_a_vlm_lora_run_holds_its_base_in_bfloat16_and_saves_a_plain_checkpoint(tmp_path):
    trainer = trained("vlm/tool_grpo", tmp_path / "run", *VLM_LORA, "steps=1", "model.base_dtype=bfloat16")
    model = trainer.adapter.model
    assert split_by_training(model) == ({torch.bfloat16}, {torch.float32})
    assert optimizer_dtypes(trainer.optimizer) == {torch.float32}
    adapted = [name for name, p in model.named_parameters() if p.requires_grad]
    assert adapted and all(".language_model.layers." in name for name in adapted)
    # the saved model is the merged policy (its outputs: the next test), which plain transformers loads
    saved = Qwen2VLForConditionalGeneration.from_pretrained(tmp_path / "run/model").state_dict()
    merged = merged_state_dict(model)
    assert saved.keys() == merged.keys() and not any("lora" in name for name in saved)
    assert all(torch.equal(saved[name], merged[name]) for name in saved)
    assert json.loads((tmp_path / "run/model/config.json").read_text())["dtype"] == "bfloat16"


def test_merged_weights_give_the_adapted_model_s_outputs():
    adapter = load_vlm("vlm_rl/assets/tiny_vlm")
    model = adapter.model
    params = add_lora(model, 4, 8.0, "attention_mlp")
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    plain = load_vlm("vlm_rl/assets/tiny_vlm").model
    merged = merged_state_dict(model)
    assert merged.keys() == plain.state_dict().keys()
    plain.load_state_dict(merged)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, model(input_ids=ids).logits)
