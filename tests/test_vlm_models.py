"""The VLM adapter on a tiny Qwen2-VL: tokenizer, chat format, image tokens, batches, log-probs, storage."""

import json
import re

import pytest
import torch
from PIL import Image

from mmrl.noise import NoiseKey
from vlm_rl.loading import load
from vlm_rl.models import (
    IMAGE_PAD,
    Segment,
    TinyVLMSpec,
    VLMAdapter,
    build_chat_tokenizer,
)

WORDS = "what color is the small square circle red green blue left box of".split()  # noqa: SIM905
TOOL_CALL = '<tool_call>{"name": "crop", "arguments": {"bbox_2d": [0.25, 0.3, 0.75, 1234]}}</tool_call>'
ANSWER = "the small square is red . <answer>red</answer>"


@pytest.fixture(scope="module")
def vlm() -> VLMAdapter:
    return VLMAdapter.tiny(WORDS)


def picture(width: int = 448, height: int = 448, seed: int = 0) -> Image.Image:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def text_tokens(vlm: VLMAdapter, count: int, seed: int) -> Segment:
    """Stand-in generated tokens: random ordinary (non-special) tokens."""
    ordinary = [i for i in range(len(vlm.tokenizer)) if i not in vlm.tokenizer.all_special_ids]
    generator = torch.Generator().manual_seed(seed)
    return Segment([ordinary[int(i)] for i in torch.randint(len(ordinary), (count,), generator=generator)])


def rollouts(vlm: VLMAdapter) -> list[Segment]:
    """Sequences like multi-turn rollouts: 0, 1 and 3 images, different lengths."""
    tool_turn = vlm.prompt_token_ids("what color is the small circle ?", picture(seed=1))
    tool_turn = tool_turn + text_tokens(vlm, 9, 0) + vlm.observation_token_ids(picture(150, 90, seed=2))
    tool_turn = tool_turn + text_tokens(vlm, 4, 1) + vlm.observation_token_ids(picture(60, 200, seed=3))
    tool_turn = tool_turn + text_tokens(vlm, 6, 2)
    return [
        vlm.prompt_token_ids("what color is the square ?", picture()) + text_tokens(vlm, 5, 3),
        vlm.prompt_token_ids("what color is the small square ?", system="red green") + text_tokens(vlm, 7, 4),
        tool_turn,
    ]


def test_tokenizer_round_trips_tool_calls_and_answers(vlm):
    for text in (TOOL_CALL, ANSWER, "<|im_end|>\n<|im_start|>user\nred\n\nblue  green"):
        ids = vlm.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert vlm.tokenizer.unk_token_id not in ids
        assert vlm.decode(ids) == text
    decoded = vlm.decode(vlm.tokenizer(TOOL_CALL)["input_ids"])
    call = re.fullmatch(r"<tool_call>(.*)</tool_call>", decoded).group(1)
    assert json.loads(call) == {"name": "crop", "arguments": {"bbox_2d": [0.25, 0.3, 0.75, 1234]}}
    tokens = vlm.tokenizer.tokenize(TOOL_CALL)
    assert tokens[0] == "<tool_call>" and tokens[-1] == "</tool_call>" and "0.25" in tokens
    assert vlm.decode(vlm.tokenizer(ANSWER)["input_ids"], skip_special_tokens=True) == ANSWER  # tags stay
    assert vlm.tokenizer.tokenize("a zebra")[-1] == "<|unk|>"
    with pytest.raises(ValueError, match="vocabulary words"):
        build_chat_tokenizer(["two words"])


