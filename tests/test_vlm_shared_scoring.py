"""Shared-prefix scoring for the policy update: rows that share a prefix (a question's prompt, a tree
branch's turns) run it once, and get the log-probs and parameter gradients of the unshared call."""

import time

import pytest
import torch
from transformers.cache_utils import Cache

from tests.test_vlm_models import WORDS, picture
from vlm_rl.models import QwenVLAdapter, Segment, TinyVLMSpec, VLMAdapter


def text_tokens(vlm: VLMAdapter, count: int, seed: int) -> Segment:
    """Stand-in generated tokens: random tokens the policy may write (no special or vision tokens)."""
    banned = {*vlm.tokenizer.all_special_ids, *vlm.vision_token_ids()}
    allowed = [i for i in range(len(vlm.tokenizer)) if i not in banned]
    generator = torch.Generator().manual_seed(seed)
    return Segment([allowed[int(i)] for i in torch.randint(len(allowed), (count,), generator=generator)])


def conversations(vlm: VLMAdapter) -> tuple[list[Segment], list[int], list[int], torch.Tensor]:
    """(sequences, prefix_lengths, prefix_groups, target mask) for nine rows in three interleaved groups:
    a prompt with an image (3 rows), a text-only prompt (2 rows) and a tree branch's prefix holding the
    prompt, a first turn and its crop (4 rows). Suffixes differ in length and hold crops, error text
    and generated tokens; only the generated tokens are targets."""
    image_prompt = vlm.prompt_token_ids("what color is the small circle ?", picture(seed=1))
    text_prompt = vlm.prompt_token_ids("what color is the small square ?", system="red green")
    branch = image_prompt + text_tokens(vlm, 6, 0) + vlm.observation_token_ids(picture(150, 90, seed=2))
    prefixes = [image_prompt, text_prompt, branch]

    def crop(seed: int) -> Segment:
        return vlm.observation_token_ids(picture(60 + 30 * seed, 200 - 20 * seed, seed=seed))

    error = vlm.observation_token_ids("the box is left of the square")
    suffixes = [  # (prefix, pieces); a piece is (tokens, whether they are targets)
        (0, [(text_tokens(vlm, 5, 1), True)]),
        (2, [(text_tokens(vlm, 3, 2), True)]),
        (1, [(text_tokens(vlm, 9, 3), True), (error, False), (text_tokens(vlm, 4, 4), True)]),
        (0, [(text_tokens(vlm, 8, 5), True), (crop(3), False), (text_tokens(vlm, 6, 6), True)]),
        (2, [(text_tokens(vlm, 11, 7), True), (crop(4), False), (text_tokens(vlm, 2, 8), True)]),
        (1, [(text_tokens(vlm, 2, 9), True)]),
        (2, [(text_tokens(vlm, 7, 10), True)]),
        (0, [(text_tokens(vlm, 13, 11), True)]),
        (2, [(text_tokens(vlm, 1, 12), True)]),
    ]
    sequences, lengths, groups, marks = [], [], [], []
    for group, pieces in suffixes:
        sequence, mark = prefixes[group], [False] * len(prefixes[group])
        for piece, trained in pieces:
            sequence, mark = sequence + piece, mark + [trained] * len(piece)
        sequences.append(sequence)
        lengths.append(len(prefixes[group]))
        groups.append(group)
        marks.append(torch.tensor(mark))
    width = max(len(sequence) for sequence in sequences)
    mask = torch.stack([torch.nn.functional.pad(mark, (0, width - len(mark))) for mark in marks])
    return sequences, lengths, groups, mask


def branch_turn(lengths: list[int]) -> range:
    """Columns of the first turn inside the tree branch's prefix (group 2 of `conversations`): the
    image prompt, which is group 0's whole prefix, comes first and the turn holds 6 tokens."""
    return range(lengths[0], lengths[0] + 6)


def with_prefix_targets(lengths: list[int], mask: torch.Tensor, suffixes: bool = True) -> torch.Tensor:
    """`conversations`' mask with targets inside prefixes, as a tree's leaves train the turn their
    branch shares: the branch's rows 1, 4, 6, 8 mark its first turn differently (all of it, its last 4
    tokens, none, its first and last) and row 3 marks its prompt's last 2 tokens. Without `suffixes`,
    only those prefix targets remain."""
    marked = mask.clone() if suffixes else torch.zeros_like(mask)
    turn = list(branch_turn(lengths))
    for row, columns in ((1, turn), (4, turn[2:]), (8, [turn[0], turn[-1]])):
        marked[row, columns] = True
    marked[3, lengths[3] - 2 : lengths[3]] = True
    return marked


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vlm(request) -> VLMAdapter:
    return VLMAdapter.tiny(WORDS, TinyVLMSpec(architecture=request.param))


