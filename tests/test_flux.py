"""FLUX.1-style diffusers pipelines through FlowPipeline: tiny guidance-distilled (dev-style,
guidance_embeds=True) and schnell-style pipelines saved with save_pretrained, sampled by FluxPipeline
and by our Euler steps on unpacked latents, trained with LoRA by both diffusion trainers, the result
loaded back by plain diffusers with `load_lora_weights`, and pipelines we cannot run refused."""

import json
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from safetensors.torch import load_file
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from diffusion_rl.inputs import LORA_TARGETS
from diffusion_rl.loading import check_model_directory, load
from diffusion_rl.models import (
    LORA_FILE,
    LORA_WEIGHTS,
    FlowPipeline,
    build_clip_tokenizer,
    build_t5_tokenizer,
    latent_image_ids,
    pack_latents,
    unpack_latents,
)
from diffusion_rl.sde import initial_noise_std, ode_step
from diffusion_rl.shapes import vocabulary
from mmrl.cli import load_checked_config, load_plugins, main
from mmrl.config import ConfigError, load_config
from mmrl.registry import TRAINERS

load_plugins()

WORDS = vocabulary()
T5_TOKENS = 16
PROMPT = "a red circle"
# FLUX.1-dev's scheduler_config.json: the shift grows with the number of image tokens (mu)
FLUX_SCHEDULER = {
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}


def tiny_vae() -> AutoencoderKL:
    """Two levels (2 pixels per latent cell), 4 latent channels, FLUX's scaling and shift factors."""
    return AutoencoderKL(
        block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=32,
        scaling_factor=0.3611,
        shift_factor=0.1159,
    )


def save_flux(
    directory: Path,
    guidance_embeds: bool = True,
    with_t5: bool = True,
    in_channels: int = 16,
) -> Path:
    """A tiny FluxPipeline (1 double- and 1 single-stream block) written by save_pretrained."""
    torch.manual_seed(0)
    clip_tokenizer = build_clip_tokenizer(WORDS)
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(clip_tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=16,
            projection_dim=32,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
    )
    t5_tokenizer = build_t5_tokenizer(WORDS, T5_TOKENS)
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=len(t5_tokenizer),
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=1,
            num_heads=2,
            relative_attention_num_buckets=8,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        )
    )
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=in_channels,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=guidance_embeds,
        axes_dims_rope=(2, 2, 4),
    )
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER),
        vae=tiny_vae(),
        text_encoder=clip,
        tokenizer=clip_tokenizer,
        text_encoder_2=t5 if with_t5 else None,
        tokenizer_2=t5_tokenizer if with_t5 else None,
        transformer=transformer,
    )
    pipe.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def flux_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("flux")
    return {
        "dev": save_flux(root / "dev", guidance_embeds=True),
        "schnell": save_flux(root / "schnell", guidance_embeds=False),
    }


@torch.no_grad()
def our_ode_sample(pipe: FlowPipeline, latents: torch.Tensor, steps: int, guidance: float) -> torch.Tensor:
    sigmas = pipe.sigmas(steps)
    x = latents * initial_noise_std(sigmas[0])
    cond, uncond = pipe.encode_prompts([PROMPT]), pipe.encode_prompts([""])
    for i in range(steps):
        v = pipe.velocity(x, sigmas[i].expand(1), cond, guidance, uncond)
        x = ode_step(v, x, sigmas[i], sigmas[i + 1])
    return x


