"""Real diffusers pipeline directories through FlowPipeline: tiny SD1.x (UNet + DDIM) and SD3 pipelines
saved with save_pretrained, sampled by diffusers and by us, trained with LoRA and loaded back by plain
diffusers with `load_lora_weights`."""

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

from diffusion_rl.branch_grpo import BranchGRPOTrainer
from diffusion_rl.loading import load
from diffusion_rl.models import FlowPipeline, build_clip_tokenizer
from diffusion_rl.sde import ddim_flow_step, flow_to_vp, initial_noise_std, ode_step
from diffusion_rl.shapes import vocabulary
from mmrl.cli import load_plugins
from mmrl.config import ConfigError, load_config

load_plugins()
WORDS = vocabulary()


def tiny_vae(latent_channels: int) -> AutoencoderKL:
    return AutoencoderKL(
        block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=latent_channels,
        norm_num_groups=8,
        sample_size=32,
    )


def text_config(hidden: int = 32) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=len(build_clip_tokenizer(WORDS)),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=16,
        projection_dim=hidden,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )


def save_sd1(directory: Path, prediction_type: str = "epsilon") -> Path:
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        block_out_channels=(16, 32),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
    )
    scheduler = DDIMScheduler(
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        clip_sample=False,
        set_alpha_to_one=True,
        steps_offset=1,
        prediction_type=prediction_type,
    )
    pipe = StableDiffusionPipeline(
        vae=tiny_vae(4),
        text_encoder=CLIPTextModel(text_config()),
        tokenizer=build_clip_tokenizer(WORDS),
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(directory)
    return directory


def save_sd3(directory: Path) -> Path:
    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=64,
        caption_projection_dim=32,
        pooled_projection_dim=64,
        pos_embed_max_size=8,
    )
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=tiny_vae(4),
        text_encoder=CLIPTextModelWithProjection(text_config()),
        tokenizer=build_clip_tokenizer(WORDS),
        text_encoder_2=CLIPTextModelWithProjection(text_config()),
        tokenizer_2=build_clip_tokenizer(WORDS),
        text_encoder_3=None,
        tokenizer_3=None,
    )
    pipe.save_pretrained(directory)
    return directory


@torch.no_grad()
def our_ode_sample(pipe: FlowPipeline, prompt: str, latents: torch.Tensor, steps: int, guidance: float):
    sigmas = pipe.sigmas(steps)
    x = latents * initial_noise_std(sigmas[0])
    cond, uncond = pipe.encode_prompts([prompt]), pipe.encode_prompts([""])
    for i in range(steps):
        v = pipe.velocity(x, sigmas[i].expand(1), cond, guidance, uncond)
        x = ode_step(v, x, sigmas[i], sigmas[i + 1])
    return x


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_sd1_ddim_sampling_matches_diffusers(tmp_path, prediction_type):
    directory = save_sd1(tmp_path / "sd1", prediction_type)
    pipe = load(directory)
    assert pipe.is_vp and pipe.is_unet and pipe.prediction == prediction_type
    latents = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    reference = StableDiffusionPipeline.from_pretrained(directory)
    expected = reference(
        "a red circle",
        height=32,
        width=32,
        num_inference_steps=5,
        guidance_scale=3.0,
        eta=0.0,
        latents=latents.clone(),
        output_type="latent",
    ).images
    ours = our_ode_sample(pipe, "a red circle", latents, steps=5, guidance=3.0)
    torch.testing.assert_close(ours, expected, atol=2e-4, rtol=1e-4)


def test_ddim_flow_step_matches_diffusers_ddim_with_noise(tmp_path):
    """The stochastic DDIM step in flow coordinates is diffusers' DDIMScheduler.step (eta = 1)."""
    pipe = load(save_sd1(tmp_path / "sd1"))
    scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    scheduler.set_timesteps(5)
    sigmas = pipe.sigmas(5).double()
    g = torch.Generator().manual_seed(2)
    x_vp = torch.randn(2, 4, 16, 16, generator=g, dtype=torch.float64)
    noise = torch.randn(2, 4, 16, 16, generator=g, dtype=torch.float64)
    cond = pipe.encode_prompts(["a red circle", "two blue squares"])
    i = 1
    t = scheduler.timesteps[i]
    with torch.no_grad():
        eps = pipe.denoiser(x_vp.float(), t, encoder_hidden_states=cond.embeds).sample.double()
    expected = scheduler.step(eps, t, x_vp, eta=1.0, variance_noise=noise).prev_sample
    _, c = flow_to_vp(sigmas[i])
    _, c_next = flow_to_vp(sigmas[i + 1])
    x_flow = x_vp / c
    v = eps - (x_flow - sigmas[i] * eps) / (1 - sigmas[i])  # v = eps - x0 with x_flow = (1-s) x0 + s eps
    out = ddim_flow_step(v, x_flow, sigmas[i], sigmas[i + 1], eta=1.0, noise=noise)
    torch.testing.assert_close(out.prev_sample * c_next, expected, atol=1e-6, rtol=1e-6)
    scored = ddim_flow_step(v, x_flow, sigmas[i], sigmas[i + 1], eta=1.0, prev_sample=out.prev_sample)
    torch.testing.assert_close(scored.log_prob, out.log_prob, atol=0, rtol=0)


