import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from diffusion_rl.alignment import (
    CONFIG_FILE,
    DEFAULT_DIR,
    REBUILD_COMMAND,
    WEIGHTS_FILE,
    AlignmentScorer,
    load_scorer,
    save_scorer,
)
from diffusion_rl.alignment_training import corrupt_spec, evaluate_scorer, main, train_scorer
from diffusion_rl.shapes import (
    Scene,
    ShapeObject,
    make_dataset,
    parse_prompt,
    prompt_text,
    render,
    render_batch,
    scene_for_spec,
    spec_for,
)
from mmrl.registry import REWARDS


@pytest.fixture(scope="module")
def scorer():
    return load_scorer()


@pytest.fixture(scope="module")
def heldout_scenes():
    """Scenes for held-out prompts, from a seed that neither training nor its evaluation used."""
    _, _, specs = make_dataset(300, seed=424242, split="heldout")
    rng = np.random.default_rng(424242)
    return [scene_for_spec(spec, rng) for spec in specs]


def test_shipped_scorer_is_small_and_records_how_it_was_made():
    files = [DEFAULT_DIR / WEIGHTS_FILE, DEFAULT_DIR / CONFIG_FILE]
    assert sum(path.stat().st_size for path in files) < 2_000_000
    config = json.loads((DEFAULT_DIR / CONFIG_FILE).read_text())
    assert config["rebuild_command"].startswith(REBUILD_COMMAND + " --steps ")
    clean = config["heldout"]["clean"]
    assert clean["score_own_prompt"] > 0.9 and clean["score_wrong_colour"] < 0.1
    assert clean["count_accuracy_present"] > 0.9 and clean["position_accuracy"] > 0.9


def test_own_prompts_score_high_and_wrong_ones_low(scorer, heldout_scenes):
    images = render_batch(heldout_scenes)
    own = [spec_for(scene) for scene in heldout_scenes]
    own_scores = scorer.score(images, own)
    assert own_scores.mean() > 0.9
    assert ((own_scores >= 0) & (own_scores <= 1)).all()
    rng = np.random.default_rng(0)
    for attribute in ("colour", "shape", "count"):
        wrong = [
            corrupt_spec(spec, scene, attribute, rng) for spec, scene in zip(own, heldout_scenes, strict=True)
        ]
        rows = [row for row, spec in enumerate(wrong) if spec is not None]
        assert scorer.score(images[rows], [wrong[row] for row in rows]).mean() < 0.3, attribute


def test_blurred_images_still_score_high(scorer, heldout_scenes):
    images = render_batch(heldout_scenes)
    half_resolution = F.interpolate(images, size=16, mode="bilinear", antialias=True)
    blurred = F.interpolate(half_resolution, size=32, mode="bilinear")
    assert scorer.score(blurred, [spec_for(scene) for scene in heldout_scenes]).mean() > 0.9


def test_wrong_position_keeps_the_credit_for_the_object(scorer):
    rng = np.random.default_rng(1)
    scenes = [scene_for_spec(parse_prompt("a red circle on the left"), rng) for _ in range(16)]
    images = render_batch(scenes)
    assert scorer.score(images, ["a red circle on the left"] * 16).mean() > 0.9
    assert 0.4 < scorer.score(images, ["a red circle on the right"] * 16).mean() < 0.6  # 1 of 2 checks


def test_unmentioned_objects_cost_only_when_asked(heldout_scenes):
    default, strict = REWARDS.get("geneval_mini")(), REWARDS.get("geneval_mini")(unmentioned=True)
    own = [prompt_text(spec_for(scene)) for scene in heldout_scenes[:32]]
    clean = render_batch(heldout_scenes[:32])
    assert strict(clean, own).mean() > 0.85
    rng = np.random.default_rng(2)
    with_extra = render_batch(
        [scene_for_spec(parse_prompt("a red circle and a blue square"), rng) for _ in range(16)]
    )
    assert default(with_extra, ["a red circle"] * 16).mean() > 0.9  # the blue square goes unnoticed
    assert 0.4 < strict(with_extra, ["a red circle"] * 16).mean() < 0.6  # 1 of 2 checks fails


def test_scores_are_batched_sized_and_deterministic(scorer, heldout_scenes):
    images = render_batch(heldout_scenes[:8])
    specs = [spec_for(scene) for scene in heldout_scenes[:8]]
    together = scorer.score(images, specs)
    one_by_one = torch.cat([scorer.score(images[i : i + 1], specs[i : i + 1]) for i in range(8)])
    assert together.shape == (8,) and together.dtype == torch.float32
    assert torch.allclose(together, one_by_one, atol=1e-5)
    assert torch.equal(together, scorer.score(images, specs))
    assert torch.equal(together, scorer.score(images, [prompt_text(spec) for spec in specs]))
    larger = F.interpolate(images, size=(64, 64), mode="nearest")
    assert torch.allclose(scorer.score(larger, specs), together, atol=0.05)
    assert torch.allclose(scorer.score(list(larger), specs), scorer.score(larger, specs))


