"""Multi-turn tool rollouts, adaptive rewards, and the VLM trainers on a tiny untrained Qwen2-VL."""

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from mmrl.checkpoint import list_checkpoints
from mmrl.cli import load_plugins, main
from mmrl.config import ConfigError, load_config
from mmrl.noise import NoiseKey
from vlm_rl.config import ToolRolloutConfig
from vlm_rl.conversation import Trajectory, prompt_segment
from vlm_rl.data import DataConfig, QuestionSet, demonstration, round_box, task_vocabulary, tool_call_text
from vlm_rl.loading import load
from vlm_rl.models import Generation, Segment, VLMAdapter
from vlm_rl.rewards import adaptive_tool_rewards
from vlm_rl.rollout import metrics_by_kind, rollout
from vlm_rl.sft import SFTTrainConfig, load_or_build, zoom_share
from vlm_rl.tasks import COLOURS, SHAPES, TaskConfig, make_example
from vlm_rl.tools import ImageStore, ToolCall, ToolStats, first_tool_call
from vlm_rl.trainer import load_policy
from vlm_rl.vision import BACKGROUND, crop_with_labels

load_plugins()

DATA = DataConfig(heldout_size=8, train_size=64)


@pytest.fixture(scope="module")
def vlm():
    return VLMAdapter.tiny(task_vocabulary(DATA, samples=50))


@pytest.fixture(scope="module")
def questions():
    heldout = QuestionSet(DATA, "heldout")
    return [heldout[i] for i in range(4)]


def scripted(vlm, monkeypatch, turns):
    """Make `generate` return `turns[k]` (text) for every row at turn k; None: the model's own tokens."""
    real = vlm.generate
    calls = {"turn": 0}

    def generate(batch, max_new_tokens, keys=None, **kwargs):
        text = turns[calls["turn"]] if calls["turn"] < len(turns) else None
        calls["turn"] += 1
        if text is None:
            return real(batch, max_new_tokens, keys=keys, **kwargs)
        ids = vlm.segment(text).token_ids[:max_new_tokens]
        rows = batch["input_ids"].shape[0]
        stop = ids[-1] in vlm.token_ids_of(["<|im_end|>", "</tool_call>"])
        prefill = int(batch["attention_mask"].sum())
        return Generation([list(ids)] * rows, [torch.full((len(ids),), -0.5)] * rows, [stop] * rows, prefill)

    monkeypatch.setattr(vlm, "generate", generate)


def test_a_zoom_then_an_answer(vlm, questions, monkeypatch):
    box = (0.0, 0.0, 0.34, 0.34)
    scripted(vlm, monkeypatch, [tool_call_text(box), "<answer>B</answer><|im_end|>"])
    (t,) = rollout(vlm, questions[:1], ToolRolloutConfig(), keys=None)
    assert t.ended == "answer" and t.turns == 2 and t.answer == "B"
    assert t.tool_stats.calls == 1 and t.tool_stats.successes == 1 and t.used_tool
    assert len(t.sequence.images) == 2 and t.store.boxes[1] == (0, 0, 153, 153)
    assert len(t.loss_mask) == len(t.old_log_probs) == len(t.sequence)
    # the observation (the crop's image tokens) is not trained; the two assistant turns are
    observation = vlm.observation_token_ids(t.store.images[1])
    start = len(prompt_segment(vlm, questions[0], None)) + len(vlm.segment(tool_call_text(box)))
    assert t.sequence.token_ids[start : start + len(observation)] == observation.token_ids
    assert not any(t.loss_mask[start : start + len(observation)]) and all(
        t.loss_mask[start + len(observation) :]
    )
    assert t.generated_tokens == len(vlm.segment(tool_call_text(box))) + len(
        vlm.segment("<answer>B</answer><|im_end|>")
    )


@pytest.mark.parametrize(
    "turns, cfg, ended, errors",
    [
        (['<tool_call>{"name": "rotate"}</tool_call>', "<answer>A</answer><|im_end|>"], {}, "answer", 1),
        (["<tool_call>[0.5, 0.5]</tool_call>"] * 3, {}, "max_turns", 2),
        ([tool_call_text((0, 0, 0.5, 0.5))] * 3, {"max_images": 2}, "max_images", 0),
        (["A A A A A A A A"], {"max_new_tokens": 4}, "truncated", 0),
    ],
)
def test_bad_calls_and_limits_end_cleanly(vlm, questions, monkeypatch, turns, cfg, ended, errors):
    scripted(vlm, monkeypatch, turns)
    (t,) = rollout(vlm, questions[:1], ToolRolloutConfig(**cfg), keys=None)
    assert t.ended == ended
    assert (t.answer is None) == (ended != "answer")
    assert sum(t.tool_stats.errors.values()) == errors
    assert len(t.sequence) <= ToolRolloutConfig(**cfg).max_tokens