def test_tiny_t5_tokenizer_loads_offline_and_packing_is_fluxs(tmp_path):
    tokenizer = build_t5_tokenizer(WORDS, T5_TOKENS)
    tokenizer.save_pretrained(tmp_path)
    loaded = type(tokenizer).from_pretrained(tmp_path, local_files_only=True)
    ids = loaded(PROMPT).input_ids
    assert len(ids) == 4 and ids[-1] == loaded.eos_token_id == 1  # one token a word, then </s>
    assert loaded.unk_token_id not in loaded("a xyz circle").input_ids  # unknown words: characters

    x = torch.randn(2, 4, 6, 10)
    packed = pack_latents(x)
    torch.testing.assert_close(packed, FluxPipeline._pack_latents(x, 2, 4, 6, 10), atol=0, rtol=0)
    torch.testing.assert_close(unpack_latents(packed, 6, 10), x, atol=0, rtol=0)
    # FluxPipeline unpacks from the pixel size: 12 x 20 pixels at 2 pixels per latent cell
    torch.testing.assert_close(FluxPipeline._unpack_latents(packed, 12, 20, 2), x, atol=0, rtol=0)
    expected_ids = FluxPipeline._prepare_latent_image_ids(2, 3, 5, "cpu", torch.float32)
    torch.testing.assert_close(latent_image_ids(6, 10, torch.device("cpu"), torch.float32), expected_ids)


def test_flux_pipeline_loads_with_plain_latents_and_its_schedule(flux_dirs):
    for name, embedded in (("dev", True), ("schnell", False)):
        pipe = load(flux_dirs[name])
        assert pipe.is_flux and not pipe.is_vp and not pipe.is_unet and pipe.guidance_embedded == embedded
        assert pipe.denoiser_folder == check_model_directory(flux_dirs[name]) == "transformer"
        assert pipe.latent_shape() == (4, 128, 128)  # FluxPipeline's default: 128 latent cells a side
        pipe.set_image_size(32)
        assert pipe.latent_shape() == (4, 16, 16)
        cond = pipe.encode_prompts([PROMPT, "two blue squares"])
        assert cond.embeds.shape == (2, T5_TOKENS, 32) and cond.pooled.shape == (2, 32)
    with pytest.raises(ValueError, match="multiple of 4 .*FLUX packs 2 x 2"):
        pipe.set_image_size(34)
    # the schedule's shift grows with the image (more tokens, more steps at high noise)
    small = pipe.sigmas(4)
    pipe.set_image_size(64)
    large = pipe.sigmas(4)
    assert small[0] == large[0] == 1 and small[-1] == large[-1] == 0 and (large[1:-1] > small[1:-1]).all()


@pytest.mark.parametrize(
    "name, size, guidance",
    [("dev", 32, 3.5), ("dev", 48, 1.0), ("schnell", 32, 1.0), ("schnell", 32, 3.0)],
)
def test_our_euler_sampling_matches_flux_pipeline(flux_dirs, name, size, guidance):
    """dev: guidance_scale is the embedded guidance; schnell: 1 is no guidance and another value
    classifier-free guidance against the empty prompt, FluxPipeline's true_cfg_scale."""
    pipe = load(flux_dirs[name])
    pipe.set_image_size(size)
    side = size // 2
    latents = torch.randn(1, 4, side, side, generator=torch.Generator().manual_seed(1))
    steps = 4
    extra = {"true_cfg_scale": guidance, "negative_prompt": ""} if name == "schnell" else {}
    reference = FluxPipeline.from_pretrained(flux_dirs[name], local_files_only=True)
    expected = reference(
        PROMPT,
        height=size,
        width=size,
        num_inference_steps=steps,
        guidance_scale=guidance,
        latents=pack_latents(latents),
        max_sequence_length=T5_TOKENS,
        output_type="latent",
        **extra,
    ).images
    ours = our_ode_sample(pipe, latents, steps, guidance)
    torch.testing.assert_close(pack_latents(ours), expected, atol=1e-4, rtol=1e-4)
    assert (ours - latents).abs().max() > 0.1  # the steps moved the sample
    # FluxPipeline's decoding (unpack, undo the VAE's scaling and shift, to [0, 1]) is ours
    images = reference(
        PROMPT,
        height=size,
        width=size,
        num_inference_steps=steps,
        guidance_scale=guidance,
        latents=pack_latents(latents),
        max_sequence_length=T5_TOKENS,
        output_type="pt",
        **extra,
    ).images
    torch.testing.assert_close(pipe.decode(ours), images, atol=1e-4, rtol=1e-4)


