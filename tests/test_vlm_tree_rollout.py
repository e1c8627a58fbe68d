"""Tree rollouts of the pixel-tool trainer (TreePO-style): a flat group is the depth-1 tree, leaf quotas
and refills, shared prefixes, per-token node advantages, the update's direction, the recipe end to end."""

import json
import math

import pytest
import torch

from mmrl.advantages import tree_depthwise
from mmrl.cli import load_plugins, main
from mmrl.config import ConfigError, load_config
from mmrl.noise import NoiseKey
from mmrl.registry import ADVANTAGES
from mmrl.tree import fused_node_advantages
from vlm_rl.config import DEFAULT_MODEL, ToolRolloutConfig, TreeRolloutConfig
from vlm_rl.conversation import prompt_segment
from vlm_rl.data import DataConfig, QuestionSet, task_vocabulary, tool_call_text
from vlm_rl.loading import load
from vlm_rl.models import IM_END, TOOL_CALL_END, Generation, VLMAdapter, shared_prefixes
from vlm_rl.rollout import rollout, tree_rollout
from vlm_rl.schedules import StepGroups
from vlm_rl.trainer import ToolGRPOTrainer, load_policy

load_plugins()

DATA = DataConfig(heldout_size=8, train_size=16)
ANSWER = "<answer>B</answer><|im_end|>"
TOOL = tool_call_text((0.0, 0.0, 0.5, 0.5))
TINY = [
    "progress=false",
    "data.train_size=16",
    "data.heldout_size=4",
    "eval_every=0",
    "eval_modes=[auto]",
    "train.questions_per_step=2",
    "train.group_size=4",
]


