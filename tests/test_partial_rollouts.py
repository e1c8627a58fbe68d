"""Partial rollouts (APRIL): the bookkeeping on toy groups with scripted lengths, then the VLM runner on
the shipped tiny policy, which answers global questions in one short turn and zooms on detail ones
(a tool call, a crop, an answer: the long conversations that get carried)."""

import copy
import itertools
import json
from dataclasses import dataclass, field

import pytest
import torch
from pinned_runs import metric_rows

from mmrl.checkpoint import load_checkpoint, save_checkpoint
from mmrl.cli import load_plugins, main
from mmrl.noise import NoiseKey
from mmrl.partial import PartialGroups
from vlm_rl.config import PartialRolloutConfig, ToolRolloutConfig
from vlm_rl.data import DataConfig, QuestionSet
from vlm_rl.eval_benchmarks import resolve_model
from vlm_rl.loading import load
from vlm_rl.rollout import generate, rollout
from vlm_rl.schedules import CarriedGroups

load_plugins()


def carried_step(carried, step, sample):
    """One training step's partial rollouts: begin the step, run the loop on it, end it."""
    generate(carried.adapter, carried.begin(step, sample), carried.cfg)
    return carried.end()


@dataclass
class Toy:
    """A member that needs `remaining` more waves, one token each."""

    remaining: int
    tokens_by_version: dict[int, int] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.remaining == 0

    def wave(self, step: int) -> None:
        if self.remaining:
            self.remaining -= 1
            self.tokens_by_version[step] = self.tokens_by_version.get(step, 0) + 1


LENGTHS = {0: [1, 3], 1: [1, 1], 2: [1, 1], 3: [2, 2], 4: [1, 1], 5: [1, 1], 6: [1, 1], 7: [1, 1]}


def toy_step(groups, step, fresh):
    """One step on toy members: drop, launch (relaunched items first, then `fresh`), waves until
    enough, take the trained groups."""
    plan = groups.begin_step(step)
    items = plan.relaunch + [next(fresh) for _ in range(plan.new)]
    groups.launch(step, items, lambda slot, item: [Toy(n) for n in LENGTHS[item]])
    waves = 0
    while True:
        for group in groups.groups:
            for member in group.members:
                member.wave(step)
        waves += 1
        if groups.enough():
            break
    trained = groups.take_trained()
    return plan, items, waves, trained, groups.metrics(step, trained)


def test_launch_carry_train_oldest_first_and_the_staleness_cap():
    groups = PartialGroups(target=2, over_provision=1.0, max_staleness=1)
    fresh = itertools.count()

    plan, items, waves, trained, metrics = toy_step(groups, 0, fresh)
    assert items == [0, 1, 2, 3] and plan.new == 4  # 2 x (1 + 1) groups in flight
    assert waves == 1  # items 1 and 2 end in one wave: enough, though 0 and 3 still run
    assert [g.item for g in trained] == [1, 2]
    assert [g.item for g in groups.groups] == [0, 3] and not any(g.complete for g in groups.groups)
    assert metrics["partial_staleness_max"] == 0 and metrics["partial_old_token_fraction"] == 0.0

    plan, items, waves, trained, metrics = toy_step(groups, 1, fresh)
    assert items == [4, 5]  # only to fill up: 2 groups were carried
    assert waves == 1
    # 3 (launched at step 0), 4 and 5 are complete: the oldest launch first, 5 waits
    assert [(g.item, g.launch_step) for g in trained] == [(3, 0), (4, 1)]
    assert [g.item for g in groups.groups] == [0, 5] and groups.groups[1].complete
    assert metrics["partial_staleness_mean"] == 0.5 and metrics["partial_staleness_max"] == 1
    assert metrics["partial_old_token_fraction"] == pytest.approx(2 / 6)  # item 3's first tokens
    assert metrics["partial_dropped"] == 0

    plan, items, waves, trained, metrics = toy_step(groups, 2, fresh)
    # item 0's group (2 steps old) would train beyond max_staleness=1: dropped, counted, relaunched
    assert [g.item for g in plan.dropped] == [0] and plan.relaunch == [0]
    assert items == [0, 6, 7]
    assert metrics["partial_dropped"] == 2 and metrics["partial_dropped_total"] == 2
    assert groups.dropped_groups == 1
    assert [(g.item, g.launch_step) for g in trained] == [(5, 1), (6, 2)]
    assert [(g.item, g.launch_step, g.slot) for g in groups.groups] == [(0, 2, 0), (7, 2, 2)]