def test_guidance_maps_to_the_embedding_or_to_cfg(flux_dirs):
    x = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(2))
    sigma = torch.tensor([0.8, 0.4])
    dev = load(flux_dirs["dev"])
    cond = dev.encode_prompts([PROMPT, PROMPT])
    with torch.no_grad():
        v1, v35 = dev.velocity(x, sigma, cond, 1.0), dev.velocity(x, sigma, cond, 3.5)  # no uncond needed
    assert v1.shape == x.shape and (v1 - v35).abs().max() > 1e-4
    schnell = load(flux_dirs["schnell"])
    with pytest.raises(ValueError, match="uncond"):
        schnell.velocity(x, sigma, schnell.encode_prompts([PROMPT, PROMPT]), 3.0)


@pytest.mark.parametrize("targets", ["attention", "attention_mlp"])
def test_lora_targets_cover_both_flux_block_kinds(flux_dirs, targets):
    from peft import LoraConfig

    transformer = load(flux_dirs["dev"]).denoiser
    transformer.add_adapter(LoraConfig(r=2, target_modules=LORA_TARGETS[targets]))
    adapted = {
        name.rsplit(".lora_A", 1)[0] for name, _ in transformer.named_parameters() if ".lora_A" in name
    }
    attention = {
        *(f"transformer_blocks.0.attn.{m}" for m in ("to_q", "to_k", "to_v", "to_out.0")),
        *(f"single_transformer_blocks.0.attn.{m}" for m in ("to_q", "to_k", "to_v")),
    }
    if targets == "attention":
        assert adapted == attention
        return
    text_stream = {
        f"transformer_blocks.0.attn.{m}" for m in ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    }
    mlp = {
        *(f"transformer_blocks.0.{ff}.net.{i}" for ff in ("ff", "ff_context") for i in ("0.proj", "2")),
        "single_transformer_blocks.0.proj_mlp",
    }
    assert adapted == attention | text_stream | mlp


TRAIN = {
    "diffusion/flat_grpo": [
        "rollout.prompts_per_step=1",
        "rollout.steps=3",
        "rollout.branch_factor=2",
        "rollout.guidance_scale=3.5",
        "eval.guidance_scale=3.5",
    ],
    "diffusion/nft": [
        "rollout.prompts_per_step=1",
        "rollout.group_size=2",
        "rollout.steps=3",
        "train.timesteps_per_sample=1",
    ],
}


@pytest.mark.parametrize("recipe", list(TRAIN))
def test_trainers_train_flux_with_lora_and_plain_diffusers_loads_it(flux_dirs, tmp_path, recipe):
    """`mmrl train RECIPE` as cmd_train runs it (the trainer kept, to compare with its trained model)."""
    base = flux_dirs["dev"]
    run = tmp_path / "run"
    config = load_checked_config(
        recipe,
        [
            f"model.path={base}",
            f"output_dir={run}",
            "progress=false",
            "steps=2",
            "checkpoint_every=2",
            "model.lora_rank=2",
            "model.lora_alpha=4",  # diffusers reads alpha from the file's metadata, else takes alpha = rank
            "rollout.image_size=32",
            "train.lr=0.05",
            "reward.name=jpeg_compressibility",
            "reward.options={}",  # the recipe's options are shapes_strict's
            "eval.prompts=1",
            "eval.steps=2",
            *TRAIN[recipe],
        ],
    )
    trainer = TRAINERS.get(config.trainer)(config)
    trainer.train()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    result = run / "final"
    record = json.loads((result / LORA_FILE).read_text())
    assert (record["lora_rank"], record["lora_alpha"]) == (2, 4.0)
    weights = load_file(result / LORA_WEIGHTS)
    assert all(key.startswith("transformer.") for key in weights)
    assert max(float(w.abs().max()) for key, w in weights.items() if "lora_B" in key) > 0  # B starts at 0

    trained = trainer.pipe  # its denoiser: the base with the trained adapter
    x = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(3))
    sigma = torch.tensor([0.6, 0.3])
    cond = trained.encode_prompts([PROMPT, "a blue square"])
    plain = FluxPipeline.from_pretrained(base, local_files_only=True)
    with torch.no_grad():
        expected = trained.velocity(x, sigma, cond, 3.5)
        before = trained.with_denoiser(plain.transformer).velocity(x, sigma, cond, 3.5)
        plain.load_lora_weights(result)
        loaded = trained.with_denoiser(plain.transformer).velocity(x, sigma, cond, 3.5)
        merged = load(result).velocity(x, sigma, cond, 3.5)  # the project's reading
    torch.testing.assert_close(loaded, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged, expected, atol=1e-5, rtol=1e-5)
    assert (loaded - before).abs().max() > 1e-4  # the LoRA changed something

    # plain diffusers' own sampling with the adapter is our sampling with the trained model
    latents = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(4))
    sampled = plain(
        PROMPT,
        height=32,
        width=32,
        num_inference_steps=3,
        guidance_scale=3.5,
        latents=pack_latents(latents),
        max_sequence_length=T5_TOKENS,
        output_type="latent",
    ).images
    ours = our_ode_sample(trained, latents, 3, 3.5)
    torch.testing.assert_close(pack_latents(ours), sampled, atol=1e-4, rtol=1e-4)