@pytest.fixture(scope="module")
def policy():
    """The shipped base: it zooms and answers, so trees branch at real turn ends."""
    return load_policy(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def questions():
    heldout = QuestionSet(DATA, "heldout")
    return [heldout[i] for i in range(4)]


def tree_cfg(branching, segment_tokens=0, **rollout):
    tree = TreeRolloutConfig(enabled=True, branching=branching, segment_tokens=segment_tokens)
    return ToolRolloutConfig(**rollout, tree=tree)


class ScriptedEngine:
    """A turn generator that writes `script(prompt index, call)` for a row keyed (.., prompt, call),
    with log-probs that name the key, and checks and records what the tree rollout asks of it."""

    def __init__(self, adapter, script):
        self.adapter, self.script, self.calls = adapter, script, []

    def generate_turn(self, sequences, max_new_tokens, keys=None, prefix_groups=None, **_):
        distinct, _ = shared_prefixes(sequences, prefix_groups)  # raises unless groups hold one sequence
        self.calls.append(([(k.prompt, k.node) for k in keys], list(prefix_groups)))
        stops = self.adapter.token_ids_of([IM_END, TOOL_CALL_END])
        ids, log_probs, stopped = [], [], []
        for key in keys:
            row = self.adapter.segment(self.script(key.prompt, key.node)).token_ids[:max_new_tokens]
            ids.append(row)
            log_probs.append(-(key.prompt + 1) - 0.01 * key.node - 0.001 * torch.arange(len(row)))
            stopped.append(row[-1] in stops)
        prefill = sum(len(sequences[i]) for i in distinct)
        return Generation(ids, log_probs, stopped, prefill)


def test_a_flat_branching_is_the_flat_rollout(policy, questions, monkeypatch):
    """branching [G]: the same tokens and log-probs as `rollout` under the same keys; only the first
    turn's prompt is prefilled once per question instead of G times."""
    g, slots, cfg = 4, [0, 3, 1, 2], tree_cfg([4])
    tree = tree_rollout(policy, questions, cfg, StepGroups(seed=7, step=2, group_size=g, slots=slots))
    keys = [NoiseKey(7, 2, s * g + j, 0) for s in slots for j in range(g)]
    prefilled, generate_turn = [], policy.generate_turn

    def counted(*args, **kwargs):
        out = generate_turn(*args, **kwargs)
        prefilled.append(out.prefill_tokens)
        return out

    monkeypatch.setattr(policy, "generate_turn", counted)
    flat = rollout(policy, [q for q in questions for _ in range(g)], cfg, keys)
    assert [t.ended for t in tree.leaves] == [t.ended for t in flat]
    assert any(t.turns > 1 for t in flat)  # the comparison covers tool turns
    for leaf, conversation in zip(tree.leaves, flat, strict=True):
        assert leaf.sequence.token_ids == conversation.sequence.token_ids
        assert leaf.loss_mask == conversation.loss_mask and leaf.turns == conversation.turns
        assert leaf.answer_text == conversation.answer_text
        assert torch.allclose(
            torch.tensor(leaf.old_log_probs), torch.tensor(conversation.old_log_probs), atol=1e-5
        )
    assert all(len(t) == g + 1 and t.depth == 1 for t in tree.trees)
    assert tree.branch_points == len(questions)  # each root's split
    assert tree.decoded_tokens == sum(t.generated_tokens for t in flat)
    prompts = sum(len(prompt_segment(policy, q, None)) for q in questions)
    assert tree.prefill_tokens == sum(prefilled) - (g - 1) * prompts


@pytest.mark.parametrize(("branching", "group_size"), [([2, 2], 4), ([4, 2], 8), ([3], 8), ([2, 2], 8)])
def test_every_question_ends_with_its_group_of_leaves(policy, questions, branching, group_size):
    """Slots are shared out in order at every split, a branch that ends early hands its spare slots
    back as a fresh branch of its parent, and each slot ends in exactly one leaf."""
    tree = tree_rollout(policy, questions, tree_cfg(branching), StepGroups(0, 1, group_size, [0, 1, 2, 3]))
    assert len(tree.leaves) == len(questions) * group_size and all(t.ended for t in tree.leaves)
    refills = 0
    for i, t in enumerate(tree.trees):
        leaves = tree.leaf_nodes[i * group_size : (i + 1) * group_size]
        assert sorted(leaves) == t.leaves()
        assert [t.nodes[n].state.slots for n in leaves] == [range(j, j + 1) for j in range(group_size)]
        assert t.nodes[0].state.slots == range(group_size)
        for node in t.nodes:
            if node.is_leaf:
                continue
            owned = [j for child in node.children for j in t.nodes[child].state.slots]
            assert sorted(owned) == list(node.state.slots)
            split = min(branching[node.depth] if node.depth < len(branching) else 1, len(node.state.slots))
            assert len(node.children) >= split
            refills += len(node.children) - split
        for k in range(i * group_size, (i + 1) * group_size):  # a leaf's tokens are its path's segments
            path = [0] + [edge.child for edge in t.path_to(tree.leaf_nodes[k])]
            nodes = tree.token_nodes[k]
            assert len(nodes) == len(tree.leaves[k].sequence) and list(dict.fromkeys(nodes)) == path
    assert refills > 0, "no branch ended early, so no refill was tested"


def test_leaves_of_a_split_share_the_parent_exactly(policy, questions):
    g = 8
    tree = tree_rollout(policy, questions, tree_cfg([4, 2]), StepGroups(0, 1, g, [0, 1, 2, 3]))
    splits = 0
    for i, t in enumerate(tree.trees):
        for parent in t.nodes[1:]:
            if parent.is_leaf:
                continue
            splits += 1
            start, end = parent.state.span
            before = parent.state.trajectory
            leaves = [
                tree.leaves[k] for k in range(i * g, (i + 1) * g) if parent.node_id in tree.token_nodes[k]
            ]
            assert len(leaves) == len(parent.state.slots) >= 2
            for leaf in leaves:  # the parent's tokens, log-probs and mask, exactly
                assert leaf.sequence.token_ids[:end] == before.sequence.token_ids
                assert leaf.old_log_probs[:end] == before.old_log_probs
                assert leaf.loss_mask[:end] == before.loss_mask
            sampled = [
                p
                for m, p in zip(before.loss_mask[start:end], before.old_log_probs[start:end], strict=True)
                if m
            ]
            assert torch.equal(parent.old_logp, torch.tensor(sampled))
    assert splits > 0


def test_siblings_sample_afresh(questions):
    """Every split's children draw their own tokens (an untrained model, split every 3 tokens)."""
    model = VLMAdapter.tiny(task_vocabulary(DATA, samples=50))
    cfg = tree_cfg([2, 2, 2], segment_tokens=3, max_new_tokens=9)
    tree = tree_rollout(model, questions[:2], cfg, StepGroups(0, 0, 8, [0, 1]))
    groups = 0
    for t in tree.trees:
        for parent in t.nodes:
            kids = [t.nodes[c].state for c in parent.children]
            firsts = {tuple(kid.trajectory.sequence.token_ids[kid.start : kid.span[1]]) for kid in kids}
            assert len(firsts) == len(kids)
            groups += len(kids) > 1
    assert groups == 2 * (1 + 2 + 4)


def test_quota_refill_keys_prefix_groups_and_node_advantages(policy, questions):
    """A hand-checked tree: G = 4, branching [2, 2]. Branch A (slots 0-1) zooms, then splits in two
    answers; branch B (slots 2-3) answers at once, so slot 3 comes back as a fresh branch R of the
    root. Rewards 1, 0, 0, 0 give A > B = R at depth 1 and A0 > A1 at depth 2."""
    g, s = 4, 5

    def script(prompt, call):
        return TOOL if (prompt - s * g, call) == (0, 0) else ANSWER

    engine = ScriptedEngine(policy, script)
    tree = tree_rollout(policy, questions[:1], tree_cfg([2, 2]), StepGroups(0, 0, g, [s]), engine=engine)
    (t,) = tree.trees
    root, a, b, a0, a1, r = range(6)
    assert [(n.parent_id, list(n.state.slots)) for n in t.nodes[1:]] == [
        (root, [0, 1]),
        (root, [2]),  # it owned 2-3 and handed 3 back
        (a, [0]),
        (a, [1]),
        (root, [3]),
    ]
    assert tree.leaf_nodes == [a0, a1, b, r] and tree.branch_points == 2
    # keys: (prompt s*G + first slot, calls along the path); fresh siblings share one prefix group
    assert engine.calls == [
        ([(20, 0), (22, 0)], [0, 0]),
        ([(20, 1), (21, 1), (23, 0)], [0, 0, 1]),
    ]
    prompt = len(prompt_segment(policy, questions[0], None))
    assert tree.prefill_tokens == prompt + len(t.nodes[a].state.trajectory.sequence) + prompt
    assert tree.decoded_tokens == len(policy.segment(TOOL)) + 4 * len(policy.segment(ANSWER))
    assert [leaf.turns for leaf in tree.leaves] == [2, 2, 1, 1] and all(
        x.ended == "answer" for x in tree.leaves
    )
    assert tree.leaves[0].used_tool and not tree.leaves[3].used_tool

    tree.set_leaf_rewards(torch.tensor([1.0, 0.0, 0.0, 0.0]))
    node_adv = fused_node_advantages(tree.trees, tree_depthwise, "mean", clip=5.0)
    # BranchGRPO's unbiased std per depth: fused A = 0.5, B = R = 0 at depth 1; A0 = 1, A1 = 0 at depth 2
    std1, std2 = math.sqrt(((0.5 - 1 / 6) ** 2 + 2 * (1 / 6) ** 2) / 2), math.sqrt(0.5)
    expected = {a: (1 / 3) / std1, b: -(1 / 6) / std1, r: -(1 / 6) / std1, a0: 0.5 / std2, a1: -0.5 / std2}
    assert {n: node_adv[(0, n)] for n in expected} == pytest.approx(expected, rel=1e-4)
    per_token = tree.token_advantages(node_adv)
    for k, leaf in enumerate(tree.leaves):
        nodes = tree.token_nodes[k]
        for position, (node, sampled) in enumerate(zip(nodes, leaf.loss_mask, strict=True)):
            assert per_token[k][position] == pytest.approx(0.0 if node == root else expected[node], rel=1e-4)
            assert not sampled or node != root
    # leaf A0: its zoom turn (and the crop shown after it) carries A's advantage, its answer A0's
    zoom = len(policy.segment(TOOL))
    assert per_token[0][prompt : prompt + zoom].tolist() == pytest.approx([expected[a]] * zoom, rel=1e-4)
    assert per_token[0][-4:].tolist() == pytest.approx([expected[a0]] * 4, rel=1e-4)


def test_a_turn_goes_on_across_segments_and_truncates_at_max_new_tokens(policy, questions):
    """segment_tokens splits inside a turn; the children finish the same turn (one turn, its text
    whole), and only the turn's max_new_tokens truncates it."""

    def script(prompt, call):
        return ["<answer>", "B", "</answer>", "<|im_end|>"][call]  # one token a call

    cfg = tree_cfg([1, 2], segment_tokens=1)
    tree = tree_rollout(
        policy, questions[:1], cfg, StepGroups(0, 0, 2, [0]), engine=ScriptedEngine(policy, script)
    )
    assert [x.turns for x in tree.leaves] == [1, 1] and [x.ended for x in tree.leaves] == ["answer"] * 2
    assert [x.answer for x in tree.leaves] == ["B", "B"] and tree.leaves[0].answer_text == ANSWER
    assert [len(n.children) for n in tree.trees[0].nodes] == [1, 2, 0, 0]

    def rambling(prompt, call):
        return "the the the the the the"

    cfg = tree_cfg([1, 2], segment_tokens=3, max_new_tokens=5)
    engine = ScriptedEngine(policy, rambling)
    tree = tree_rollout(policy, questions[:1], cfg, StepGroups(0, 0, 2, [0]), engine=engine)
    assert [x.ended for x in tree.leaves] == ["truncated"] * 2 and [
        x.generated_tokens for x in tree.leaves
    ] == [5, 5]
    assert [keys for keys, _ in engine.calls] == [[(0, 0)], [(0, 1), (1, 1)]]


def trainer_for(tmp_path, recipe, *overrides):
    config = load_config(recipe, [*TINY, f"output_dir={tmp_path}", *overrides])
    trainer = ToolGRPOTrainer(config)
    trainer.prepare_run_dir()
    trainer.seed_everything()
    trainer.setup()
    return trainer


def test_a_flat_tree_trains_like_the_flat_group(tmp_path):
    """branching [G] with the depthwise estimator gives grpo's loss and update on the same conversations
    (its population-std form, as grpo's; `tree_depthwise`'s unbiased std scales them by sqrt(G/(G-1)))."""
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.0])
    runs = {}
    for name, overrides in {
        "flat": ["train.advantage=grpo"],
        "tree": [
            "rollout.tree.enabled=true",
            "rollout.tree.branching=[4]",
            "train.advantage=tree_depthwise_population_std",
        ],
        "flat_tree_estimator": [
            "train.advantage=tree_depthwise_population_std"
        ],  # flat groups as depth-1 trees
    }.items():
        trainer = trainer_for(tmp_path / name, "vlm/tool_grpo", "train.kl_coef=0.1", *overrides)
        trainer.reward_fn = lambda texts, **kwargs: rewards
        metrics = trainer.train_step(0)
        runs[name] = metrics, trainer.adapter.model.state_dict()
    (flat, flat_weights), (tree, tree_weights) = runs["flat"], runs["tree"]
    assert flat["trained_sequences"] == tree["trained_sequences"] == 8
    assert tree["loss"] == pytest.approx(flat["loss"], rel=1e-4, abs=1e-7) and flat["loss"] != 0
    assert tree["kl"] == pytest.approx(flat["kl"], rel=1e-4, abs=1e-9)
    for key in ("accuracy", "tool_ratio", "tokens_per_answer", "reward", "groups_kept"):
        assert tree[key] == flat[key]
    assert {"prefill_tokens", "decoded_tokens", "tree_nodes", "branch_points"} <= set(tree)
    assert not {"prefill_tokens", "tree_nodes"} & set(flat)
    assert all(torch.allclose(tree_weights[k], flat_weights[k], atol=1e-6) for k in flat_weights)
    assert runs["flat_tree_estimator"][0]["loss"] == pytest.approx(flat["loss"], rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("advantage", ["tree_depthwise", "grpo"], ids=["node-credit", "flat-credit"])
@pytest.mark.parametrize("sign", [1, -1])
def test_a_rewarded_leaf_becomes_more_likely(tmp_path, sign, advantage):
    """Leaf 0 alone rewarded (sign 1) or alone not (sign -1): every sampled token of it gets an
    advantage of that sign, through the tree's node advantages or as its leaf's group advantage, and
    one update raises its log-prob, or lowers it."""
    trainer = trainer_for(
        tmp_path,
        "vlm/tool_grpo_tree",
        f"train.advantage={advantage}",
        "train.questions_per_step=1",
        "rollout.tree.branching=[2,2]",
        "train.kl_coef=0",
        "train.minibatches=1",
        "train.lr=1e-5",
    )
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0] if sign > 0 else [0.0, 1.0, 1.0, 1.0])
    trainer.reward_fn = lambda texts, **kwargs: rewards
    real, seen = trainer.optimise, {}

    def leaf_log_prob(leaf):
        batch = trainer.adapter.collate([leaf.sequence], "right")
        with torch.no_grad():
            return float(trainer.adapter.token_log_probs(batch, torch.tensor([leaf.loss_mask])).sum())

    def optimise(trajectories, advantages, step, prefixes):
        leaf = trajectories[0]
        per_token = advantages[0].expand(len(leaf.loss_mask))  # flat credit: one per sequence
        seen["advantages"] = [a for a, m in zip(per_token.tolist(), leaf.loss_mask, strict=True) if m]
        seen["before"] = leaf_log_prob(leaf)
        out = real(trajectories, advantages, step, prefixes)
        trainer.adapter.model.eval()
        seen["after"] = leaf_log_prob(leaf)
        return out

    trainer.optimise = optimise
    trainer.train_step(0)
    assert seen["advantages"] and all(a * sign > 0 for a in seen["advantages"])
    assert (seen["after"] - seen["before"]) * sign > 0


