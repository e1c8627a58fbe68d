"""Snapshot-branched GRPO groups: a restored snapshot steps exactly like replaying its prefix from reset,
every group ends with G leaves (early ends included), branch noise is keyed by the tree and not by the
env slot, the tree update raises the successful path, and the config refuses what cannot work."""

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch import nn

import vla_rl.methods.grpo
from mmrl.config import ConfigError, load_config
from mmrl.credit import Credit
from mmrl.tree import branch_children, split_slots
from vla_rl.branching import BranchedGroups, BranchPlan, branched_rollouts
from vla_rl.methods.grpo import chunk_batch, update_branched_grpo
from vla_rl.policy import ClippedGaussian, VLAConfig, VLAPolicy, task_vocabulary
from vla_rl.trainer import VLAOnlineTrainer

SIZE = 32
BRANCHED = [
    "rollout.task=Reach",
    "rollout.env_steps=40",
    "rollout.num_envs=4",
    "rollout.group_size=4",
    "rollout.max_episode_steps=16",
    "method=grpo",
    "intervention.enabled=false",
    "grpo.branch_every=2",
    "steps=2",
    "checkpoint_every=1",
    "progress=false",
    "eval.episodes=2",
    "eval.num_envs=2",
    "train.updates=2",
    "train.batch_size=8",
    "train.demo_episodes=0",
]


def replay_from_reset(env, seed, actions):
    """Reset with `seed` and execute `actions`: the observations' arrays, the success and how the
    episode ended (None: it did not end)."""
    obs, _ = env.reset(seed=int(seed))
    states, images, ended, success = [obs["state"]], [obs["image"]], None, False
    for action in actions:
        obs, _, terminated, truncated, info = env.step(action)
        states.append(obs["state"])
        images.append(obs["image"])
        success = bool(info["is_success"])
        if terminated or truncated:
            ended = "terminated" if terminated else "truncated"
            break
    return {"states": np.stack(states), "images": np.stack(images), "success": success, "ended": ended}


# ----- the leaf quota --------------------------------------------------------------------------------


def test_leaf_slots_are_shared_out_evenly_in_order():
    assert split_slots(range(0, 5), 2) == [range(0, 3), range(3, 5)]
    assert split_slots(range(3, 10), 3) == [range(3, 6), range(6, 8), range(8, 10)]
    assert split_slots(range(2, 3), 1) == [range(2, 3)]
    with pytest.raises(ValueError, match="cannot share 2 leaf slots out to 3 children"):
        split_slots(range(2), 3)
    # children by depth, 1 past the list, never more than the slots a node owns
    assert [branch_children([4, 2], d, 3) for d in range(3)] == [3, 2, 1]


# ----- a toy env and policy: fast, and exactly independent of batch composition ----------------------