def test_an_observation_that_would_pass_the_token_limit_ends_the_rollout(vlm, questions, monkeypatch):
    call = tool_call_text((0, 0, 0.5, 0.5))
    scripted(vlm, monkeypatch, [call])
    limit = len(prompt_segment(vlm, questions[0], None)) + len(vlm.segment(call)) + 5  # no room for a crop
    (t,) = rollout(vlm, questions[:1], ToolRolloutConfig(max_tokens=limit), keys=None)
    assert t.ended == "max_tokens" and len(t.sequence) <= limit and t.tool_stats.calls == 1


def test_error_text_goes_back_to_the_model(vlm, questions, monkeypatch):
    bad = '<tool_call>{"name": "rotate"}</tool_call>'
    scripted(vlm, monkeypatch, [bad, "<answer>A</answer><|im_end|>"])
    (t,) = rollout(vlm, questions[:1], ToolRolloutConfig(), keys=None)
    assert t.tool_stats.errors == {"missing_key": 1} and len(t.sequence.images) == 1
    assert t.tool_stats.calls == 1 and not t.used_tool  # no crop was seen: a tool-free answer
    shown = vlm.observation_token_ids(first_tool_call(bad).message).token_ids
    start = len(prompt_segment(vlm, questions[0], None)) + len(vlm.segment(bad))
    assert t.sequence.token_ids[start : start + len(shown)] == shown


def test_recomputed_log_probs_equal_the_rollouts_after_an_image_turn(vlm, questions, monkeypatch):
    """The second turn is sampled by the model after a crop was shown mid-conversation; scoring the
    whole conversation again gives its log-probs back (M-RoPE positions with two images agree)."""
    call = tool_call_text((0.3, 0.3, 0.7, 0.7))
    scripted(vlm, monkeypatch, [call, None])
    cfg = ToolRolloutConfig(max_new_tokens=40, max_turns=2)
    keys = [NoiseKey(0, 0, i, 0) for i in range(2)]
    trajectories = rollout(vlm, questions[:2], cfg, keys)
    batch = vlm.collate([t.sequence for t in trajectories], "right")
    mask = torch.zeros(batch["input_ids"].shape, dtype=torch.bool)
    for row, t in enumerate(trajectories):
        assert len(t.sequence.images) == 2 and t.turns == 2
        second_turn = t.generated_tokens - len(vlm.segment(call))  # the conversation ends with it
        mask[row, len(t.sequence) - second_turn : len(t.sequence)] = True
    with torch.no_grad():
        scored = vlm.token_log_probs(batch, mask)
    for row, t in enumerate(trajectories):
        old = torch.tensor(t.old_log_probs)[mask[row, : len(t.sequence)]]
        torch.testing.assert_close(scored[row][mask[row]], old, atol=1e-4, rtol=0)


def test_keyed_rollouts_do_not_depend_on_the_batch(vlm, questions):
    cfg = ToolRolloutConfig(max_new_tokens=10)
    keys = [NoiseKey(1, 2, i, 0) for i in range(3)]
    together = rollout(vlm, questions[:3], cfg, keys)
    alone = rollout(vlm, questions[2:3], cfg, keys[2:])
    assert together[2].sequence.token_ids == alone[0].sequence.token_ids


def test_tool_modes(vlm, questions):
    cfg = ToolRolloutConfig(max_new_tokens=6)
    always = rollout(vlm, questions[:2], cfg, keys=None, tool_mode="always")
    start = vlm.token_ids_of(["<tool_call>"])[0]
    for q, t in zip(questions, always, strict=False):
        first = len(prompt_segment(vlm, q, None))
        assert t.sequence.token_ids[first] == start and not t.loss_mask[first] and t.loss_mask[first + 1]
    never = rollout(vlm, questions[:2], cfg, [NoiseKey(0, 0, i, 0) for i in range(2)], tool_mode="never")
    assert all(start not in t.sequence.token_ids for t in never)