def test_shared_log_probs_equal_the_right_padded_call(vlm):
    sequences, lengths, groups, mask = conversations(vlm)
    assert len(set(lengths)) == 3 and {len(s.images) for s in sequences} == {0, 1, 2, 3}
    with torch.no_grad():
        flat = vlm.token_log_probs(vlm.collate(sequences, "right"), mask)
        shared = vlm.shared_token_log_probs(sequences, lengths, groups, mask)
    assert shared.shape == flat.shape == mask.shape and shared.dtype == torch.float32
    torch.testing.assert_close(shared, flat, atol=1e-5, rtol=0)
    assert (shared[~mask] == 0).all() and (shared[mask] < 0).all() and shared.isfinite().all()
    # the prefix's last logits score each row's first suffix token: a row of one target token agrees
    assert shared[8, lengths[8]] != 0 and shared[8].ne(0).sum() == 1


def test_suffixes_need_their_positions_in_the_whole_sequence(vlm, monkeypatch):
    """The check above can fail: 1-D token positions instead of the M-RoPE ones shift the scores."""
    sequences, lengths, groups, mask = conversations(vlm)

    def token_positions(self, batch):
        rows, width = batch["input_ids"].shape
        return torch.arange(width).expand(3, rows, width).clone()

    monkeypatch.setattr(QwenVLAdapter, "sequence_position_ids", token_positions)
    with torch.no_grad():
        flat = vlm.token_log_probs(vlm.collate(sequences, "right"), mask)
        wrong = vlm.shared_token_log_probs(sequences, lengths, groups, mask)
    assert (wrong - flat).abs().max() > 1e-4


def test_each_prefix_and_its_images_run_once(vlm):
    sequences, lengths, groups, mask = conversations(vlm)
    seen = {"tokens": 0, "patches": 0}

    def count_tokens(module, args, output):
        seen["tokens"] += int(args[0].numel())

    def count_patches(module, args, kwargs, output):
        seen["patches"] += int(args[0].shape[0])

    hooks = [
        vlm.model.get_input_embeddings().register_forward_hook(count_tokens),
        vlm.model.model.visual.register_forward_hook(count_patches, with_kwargs=True),
    ]
    try:
        with torch.no_grad():
            vlm.shared_token_log_probs(sequences, lengths, groups, mask)
    finally:
        for hook in hooks:
            hook.remove()
    distinct = {group: length for group, length in zip(groups, lengths, strict=True)}
    suffix_width = max(len(s) - p for s, p in zip(sequences, lengths, strict=True))
    assert seen["tokens"] == len(distinct) * max(distinct.values()) + len(sequences) * suffix_width
    assert seen["tokens"] < len(sequences) * mask.shape[1]  # fewer than the right-padded batch
    in_prefix = {0: 1, 1: 0, 2: 2}  # images each group's prefix holds
    prefix_images = [sequences[groups.index(group)].images[: in_prefix[group]] for group in distinct]
    suffix_images = [s.images[in_prefix[group] :] for s, group in zip(sequences, groups, strict=True)]
    run = [image for images in prefix_images + suffix_images for image in images]
    assert len(run) < sum(len(s.images) for s in sequences)
    assert seen["patches"] == sum(image.pixel_values.shape[0] for image in run)


