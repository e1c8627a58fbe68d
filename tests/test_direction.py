"""Learning direction of every trainer: one real update through the trainer's own code, with rewards the
test chooses, raises the log-probs of the samples it rewarded above their group and lowers the others'.

The signs come from the chosen rewards, never from the advantages the trainer computed, so a sign error
anywhere between reward and optimizer step fails here. HABC's per-chunk actor weights and the FP4
exploration's kept leaves are checked on inputs whose right answer is known by construction."""

import copy

import numpy as np
import pytest
import torch

from mmrl.cli import load_plugins
from mmrl.config import load_config

load_plugins()


def assert_direction(delta: torch.Tensor, sign: torch.Tensor) -> None:
    """Mean log-prob change of the rewarded samples > 0, of the penalised ones < 0."""
    assert (sign > 0).any() and (sign < 0).any(), "the fixed batch needs both kinds of samples"
    up, down = delta[sign > 0].mean(), delta[sign < 0].mean()
    assert up > 0 > down, f"rewarded samples changed by {float(up):+.3g}, penalised by {float(down):+.3g}"


# ----- tiny GRPO (mmrl/examples/tiny_grpo.py) ----------------------------------------------------


@pytest.mark.parametrize(
    ("recipe", "advantage"),
    [
        ("core/tiny_grpo", "grpo"),
        ("core/tiny_branch_grpo", "tree_depthwise"),
        ("core/tiny_branch_grpo", "treepo"),
        ("core/tiny_branch_grpo", "grpo"),
    ],
    ids=["flat", "tree-node-credit", "tree-treepo", "tree-flat-credit"],
)
def test_tiny_grpo_update_raises_rewarded_answers(tmp_path, monkeypatch, recipe, advantage):
    from mmrl.examples import tiny_grpo

    config = load_config(
        recipe,
        [
            f"train.advantage={advantage}",
            "model.path=null",
            "model.hidden_size=32",
            "task.train_prompts=64",
            "task.heldout_prompts=8",
            "rollout.prompts_per_step=4",
            "progress=false",
            f"output_dir={tmp_path}",
        ],
    )
    trainer = tiny_grpo.TinyGRPOTrainer(config)
    trainer.prepare_run_dir()
    trainer.seed_everything()
    trainer.setup()
    trainer.start_run_dir()
    seen = {}

    def reward(prompts, answers):  # answers starting with a low digit are right
        seen["prompts"], seen["answers"] = prompts, answers
        return (answers[:, 0] < 5).float()

    monkeypatch.setattr(tiny_grpo, "reversal_reward", reward)
    before = copy.deepcopy(trainer.model)
    trainer.train_step(0)
    prompts, answers = seen["prompts"], seen["answers"]  # the last call scores every leaf
    groups = (answers[:, 0] < 5).float().view(config.rollout.prompts_per_step, -1)
    sign = torch.sign(groups - groups.mean(1, keepdim=True)).flatten()
    with torch.no_grad():
        delta = tiny_grpo.answer_logprobs(trainer.model, prompts, answers).sum(1) - tiny_grpo.answer_logprobs(
            before, prompts, answers
        ).sum(1)
    assert_direction(delta, sign)


# ----- BranchGRPO (diffusion_rl/branch_grpo.py) --------------------------------------------------


@pytest.fixture(scope="module")
def flow_dir(tmp_path_factory):
    from diffusion_rl.models import FlowPipeline, TinyFlowSpec
    from diffusion_rl.shapes import vocabulary

    path = tmp_path_factory.mktemp("tiny_flow")
    spec = TinyFlowSpec(
        image_size=16, patch_size=4, layers=1, heads=2, head_dim=8, text_hidden=16, text_layers=1
    )
    FlowPipeline.tiny(vocabulary(), spec).save_pretrained(path)
    return path


