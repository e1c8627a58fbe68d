"""The real models' configs build their published sizes; their tiny replicas load through the code that
loads real weights; every real-model recipe runs an iteration on its replica; held-out prompt files."""

import json

import pytest
import torch
import yaml
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

from diffusion_rl.loading import load
from diffusion_rl.replicas import FULL, build_full
from mmrl.cli import load_plugins, main
from mmrl.config import CONFIG_ROOT as CONFIGS
from mmrl.config import ConfigError, load_config
from mmrl.registry import REPLICAS, REWARDS, TRAINERS
from vlm_rl import loading as vlm_loading
from vlm_rl.replicas import FULL as QWEN25VL_FULL
from vlm_rl.replicas import build_full as build_qwen25vl

load_plugins()

# Published sizes (model cards): SD3.5 Medium's MMDiT-X 2.5B (its position-embedding table
# included), FLUX.1 12B, the T5 v1.1 XXL encoder 4.8B, PickScore's CLIP ViT-H/14 986M.
PUBLISHED = {
    ("sd35m", "transformer"): 2.5e9,
    ("flux_dev", "transformer"): 12e9,
    ("flux_dev", "text_encoder_2"): 4.76e9,
    ("pickscore", "model"): 0.986e9,
    ("qwen25vl_3b", "model"): 3.75e9,
}
TRAIN_PROMPTS = ["a red square on a table", "two blue crosses", "a photo of a cat", "three yellow circles"]
HELDOUT_PROMPTS = ["a purple triangle", "a dog in the snow", "one green cross"]


@pytest.mark.parametrize(("name", "part"), sorted(PUBLISHED))
def test_full_configs_build_the_published_sizes_on_the_meta_device(name, part):
    with torch.device("meta"):
        module = build_qwen25vl() if name == "qwen25vl_3b" else build_full(name)[part]
    size = sum(t.numel() for t in module.parameters()) + sum(t.numel() for t in module.buffers())
    assert abs(size / PUBLISHED[(name, part)] - 1) < 0.03, size


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    root = tmp_path_factory.mktemp("replicas")
    return {name: REPLICAS.get(name)(root / name) for name in [*FULL, "qwen25vl_3b"]}


@pytest.mark.parametrize(
    ("name", "denoiser"), [("sd35m", SD3Transformer2DModel), ("flux_dev", FluxTransformer2DModel)]
)
def test_replicas_load_as_the_real_pipelines_do_and_keep_their_structure(replicas, name, denoiser):
    index = json.loads((replicas[name] / "model_index.json").read_text())
    assert index["_class_name"] == {"sd35m": "StableDiffusion3Pipeline", "flux_dev": "FluxPipeline"}[name]
    pipe = load(replicas[name])
    assert isinstance(pipe.denoiser, denoiser)
    assert pipe.vae_scale == 8 and pipe.latent_shape()[0] == 16  # the real VAE's downsampling, channels
    full = FULL[name]["transformer"]
    for key in ("patch_size", "in_channels", "qk_norm", "guidance_embeds"):
        if key in full:
            assert pipe.denoiser.config[key] == full[key], key
    if name == "sd35m":
        assert pipe.denoiser.config.dual_attention_layers == [0]  # the dual-attention block kept
        assert pipe.diffusers_pipeline.text_encoder_3 is not None  # T5 as the third encoder
    else:
        assert sum(pipe.denoiser.config.axes_dims_rope) == pipe.denoiser.config.attention_head_dim
        assert pipe.guidance_embedded