def test_sd3_sampling_matches_diffusers(tmp_path):
    directory = save_sd3(tmp_path / "sd3")
    pipe = load(directory)
    assert not pipe.is_vp and not pipe.is_unet and pipe.shift == 3.0
    assert pipe.latent_shape() == (4, 16, 16)
    latents = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    reference = StableDiffusion3Pipeline.from_pretrained(directory, text_encoder_3=None, tokenizer_3=None)
    steps = 4
    expected = reference(
        "a red circle",
        height=32,
        width=32,
        num_inference_steps=steps,
        sigmas=list(np.linspace(1.0, 0.0, steps + 1)[:-1]),  # the scheduler shifts them, as we do
        guidance_scale=3.0,
        latents=latents.clone(),
        output_type="latent",
    ).images
    ours = our_ode_sample(pipe, "a red circle", latents, steps=steps, guidance=3.0)
    torch.testing.assert_close(ours, expected, atol=2e-4, rtol=1e-4)


def test_unsupported_and_mismatched_pipeline_dirs_are_refused(tmp_path):
    (tmp_path / "model_index.json").write_text('{"_class_name": "Whatever"}')
    with pytest.raises(Exception, match="Whatever|model_index"):
        load(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        load(tmp_path / "missing")


def lora_run(tmp_path: Path, model_dir: Path, *extra: str) -> BranchGRPOTrainer:
    cfg = load_config(
        "diffusion/flat_grpo",
        [
            f"output_dir={tmp_path / 'run'}",
            f"model.path={model_dir}",
            "model.lora_rank=4",
            "model.lora_alpha=8",  # diffusers reads alpha from the file's metadata, else takes alpha = rank
            "steps=2",
            "checkpoint_every=2",
            "progress=false",
            "rollout.prompts_per_step=1",
            "rollout.steps=4",
            "rollout.branch_factor=2",
            "rollout.guidance_scale=1.0",
            "train.lr=0.05",
            "reward.name=jpeg_compressibility",
            "eval.prompts=1",
            "eval.steps=2",
            *extra,
        ],
    )
    trainer = BranchGRPOTrainer(cfg)
    trainer.train()
    return trainer


@pytest.mark.parametrize("family", ["sd1", "sd3"])
def test_lora_result_loads_in_plain_diffusers(tmp_path, family):
    save = {"sd1": save_sd1, "sd3": save_sd3}[family]
    pipeline_class = {"sd1": StableDiffusionPipeline, "sd3": StableDiffusion3Pipeline}[family]
    model_dir = save(tmp_path / family)
    extra = ["rollout.sde=ddim", "rollout.noise_level=1.0"] if family == "sd1" else []
    trainer = lora_run(tmp_path, model_dir, *extra)
    assert (tmp_path / "run" / "final" / "pytorch_lora_weights.safetensors").is_file()

    absent = {"text_encoder_3": None, "tokenizer_3": None} if family == "sd3" else {}
    plain = pipeline_class.from_pretrained(model_dir, **absent)
    denoiser = plain.unet if family == "sd1" else plain.transformer
    x = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(3))
    cond = trainer.pipe.encode_prompts(["a red circle", "a blue square"])
    sigma = torch.tensor([0.6, 0.3])
    base = load(model_dir).velocity(x, sigma, cond)
    plain.load_lora_weights(tmp_path / "run" / "final")
    loaded = trainer.pipe.with_denoiser(denoiser).velocity(x, sigma, cond)
    trained = trainer.pipe.velocity(x, sigma, cond)
    torch.testing.assert_close(loaded, trained, atol=1e-5, rtol=1e-5)
    assert (loaded - base).abs().max() > 1e-4  # the LoRA changed something


def test_ddim_rejects_a_split_at_the_noiseless_last_step():
    with pytest.raises(ConfigError, match="last step"):
        load_config("diffusion/flat_grpo", ["rollout.sde=ddim", "rollout.steps=4", "rollout.split_steps=[3]"])
