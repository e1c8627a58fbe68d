"""Sol-RL's pieces: the contrastive keep, the exact replay of kept keys, and the rank agreement."""

import math

import pytest
import torch

from diffusion_rl.branch_rollout import ancestors, rollout_trees
from diffusion_rl.models import FlowPipeline
from diffusion_rl.quantized_exploration import (
    KeptLeaves,
    exploration_plan,
    keep_best_and_worst,
    keep_for_replay,
    kendall_tau,
    rank_agreement,
    replay_plan,
)
from diffusion_rl.shapes import train_prompts, vocabulary
from mmrl.cli import load_plugins
from mmrl.config import load_config
from mmrl.precision import explore_precision
from mmrl.tree import RolloutTree
from tests.tiny_flow import SMALL

load_plugins()


def fp4_config(*overrides):
    return load_config(
        "diffusion/branchgrpo_fp4",
        [
            "rollout.steps=6",
            "rollout.split_steps=[0,2]",
            "rollout.guidance_scale=1.0",
            "explore.branch_factor=3",
            "explore.keep=4",
            *overrides,
        ],
    )


def flat_tree(keys):
    """A root with one leaf per key (the leaves' keys are what the keep reads)."""
    tree = RolloutTree(root_state={"key": 0})
    for key in keys:
        tree.add_child(0, state={"key": key})
    return tree


def test_keep_best_and_worst_takes_the_top_and_bottom_halves():
    rewards = torch.tensor([0.5, 0.9, 0.1, 0.7, 0.3, 0.0, 0.8, 0.6])
    # best two: 0.9 (1), 0.8 (6); worst two: 0.0 (5), 0.1 (2); the top four would be 1, 6, 3, 7
    assert keep_best_and_worst(rewards, 4) == [1, 2, 5, 6]
    assert keep_best_and_worst(rewards, 2) == [1, 5]
    assert keep_best_and_worst(rewards, 8) == list(range(8))


def test_keep_for_replay_keeps_keys_their_ancestors_and_pool_rewards():
    plan = replay_plan(fp4_config().rollout, fp4_config().explore)  # branch factor 3
    trees = [flat_tree([1, 2, 3]), flat_tree([1, 2, 3])]
    rewards = torch.tensor([0.2, 0.9, 0.5, 0.7, 0.1, 0.3])
    kept = keep_for_replay(plan, trees, rewards, keep=2)
    assert kept.skeletons == [{0, 2, 1}, {0, 1, 2}]
    assert kept.pool_rewards == pytest.approx({(0, 2): 0.9, (0, 1): 0.2, (1, 1): 0.7, (1, 2): 0.1})
    # a deeper key brings its whole path: key 7 = child 0 of key 2 = child 1 of the root
    assert ancestors(plan, [7]) == {0, 2, 7}


def test_plans_of_pool_and_replay():
    cfg = fp4_config("rollout.steps=8", "rollout.split_steps=[0,2,4]", "explore.steps=4")
    pool, replay = exploration_plan(cfg.rollout, cfg.explore), replay_plan(cfg.rollout, cfg.explore)
    assert (pool.steps, pool.split_steps, pool.branch_factor) == (4, [0, 1, 2], 3)
    assert (replay.steps, replay.split_steps, replay.branch_factor) == (8, [0, 2, 4], 3)
    assert len(replay.leaf_keys()) == len(pool.leaf_keys()) == 27


def test_kendall_tau_known_values():
    assert kendall_tau(torch.tensor([1.0, 2, 3]), torch.tensor([10.0, 20, 30])) == 1.0
    assert kendall_tau(torch.tensor([1.0, 2, 3]), torch.tensor([3.0, 2, 1])) == -1.0
    assert kendall_tau(torch.tensor([1.0, 2, 3, 4]), torch.tensor([1.0, 2, 4, 3])) == pytest.approx(4 / 6)
    # by hand: pairs (0,1) concordant, (0,2) concordant, (0,3) discordant, (1,2) tied in b (0),
    # (1,3) discordant, (2,3) discordant: (2 - 3) / 6
    a, b = torch.tensor([0.1, 0.4, 0.3, 0.9]), torch.tensor([1.0, 5.0, 5.0, 0.0])
    assert kendall_tau(a, b) == pytest.approx(-1 / 6)
    assert math.isnan(kendall_tau(torch.tensor([1.0]), torch.tensor([2.0])))


def test_rank_agreement_pairs_each_replayed_leaf_with_its_pool_reward():
    trees = [flat_tree([4, 1, 2])]  # replay order differs from the pool's order of keys
    kept = KeptLeaves(skeletons=[{0, 1, 2, 4}], pool_rewards={(0, 1): 0.1, (0, 2): 0.2, (0, 4): 0.4})
    assert rank_agreement(kept, trees, torch.tensor([9.0, 1.0, 2.0])) == 1.0
    assert rank_agreement(kept, trees, torch.tensor([0.0, 2.0, 1.0])) == pytest.approx(-1.0)


def test_replay_of_kept_keys_is_the_full_precision_sample_of_those_keys():
    cfg = fp4_config()
    torch.manual_seed(0)
    pipe = FlowPipeline.tiny(vocabulary(), SMALL)
    prompts = train_prompts()[:2]
    cond, uncond = pipe.encode_prompts(prompts), pipe.encode_prompts([""])[[0, 0]]
    pool_plan, full_plan = exploration_plan(cfg.rollout, cfg.explore), replay_plan(cfg.rollout, cfg.explore)

    def rollout(plan, skeletons=None):
        return rollout_trees(pipe, cond, uncond, [0, 1], plan, cfg.rollout, cfg.seed, 3, skeletons)

    with explore_precision(pipe.denoiser, cfg.explore.precision):
        pool, pool_leaves, _ = rollout(pool_plan)
    rewards = pool_leaves.flatten(1).mean(1)  # any score of the low-precision images
    kept = keep_for_replay(pool_plan, pool, rewards, cfg.explore.keep)
    replay, replay_leaves, _ = rollout(full_plan, kept.skeletons)
    fresh, fresh_leaves, _ = rollout(full_plan)  # every leaf in full precision, no skeleton

    fresh_by_key = {
        (t, tree.nodes[leaf].state["key"]): fresh_leaves[t * 9 + i]
        for t, tree in enumerate(fresh)
        for i, leaf in enumerate(tree.leaves())
    }
    replayed = [(t, tree.nodes[leaf].state["key"]) for t, tree in enumerate(replay) for leaf in tree.leaves()]
    assert sorted(replayed) == sorted(kept.pool_rewards)
    assert len(replayed) == 2 * cfg.explore.keep
    expected = torch.stack([fresh_by_key[key] for key in replayed])
    # the same keyed noise; batched matmuls of other batch sizes round differently in float32
    torch.testing.assert_close(replay_leaves, expected, rtol=0, atol=1e-5)
    # and the replay is not the low-precision pool's sample of the key
    pool_by_key = {
        (t, tree.nodes[leaf].state["key"]): pool_leaves[t * 9 + i]
        for t, tree in enumerate(pool)
        for i, leaf in enumerate(tree.leaves())
    }
    assert not torch.allclose(replay_leaves, torch.stack([pool_by_key[key] for key in replayed]), atol=1e-4)