class ToyWalk(gym.Env):
    """A point on a line: the first action entry moves it; past +1 is a success, past -1 a failure
    (both end the episode early), otherwise the time limit ends it. Saves and restores its state."""

    observation_space = gym.spaces.Dict(
        {
            "state": gym.spaces.Box(-np.inf, np.inf, (9,), np.float32),
            "image": gym.spaces.Box(0, 255, (4, 4, 3), np.uint8),
        }
    )
    action_space = gym.spaces.Box(-1.0, 1.0, (5,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.position, self.t = float(self.np_random.uniform(-0.5, 0.5)), 0
        return self._obs(), {"instruction": "reach", "is_success": False}

    def step(self, action):
        self.position += 0.35 * float(action[0])
        self.t += 1
        success, failure = self.position > 1.0, self.position < -1.0
        return self._obs(), float(success), success or failure, False, {"is_success": success}

    def _obs(self):
        state = np.zeros(9, np.float32)
        state[:2] = self.position, self.t
        return {"state": state, "image": np.full((4, 4, 3), self.t % 256, np.uint8)}

    def snapshot(self):
        return self.position, self.t

    def restore(self, snapshot):
        self.position, self.t = snapshot


def toy_envs(n: int, limit: int = 12) -> list[gym.Env]:
    return [gym.wrappers.TimeLimit(ToyWalk(), limit) for _ in range(n)]


class ToyPolicy(nn.Module):
    """Element-wise in each row (so a row's output does not depend on the batch around it): the mean
    pulls the point back towards 0."""

    config = VLAConfig(vocabulary=task_vocabulary(), horizon=4, n_action_steps=2)

    def __init__(self) -> None:
        super().__init__()
        self.log_std = nn.Parameter(torch.zeros(()))

    def prepare(self, batch, instructions):
        return {"state": torch.as_tensor(batch["state"])}

    def forward(self, inputs):
        mean = -0.2 * inputs["state"][:, :1, None].expand(-1, 4, 5)
        return ClippedGaussian(mean, self.log_std.exp().expand_as(mean))


def toy_groups(plan: BranchPlan, num_envs: int, first_index: int = 0) -> BranchedGroups:
    return branched_rollouts(
        ToyPolicy(), toy_envs(num_envs), [5, 6, 7], [50, 60, 70], plan, (0, 3, first_index), std_scale=1.0
    )


@pytest.mark.parametrize(
    ("group_size", "every", "branching"),
    [(4, 1, (2, 2)), (5, 3, (2, 2)), (3, 1, (4,)), (4, 1, (1,)), (6, 1, (2, 3, 2))],
)
def test_every_group_ends_with_group_size_leaves_despite_early_ends(group_size, every, branching):
    plan = BranchPlan(group_size, every, branching)
    out = toy_groups(plan, num_envs=3)
    assert len(out.leaves) == 3 * group_size
    handed_back = 0
    for t, tree in enumerate(out.trees):
        # every leaf slot ends in exactly one leaf
        assert sorted(tree.nodes[n].state.slots.start for n in tree.leaves()) == list(range(group_size))
        for node in tree.nodes[1:]:
            slots, parent = node.state.slots, tree.nodes[node.parent_id].state.slots
            assert parent.start <= slots.start and slots.stop <= parent.stop
            edge = node.state.edge
            assert len(node.old_logp) == len(edge.decisions)  # one old log-prob per executed chunk
            if not node.is_leaf:  # a branch point: `every` whole chunks, then the split
                assert not edge.terminated and edge.chunk_step.tolist() == [0, 1] * every
        # a leaf that ended owning spare slots handed them back as one more child of its parent
        spare = sum(len(tree.nodes[n].state.slots) > 1 for n in tree.leaves())
        extra = sum(
            len(node.children) - branch_children(branching, node.depth, len(node.state.slots))
            for node in tree.nodes
            if node.children
        )
        assert extra == spare
        handed_back += spare
        for slot in range(group_size):  # each leaf is a whole episode, the same as replayed from reset
            leaf = out.leaves[t * group_size + slot]
            assert leaf.group == [50, 60, 70][t] and leaf.seed == [5, 6, 7][t]
            replay = replay_from_reset(toy_envs(1)[0], leaf.seed, leaf.actions)
            assert replay["ended"] == ("terminated" if leaf.terminated else "truncated")
            assert replay["success"] == leaf.success
            np.testing.assert_array_equal(replay["states"], leaf.states)
    assert any(leaf.terminated and leaf.length < 12 for leaf in out.leaves)  # early ends happened
    assert any(leaf.length == 12 for leaf in out.leaves)  # and time limits
    if branching == (1,):  # a chain: every leaf but the last handed the rest back to the root
        assert handed_back == 3 * (group_size - 1)
    if every == 3:  # long branches: some end early while they still own several slots
        assert handed_back > 0
    edge_steps = sum(len(e.actions) for *_, e in out.edges())
    assert out.env_steps == edge_steps <= sum(leaf.length for leaf in out.leaves)


def test_branch_noise_depends_on_the_tree_not_on_the_env_slot():
    plan = BranchPlan(4, 1, (2, 2))
    one, many = toy_groups(plan, num_envs=1), toy_groups(plan, num_envs=4)
    for a, b in zip(one.leaves, many.leaves, strict=True):
        np.testing.assert_array_equal(a.actions, b.actions)
    assert one.env_steps == many.env_steps
    # the same groups at another index of the iteration draw other noise: the keys matter
    moved = toy_groups(plan, num_envs=4, first_index=3)
    assert any(
        not np.array_equal(a.actions, b.actions) for a, b in zip(one.leaves, moved.leaves, strict=True)
    )


def test_snapshots_need_an_env_that_can_save_its_state():
    from sim.env import restore_env, snapshot_env, snapshot_error

    env = gym.make("CartPole-v1")
    assert "CartPoleEnv cannot save and restore its state" in snapshot_error(env)
    with pytest.raises(TypeError, match="snapshot branching needs a MuJoCo env with get/set state"):
        snapshot_env(env)
    toy = toy_envs(1)[0]
    toy.reset(seed=0)
    with pytest.raises(ValueError, match="taken through 1 time-limit wrappers, this env has 0"):
        restore_env(ToyWalk(), snapshot_env(toy))


# ----- MuJoCo: snapshots against replays from reset --------------------------------------------------


@pytest.mark.needs_rendering
@pytest.mark.parametrize("task", ["Reach", "Push", "PickPlace"])
def test_a_restored_snapshot_steps_exactly_like_replaying_its_prefix(task):
    """Reset, run a prefix, snapshot; restore into another env that ran something else; step actions A.
    Everything must equal resetting a third env and replaying prefix + A: observations (camera
    included), rewards, success, the end of the episode at the time limit, the full physics state."""
    import mujoco

    import sim
    from sim.env import restore_env, snapshot_env

    kwargs = {"obs_mode": "state+rgb", "image_size": 24, "randomize": True, "max_episode_steps": 40}
    source, branch, replay = (sim.make(task, **kwargs) for _ in range(3))
    rng = np.random.default_rng(1)
    prefix, tail = rng.uniform(-1, 1, (15, 5)), rng.uniform(-1, 1, (40, 5))
    source.reset(seed=3)
    for action in prefix:
        source.step(action)
    snapshot = snapshot_env(source)
    branch.reset(seed=8)
    for action in tail[:7]:
        branch.step(action)
    restore_env(branch, snapshot)
    replay.reset(seed=3)
    for action in prefix:
        replay.step(action)
    steps = 0
    for action in tail:
        a, b = branch.step(action), replay.step(action)
        for key in ("state", "image"):
            np.testing.assert_array_equal(a[0][key], b[0][key])
        assert a[1:4] == b[1:4] and a[4]["is_success"] == b[4]["is_success"]
        steps += 1
        if a[2] or a[3]:
            break
    assert steps == 25 and a[3]  # the time limit came from the snapshot's step counter
    physics = []
    for env in (branch, replay):
        base = env.unwrapped
        state = np.empty(mujoco.mj_stateSize(base.model, mujoco.mjtState.mjSTATE_INTEGRATION))
        mujoco.mj_getState(base.model, base.data, state, mujoco.mjtState.mjSTATE_INTEGRATION)
        physics.append(state)
    np.testing.assert_array_equal(*physics)
    for env in (source, branch, replay):
        env.close()


def tiny_policy_dir(tmp_path):
    torch.manual_seed(0)
    config = VLAConfig(vocabulary=task_vocabulary(), image_size=SIZE, channels=[8, 8], keypoints=8,
                       hidden=32, horizon=4, n_action_steps=2)  # fmt: skip
    VLAPolicy(config).save_pretrained(tmp_path / "base")
    return tmp_path / "base"


def branched_trainer(tmp_path, *overrides) -> VLAOnlineTrainer:
    config = load_config(
        "vla/habc",
        [f"output_dir={tmp_path / 'run'}", f"model.path={tiny_policy_dir(tmp_path)}", *BRANCHED, *overrides],
    )
    trainer = VLAOnlineTrainer(config)
    trainer.setup()
    return trainer


@pytest.mark.needs_rendering
def test_branched_robot_episodes_equal_replaying_their_actions_from_reset(tmp_path):
    trainer = branched_trainer(tmp_path)
    groups = trainer.collect_branched(0)
    assert len(groups.leaves) % 4 == 0 and groups.branch_points > 0
    assert groups.env_steps < sum(len(leaf.actions) for leaf in groups.leaves)  # prefixes ran once
    for leaf in groups.leaves:
        replay = replay_from_reset(trainer.envs[0], leaf.seed, leaf.actions)
        np.testing.assert_array_equal(replay["states"], leaf.states)
        np.testing.assert_array_equal(replay["images"], leaf.images)
        assert replay["success"] == leaf.success and replay["ended"] == (
            "terminated" if leaf.terminated else "truncated"
        )
    for env in trainer.envs:
        env.close()


def edge_logps(trainer: VLAOnlineTrainer, edges) -> torch.Tensor:
    """Per edge: the summed log-prob of the actions executed from its chunks under the current policy."""
    totals = []
    with torch.no_grad():
        for edge in edges:
            items = [(0, t0, k) for t0, k in edge.decisions]
            inputs, actions, mask, _ = chunk_batch(trainer.policy, [edge], items, torch.zeros(1))
            logp = trainer.policy(inputs).scaled(trainer.config.rollout.std_scale).log_prob(actions).sum(-1)
            totals.append((logp * mask).sum())
    return torch.stack(totals)


@pytest.mark.needs_rendering
@pytest.mark.parametrize("advantage", ["tree_depthwise", "grpo"], ids=["node-credit", "flat-credit"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_branched_update_raises_the_successful_path_and_lowers_the_failing_ones(
    tmp_path, monkeypatch, sign, advantage
):
    """Leaf slot 0 of every group succeeds, the others fail. The update must raise the log-prob of the
    chunks on the edge into the successful leaf and lower those into the failing leaves, with node
    credit (edges) or flat credit (the leaves' whole episodes); with the advantages negated (sign -1)
    the same measurement must show the opposite, so the test can fail."""
    trainer = branched_trainer(
        tmp_path, f"grpo.advantage={advantage}", "train.lr=1e-4", "train.updates=4", "train.batch_size=32"
    )
    groups = trainer.collect_branched(0)
    size = trainer.config.rollout.group_size
    leaf_edges = {True: [], False: []}
    for t, tree in enumerate(groups.trees):
        for leaf in tree.leaves():
            slot = tree.nodes[leaf].state.slots.start
            good = slot == 0
            tree.set_leaf_reward(leaf, float(good))
            groups.leaves[t * size + slot].success = good
            leaf_edges[good].append(tree.nodes[leaf].state.edge)
    real = vla_rl.methods.grpo.assign_credit

    def signed_credit(trees, estimator):
        credit = real(trees, estimator)
        nodes = {k: sign * v for k, v in credit.nodes.items()}
        return Credit(nodes, {k: sign * v for k, v in credit.leaves.items()}, credit.per_leaf)

    monkeypatch.setattr(vla_rl.methods.grpo, "assign_credit", signed_credit)
    real_group = vla_rl.methods.grpo.group_advantages
    monkeypatch.setattr(
        vla_rl.methods.grpo,
        "group_advantages",
        lambda episodes, estimator: real_group(episodes, estimator)._replace(
            values=sign * real_group(episodes, estimator).values
        ),
    )
    before = {good: edge_logps(trainer, edges) for good, edges in leaf_edges.items()}
    out = update_branched_grpo(trainer, groups, torch.Generator().manual_seed(0))
    assert out["actor_updates"] == trainer.config.train.updates and out["grpo_chunks"] > 0
    change = {good: (edge_logps(trainer, edges) - before[good]).mean() for good, edges in leaf_edges.items()}
    assert sign * change[True] > 0 > sign * change[False]
    for env in trainer.envs:
        env.close()


@pytest.mark.needs_rendering
def test_a_branched_grpo_run_counts_each_shared_prefix_once(tmp_path):
    import json

    config = load_config(
        "vla/habc", [f"output_dir={tmp_path / 'run'}", f"model.path={tiny_policy_dir(tmp_path)}", *BRANCHED]
    )
    VLAOnlineTrainer(config).train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout_episodes"] % 4 == 0 and r["branch_points"] > 0
    assert rows[0]["env_steps"] < rows[0]["replayed_env_steps"]
    assert rows[1]["env_steps"] - rows[0]["env_steps"] < rows[1]["replayed_env_steps"]


# ----- config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["grpo.branch_every=2", "grpo.advantage=mc_grpo"], "mc_grpo needs an odd number of rollouts per "
         "group.*rollout.group_size = 4"),
        (["grpo.advantage=tree_depthwise"], "grpo.advantage = 'tree_depthwise' scores the nodes of branched "
         "groups, but grpo.branch_every = 0"),
        (["grpo.branch_every=2", "intervention.enabled=true"], "intervention.enabled = true with "
         "grpo.branch_every = 2: the supervisor's state is not part of a snapshot"),
        (["method=habc", "grpo.branch_every=2"], "grpo.branch_every = 2 branches GRPO groups, but "
         "method = 'habc'"),
        (["grpo.branch_every=2", "grpo.branching=[]"], r"grpo.branching = \[\]: give the number of children"),
        (["grpo.branch_every=2", "grpo.branching=[2,0]"], "grpo.branching = 0 is out of range"),
        (["grpo.branch_every=-1"], "grpo.branch_every = -1 is out of range"),
        (["grpo.branch_every=2", "grpo.advantage=gae"], "grpo.advantage = 'gae' is a temporal advantage"),
    ],
)  # fmt: skip
def test_config_refuses_what_branching_cannot_do(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("vla/grpo", overrides)


def test_the_advantage_defaults_to_the_tree_estimator_when_branching():
    assert load_config("vla/grpo", []).grpo.advantage == "grpo"
    branched = load_config("vla/grpo", ["grpo.branch_every=3"]).grpo
    assert (branched.advantage, branched.branch_every, branched.branching) == ("tree_depthwise", 3, [2, 2])
    assert load_config("vla/grpo", ["grpo.branch_every=3", "grpo.advantage=treepo"]).grpo.advantage == (
        "treepo"
    )
    flat_credit = load_config("vla/grpo", ["grpo.branch_every=3", "grpo.advantage=grpo"]).grpo
    assert (flat_credit.advantage, flat_credit.branch_every) == ("grpo", 3)


@pytest.mark.needs_fetch
@pytest.mark.needs_rendering
def test_a_task_without_snapshots_is_named(tmp_path):
    config = load_config(
        "vla/habc",
        [
            f"output_dir={tmp_path / 'run'}",
            f"model.path={tiny_policy_dir(tmp_path)}",
            *BRANCHED,
            "rollout.task=FetchReach-v4",
        ],
    )
    with pytest.raises(
        ConfigError,
        match="grpo.branch_every = 2 with rollout.task = 'FetchReach-v4': .* snapshot branching needs a "
        "MuJoCo env with get/set state.*set grpo.branch_every=0",
    ):
        VLAOnlineTrainer(config).setup()


@pytest.mark.needs_rendering
def test_the_bench_row_compares_branched_groups_with_their_replay_from_reset(capsys):
    from vla_rl.bench import bench_vla

    options = {"num_envs": 2, "repeats": 1, "image_size": 32, "branch_group_size": 4, "branch_every": 1}
    options["metaworld_task"] = ""  # no rows (e)
    rows = bench_vla(steps=12, branching=[2, 2], **options)
    row = rows[-1]
    # episodes of 3 chunks of 4 steps: the root's 2 children run one chunk each, then split into 2
    # leaves that run the last 2 chunks; replayed, each of the 4 leaves takes all 12 steps
    assert row["section"] == "(d)" and row["decisions"] == 2 + 4 * 2
    assert row["env_steps_per_decision"] == pytest.approx(4.0)
    assert row["baseline_env_steps_per_decision"] == pytest.approx(4 * 12 / 10)
    assert (
        row["ratio"] == pytest.approx(40 / 48)
        and row["verdict"] == "PASS"
        and row["seconds_per_decision"] > 0
    )
    assert "snapshot-branched GRPO groups" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="branching = \\[\\]: give children per depth"):
        bench_vla(steps=12, branching=[], **options)
