"""`mmrl eval diffusion`: paired side-by-side evaluation of diffusion models on fixed prompts and seeds."""

import json
import shutil

import pytest
import torch

from diffusion_rl.evaluate import DiffusionEvalConfig, evaluate_models, paired
from diffusion_rl.models import FlowPipeline, TinyFlowSpec
from diffusion_rl.shapes import vocabulary
from mmrl.cli import load_plugins, main

load_plugins()

SMALL = TinyFlowSpec(
    image_size=16, patch_size=4, layers=1, heads=2, head_dim=8, text_hidden=16, text_layers=1
)


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    pipe = FlowPipeline.tiny(vocabulary(), SMALL)
    pipe.save_pretrained(root / "a")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a second model: the same one with every weight perturbed
        for p in pipe.denoiser.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    pipe.save_pretrained(root / "b")
    return str(root / "a"), str(root / "b")


def test_paired_statistics():
    reference = torch.tensor([0.1, 0.5, 0.9, 0.3])
    other = torch.tensor([0.2, 0.5, 0.7, 0.3])
    stats = paired(reference, other)
    assert stats["diff"] == pytest.approx(-0.025)
    assert stats["se"] == pytest.approx(float((other - reference).std()) / 2)
    assert (stats["better"], stats["worse"]) == (1, 1)


def test_models_side_by_side_are_paired_and_written(two_models, tmp_path):
    a, b = two_models
    copy = tmp_path / "copy_of_a"
    shutil.copytree(a, copy)
    cfg = DiffusionEvalConfig(
        models=[a, b, str(copy)],
        num_prompts=5,
        seeds=2,
        steps=2,
        rewards=["geneval_mini", "jpeg_compressibility"],
        grid_prompts=3,
        output_dir=str(tmp_path / "out"),
    )
    results = evaluate_models(cfg)
    assert results["num_prompts"] == 5 and results["seeds"] == 2
    first, other, same = (results["models"][m] for m in cfg.models)
    assert set(first) == {"geneval_mini", "jpeg_compressibility"} and "diff" not in first["geneval_mini"]
    for name in first:
        assert other[name]["diff"] == pytest.approx(other[name]["mean"] - first[name]["mean"], abs=1e-6)
        # the same weights draw the same images from the same noise: exactly no difference
        assert (same[name]["diff"], same[name]["better"], same[name]["worse"]) == (0.0, 0, 0)
    assert other["jpeg_compressibility"]["diff"] != 0.0
    assert json.loads((tmp_path / "out" / "eval_diffusion.json").read_text()) == results
    assert (tmp_path / "out" / "grid.png").stat().st_size > 0


def test_command_line_and_bad_input(two_models, tmp_path, capsys):
    a, b = two_models
    code = main(
        [
            "eval",
            "diffusion",
            f"models=[{a},{b}]",
            "num_prompts=3",
            "steps=2",
            "grid_prompts=0",
            f"output_dir={tmp_path}",
        ]
    )
    assert code == 0 and "vs the first" in capsys.readouterr().out
    for overrides, message in [
        (["models=[]"], "models is empty"),
        ([f"models=[{a},{a}]"], "twice"),
        ([f"models=[{a}]", "rewards=[geneval_mni]"], "did you mean 'geneval_mini'"),
        ([f"models=[{a}]", "prompts=/nonexistent.txt"], "does not exist"),
        (["models=[/nonexistent/model]"], "is not a directory"),
        ([f"models=[{a}]", "seeds=0"], "seeds"),
    ]:
        assert main(["eval", "diffusion", *overrides, f"output_dir={tmp_path}"]) == 2
        assert message in capsys.readouterr().err