def test_a_group_is_trained_only_when_every_member_ended():
    groups = PartialGroups(target=1, over_provision=0.0, max_staleness=5)
    groups.launch(0, [0], lambda slot, item: [Toy(1), Toy(3)])
    for _ in range(2):
        for member in groups.groups[0].members:
            member.wave(0)
        assert not groups.enough() and groups.take_trained() == []
    groups.groups[0].members[1].wave(0)
    assert groups.enough() and [g.item for g in groups.take_trained()] == [0]


def test_state_dict_is_flat_and_round_trips():
    groups = PartialGroups(target=2, over_provision=1.0, max_staleness=1)
    toy_step(groups, 0, itertools.count())
    state = groups.state_dict()
    tensors = {k for k, v in state.items() if isinstance(v, torch.Tensor)}
    assert tensors == set(PartialGroups.TENSOR_KEYS)
    json.dumps({k: v for k, v in state.items() if k not in tensors})  # the rest is JSON
    members = {(g.launch_step, g.slot): g.members for g in groups.groups}

    restored = PartialGroups(target=2, over_provision=1.0, max_staleness=1)
    restored.load_state_dict(state, lambda position, g: copy.deepcopy(members[(g.launch_step, g.slot)]))
    assert [(g.item, g.launch_step, g.slot) for g in restored.groups] == [
        (g.item, g.launch_step, g.slot) for g in groups.groups
    ]
    runs = [toy_step(g, 1, itertools.count(4))[1:] for g in (groups, restored)]
    assert [[(t.item, t.launch_step) for t in run[2]] for run in runs] == [[(3, 0), (4, 1)]] * 2
    assert runs[0][3] == runs[1][3]  # the same metrics
    with pytest.raises(ValueError, match="for 2 groups per step"):
        PartialGroups(target=3, over_provision=0.0, max_staleness=1).load_state_dict(state, lambda p, g: [])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"target": 0, "over_provision": 0.5, "max_staleness": 1}, "target"),
        ({"target": 2, "over_provision": -0.1, "max_staleness": 1}, "over_provision"),
        ({"target": 2, "over_provision": 0.5, "max_staleness": -1}, "max_staleness"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PartialGroups(**kwargs)


# -- the VLM runner ------------------------------------------------------------------------------------

G = 2
DATA = DataConfig(heldout_size=64, heldout_detail_fraction=0.5)


@pytest.fixture(scope="module")
def policy():
    adapter = load(resolve_model(None))
    adapter.model.eval()
    return adapter


@pytest.fixture(scope="module")
def questions():
    return QuestionSet(DATA, "heldout")


def items_of(questions, kinds):
    """Question indices in the order of `kinds` ("global": answered directly, "detail": zoomed)."""
    pools = {kind: iter([i for i in range(len(questions)) if questions[i].kind == kind]) for kind in kinds}
    return [next(pools[kind]) for kind in kinds]


def sampler(items):
    pending = iter(items)
    return lambda n: [next(pending) for _ in range(n)]


def config(**partial):
    return ToolRolloutConfig(partial=PartialRolloutConfig(enabled=True, **partial))


def same_conversation(a, b):
    return (
        a.sequence.token_ids == b.sequence.token_ids
        and a.old_log_probs == b.old_log_probs
        and a.loss_mask == b.loss_mask
        and (a.ended, a.turns, a.calls, a.turn_ids, a.answer_text)
        == (b.ended, b.turns, b.calls, b.turn_ids, b.answer_text)
        and a.tool_stats == b.tool_stats
        and len(a.sequence.images) == len(b.sequence.images)
        and all(
            torch.equal(x.pixel_values, y.pixel_values) and x.image.tobytes() == y.image.tobytes()
            for x, y in zip(a.sequence.images, b.sequence.images, strict=True)
        )
        and a.store.boxes == b.store.boxes
    )


def test_without_over_provision_a_step_is_the_synchronous_rollout(policy, questions):
    items = items_of(questions, ["detail", "global", "global"])
    cfg = config(over_provision=0.0)
    runner = CarriedGroups(policy, questions, cfg, target_groups=3, group_size=G, seed=5)
    out = carried_step(runner, 4, sampler(items))
    keys = [NoiseKey(5, 4, s * G + j, 0) for s in range(3) for j in range(G)]
    expected = rollout(policy, [questions[i] for i in items for _ in range(G)], cfg, keys)
    assert out.items == items and [g.launch_step for g in out.groups] == [4] * 3
    assert any(t.turns == 2 for t in expected)  # a zoom, which takes two waves
    assert all(same_conversation(a, b) for a, b in zip(out.trajectories, expected, strict=True))
    assert out.metrics["partial_carried_groups"] == 0 and out.metrics["partial_launched_groups"] == 3


def test_a_carried_conversation_keeps_its_tokens_and_log_probs(policy, questions):
    adapter = copy.deepcopy(policy)
    items = items_of(questions, ["detail", "global", "global", "global", "global", "global"])
    runner = CarriedGroups(
        adapter, questions, config(over_provision=1.0), target_groups=2, group_size=G, seed=1
    )
    first = carried_step(runner, 0, sampler(items))
    assert len(first.groups) == 2 and all(t.ended for t in first.trajectories)
    # the zoom is carried after its tool call and crop, before its answer
    carried = runner.groups.groups[0]
    assert carried.item == items[0] and carried.launch_step == 0 and not carried.complete
    before = [copy.deepcopy(m.trajectory) for m in carried.members]
    assert all(t.turns == 1 and not t.ended and len(t.sequence.images) == 2 for t in before)

    with torch.no_grad():  # the policy is updated between the steps
        for p in adapter.model.parameters():
            p.add_(0.05 * torch.randn_like(p, generator=torch.Generator().manual_seed(0)))
    second = carried_step(runner, 1, sampler(items[4:]))
    assert second.groups[0] is carried and carried.complete  # trained first: the oldest launch
    for old, member in zip(before, carried.members, strict=True):
        t = member.trajectory
        n = len(old.sequence)
        assert t.sequence.token_ids[:n] == old.sequence.token_ids and t.old_log_probs[:n] == old.old_log_probs
        assert len(t.sequence) > n and t.ended == "answer"
        assert member.tokens_by_version == {
            0: old.generated_tokens,
            1: t.generated_tokens - old.generated_tokens,
        }
        # new tokens carry the updated policy's log-probs, the earlier ones the old policy's
        batch = adapter.collate([t.sequence], "right")
        now = adapter.token_log_probs(batch, torch.tensor([t.loss_mask]))[0]
        new = [i for i in range(n, len(t.sequence)) if t.loss_mask[i]]
        early = [i for i in range(n) if t.loss_mask[i]]
        assert torch.allclose(now[new], torch.tensor([t.old_log_probs[i] for i in new]), atol=1e-4)
        assert not torch.allclose(now[early], torch.tensor([t.old_log_probs[i] for i in early]), atol=1e-3)
    assert second.metrics["partial_staleness_max"] == 1
    assert 0 < second.metrics["partial_old_token_fraction"] < 1


def test_mid_turn_pauses_never_reuse_a_key(policy, questions, monkeypatch):
    items = items_of(questions, ["detail", "global", "global", "global", "global", "global", "global"])
    cfg = config(over_provision=1.0, segment_tokens=4, max_staleness=20)
    runner = CarriedGroups(policy, questions, cfg, target_groups=2, group_size=G, seed=2)
    drawn = []
    real = policy.generate_turn

    def generate_turn(sequences, max_new_tokens, keys=None, **kwargs):
        out = real(sequences, max_new_tokens, keys=keys, **kwargs)
        drawn.extend((k, len(ids)) for k, ids in zip(keys, out.token_ids, strict=True))
        return out

    monkeypatch.setattr(policy, "generate_turn", generate_turn)
    draw = sampler(items)
    zoom, paused = None, []
    for step in range(12):
        out = carried_step(runner, step, draw)
        if items[0] in out.items:
            zoom = out.groups[out.items.index(items[0])]
            break
        paused.append(any(m.trajectory.turn_ids for g in runner.groups.groups for m in g.members))
    assert zoom is not None and zoom.launch_step == 0
    assert any(paused)  # steps ended with a turn paused mid-way
    t = zoom.members[0].trajectory
    assert t.turns == 2 and t.used_tool and t.calls > t.turns  # the tool call took several calls
    keys = [k for k, _ in drawn]
    assert len(set(keys)) == len(keys)  # each call of each conversation has its own key
    for j, member in enumerate(zoom.members):  # every call of the zoom, in any step, has its launch key
        nodes = sorted(k.node for k in keys if (k.step, k.prompt) == (0, j))
        assert nodes == list(range(member.trajectory.calls))


def test_the_staleness_cap_drops_counts_and_relaunches(policy, questions):
    items = items_of(questions, ["detail", "global", "global", "global", "global", "global", "global"])
    runner = CarriedGroups(policy, questions, config(over_provision=1.0, max_staleness=0), 2, G, seed=3)
    carried_step(runner, 0, sampler(items))
    carried = [g.item for g in runner.groups.groups]
    assert items[0] in carried
    out = carried_step(runner, 1, sampler(items[4:]))
    # every carried group would train 1 version behind: all dropped, counted and launched again first
    assert out.metrics["partial_dropped"] == G * len(carried) == out.metrics["partial_dropped_total"]
    relaunched = sorted((g.slot, g.item, g.launch_step) for g in [*out.groups, *runner.groups.groups])
    assert relaunched[: len(carried)] == [(slot, item, 1) for slot, item in enumerate(carried)]
    assert all(g.staleness(1) == 0 for g in out.groups)


@pytest.mark.parametrize("segment_tokens", [0, 4])
def test_state_dict_rebuilds_identical_conversations(policy, questions, tmp_path, segment_tokens):
    items = items_of(questions, ["detail", "global", "global", "global", "detail", "global", "global"])
    cfg = config(over_provision=1.0, segment_tokens=segment_tokens)
    runner = CarriedGroups(policy, questions, cfg, target_groups=2, group_size=G, seed=4)
    carried_step(runner, 0, sampler(items))
    assert any(not g.complete for g in runner.groups.groups)
    state = runner.state_dict()
    assert {k for k, v in state.items() if isinstance(v, torch.Tensor)} == set(CarriedGroups.TENSOR_KEYS)
    save_checkpoint(tmp_path, 0, {"partial": state})
    (path,) = tmp_path.iterdir()
    restored = CarriedGroups(policy, questions, cfg, target_groups=2, group_size=G, seed=4)
    restored.load_state_dict(load_checkpoint(path).state["partial"])

    pairs = [
        (a, b)
        for x, y in zip(runner.groups.groups, restored.groups.groups, strict=True)
        for a, b in zip(x.members, y.members, strict=True)
    ]
    assert len(pairs) == 2 * G
    assert all(same_conversation(a.trajectory, b.trajectory) for a, b in pairs)
    assert all(a.key == b.key and a.tokens_by_version == b.tokens_by_version for a, b in pairs)
    if segment_tokens:
        assert any(a.trajectory.turn_ids for a, _ in pairs)  # a turn paused mid-way came back open

    rest = items[4:]
    outs = [carried_step(r, 1, sampler(rest)) for r in (runner, restored)]
    assert outs[0].items == outs[1].items and outs[0].metrics == outs[1].metrics
    assert all(
        same_conversation(a, b) for a, b in zip(outs[0].trajectories, outs[1].trajectories, strict=True)
    )


def test_a_state_from_other_settings_is_refused(policy, questions):
    items = items_of(questions, ["detail", "global", "global", "global"])
    runner = CarriedGroups(policy, questions, config(over_provision=1.0), 2, G, seed=4)
    carried_step(runner, 0, sampler(items))
    state = runner.state_dict()
    with pytest.raises(ValueError, match="groups of 2"):
        CarriedGroups(policy, questions, config(over_provision=1.0), 2, 3, seed=4).load_state_dict(state)
    other = ToolRolloutConfig(
        crop_min_size=400, partial=PartialRolloutConfig(enabled=True, over_provision=1.0)
    )
    with pytest.raises(ValueError, match="replays to"):
        CarriedGroups(policy, questions, other, 2, G, seed=4).load_state_dict(state)


def test_a_resumed_partial_run_repeats_the_uninterrupted_one(tmp_path):
    args = [
        "progress=false",
        "data.train_size=32",
        "data.heldout_size=4",
        "eval_modes=[auto]",
        "train.questions_per_step=2",
        "train.group_size=2",
        "train.lr=1e-3",
        "checkpoint_every=2",
        "rollout.partial.enabled=true",
        "rollout.partial.over_provision=1.0",
    ]

    def run(out, steps, *extra):
        assert main(["train", "vlm/tool_grpo", f"output_dir={out}", f"steps={steps}", *args, *extra]) == 0
        return metric_rows(out), load(out / "model").model.state_dict()

    straight_rows, straight = run(tmp_path / "straight", 3)
    assert {"partial_staleness_mean", "partial_old_token_fraction", "partial_dropped"} <= set(
        straight_rows[0]
    )
    run(tmp_path / "stopped", 2)
    carried = load_checkpoint(tmp_path / "stopped" / "checkpoints" / "step_00000002").state["trainer"][
        "partial"
    ]
    assert len(carried["items"]) > 0 and (carried["ended"] == 0).any()  # unfinished conversations were saved
    resumed_rows, resumed = run(tmp_path / "stopped", 3, "resume=true")
    assert resumed_rows == straight_rows
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_bench_rows_put_partial_and_synchronous_side_by_side(policy, capsys):
    from vlm_rl.bench.rollout_speed import _partial_rows

    sync, partial = _partial_rows(policy, groups=2, steps=2)
    assert (sync["variant"], partial["variant"]) == ("synchronous rollouts", "partial rollouts (APRIL)")
    assert sync["tokens"] > 0 and partial["tokens"] > 0 and "ratio" not in sync
    assert partial["ratio"] == partial["tokens_per_second"] / sync["tokens_per_second"]
    assert partial["target"] == 1.2 and partial["target_op"] == ">="
    assert 0 <= partial["old_token_fraction"] <= 1 and partial["staleness_max"] <= 2
    assert "partial / synchronous" in capsys.readouterr().out


def test_a_group_samples_its_first_tokens_in_its_launch_step(policy, questions):
    # one group trained per step, three in flight: finished groups wait, and would already be enough
    items = items_of(questions, ["global"] * 5)
    runner = CarriedGroups(policy, questions, config(over_provision=2.0), 1, G, seed=7)
    carried_step(runner, 0, sampler(items))
    waiting = [g for g in runner.groups.groups if g.complete]
    assert len(waiting) >= 1
    carried_step(runner, 1, sampler(items[3:]))
    launched = [g for g in runner.groups.groups if g.launch_step == 1]
    assert launched and all(set(m.tokens_by_version) == {1} for g in launched for m in g.members)