def test_adaptive_ranking_rewards():
    correct = torch.tensor([1, 1, 0, 0, 1, 0, 0, 1, 1, 0])
    used = torch.tensor([0, 1, 1, 0, 1, 1, 0, 1, 0, 0])
    groups = torch.tensor([7, 7, 7, 7, 3, 3, 3, 5, 5, 5])
    rewards = adaptive_tool_rewards(correct, used, groups)
    # group 7 and 5: a tool-free rollout is right (direct 1.0 > tool 0.8 > tool wrong 0.5 > direct wrong 0)
    # group 3: none is, so a correct zoom ranks first (tool 1.0 > tool wrong 0.5 > direct wrong 0)
    assert rewards.tolist() == pytest.approx([1.0, 0.8, 0.5, 0.0, 1.0, 0.5, 0.0, 0.8, 1.0, 0.0])
    cost = adaptive_tool_rewards(correct, used, groups, scheme="tool_cost", tool_cost=0.25)
    assert cost.tolist() == pytest.approx([1.0, 0.75, -0.25, 0.0, 0.75, -0.25, 0.0, 0.75, 1.0, 0.0])


def test_demonstrations_round_trip(vlm, questions):
    q = next(q for q in questions if q.target_box is not None)
    image = q.image
    prompt = prompt_segment(vlm, q, None, image)
    sequence, mask = demonstration(vlm, q, prompt, True, image)
    text = vlm.decode([t for t, m in zip(sequence.token_ids, mask, strict=True) if m])
    answer = q.options["ABCD".index(q.answer)]
    assert text.startswith("<tool_call>") and text.endswith(f"<answer>{answer}</answer><|im_end|>")
    assert len(sequence.images) == 2
    direct, direct_mask = demonstration(vlm, q, prompt, False, image)
    assert vlm.decode(direct.token_ids[len(prompt) :]) == f"<answer>{answer}</answer><|im_end|>"
    assert direct_mask == [False] * len(prompt) + [True] * (len(direct) - len(prompt))


def test_sft_then_grpo_train_save_and_resume(vlm, tmp_path):
    common = [
        "progress=false",
        "data.heldout_size=4",
        "data.train_size=32",
        "eval_modes=[auto]",
        "rollout.max_new_tokens=8",
    ]
    assert (
        main(
            [
                "pretrain",
                "vlm",
                f"output_dir={tmp_path / 'sft'}",
                "model.path=null",  # a new tiny model, not the recipe's vision-stage checkpoint
                "steps=3",
                "train.batch_size=4",
                "train.warmup_steps=1",
                *common,
            ]
        )
        == 0
    )
    base = tmp_path / "sft" / "model"
    assert (base / "config.json").is_file()
    grpo = [
        f"model.path={base}",
        "train.questions_per_step=2",
        "train.group_size=2",
        "checkpoint_every=2",
        "train.lr=1e-3",
        *common,
    ]

    def run(out, steps, *extra):
        assert main(["train", "vlm/tool_grpo", f"output_dir={out}", f"steps={steps}", *grpo, *extra]) == 0
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        weights = load(out / "model").model.state_dict()
        return [{k: v for k, v in r.items() if k != "step_seconds"} for r in rows], weights

    straight_rows, straight = run(tmp_path / "straight", 4)
    assert {"accuracy", "tool_ratio", "tool_error_bad_json", "tokens_per_answer", "groups_kept"} <= set(
        straight_rows[0]
    )
    assert all(
        any(key.startswith("tool_ratio_") for key in row) for row in straight_rows if "accuracy" in row
    )
    run(tmp_path / "stopped", 2)
    resumed_rows, resumed = run(tmp_path / "stopped", 4, "resume=true")
    assert resumed_rows == straight_rows
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert json.loads((tmp_path / "straight" / "eval.json").read_text())["after"]["auto_accuracy"] >= 0.0