def test_the_tree_recipe_trains_and_resumes(tmp_path):
    overrides = [*TINY, "rollout.tree.branching=[2,2]", "checkpoint_every=1", "rollout.max_new_tokens=24"]

    def run(out, steps, *extra):
        assert (
            main(["train", "vlm/tool_grpo_tree", f"output_dir={out}", f"steps={steps}", *overrides, *extra])
            == 0
        )
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        weights = load(out / "model").model.state_dict()
        return [{k: v for k, v in r.items() if k != "step_seconds"} for r in rows], weights

    straight_rows, straight = run(tmp_path / "straight", 2)
    assert len(straight_rows) == 2
    for row in straight_rows:
        assert {"prefill_tokens", "decoded_tokens", "tree_nodes", "branch_points", "loss", "accuracy"} <= set(
            row
        )
        assert row["tree_nodes"] >= 1 + 4 and 1 <= row["branch_points"] <= 3
    run(tmp_path / "stopped", 1)
    resumed_rows, resumed = run(tmp_path / "stopped", 2, "resume=true")
    assert resumed_rows == straight_rows
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_tree_rollouts_refuse_what_they_cannot_train():
    with pytest.raises(ConfigError, match="not supported together"):
        load_config("vlm/tool_grpo_tree", ["rollout.partial.enabled=true"])
    with pytest.raises(ConfigError, match="odd number of rollouts per group"):
        load_config("vlm/tool_grpo_tree", ["train.advantage=mc_grpo"])
    load_config("vlm/tool_grpo", ["train.advantage=tree_depthwise"])  # flat groups are depth-1 trees
    load_config("vlm/tool_grpo_tree", ["train.advantage=grpo"])  # flat credit on the tree's leaves