def branch_trainer(recipe, flow_dir, run_dir, *overrides):
    from diffusion_rl.branch_grpo import BranchGRPOTrainer

    config = load_config(
        recipe,
        [
            f"model.path={flow_dir}",
            f"output_dir={run_dir}",
            "progress=false",
            "rollout.prompts_per_step=2",
            "rollout.steps=8",
            "rollout.split_steps=[0,2,4]",
            "rollout.guidance_scale=1.0",
            *overrides,
        ],
    )
    trainer = BranchGRPOTrainer(config)
    trainer.prepare_run_dir()
    trainer.seed_everything()
    trainer.setup()
    trainer.start_run_dir()
    return trainer


def first_branch(key: int, branch_factor: int) -> int:
    """The depth-1 ancestor of a node key (heap numbering: parent = (key - 1) // branch_factor)."""
    while key > branch_factor:
        key = (key - 1) // branch_factor
    return key


@pytest.mark.parametrize("advantage", ["tree_depthwise", "treepo", "grpo"])
def test_branch_grpo_update_raises_the_rewarded_subtree(flow_dir, tmp_path, monkeypatch, advantage):
    """Leaves under the root's first child score 1, the others 0: every node in the first subtree has
    the higher fused reward at its depth, every node in the second the lower; with flat credit
    (`grpo`) every edge in the first subtree carries its leaves' positive advantage."""
    from diffusion_rl import branch_grpo as module

    trainer = branch_trainer(
        "diffusion/branchgrpo", flow_dir, tmp_path, "train.lr=1e-3", f"train.advantage={advantage}"
    )
    seen = {}
    rollout_trees = module.rollout_trees

    def spy(pipe, cond, uncond, *args, **kwargs):
        out = rollout_trees(pipe, cond, uncond, *args, **kwargs)
        seen.update(trees=out[0], cond=cond, uncond=uncond)
        return out

    def reward(images, prompts):
        keys = [tree.nodes[leaf].state["key"] for tree in seen["trees"] for leaf in tree.leaves()]
        assert len(keys) == len(images)
        return torch.tensor([float(first_branch(k, 2) == 1) for k in keys])

    monkeypatch.setattr(module, "rollout_trees", spy)
    trainer.reward_fn = reward
    before = copy.deepcopy(trainer.model)
    trainer.train_step(0)
    chunk, sign = [], []
    for t, tree in enumerate(seen["trees"]):
        for node in tree.nodes[1:]:
            for record in node.state["records"]:
                chunk.append((t, record, 0.0, 1.0))
                sign.append(1.0 if first_branch(node.state["key"], 2) == 1 else -1.0)
    args = (chunk, seen["cond"], seen["uncond"], trainer.pipe.sigmas(8), set(trainer.plan.split_steps))
    with torch.no_grad():
        delta = (
            trainer.chunk_log_probs(trainer.model, *args).log_prob
            - trainer.chunk_log_probs(before, *args).log_prob
        )
    assert_direction(delta, torch.tensor(sign))


def test_fp4_exploration_keeps_exactly_the_best_and_the_worst_leaves(flow_dir, tmp_path, monkeypatch):
    """27 exploration leaves per prompt with distinct rewards; keep = 4 must replay the best 2 and the
    worst 2 (the top 4 would be a different set)."""
    from diffusion_rl import branch_grpo as module

    trainer = branch_trainer(
        "diffusion/branchgrpo_fp4", flow_dir, tmp_path, "explore.branch_factor=3", "explore.keep=4"
    )
    calls = []
    rollout_trees = module.rollout_trees

    def spy(*args, **kwargs):
        out = rollout_trees(*args, **kwargs)
        calls.append(out[0])
        return out

    leaf_keys = module.plan_for(trainer.config.rollout, branch_factor=3).leaf_keys()
    generator = torch.Generator().manual_seed(0)
    tables = [
        dict(zip(leaf_keys, torch.randperm(len(leaf_keys), generator=generator).tolist(), strict=True))
        for _ in range(2)
    ]

    def reward(images, prompts):  # a fixed score per (prompt, leaf key), the same in exploration and replay
        trees = calls[-1]
        scores = [
            tables[t][tree.nodes[leaf].state["key"]] for t, tree in enumerate(trees) for leaf in tree.leaves()
        ]
        return torch.tensor(scores, dtype=torch.float32)

    monkeypatch.setattr(module, "rollout_trees", spy)
    trainer.reward_fn = reward
    trainer.train_step(0)
    explored, replayed = calls
    for table, low, full in zip(tables, explored, replayed, strict=True):
        ranked = sorted(leaf_keys, key=table.get)
        expected = set(ranked[:2] + ranked[-2:])
        assert len(low.leaves()) == 27 and expected != set(ranked[-4:])
        assert {full.nodes[leaf].state["key"] for leaf in full.leaves()} == expected