def test_the_qwen25vl_replica_loads_as_the_real_checkpoint_does_and_keeps_its_structure(replicas):
    adapter = vlm_loading.load(replicas["qwen25vl_3b"])
    config = adapter.model.config
    assert type(adapter.model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    text, vision = config.get_text_config(), config.vision_config
    full_text, full_vision = QWEN25VL_FULL["text"], QWEN25VL_FULL["vision"]
    assert (
        text.num_attention_heads // text.num_key_value_heads
        == 8
        == (full_text["num_attention_heads"] // full_text["num_key_value_heads"])
    )
    head = text.hidden_size // text.num_attention_heads
    assert sum(text.rope_parameters["mrope_section"]) == head // 2
    for key in ("patch_size", "spatial_merge_size", "temporal_patch_size", "window_size"):
        assert getattr(vision, key) == full_vision[key], key
    assert vision.out_hidden_size == text.hidden_size and config.tie_word_embeddings
    assert text.vocab_size == len(adapter.tokenizer)


def test_pickscore_replica_scores_with_the_reward_code(replicas):
    reward = REWARDS.get("pickscore")(model_path=str(replicas["pickscore"]), device="cpu")
    images = torch.rand(2, 3, 64, 64)
    scores = reward(images, prompts=["a red square", "a dog"])
    assert scores.shape == (2,) and torch.isfinite(scores).all()


def test_the_replica_command_writes_a_replica_and_refuses_bad_options(tmp_path, capsys):
    assert main(["replica", "pickscore", f"output_dir={tmp_path / 'p'}"]) == 0
    assert (tmp_path / "p" / "config.json").is_file()
    assert main(["replica", "pickscore", f"output_dir={tmp_path / 'p'}"]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert main(["replica", "pickscore", f"output_dir={tmp_path / 'q'}", "size=3"]) == 2
    assert "unknown option 'size'" in capsys.readouterr().err
    assert main(["replica", "sd4"]) == 2
    assert "sd4" in capsys.readouterr().err


def replica_run(replicas, name, tmp_path) -> list[str]:
    """Overrides that point a real-model recipe at its replica (`name`), the PickScore replica and
    prompt files written to `tmp_path`, at 64 px with 2 held-out prompts."""
    train, heldout = tmp_path / "train.txt", tmp_path / "heldout.txt"
    train.write_text("\n".join(TRAIN_PROMPTS) + "\n")
    heldout.write_text("\n".join(HELDOUT_PROMPTS) + "\n")
    clip = replicas["pickscore"]
    return [
        f"model.path={replicas[name]}",
        f"prompt_file={train}",
        f"eval.prompt_file={heldout}",
        f"reward.options.model_path={clip}",
        f"eval.gold_reward.options.model_path={clip}",
        "rollout.image_size=64",
        "rollout.prompts_per_step=1",
        "eval.prompts=2",
        "eval.steps=2",
        "steps=1",
        "progress=false",
    ]


RECIPES = {
    "diffusion/sd35m_pickscore_lora": ("sd35m", ["rollout.branch_factor=4", "rollout.steps=3"]),
    "diffusion/flux_dev_branchgrpo_lora": ("flux_dev", ["rollout.steps=4", "rollout.split_steps=[0,2]"]),
    "diffusion/sol_rl_flux": (
        "flux_dev",
        ["rollout.group_size=4", "rollout.steps=3", "explore.pool=8", "explore.steps=2"],
    ),
}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_each_real_model_recipe_runs_an_iteration_on_its_replica(replicas, tmp_path, recipe, capsys):
    name, sizes = RECIPES[recipe]
    config = load_config(
        recipe, [*replica_run(replicas, name, tmp_path), f"output_dir={tmp_path / 'run'}", *sizes]
    )
    assert config.model.lora_rank > 0
    result = TRAINERS.get(config.trainer)(config).train()
    # its batch sizes are per process, for 8 GPUs: one process is told that its effective batch differs
    assert "written for 8 process(es); on 1 the effective batch differs" in capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and torch.isfinite(torch.tensor(rows[0]["loss"]))
    evals = json.loads((tmp_path / "run" / "eval.json").read_text())
    # held-out prompts from the file: scored by the trained reward and the gold reward, not geneval_mini
    assert set(evals["after"]) == {"heldout_pickscore", "heldout_gold"}, evals["after"]
    assert set(result) >= {"heldout_pickscore", "heldout_gold"}
    adapter = tmp_path / "run" / "final" / "pytorch_lora_weights.safetensors"
    assert adapter.is_file()
    load(tmp_path / "run" / "final")  # the LoRA result loads on its base


VLM_RECIPES = {"vlm/qwen25vl_3b_tool_grpo": "qwen25vl_3b"}
LEROBOT_RECIPES = {"vla/smolvla_habc"}  # run on its replica in the LeRobot venv: tests/test_vla_lerobot.py
REAL_MODEL_RECIPES = {*RECIPES, *VLM_RECIPES, *LEROBOT_RECIPES}


@pytest.mark.parametrize("recipe", sorted(VLM_RECIPES))
def test_the_vlm_recipe_runs_an_iteration_on_its_replica(replicas, tmp_path, recipe, capsys):
    config = load_config(
        recipe,
        [
            f"model.path={replicas[VLM_RECIPES[recipe]]}",
            f"output_dir={tmp_path / 'run'}",
            "rollout.backend=transformers",  # vLLM is optional (tests/test_vllm_engine.py)
            "rollout.max_new_tokens=12",
            "train.questions_per_step=2",
            "train.group_size=4",
            "data.train_size=16",
            "data.heldout_size=4",
            "eval_every=0",
            "steps=1",
            "progress=false",
        ],
    )
    assert config.rollout.system_prompt  # a real model is told about the tool
    TRAINERS.get(config.trainer)(config).train()
    assert "written for 8 process(es); on 1 the effective batch differs" in capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and all(
        torch.isfinite(torch.tensor(v)) for v in rows[0].values() if isinstance(v, float)
    )
    assert vlm_loading.load(tmp_path / "run" / "model").model.config.model_type == "qwen2_5_vl"


def test_a_heldout_prompt_file_shorter_than_eval_prompts_is_refused(replicas, tmp_path):
    overrides = [
        *replica_run(replicas, "sd35m", tmp_path),
        f"output_dir={tmp_path / 'run'}",
        "eval.prompts=5",
    ]
    config = load_config("diffusion/sd35m_pickscore_lora", overrides)
    with pytest.raises(ConfigError, match="holds 3 prompts, fewer than eval.prompts = 5"):
        TRAINERS.get(config.trainer)(config).train()
    assert not (tmp_path / "run" / "final").exists()


@pytest.mark.parametrize(
    ("launch", "name"),
    [
        ("fsdp_1node_8gpu_flux", "flux_dev"),
        ("fsdp_1node_8gpu_sd3", "sd35m"),
        ("fsdp_1node_8gpu_qwen25vl", "qwen25vl_3b"),
    ],
)
def test_fsdp_configs_wrap_blocks_the_models_have(replicas, launch, name):
    config = yaml.safe_load((CONFIGS / "accelerate" / f"{launch}.yaml").read_text())
    wrapped = config["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"].split(",")
    model = vlm_loading.load(replicas[name]).model if name == "qwen25vl_3b" else load(replicas[name]).denoiser
    classes = {type(module).__name__ for module in model.modules()}
    assert set(wrapped) <= classes, sorted(set(wrapped) - classes)