def test_flux_pipelines_we_cannot_run_are_refused(tmp_path):
    no_t5 = save_flux(tmp_path / "no_t5", with_t5=False)
    for reader in (load, check_model_directory):
        with pytest.raises(ConfigError, match="no text_encoder_2, tokenizer_2 .*T5 text encoder"):
            reader(no_t5)
    code = main(["train", "diffusion/flat_grpo", f"model.path={no_t5}", f"output_dir={tmp_path / 'run'}"])
    assert code == 2 and not (tmp_path / "run" / "final").exists()

    fill = save_flux(tmp_path / "fill", in_channels=32)  # extra conditioning channels, as FLUX Fill
    with pytest.raises(ConfigError, match="text-to-image FLUX only .*not Fill"):
        load(fill)

    karras = save_flux(tmp_path / "karras")
    config_file = karras / "scheduler" / "scheduler_config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"use_karras_sigmas": True}))
    with pytest.raises(ConfigError, match="use_karras_sigmas"):
        load(karras)


def test_nft_trains_a_guidance_distilled_model_at_the_guidance_it_sampled_with(flux_dirs, tmp_path):
    """FLUX.1-dev's guidance is an input, not classifier-free guidance: the NFT update's velocity is the
    one the rollouts sampled with (embedded guidance 3.5); a schnell-style model trains unguided."""
    from diffusion_rl.nft import DiffusionNFTTrainer

    for name, expected_guidance in (("dev", 3.5), ("schnell", 1.0)):
        config = load_config(
            "diffusion/nft",
            [
                f"model.path={flux_dirs[name]}",
                f"output_dir={tmp_path / name}",
                "progress=false",
                "rollout.prompts_per_step=1",
                "rollout.group_size=2",
                "rollout.steps=2",
                "rollout.guidance_scale=3.5",
                "rollout.image_size=32",
            ],
        )
        trainer = DiffusionNFTTrainer(config)
        trainer.seed_everything()
        trainer.setup()
        x = torch.randn(1, *trainer.pipe.latent_shape())
        t, cond = torch.tensor([0.4]), trainer.pipe.encode_prompts(["a red square"])
        with torch.no_grad():
            got = trainer.velocity(trainer.pipe.denoiser, x, t, cond)
            want = trainer.pipe.velocity(x, t, cond, expected_guidance)
        assert torch.equal(got, want)
        if name == "dev":  # the embedded guidance changes the velocity: the check can fail
            assert not torch.equal(got, trainer.pipe.velocity(x, t, cond, 1.0))