def test_vision_labels_mark_the_tokens_that_show_the_small_object(vlm):
    """A token labelled with the shape covers the object's pixels; a background token none of them."""
    task = TaskConfig(detail_fraction=1.0, max_large=1)
    checked = 0
    for index in range(40):
        example = make_example(index, 0, "train", task)
        target = example.objects[example.target]
        if any(o.colour == target.colour for i, o in enumerate(example.objects) if i != example.target):
            continue  # another object of that colour would blur the pixel check
        image, labels = crop_with_labels(example, vlm)
        crop = ImageStore(example.image).crop(ToolCall("crop", round_box(example.target_box))).image
        pixels = np.asarray(crop.resize(image.size, Image.Resampling.NEAREST), dtype=float) / 255
        on_object = np.abs(pixels - np.array(COLOURS[target.colour])).sum(-1) < 0.1
        cell = vlm.image_processor.patch_size * vlm.image_processor.merge_size
        rows, cols = image.size[1] // cell, image.size[0] // cell
        per_token = on_object.reshape(rows, cell, cols, cell).sum(axis=(1, 3)).flatten()
        shape = SHAPES.index(target.shape)
        assert set(labels.tolist()) <= {shape, BACKGROUND, -100} and (labels == shape).any()
        assert per_token[labels == BACKGROUND].sum() == 0
        assert per_token[labels == shape].sum() >= 0.7 * per_token.sum() > 0
        checked += 1
    assert checked >= 10


def test_vision_pre_stage_trains_the_tower_only_then_sft_can_keep_it(tmp_path):
    tiny = ["model.hidden=32", "model.layers=1", "model.vision_width=16", "model.vision_depth=1"]
    common = ["progress=false", "data.heldout_size=4", "train.batch_size=4", "train.warmup_steps=1", *tiny]

    def vision_run(out, steps, *extra):
        args = ["pretrain", "vlm_vision", f"output_dir={out}", f"steps={steps}", "checkpoint_every=2"]
        assert main([*args, *common, *extra]) == 0
        return load(out / "model").model.state_dict()

    straight = vision_run(tmp_path / "straight", 4)
    vision_run(tmp_path / "stopped", 4)
    *_, last = list_checkpoints(tmp_path / "stopped" / "checkpoints")
    shutil.rmtree(last)  # as if killed after the step-2 checkpoint (the schedule depends on steps)
    resumed = vision_run(tmp_path / "stopped", 4, "resume=true")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    evals = json.loads((tmp_path / "straight" / "eval.json").read_text())
    assert 0.0 <= evals["after"]["crop_shape_accuracy"] <= 1.0

    cfg = load_config("pretrain/vlm_vision", ["output_dir=unused", *tiny])
    fresh = load_or_build(cfg.model, cfg.data, cfg.seed).model.state_dict()
    changed = {k for k in fresh if not torch.equal(fresh[k], straight[k])}
    assert changed and all(".visual." in k or k.startswith("visual.") for k in changed)

    sft = tmp_path / "sft"
    base = tmp_path / "straight" / "model"
    args = ["pretrain", "vlm", f"output_dir={sft}", "steps=2", f"model.path={base}"]
    assert main([*args, "train.vision_lr_scale=0", "eval_modes=[never]", *common]) == 0
    after = load(sft / "model").model.state_dict()
    kept = [k for k in after if ".visual." in k or k.startswith("visual.")]
    assert kept and all(torch.equal(after[k], straight[k]) for k in kept)
    assert any(not torch.equal(after[k], straight[k]) for k in after if k not in kept)
    bad = ["pretrain", "vlm_vision", f"output_dir={tmp_path / 'bad'}", f"model.path={base}"]
    assert main(bad) == 2


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.path=/nonexistent", "model.path = '/nonexistent'"),
        ("eval_modes=[auto,sometimes]", "choose one of auto, always, never"),
        ("reward.options={scheme: rank}", "unknown scheme 'rank'"),
        ("train.aggregation=sum", "train.aggregation"),
        ("train.loss=ppo", "unknown loss 'ppo'"),
    ],
)
def test_bad_config_is_one_clear_error(tmp_path, capsys, override, message):
    assert main(["train", "vlm/tool_grpo", f"output_dir={tmp_path}", override]) == 2
    assert message in capsys.readouterr().err


