"""`mmrl pretrain diffusion`: flow-matching pretraining of the tiny model, EMA, save and reload."""

import json

import pytest
import torch

from diffusion_rl.loading import load
from diffusion_rl.models import FlowPipeline
from mmrl.cli import load_plugins, main

load_plugins()


def test_pretrain_saves_a_loadable_ema_pipeline(tmp_path, monkeypatch):
    monkeypatch.setattr(
        "diffusion_rl.pretrain.evaluate_alignment", lambda *a, **k: {"heldout_alignment": 0.5}
    )
    code = main(
        [
            "pretrain",
            "diffusion",
            f"output_dir={tmp_path}",
            "steps=3",
            "checkpoint_every=2",
            "progress=false",
            "model.image_size=16",
            "model.backbone=sd3",
            "model.layers=1",
            "model.head_dim=8",
            "model.text_hidden=16",
            "model.text_layers=1",
            "train.batch_size=4",
        ]
    )
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["loss"] > 0 for r in rows)
    pipe = load(tmp_path / "pipeline")
    assert pipe.latent_shape() == (3, 16, 16)
    assert pipe.prediction == "velocity"  # the parameterisation it was trained with travels with it
    # the saved weights are the EMA, which moved off the initial weights but not all the way
    from safetensors.torch import load_file

    ema = load_file(tmp_path / "pipeline" / "transformer" / "diffusion_pytorch_model.safetensors")
    live = load_file(tmp_path / "checkpoints" / "step_00000003" / "model.safetensors")
    name = next(k for k in ema if k.endswith("proj_out.weight"))
    assert not torch.equal(ema[name], live[name])
    cond = pipe.encode_prompts(["a red circle"])
    v = pipe.velocity(torch.zeros(1, 3, 16, 16), torch.tensor([0.5]), cond)
    assert v.shape == (1, 3, 16, 16) and torch.isfinite(v).all()


def test_sample_prediction_becomes_a_velocity():
    from diffusion_rl.models import TinyFlowSpec
    from diffusion_rl.shapes import vocabulary

    spec = TinyFlowSpec(image_size=16, layers=1, head_dim=8, text_hidden=16, text_layers=1)
    pipe = FlowPipeline.tiny(vocabulary(), spec, prediction="sample")
    x, sigma = torch.randn(2, 3, 16, 16), torch.tensor([0.5, 0.01])
    cond = pipe.encode_prompts(["a red circle", "two blue squares"])
    with torch.no_grad():
        x0 = pipe.denoiser(
            hidden_states=x,
            timestep=sigma * 1000,
            encoder_hidden_states=cond.embeds,
            pooled_projections=cond.pooled,
        ).sample
        v = pipe.velocity(x, sigma, cond)
    torch.testing.assert_close(v[0], (x[0] - x0[0]) / 0.5)
    torch.testing.assert_close(v[1], (x[1] - x0[1]) / 0.05)  # the divisor is floored near sigma = 0


@pytest.mark.slow  # two processes, each building the pipeline
def test_tokenizer_is_the_same_in_every_process():
    import subprocess
    import sys

    code = (
        "from diffusion_rl.models import build_clip_tokenizer; from diffusion_rl.shapes import vocabulary; "
        "t = build_clip_tokenizer(vocabulary()); "
        "print(len(t), t('two red circles and a green cross')['input_ids'])"
    )
    runs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        for _ in range(3)
    }
    assert len(runs) == 1
    from diffusion_rl.models import build_clip_tokenizer
    from diffusion_rl.shapes import vocabulary

    tokenizer = build_clip_tokenizer(vocabulary())
    for word in vocabulary():  # every word of the grammar is one token
        assert tokenizer.convert_ids_to_tokens(tokenizer(word)["input_ids"])[1:-1] == [word + "</w>"]


def test_unet_backbone_pretrains_and_reloads(tmp_path, monkeypatch):
    monkeypatch.setattr(
        "diffusion_rl.pretrain.evaluate_alignment", lambda *a, **k: {"heldout_alignment": 0.5}
    )
    overrides = ["steps=2", "checkpoint_every=2", "progress=false", "model.image_size=16"]
    overrides += ["model.backbone=unet", "model.unet_channels=[8,16]", "train.batch_size=4"]
    assert main(["pretrain", "diffusion", f"output_dir={tmp_path}", *overrides]) == 0
    pipe = load(tmp_path / "pipeline")
    assert pipe.is_unet and not pipe.is_vp and pipe.latent_shape() == (3, 16, 16)


def test_shipped_tiny_flow_weights_draw_what_prompts_ask():
    """The base model the diffusion recipes start from is trained, not random: a small held-out
    alignment check (an untrained model scores about 0.004; these weights 0.138 on 64 prompts)."""
    from diffusion_rl.inputs import resolve_model_path
    from diffusion_rl.sampling import evaluate_alignment

    pipe = load(resolve_model_path("diffusion_rl/assets/tiny_flow"))
    assert pipe.is_unet and pipe.latent_shape() == (3, 32, 32)
    score = evaluate_alignment(pipe, num_prompts=16, steps=10, guidance_scale=3.0, seed=0)
    assert score["heldout_alignment"] > 0.05