def test_chat_template_renders_the_qwen2_vl_format(vlm):
    messages = [
        {"role": "system", "content": "red"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what color ?"}]},
        {"role": "assistant", "content": "blue"},
    ]
    assert vlm.render(messages) == (
        "<|im_start|>system\nred<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
        "what color ?<|im_end|>\n<|im_start|>assistant\nblue<|im_end|>\n<|im_start|>assistant\n"
    )


def test_prompt_expands_each_image_to_its_grid(vlm):
    prompt = vlm.prompt_token_ids("what color is the square ?", picture(), system="red")
    (image,) = prompt.images
    assert image.grid_thw.tolist() == [1, 8, 8] and image.size == (112, 112)
    assert prompt.token_ids.count(vlm.image_token_id) == 16 == int(image.grid_thw.prod()) // 4
    assert image.pixel_values.shape[0] == int(image.grid_thw.prod())
    text = vlm.decode(prompt.token_ids)
    assert text.startswith("<|im_start|>system\nred<|im_end|>\n<|im_start|>user\n<|vision_start|>")
    assert text.endswith("<|vision_end|>what color is the square ?<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="1 image placeholders but 0 images"):
        vlm.segment(vlm.render([{"role": "user", "content": [{"type": "image"}]}]))


def test_observations_close_the_assistant_turn(vlm):
    crop = picture(200, 100)
    observation = vlm.observation_token_ids(crop)
    (image,) = observation.images
    assert observation.token_ids.count(vlm.image_token_id) == image.num_tokens == image.grid_thw.prod() // 4
    expected = "<|im_end|>\n<|im_start|>user\n<|vision_start|>" + IMAGE_PAD * image.num_tokens
    assert vlm.decode(observation.token_ids) == expected + "<|vision_end|><|im_end|>\n<|im_start|>assistant\n"
    error = vlm.observation_token_ids("the box is left of the square")
    assert error.images == [] and vlm.decode(error.token_ids) == (
        "<|im_end|>\n<|im_start|>user\nthe box is left of the square<|im_end|>\n<|im_start|>assistant\n"
    )


def test_resized_size_matches_the_patch_grid(vlm):
    for width, height in [(448, 448), (150, 90), (60, 200), (1000, 300), (10, 10)]:
        image = picture(width, height)
        encoded = vlm.encode_image(image)
        grid = encoded.grid_thw.tolist()
        assert vlm.resized_size(image) == (grid[2] * 14, grid[1] * 14) == encoded.size


def test_huge_and_non_rgb_images_are_made_safe(vlm):
    with pytest.warns(UserWarning, match="downscaled"):
        huge = vlm.encode_image(Image.new("L", (9000, 300), 128))
    assert huge.pixel_values.shape[1] == 3 * 2 * 14 * 14
    assert vlm.encode_image(Image.new("RGBA", (50, 50))).num_tokens == 4


def test_generate_a_batch_of_prompts_with_images(vlm):
    image, question = {"type": "image"}, {"type": "text", "text": "what color ?"}
    conversations = [
        ([{"role": "user", "content": [image, question]}], [picture()]),
        ([{"role": "user", "content": [image, image, question]}], [picture(200, 100), picture(seed=4)]),
    ]
    batch = vlm.encode_prompts(conversations)
    assert batch["attention_mask"][:, -1].all() and not batch["attention_mask"][:, 0].all()  # left-padded
    assert batch["image_grid_thw"].shape == (3, 3)
    assert torch.equal(batch["mm_token_type_ids"], (batch["input_ids"] == vlm.image_token_id).long())
    torch.manual_seed(0)
    out = vlm.generate(batch, max_new_tokens=6)
    for ids, log_probs, stopped in zip(out.token_ids, out.log_probs, out.stopped, strict=True):
        assert 1 <= len(ids) <= 6 and log_probs.shape == (len(ids),) and (log_probs <= 0).all()
        assert stopped == (ids[-1] in vlm.tokenizer.convert_tokens_to_ids(["<|im_end|>", "</tool_call>"]))


def test_save_and_load_round_trip(vlm, tmp_path):
    vlm.save_pretrained(tmp_path)
    loaded = load(tmp_path)
    assert type(loaded) is type(vlm)
    sequences = rollouts(vlm)
    assert [s.token_ids for s in rollouts(loaded)] == [s.token_ids for s in sequences]
    batch = vlm.collate(sequences)
    with torch.no_grad():
        expected = vlm.model(**vlm.on_device(batch)).logits
        actual = loaded.model(**loaded.on_device(batch)).logits
    assert torch.equal(expected, actual)
    assert loaded.resized_size(picture(1000, 300)) == vlm.resized_size(picture(1000, 300))


def test_bad_paths_name_what_is_missing(vlm, tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        load(tmp_path / "nowhere")
    vlm.save_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").unlink()
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="preprocessor_config.json, model.safetensors or"):
        load(tmp_path)


def scores_alone(vlm: VLMAdapter, sequences: list[Segment], masks: list[torch.Tensor]) -> list[torch.Tensor]:
    return [vlm.token_log_probs(vlm.collate([s]), m[None])[0] for s, m in zip(sequences, masks, strict=True)]


@pytest.mark.parametrize("architecture", ["qwen2_vl", "qwen2_5_vl"])
def test_padded_batches_score_like_single_sequences(architecture):
    vlm = VLMAdapter.tiny(WORDS, TinyVLMSpec(architecture=architecture))
    sequences = rollouts(vlm)
    masks = [torch.ones(len(s), dtype=torch.bool) for s in sequences]
    alone = scores_alone(vlm, sequences, masks)
    sequences.append(sequences[1] + text_tokens(vlm, 3, 5))  # rows 1 and 3: a batch without images
    alone.append(scores_alone(vlm, sequences[-1:], [torch.ones(len(sequences[-1]), dtype=torch.bool)])[0])
    for rows, side in [([0, 1, 2], "left"), ([0, 1, 2], "right"), ([1, 3], "left")]:
        batch = vlm.collate([sequences[row] for row in rows], side)
        mask = batch["attention_mask"].bool()
        with torch.no_grad():
            scored = vlm.token_log_probs(batch, mask)
        for i, row in enumerate(rows):
            torch.testing.assert_close(scored[i][mask[i]], alone[row], atol=1e-4, rtol=0)
        assert (scored[~mask] == 0).all() and (scored.ne(0).sum(1) == mask.sum(1) - 1).all()

    vlm.model.zero_grad()
    batch = vlm.collate(sequences, "left")
    vlm.token_log_probs(batch, batch["attention_mask"]).sum().backward()  # padding gives no NaN gradients
    grads = [p.grad for p in vlm.model.parameters() if p.grad is not None]
    assert len(grads) == len(list(vlm.model.parameters())) and all(g.isfinite().all() for g in grads)


def test_keyed_sampling_depends_on_the_row_key_alone(vlm):
    prompts = rollouts(vlm)[::2]
    keys = [NoiseKey(3, 1, row, 0) for row in range(len(prompts))]
    together = vlm.generate(vlm.collate(prompts, "left"), max_new_tokens=12, keys=keys)
    alone = vlm.generate(vlm.collate(prompts[1:], "left"), max_new_tokens=12, keys=keys[1:])
    assert alone.token_ids[0] == together.token_ids[1]  # another batch, another padding: same tokens
    other = vlm.generate(vlm.collate(prompts[1:], "left"), max_new_tokens=12, keys=[NoiseKey(3, 2, 1, 0)])
    assert other.token_ids[0] != together.token_ids[1]
    banned = vlm.generate(vlm.collate(prompts, "left"), 12, keys=keys, banned_tokens=["<tool_call>"])
    assert all(vlm.tokenizer.convert_tokens_to_ids("<tool_call>") not in ids for ids in banned.token_ids)
    with pytest.raises(ValueError, match="one token of the vocabulary"):
        vlm.generate(vlm.collate(prompts, "left"), 4, banned_tokens=["not a token"])


def test_log_probs_match_what_generate_sampled(vlm):
    prompts = rollouts(vlm)[::2]  # one fresh prompt, one rollout already holding three images
    batch = vlm.collate(prompts, "left")
    keys = [NoiseKey(0, 0, row, 0) for row in range(len(prompts))]
    for row_keys, temperature in [(None, 1.0), (keys, 1.0), (keys, 0.7)]:
        generated = vlm.generate(batch, max_new_tokens=8, keys=row_keys, temperature=temperature)
        sequences = [p + Segment(ids) for p, ids in zip(prompts, generated.token_ids, strict=True)]
        masks = [torch.arange(len(s)) >= len(p) for s, p in zip(sequences, prompts, strict=True)]
        padded = [torch.nn.functional.pad(m, (0, max(map(len, masks)) - len(m))) for m in masks]
        with torch.no_grad():
            scored = vlm.token_log_probs(vlm.collate(sequences), torch.stack(padded), temperature=temperature)
        for row, (prompt, sequence) in enumerate(zip(prompts, sequences, strict=True)):
            expected = generated.log_probs[row]
            torch.testing.assert_close(scored[row, len(prompt) : len(sequence)], expected, atol=1e-4, rtol=0)

    # the same against transformers' own processed scores (the temperature warper alone)
    torch.manual_seed(2)
    out = vlm.model.generate(
        **batch,
        max_new_tokens=5,
        do_sample=True,
        temperature=0.7,
        top_k=0,
        top_p=1.0,
        suppress_tokens=vlm.banned_ids.tolist(),  # what VLMAdapter.generate adds
        output_scores=True,
        return_dict_in_generate=True,
    )
    new = out.sequences[:, batch["input_ids"].shape[1] :]
    expected = torch.log_softmax(torch.stack(out.scores, 1).float(), -1).gather(-1, new[..., None])[..., 0]
    for row, prompt in enumerate(prompts):
        ids = new[row].tolist()
        ids = ids[: ids.index(vlm.tokenizer.eos_token_id) + 1] if vlm.tokenizer.eos_token_id in ids else ids
        sequence = prompt + Segment(ids)
        targets = (torch.arange(len(sequence)) >= len(prompt))[None]
        with torch.no_grad():
            scored = vlm.token_log_probs(vlm.collate([sequence]), targets, temperature=0.7)
        torch.testing.assert_close(scored[0, len(prompt) :], expected[row, : len(ids)], atol=1e-4, rtol=0)