def test_the_update_uses_the_policy_loss_train_loss_names(vlm, tmp_path, monkeypatch):
    """A policy loss that is always zero, named by train.loss, gets the config's clip range and
    leaves the weights as they were, though the groups' advantages are not zero."""
    from mmrl.losses import LossOutput
    from mmrl.registry import LOSSES
    from vlm_rl.trainer import ToolGRPOTrainer

    calls = []

    def zero(logp, old_logp, advantages, mask, **options):
        calls.append(options)
        return LossOutput((logp * 0).sum(), {})

    monkeypatch.setattr(LOSSES, "_entries", {**LOSSES._entries, "zero": zero})
    monkeypatch.setattr(LOSSES, "_entry_kinds", {**LOSSES._entry_kinds, "zero": "policy"})
    vlm.save_pretrained(tmp_path / "base")
    config = load_config(
        "vlm/tool_grpo",
        [
            f"model.path={tmp_path / 'base'}",
            f"output_dir={tmp_path / 'run'}",
            "progress=false",
            "data.heldout_size=2",
            "train.questions_per_step=1",
            "train.group_size=4",
            "train.loss=zero",
            "train.clip_low=0.1",
            "train.clip_high=0.3",
            "rollout.max_new_tokens=4",
        ],
    )
    trainer = ToolGRPOTrainer(config)
    trainer.prepare_run_dir()
    trainer.seed_everything()
    trainer.setup()
    trainer.reward_fn = lambda texts, **kwargs: torch.tensor([1.0, 1.0, 0.0, 0.0])
    before = {k: v.clone() for k, v in trainer.adapter.model.state_dict().items()}
    metrics = trainer.train_step(0)
    assert metrics["trained_sequences"] == 4
    assert calls and all(c == {"clip_low": 0.1, "clip_high": 0.3, "aggregation": "token_mean"} for c in calls)
    after = trainer.adapter.model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_bench_vlm_compares_the_same_conversations(tmp_path, vlm, capsys):
    from vlm_rl.bench.rollout_speed import bench_vlm

    vlm.save_pretrained(tmp_path)
    rows = bench_vlm(rollouts=6, model=str(tmp_path), vllm=False, partial_steps=0, tree_steps=0)
    assert [row["variant"] for row in rows] == ["per-sample generate loop", "batched multi-turn engine"]
    assert rows[1]["same_conversations"] and rows[0]["tokens"] == rows[1]["tokens"] > 0
    assert rows[1]["ratio"] == rows[1]["tokens_per_second"] / rows[0]["tokens_per_second"]
    assert "batched / per-sample" in capsys.readouterr().out


