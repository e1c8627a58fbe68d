from collections import Counter

import numpy as np
import pytest
import torch

from diffusion_rl.shapes import (
    COLOURS,
    POSITIONS,
    SHAPES,
    PromptSpec,
    Requirement,
    Scene,
    ShapeObject,
    all_prompts,
    heldout_pairs,
    heldout_prompts,
    in_position,
    make_dataset,
    parse_prompt,
    prompt_for,
    prompt_text,
    render,
    sample_cluttered_scene,
    sample_scene,
    scene_for_spec,
    train_prompts,
    vocabulary,
)


def test_same_seed_same_scenes_and_dataset():
    assert sample_scene(7) == sample_scene(7)
    assert sample_scene(7) != sample_scene(8)
    assert sample_scene(np.random.default_rng(7)) == sample_scene(7)
    from_torch = sample_scene(torch.Generator().manual_seed(7))
    assert from_torch == sample_scene(torch.Generator().manual_seed(7))
    images, prompts, specs = make_dataset(32, seed=3)
    again, prompts_again, specs_again = make_dataset(32, seed=3)
    assert torch.equal(images, again) and prompts == prompts_again and specs == specs_again
    other, other_prompts, _ = make_dataset(32, seed=4)
    assert prompts != other_prompts and not torch.equal(images, other)


@pytest.mark.parametrize("size", [16, 32, 64])
def test_render_shape_range_and_colours(size):
    scene = sample_scene(np.random.default_rng(0), template="pair")
    image = render(scene, size)
    assert image.shape == (3, size, size) and image.dtype == torch.float32
    assert image.min() >= 0 and image.max() <= 1
    colours = {tuple(round(v, 2) for v in image[:, y, x].tolist()) for y in range(size) for x in range(size)}
    expected = {tuple(round(v, 2) for v in COLOURS[obj.colour]) for obj in scene.objects}
    assert expected <= colours and len(colours) == len(expected) + 1  # the objects and the background


def test_render_puts_objects_where_the_scene_says():
    scene = Scene((ShapeObject("red", "square", 0.25, 0.75, 0.3),))
    image = render(scene, 32)
    assert torch.allclose(image[:, 24, 8], torch.tensor(COLOURS["red"]))  # row = y, column = x
    assert not torch.allclose(image[:, 8, 24], torch.tensor(COLOURS["red"]))


def test_shapes_differ_in_their_pixels():
    masks = [render(Scene((ShapeObject("white", shape, 0.5, 0.5, 0.34),)))[0] > 0.5 for shape in SHAPES]
    for i in range(len(masks)):
        for j in range(i + 1, len(masks)):
            assert (masks[i] != masks[j]).sum() >= 10, (SHAPES[i], SHAPES[j])


def test_objects_stay_inside_and_apart():
    rng = np.random.default_rng(1)
    for scene in [sample_cluttered_scene(rng) for _ in range(200)] + [sample_scene(rng) for _ in range(200)]:
        for i, a in enumerate(scene.objects):
            assert a.size / 2 <= a.x <= 1 - a.size / 2 and a.size / 2 <= a.y <= 1 - a.size / 2
            for b in scene.objects[i + 1 :]:
                assert np.hypot(a.x - b.x, a.y - b.y) > (a.size + b.size) / 2


def test_prompts_parse_back_to_what_the_scene_shows():
    rng = np.random.default_rng(2)
    for _ in range(500):
        scene = sample_scene(rng)
        spec = parse_prompt(prompt_for(scene))
        assert Counter({(r.colour, r.shape): r.count for r in spec.requirements}) == Counter(
            (obj.colour, obj.shape) for obj in scene.objects
        )
        assert spec.position == scene.position
        if spec.position is not None:
            (obj,) = scene.objects
            assert in_position(obj.x, obj.y, spec.position)


def test_grammar_examples():
    assert parse_prompt("two red circles") == PromptSpec((Requirement("red", "circle", 2),))
    assert parse_prompt("A Blue square on the left") == PromptSpec(
        (Requirement("blue", "square", 1),), "left"
    )
    assert parse_prompt("a green triangle and a white cross") == PromptSpec(
        (Requirement("green", "triangle", 1), Requirement("white", "cross", 1))
    )
    assert parse_prompt("three yellow crosses and a red cross").requirements[0].count == 3
    assert parse_prompt("a purple circle in the center").template == "position"
    for prompt in all_prompts():
        assert prompt_text(parse_prompt(prompt)) == prompt


@pytest.mark.parametrize(
    ("prompt", "named"),
    [
        ("a pink circle", "'pink'"),
        ("two red hexagons", "'hexagons'"),
        ("a red circle next to a cat", "'next'"),
        ("a red circles", "singular"),
        ("two red circle", "plural"),
        ("red circle", "ends early"),
        ("a circle red", "colour"),
        ("two red circles on the left", "single object"),
        ("a red circle on the top", "expected 'and'"),
        ("a red circle and a red circle", "twice"),
        ("", "ends early"),
    ],
)
def test_prompts_outside_the_grammar_raise(prompt, named):
    with pytest.raises(ValueError, match=named):
        parse_prompt(prompt)


def test_vocabulary_covers_every_prompt_and_nothing_more():
    words = {word for prompt in all_prompts() for word in prompt.split()}
    assert words <= set(vocabulary())
    assert set(vocabulary()) - words == set()  # every word is used by some prompt
    assert vocabulary() == sorted(vocabulary())


def test_prompt_split_is_disjoint_and_holds_out_compositions():
    train, heldout = train_prompts(0), heldout_prompts(0)
    assert len(train) + len(heldout) == len(all_prompts()) == len(set(all_prompts())) == 744
    assert not set(train) & set(heldout)
    held = heldout_pairs(0)
    assert len({c for c, _ in held}) == len(held) == len({s for _, s in held})
    trained_words = {word for prompt in train for word in prompt.split()}
    assert set(COLOURS) <= trained_words and set(SHAPES) <= trained_words  # only the pairings are new
    for prompt in train:
        assert not any((r.colour, r.shape) in held for r in parse_prompt(prompt).requirements)
    for prompt in heldout:
        assert any((r.colour, r.shape) in held for r in parse_prompt(prompt).requirements)
    assert heldout_pairs(0) == heldout_pairs(0) and heldout_pairs(0) != heldout_pairs(1)


def test_dataset_splits_follow_the_prompt_split():
    _, train, _ = make_dataset(200, seed=5, split="train")
    _, heldout, specs = make_dataset(200, seed=5, split="heldout")
    assert set(train) <= set(train_prompts(0))
    assert set(heldout) <= set(heldout_prompts(0))
    assert {spec.template for spec in specs} == {"count", "position", "pair"}
    with pytest.raises(ValueError, match="split"):
        make_dataset(1, seed=0, split="test")


def test_position_scenes_keep_a_margin_to_their_region_edges():
    rng = np.random.default_rng(3)
    for position in POSITIONS:
        for _ in range(50):
            spec = PromptSpec((Requirement("red", "circle", 1),), position)
            (obj,) = scene_for_spec(spec, rng).objects
            for dx, dy in [(0, 0), (0.05, 0.05), (-0.05, 0.05), (0.05, -0.05), (-0.05, -0.05)]:
                assert in_position(obj.x + dx, obj.y + dy, position), (position, obj)