def parameter_gradients(vlm: VLMAdapter, score) -> dict[str, torch.Tensor]:
    vlm.model.zero_grad()
    score().backward()
    return {name: p.grad.clone() for name, p in vlm.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("targets", ["suffixes", "prefixes and suffixes", "prefixes only"])
def test_shared_gradients_equal_the_unshared_ones(vlm, targets):
    sequences, lengths, groups, mask = conversations(vlm)
    if targets != "suffixes":
        mask = with_prefix_targets(lengths, mask, suffixes=targets == "prefixes and suffixes")
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))
    batch = vlm.collate(sequences, "right")
    vlm.model.train()
    try:
        flat = parameter_gradients(vlm, lambda: (vlm.token_log_probs(batch, mask) * weights).sum())
        shared = parameter_gradients(
            vlm, lambda: (vlm.shared_token_log_probs(sequences, lengths, groups, mask) * weights).sum()
        )
    finally:
        vlm.model.eval()
        vlm.model.zero_grad()
    assert shared.keys() == flat.keys() == {name for name, _ in vlm.model.named_parameters()}

    def relative(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    picked = [
        name
        for name in flat
        if name.endswith(
            ("visual.patch_embed.proj.weight", "layers.0.self_attn.q_proj.weight", "lm_head.weight")
        )
        or ("visual.blocks.0." in name and name.endswith("qkv.weight"))
        or name.endswith("embed_tokens.weight")
    ]
    assert len(picked) >= 4
    for name in picked:
        assert relative(shared[name], flat[name]) < 1e-5, name
    total = [torch.cat([grads[name].flatten() for name in flat]) for grads in (shared, flat)]
    assert abs(float(total[0].norm() / total[1].norm()) - 1) < 1e-5
    assert relative(total[0], total[1]) < 1e-5


def test_a_cache_cut_from_the_graph_would_lose_the_prefix_gradient(vlm, monkeypatch):
    """The check above can fail: copying the prefixes' cache without its graph changes the gradients."""
    sequences, lengths, groups, mask = conversations(vlm)
    batch = vlm.collate(sequences, "right")
    reorder = Cache.reorder_cache

    def detached_reorder(self, index):
        for layer in self.layers:
            layer.keys, layer.values = layer.keys.detach(), layer.values.detach()
        reorder(self, index)

    monkeypatch.setattr(Cache, "reorder_cache", detached_reorder)
    try:
        flat = parameter_gradients(vlm, lambda: vlm.token_log_probs(batch, mask).sum())
        cut = parameter_gradients(
            vlm, lambda: vlm.shared_token_log_probs(sequences, lengths, groups, mask).sum()
        )
    finally:
        vlm.model.zero_grad()
    name = next(name for name in flat if name.endswith("patch_embed.proj.weight"))
    assert float((cut[name] - flat[name]).norm() / flat[name].norm()) > 1e-3


def test_targets_past_the_end_and_mismatched_groups_are_refused(vlm):
    sequences, lengths, groups, mask = conversations(vlm)
    score = vlm.shared_token_log_probs
    past = mask.clone()
    past[0, len(sequences[0])] = True
    with pytest.raises(ValueError, match=f"token {len(sequences[0])} of row 0, past its end"):
        score(sequences, lengths, groups, past)
    with pytest.raises(ValueError, match=r"target_mask is \[9, 5\], not \[sequences, longest sequence\]"):
        score(sequences, lengths, groups, mask[:, :5])
    shorter = [*lengths[:4], lengths[4] - 3, *lengths[5:]]
    with pytest.raises(
        ValueError, match=r"rows 1 and 4 under id 2, but prefix_lengths gives them \d+ and \d+"
    ):
        score(sequences, shorter, groups, mask)
    with pytest.raises(ValueError, match="rows 0 and 2 under id 0, but their sequences differ"):
        score(sequences, [lengths[0], lengths[1], lengths[0], *lengths[3:]], [0, 2, 0, *groups[3:]], mask)
    first_image = sequences[0].token_ids.index(vlm.image_token_id)
    cut = [first_image + 2, *lengths[1:]]
    with pytest.raises(ValueError, match=f"cut after token {first_image + 2} falls inside .* image 0"):
        score(sequences, cut, [9, *groups[1:]], mask)
    imageless = [Segment(sequences[0].token_ids), *sequences[1:]]
    with pytest.raises(ValueError, match="more image tokens than its 0 images need"):
        score(imageless, lengths, groups, mask)
    with pytest.raises(ValueError, match="prefix_lengths.0. is 0, but a prefix holds 1 to"):
        score(sequences, [0, *lengths[1:]], [9, *groups[1:]], mask)
    with pytest.raises(ValueError, match="8 prefix_lengths for 9 sequences"):
        score(sequences, lengths[:8], groups, mask)
    with pytest.raises(ValueError, match="8 prefix_groups for 9 sequences"):
        score(sequences, lengths, groups[:8], mask)
    nothing = score(sequences, lengths, groups, torch.zeros_like(mask))
    assert (nothing == 0).all() and nothing.shape == mask.shape


def test_targets_inside_prefixes_equal_the_right_padded_call(vlm):
    sequences, lengths, groups, mask = conversations(vlm)
    mask = with_prefix_targets(lengths, mask)
    mask[5, 0] = True  # a sequence's first token: nothing predicts it, both paths give 0
    with torch.no_grad():
        flat = vlm.token_log_probs(vlm.collate(sequences, "right"), mask)
        shared = vlm.shared_token_log_probs(sequences, lengths, groups, mask)
    torch.testing.assert_close(shared, flat, atol=1e-5, rtol=0)
    mask[5, 0] = False
    assert (shared[~mask] == 0).all() and (shared[mask] < 0).all()
    turn = list(branch_turn(lengths))
    assert (
        shared[6, turn].eq(0).all() and shared[4, turn[:2]].eq(0).all() and shared[8, turn[1:-1]].eq(0).all()
    )
    # one computation per prefix, copied to its rows: the rows that train a shared token get its value
    assert torch.equal(shared[1, turn[2:]], shared[4, turn[2:]])
    assert torch.equal(shared[1, [turn[0], turn[-1]]], shared[8, [turn[0], turn[-1]]])


@pytest.mark.parametrize("rows", [[1], [3], [1, 4]])
def test_prefix_log_probs_keep_their_graph_and_come_from_the_rows_prefix(vlm, rows):
    """A row's prefix targets alone (no suffix target anywhere) give that sequence's own unshared
    log-probs and gradients: a detached copy would give no gradient, another prefix's copy other
    values, and two rows training one shared token add their gradients as two sequences would."""
    sequences, lengths, groups, mask = conversations(vlm)
    mask = with_prefix_targets(lengths, mask, suffixes=False)
    alone = [vlm.collate([sequences[row]], "right") for row in rows]
    masks = [mask[row : row + 1, : len(sequences[row])] for row in rows]
    try:
        flat = parameter_gradients(
            vlm, lambda: sum(vlm.token_log_probs(b, m).sum() for b, m in zip(alone, masks, strict=True))
        )
        shared = parameter_gradients(
            vlm, lambda: vlm.shared_token_log_probs(sequences, lengths, groups, mask)[rows].sum()
        )
    finally:
        vlm.model.zero_grad()
    assert shared.keys() == flat.keys()
    total = [torch.cat([grads[name].flatten() for name in flat]) for grads in (shared, flat)]
    assert float(total[1].norm()) > 0
    assert float((total[0] - total[1]).norm() / total[1].norm()) < 1e-5


def test_prefix_logits_start_at_the_first_target_inside_a_prefix(vlm):
    """The prefix call computes logits from the column before the first target any row marks in a
    prefix (columns counted in the left-padded prefixes), or only its last column when none does."""
    sequences, lengths, groups, mask = conversations(vlm)
    widths = []
    hook = vlm.model.lm_head.register_forward_hook(
        lambda module, args, output: widths.append(output.shape[1])
    )
    prefix_width = max(lengths)
    try:
        with torch.no_grad():
            vlm.shared_token_log_probs(sequences, lengths, groups, mask)
            branch = mask.clone()
            branch[4, branch_turn(lengths)[3]] = True
            vlm.shared_token_log_probs(sequences, lengths, groups, branch)
            prompt = mask.clone()
            prompt[7, lengths[7] - 2] = True
            vlm.shared_token_log_probs(sequences, lengths, groups, prompt)
            vlm.shared_token_log_probs(sequences, lengths, groups, branch | prompt)
    finally:
        hook.remove()
    suffix_width = max(len(s) - p for s, p in zip(sequences, lengths, strict=True))
    shift = {row: prefix_width - lengths[row] for row in (4, 7)}
    from_branch = prefix_width - (branch_turn(lengths)[3] + shift[4]) + 1
    from_prompt = prefix_width - (lengths[7] - 2 + shift[7]) + 1
    assert 1 < from_prompt < from_branch < prefix_width
    assert widths[1::2] == [suffix_width] * 4
    assert widths[::2] == [1, from_branch, from_prompt, from_branch]  # the earliest column of any prefix


def test_timing_of_eight_rows_sharing_a_prompt(vlm):
    """Not a check: prints forward+backward seconds of both paths for the report."""
    prompt = vlm.prompt_token_ids("what color is the small circle ?", picture(seed=1))
    sequences = [prompt + text_tokens(vlm, 12 + 2 * row, row) for row in range(8)]
    width = max(len(s) for s in sequences)
    mask = torch.stack(
        [(torch.arange(width) >= len(prompt)) & (torch.arange(width) < len(s)) for s in sequences]
    )
    batch = vlm.collate(sequences, "right")
    paths = {
        "unshared": lambda: vlm.token_log_probs(batch, mask),
        "shared": lambda: vlm.shared_token_log_probs(sequences, [len(prompt)] * 8, [0] * 8, mask),
    }
    seconds = {}
    for name, score in paths.items():
        score().sum().backward()  # warm-up
        start = time.perf_counter()
        for _ in range(5):
            score().sum().backward()
        seconds[name] = (time.perf_counter() - start) / 5
    vlm.model.zero_grad()
    print(
        f"\n{vlm.model.config.model_type}: 8 rows, prompt {len(prompt)} tokens, suffixes 12-26 tokens: "
        f"forward+backward unshared {seconds['unshared'] * 1e3:.1f} ms, "
        f"shared {seconds['shared'] * 1e3:.1f} ms"
    )