def test_flat_credit_on_a_tree_gives_each_leaf_its_group_advantage(tmp_path):
    """A group estimator on tree rollouts scores each question's leaves as its group, one advantage
    per leaf for its whole answer (shared segments included), as on a flat group with those rewards."""
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.0])
    trainer = trainer_for(
        tmp_path, "vlm/tool_grpo_tree", "train.advantage=grpo", "rollout.tree.branching=[2,2]"
    )
    trainer.reward_fn = lambda texts, **kwargs: rewards
    seen = {}
    trainer.optimise = lambda trajectories, advantages, step, prefixes: seen.update(a=advantages) or {}
    trainer.train_step(0)
    groups = torch.arange(len(rewards)).div(trainer.config.train.group_size, rounding_mode="floor")
    torch.testing.assert_close(seen["a"], ADVANTAGES.get("grpo")(rewards, groups).values)


@pytest.mark.parametrize(
    "rollouts",
    [[], ["rollout.tree.enabled=true", "rollout.tree.branching=[2,2]", "train.advantage=tree_depthwise"]],
    ids=["flat", "tree"],
)
def test_shared_prefix_scoring_trains_like_the_unshared_update(tmp_path, rollouts):
    """train.shared_prefix scores a group's prompt (flat) or a branch (tree) once: same loss, KL and
    weights after a step (one minibatch: sharing deals whole groups into minibatches, so with several
    the minibatches differ), and the shared calls really ran."""
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.0])
    runs = {}
    for shared in (False, True):
        trainer = trainer_for(
            tmp_path / str(shared),
            "vlm/tool_grpo",
            "train.kl_coef=0.1",
            "train.minibatches=1",
            f"train.shared_prefix={shared}",
            *rollouts,
        )
        trainer.reward_fn = lambda texts, **kwargs: rewards
        calls = []

        def counted(*args, calls=calls, score=trainer.adapter.shared_token_log_probs, **kwargs):
            calls.append(args[2])  # the prefix groups
            return score(*args, **kwargs)

        trainer.adapter.shared_token_log_probs = counted
        start = {k: v.clone() for k, v in trainer.adapter.model.state_dict().items()}
        metrics = trainer.train_step(0)
        steps = {k: v - start[k] for k, v in trainer.adapter.model.state_dict().items()}
        runs[shared] = metrics, steps, calls
    (plain, plain_steps, plain_calls), (shared, shared_steps, shared_calls) = runs[False], runs[True]
    assert not plain_calls and shared_calls
    assert any(len(set(groups)) < len(groups) for groups in shared_calls)  # some rows did share
    assert shared["loss"] == pytest.approx(plain["loss"], rel=1e-4, abs=1e-7) and plain["loss"] != 0
    assert shared["kl"] == pytest.approx(plain["kl"], rel=1e-4, abs=1e-9)
    assert shared["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-4)
    # Adam's first step moves every weight by about lr along its gradient's sign, so an element whose
    # gradient is rounding noise may step either way; a gradient that differed beyond rounding would
    # flip many signs, so the steps are compared as a whole
    difference = torch.cat([(shared_steps[k] - plain_steps[k]).flatten() for k in plain_steps]).norm()
    assert difference <= 1e-3 * torch.cat([v.flatten() for v in plain_steps.values()]).norm()


def test_tree_bench_rows_count_prefill_and_trained_tokens(capsys):
    from vlm_rl.bench.tree_steps import tree_vs_flat_rows
    from vlm_rl.eval_benchmarks import resolve_model

    rows = tree_vs_flat_rows(resolve_model(None), steps=1, branching="[2,2]", questions=2, group_size=4)
    flat, shared, tree = rows
    assert [row["variant"] for row in rows] == ["flat groups", "flat, shared prompt", "tree rollouts [2,2]"]
    # the tree prefills each question's prompt once per wave, flat groups once per rollout
    assert min(flat["prefill_tokens"], shared["prefill_tokens"]) > tree["prefill_tokens"] > 0
    assert all(row["trained_tokens"] > 0 and row["seconds"] > 0 for row in rows)
    assert tree["prefill_ratio"] == tree["prefill_tokens"] / flat["prefill_tokens"]
    assert tree["wall_per_trained_token_ratio"] == tree["ms_per_trained_token"] / flat["ms_per_trained_token"]
    assert "tree / flat prefill tokens" in capsys.readouterr().out


def test_flat_shared_prefixes_are_the_prompts_even_without_sampled_tokens():
    from vlm_rl.conversation import Trajectory
    from vlm_rl.models import Segment
    from vlm_rl.trainer import shared_prefixes

    def conversation(mask):
        return Trajectory(Segment(list(range(len(mask)))), mask, [0.0] * len(mask), ("A", "B"), None)

    sampled = conversation([False, False, True, True])
    unsampled = conversation([False, False, False])  # ended at max_tokens before sampling
    assert shared_prefixes([sampled, sampled, unsampled, unsampled], 2) == [(0, 2), (0, 2), (1, 3), (1, 3)]