def test_blank_and_noise_images_score_low(scorer):
    prompts = ["two red circles", "a blue square on the left", "a green triangle and a white cross"]
    blank = torch.full((3, 3, 32, 32), 0.12)
    noise = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    assert scorer.score(blank, prompts).max() < 0.1
    assert scorer.score(noise, prompts).max() < 0.3


def test_reward_registry_entry(heldout_scenes):
    reward = REWARDS.get("geneval_mini")()
    images = render_batch(heldout_scenes[:4])
    prompts = [prompt_text(spec_for(scene)) for scene in heldout_scenes[:4]]
    scores = reward(images, prompts=prompts, answers=["ignored"] * 4)
    assert scores.shape == (4,) and scores.dtype == torch.float32 and scores.min() > 0.5
    assert torch.allclose(reward(list(images), prompts=prompts), scores)
    with pytest.raises(ValueError, match="'dog'"):
        reward(images[:1], prompts=["a red dog"])


def test_missing_weights_name_the_rebuild_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m diffusion_rl.alignment_training"):
        load_scorer(tmp_path)


def test_save_load_gives_identical_outputs(tmp_path, heldout_scenes):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        original = AlignmentScorer()
    original.train()
    original(torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(0)))  # moves batch-norm stats
    original.eval()
    save_scorer(original, tmp_path, {"note": "test"})
    images = render_batch(heldout_scenes[:8])
    for got, expected in zip(load_scorer(tmp_path).predict(images), original.predict(images), strict=True):
        assert torch.equal(got, expected)


def test_train_scorer_writes_a_loadable_scorer(tmp_path):
    info = train_scorer(steps=3, batch_size=8, seed=0, out_dir=tmp_path, eval_scenes=16)
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert config["heldout"] == info["heldout"]
    assert config["rebuild_command"].startswith(
        f"python -m diffusion_rl.alignment_training --out {tmp_path} --steps 3 "
    )
    evaluated_again = evaluate_scorer(load_scorer(tmp_path), 16, seed=info["heldout"]["seed"])
    assert evaluated_again == info["heldout"]  # the loaded scorer gives the trained one's outputs
    again = train_scorer(steps=3, batch_size=8, seed=0, out_dir=tmp_path / "again", eval_scenes=16)
    assert again["heldout"] == info["heldout"]


def test_command_line_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "--steps" in capsys.readouterr().out


def test_objects_by_shape_says_what_was_drawn_instead_of_the_asked_object(scorer):
    blue_square = ShapeObject("blue", "square", 0.7, 0.5, 0.3)
    images = torch.stack(
        [
            render(Scene((ShapeObject("red", "triangle", 0.3, 0.5, 0.3), blue_square))),  # as asked
            render(Scene((ShapeObject("red", "circle", 0.3, 0.5, 0.3), blue_square))),  # circle for triangle
            render(Scene((blue_square,))),  # the triangle left out
            render(
                Scene(
                    (
                        ShapeObject("green", "cross", 0.3, 0.3, 0.25),
                        ShapeObject("green", "cross", 0.7, 0.7, 0.25),
                    )
                )
            ),
        ]
    )
    pair = parse_prompt("a red triangle and a blue square")
    specs = [pair, pair, pair, parse_prompt("three green crosses")]
    drawn, found, asked = scorer.objects_by_shape(images, specs)
    rounded = {shape: [round(float(v)) for v in values] for shape, values in drawn.items()}
    assert rounded == {
        "circle": [0, 1, 0, 0],
        "square": [1, 1, 1, 0],
        "triangle": [1, 0, 0, 0],
        "cross": [0, 0, 0, 2],
    }
    assert [bool(v) for v in asked["triangle"]] == [True, True, True, False]
    assert [bool(v) for v in asked["cross"]] == [False, False, False, True]
    assert not asked["circle"].any()
    # the asked triangle is found only where it is drawn; two of three asked crosses are found
    assert found["triangle"][:3].tolist() == pytest.approx([1.0, 0.0, 0.0], abs=0.1)
    assert found["square"][:3].tolist() == pytest.approx([1.0, 1.0, 1.0], abs=0.1)
    assert found["cross"][3].item() == pytest.approx(2 / 3, abs=0.05)
    assert found["circle"].eq(0).all() and found["triangle"][3] == 0
    with pytest.raises(ValueError, match="4 images but 3 prompts"):
        scorer.objects_by_shape(images, specs[:3])