# ----- DiffusionNFT (diffusion_rl/nft.py) --------------------------------------------------------


@pytest.mark.parametrize("reversed_rewards", [False, True])
def test_diffusion_nft_update_pulls_the_model_towards_rewarded_samples(
    flow_dir, tmp_path, monkeypatch, reversed_rewards
):
    """The first half of every group scores 1, the second 0 (or the reverse): after one update the
    model's clean-sample error x_t - t v - x0 at the noised samples it trained on falls for the rewarded
    samples and rises for the others."""
    from diffusion_rl import nft as module

    config = load_config(
        "diffusion/nft",
        [
            f"model.path={flow_dir}",
            f"output_dir={tmp_path}",
            "progress=false",
            "rollout.prompts_per_step=2",
            "rollout.group_size=4",
            "rollout.steps=4",
            "train.lr=1e-4",
            "train.timesteps_per_sample=4",
        ],
    )
    trainer = module.DiffusionNFTTrainer(config)
    trainer.prepare_run_dir()
    trainer.seed_everything()
    trainer.setup()
    trainer.start_run_dir()
    seen = {}
    rollout_trees = module.rollout_trees

    def spy(*args, **kwargs):
        out = rollout_trees(*args, **kwargs)
        seen["cond"], seen["clean"] = args[1], out[1].clone()
        return out

    first_half = torch.tensor([1.0, 1.0, 0.0, 0.0]).repeat(2)
    rewards = 1 - first_half if reversed_rewards else first_half
    monkeypatch.setattr(module, "rollout_trees", spy)
    trainer.reward_fn = lambda images, prompts: rewards
    before = copy.deepcopy(trainer.model)
    trainer.train_step(0)
    x0, t, x_t, rows = trainer.noised(seen["clean"], list(range(8)), step=0)  # slots 0, 1 x 4 samples
    cond = seen["cond"][(rows // 4).tolist()]

    def error(model):
        with torch.no_grad():
            v = trainer.pipe.velocity(x_t, t, cond, denoiser=model)
        per_row = (x_t - t.view(-1, 1, 1, 1) * v - x0).square().flatten(1).mean(1)
        return torch.zeros(8).index_add_(0, rows, per_row)

    delta = error(trainer.model) - error(before)
    assert_direction(-delta, torch.sign(rewards - 0.5))


# ----- tool GRPO (vlm_rl/trainer.py) -------------------------------------------------------------


def test_tool_grpo_update_raises_the_rewarded_conversations(tmp_path, monkeypatch):
    """In every group of 4 rollouts the first two score 1 and the last two 0."""
    from vlm_rl.data import DataConfig, task_vocabulary
    from vlm_rl.models import VLMAdapter
    from vlm_rl.trainer import ToolGRPOTrainer

    VLMAdapter.tiny(task_vocabulary(DataConfig(heldout_size=4, train_size=16), samples=50)).save_pretrained(
        tmp_path / "base"
    )
    config = load_config(
        "vlm/tool_grpo",
        [
            f"model.path={tmp_path / 'base'}",
            f"output_dir={tmp_path / 'run'}",
            "progress=false",
            "data.heldout_size=4",
            "data.train_size=16",
            "train.questions_per_step=2",
            "train.group_size=4",
            "train.lr=1e-3",
            "rollout.max_new_tokens=8",
        ],
    )
    trainer = ToolGRPOTrainer(config)
    trainer.prepare_run_dir()
    trainer.seed_everything()
    trainer.setup()
    trainer.start_run_dir()
    seen = {}
    optimise = trainer.optimise

    def spy(trajectories, advantages, step, prefixes):
        seen["trajectories"] = trajectories
        return optimise(trajectories, advantages, step, prefixes)

    def reward(texts, group_ids, **kwargs):
        return torch.tensor([1.0, 1.0, 0.0, 0.0] * (len(texts) // 4))

    monkeypatch.setattr(trainer, "optimise", spy)
    trainer.reward_fn = reward
    before = copy.deepcopy(trainer.adapter.model)
    trainer.train_step(0)
    trajectories = seen["trajectories"]
    sequences = [tuple(t.sequence.token_ids) for t in trajectories]
    assert len(set(sequences)) == len(sequences), "rewarded and penalised rollouts must differ"
    batch = trainer.adapter.collate([t.sequence for t in trajectories], "right")
    mask = torch.zeros(batch["input_ids"].shape, dtype=torch.bool)
    for row, t in enumerate(trajectories):
        mask[row, : len(t.loss_mask)] = torch.tensor(t.loss_mask)
    with torch.no_grad():
        after = trainer.adapter.token_log_probs(batch, mask, model=trainer.adapter.model)
        start = trainer.adapter.token_log_probs(batch, mask, model=before)
    delta = ((after - start) * mask).sum(1)
    assert_direction(delta, torch.tensor([1.0, 1.0, -1.0, -1.0] * (len(trajectories) // 4)))


# ----- HABC per-chunk actor weights (vla_rl/methods/habc.py) -----------------------


class ScriptedCritics(torch.nn.Module):
    """Critic heads that read their values off the state: V_v = state[:, 0], u = state[:, 1]."""

    def forward(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.logit(state[:, 0].double()).float(), state[:, 1]


@pytest.mark.needs_robot
def test_habc_per_chunk_weights_follow_the_gated_advantage():
    """Four successful policy episodes of 4 steps, two chunks of 2 steps each. The first chunks are
    compared in pairs whose viability and efficiency advantages disagree in order: where V_v is low
    the gate is near 0 and the chunk that raises viability must weigh more; where V_v is high the gate
    is near 1 and the chunk that saves steps must weigh more."""
    from vla_rl.lerobot_format import IMAGE_KEY, STATE_KEY
    from vla_rl.methods.habc import HABC
    from vla_rl.online import Transitions
    from vla_rl.replay_buffer import ReplayBuffer

    config = load_config("vla/habc", ["train.demos=null"])
    assert config.actor.per_chunk  # the recipes' path
    # (V_v, u) at s_0 and at s_2, where the first chunk hands over to the second
    episodes = {
        "viability_up": ((0.10, -0.50), (0.15, -0.55)),
        "efficiency_up_low_v": ((0.10, -0.50), (0.08, -0.45)),
        "efficiency_up": ((0.90, -0.30), (0.88, -0.25)),
        "viability_up_high_v": ((0.90, -0.30), (0.95, -0.35)),
    }
    buffer, lengths = ReplayBuffer(100), {}
    for number, (start, middle) in enumerate(episodes.values()):
        values = np.array([start, start, middle, middle, middle])
        state = np.concatenate([values, np.full((5, 1), number)], axis=1).astype(np.float32)
        obs = {STATE_KEY: state, IMAGE_KEY: np.zeros((5, 4, 4, 3), np.uint8)}
        episode = buffer.add_episode(obs, np.zeros((4, 5)), True, "reach", chunk_step=[0, 1, 0, 1])
        lengths[episode] = 4
    tr = Transitions.from_buffer(buffer, lengths)
    weights = HABC.actor_targets(tr, ScriptedCritics(), config, horizon=4).weights
    first = {
        name: weights[(tr.state[:, 2] == number) & (tr.t == 0)].item() for number, name in enumerate(episodes)
    }
    assert first["viability_up"] > first["efficiency_up_low_v"]
    assert first["efficiency_up"] > first["viability_up_high_v"]
    assert max(first.values()) < config.actor.w_max  # no pair compared at the clip