def test_nan_losses_are_skipped_then_stop_the_run_with_a_checkpoint(vlm, tmp_path, monkeypatch):
    vlm.save_pretrained(tmp_path / "base")
    original = VLMAdapter.token_log_probs

    def poisoned(self, batch, mask, model=None, temperature=1.0):
        return original(self, batch, mask, model, temperature) * float("nan")

    monkeypatch.setattr(VLMAdapter, "token_log_probs", poisoned)
    out = tmp_path / "run"
    code = main(
        [
            "train",
            "vlm/tool_grpo",
            f"output_dir={out}",
            f"model.path={tmp_path / 'base'}",
            "progress=false",
            "steps=5",
            "train.questions_per_step=1",
            "train.group_size=2",
            "train.nan_patience=2",
            "data.heldout_size=2",
            "eval_modes=[auto]",
            "rollout.max_new_tokens=4",
        ]
    )
    assert code == 1
    stopped = json.loads((out / "stopped.json").read_text())
    assert stopped["step"] == 1 and "non-finite loss in 2 steps in a row" in stopped["reason"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["skipped"] == 1 and rows[0]["skipped_steps"] == 1
    assert (out / "checkpoints" / "step_00000001" / "manifest.json").is_file()


def test_questions_from_jsonl_files(vlm, tmp_path, capsys):
    from vlm_rl.question_jsonl import write_benchmark
    from vlm_rl.tasks import make_examples

    train = write_benchmark(make_examples(6, seed=1), tmp_path / "train")
    held = write_benchmark(make_examples(3, seed=1, split="heldout"), tmp_path / "held")
    vlm.save_pretrained(tmp_path / "base")
    common = [
        "train",
        "vlm/tool_grpo",
        f"model.path={tmp_path / 'base'}",
        f"data.source={train}",
        "steps=1",
        "train.questions_per_step=2",
        "train.group_size=2",
        "eval_modes=[auto]",
        "rollout.max_new_tokens=4",
        "progress=false",
    ]
    assert main([*common, f"output_dir={tmp_path / 'a'}"]) == 2
    assert "needs data.heldout_file" in capsys.readouterr().err
    assert main([*common, f"output_dir={tmp_path / 'b'}", f"data.heldout_file={held}"]) == 0
    assert json.loads((tmp_path / "b" / "eval.json").read_text())["after"]["auto_answered"] >= 0.0
    assert (
        main(
            [
                *common,
                f"output_dir={tmp_path / 'c'}",
                "data.source=/nonexistent.jsonl",
                f"data.heldout_file={held}",
            ]
        )
        == 2
    )
    assert "does not exist" in capsys.readouterr().err


def test_metrics_by_kind_split_accuracy_and_tool_use():
    def done(calls: int, successes: int) -> Trajectory:
        t = Trajectory(Segment([]), [], [], ("a", "b"), store=None, turns=1 + calls, ended="answer")
        t.tool_stats = ToolStats(calls=calls, successes=successes)
        return t

    # two detail questions zoomed (one right), a global one answered directly (right), a global one
    # with a failed call only (wrong): that last one did not use the tool
    trajectories = [done(1, 1), done(1, 1), done(0, 0), done(1, 0)]
    metrics = metrics_by_kind(
        trajectories, [True, False, True, False], ["detail", "detail", "global", "global"]
    )
    assert metrics == {
        "accuracy_detail": 0.5,
        "tool_ratio_detail": 1.0,
        "accuracy_global": 0.5,
        "tool_ratio_global": 0.0,
    }
    assert metrics_by_kind(trajectories, [True] * 4, [""] * 4) == {}  # data without kinds


def test_heldout_questions_can_mix_kinds_unlike_training():
    cfg = DataConfig(detail_fraction=1.0, heldout_detail_fraction=0.0, train_size=20, heldout_size=20)
    assert {QuestionSet(cfg, "train")[i].kind for i in range(20)} == {"detail"}
    assert {QuestionSet(cfg, "heldout")[i].kind for i in range(20)} == {"global"}


def test_demonstrations_can_zoom_by_question_kind():
    questions = QuestionSet(DataConfig(train_size=40), "train")
    kinds = [questions[i].kind for i in range(40)]
    assert {"global", "detail"} <= set(kinds)
    by_kind = SFTTrainConfig(tool_fraction=1.0, global_tool_fraction=0.0)
    assert [zoom_share(questions[i], by_kind) for i in range(40)] == [float(k == "detail") for k in kinds]
    assert {zoom_share(questions[i], SFTTrainConfig(tool_fraction=0.3)) for i in range(40)} == {0.3}
    unknown = dataclasses.replace(questions[0], kind="")  # a question from a file: tool_fraction
    assert zoom_share(unknown, by_kind) == 1.0


@pytest.mark.parametrize(
    "path, command",
    [
        ("runs/pretrain/vlm/model", "mmrl pretrain vlm"),
        ("runs/pretrain/vlm_read/model", "mmrl pretrain vlm_read"),
    ],
)
def test_a_missing_default_checkpoint_names_the_command_that_writes_it(tmp_path, monkeypatch, path, command):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=f"run `{command}` first"):
        load_policy(path)


def test_the_default_model_is_the_shipped_base_found_from_any_working_directory(tmp_path, monkeypatch):
    from vlm_rl.config import DEFAULT_MODEL
    from vlm_rl.eval_benchmarks import resolve_model

    monkeypatch.chdir(tmp_path)
    adapter = load_policy(DEFAULT_MODEL)
    assert resolve_model(None).is_dir() and adapter.model.config.model_type == "qwen2_vl"


def test_each_conversation_keeps_its_own_token_budget(vlm, questions, monkeypatch):
    """A conversation near max_tokens ends there; it neither cuts the turn of one with room nor marks it
    truncated."""
    from vlm_rl.conversation import start_conversations
    from vlm_rl.rollout import generate
    from vlm_rl.schedules import Conversation, Groups

    answer = "<answer>B</answer><|im_end|>"
    scripted(vlm, monkeypatch, [answer])
    near, roomy = start_conversations(vlm, questions[:2], ToolRolloutConfig())
    needed = len(vlm.segment(answer))
    cfg = ToolRolloutConfig(max_tokens=max(len(near.sequence), len(roomy.sequence)) + needed + 2)
    room = needed - 3  # near gets room for part of the answer only
    filler = cfg.max_tokens - room - len(near.sequence)
    near.append(Segment([vlm.segment("A").token_ids[0]] * filler), sampled=False)  # an earlier turn's room
    assert cfg.max_tokens - len(near.sequence) == room > 0
    generate(vlm, Groups([Conversation(near, None), Conversation(roomy, None)]), cfg)
    assert roomy.ended == "answer" and roomy.answer == "B"
    assert near.ended == "max_tokens" and len(near.sequence) == cfg.max_tokens
