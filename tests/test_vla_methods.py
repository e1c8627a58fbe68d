"""The vla_online trainer's methods: the table of replay-buffer methods (what each trains the actor on,
with what weight), HABC's actor weights, AWR's Monte-Carlo returns, GRPO's chunks and its config
options looked up in the registries."""

import math

import numpy as np
import pytest
import torch

from mmrl.advantages import Advantages
from mmrl.config import ConfigError, load_config
from tests.test_vla_habc import toy_transitions
from vla_rl.config import METHODS
from vla_rl.methods import UPDATES
from vla_rl.methods.buffer import monte_carlo_returns
from vla_rl.methods.critics import CriticTargets, critic_losses
from vla_rl.methods.grpo import group_advantages, sampled_chunks
from vla_rl.methods.habc import Gate, Head, habc_weights
from vla_rl.methods.weighting import Weighting, advantage_weights
from vla_rl.online import Episode
from vla_rl.trainer import VLAOnlineTrainer  # noqa: F401  (registers vla_online for load_config)


class ConstantCritics(torch.nn.Module):
    """V_v = sigmoid(0) = 0.5 and u = -0.5 everywhere."""

    def forward(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(len(state)), torch.full((len(state),), -0.5)


def test_the_method_table_is_what_the_config_accepts():
    assert list(UPDATES) == list(METHODS) == ["habc", "awr", "bc", "dagger", "grpo"]
    with pytest.raises(ConfigError, match="choose one of habc, awr, bc, dagger, grpo"):
        load_config("vla/habc", ["method=ppo"])
    # the methods with a critic train it; bc and dagger have none
    assert [m for m, update in UPDATES.items() if update.trains_critics] == ["habc", "awr"]


def test_bc_clones_interventions_and_successes_and_dagger_relabels_every_state():
    tr = toy_transitions()
    config = load_config("vla/habc", ["method=bc"])
    assert tr.actor_rows.tolist() == [0, 3, 4, 6, 9, 11, 12, 13]
    bc = UPDATES["bc"].actor_targets(tr, ConstantCritics(), config, 4)
    assert bc.rows.tolist() == [0, 3, 4, 9, 11, 12, 13]  # the failed episode's chunk (row 6) is left out
    assert not bc.relabel and (bc.weights == 1).all()
    dagger = UPDATES["dagger"].actor_targets(tr, ConstantCritics(), config, 4)
    assert dagger.rows.tolist() == list(range(14)) and dagger.relabel and (dagger.weights == 1).all()


def test_awr_regresses_monte_carlo_returns_and_weights_above_the_value():
    tr = toy_transitions()
    g = 0.5
    returns = [g**8, g**7, g**6, g**5, g, 1, 0, 0, 0, g, 1, g**4, g**3, g**2]
    torch.testing.assert_close(monte_carlo_returns(tr, g), torch.tensor(returns))
    options = ["method=awr", "critic.gamma_v=0.5", "actor.beta=2"]
    config = load_config("vla/habc", [*options, "actor.per_chunk=false"])
    targets = UPDATES["awr"].critic_targets(tr, ConstantCritics(), config)
    assert targets.v_rows.tolist() == list(range(14)) and len(targets.e_rows) == 0
    torch.testing.assert_close(targets.v_target, torch.tensor(returns))
    out = UPDATES["awr"].actor_targets(tr, ConstantCritics(), config, 4)
    torch.testing.assert_close(out.weights, torch.exp(2 * (torch.tensor(returns) - 0.5)))
    assert out.weights[5] > 1 > out.weights[6]  # a success's last step above the value, a failure's below
    # per chunk: the steps executed from a chunk take the weight of the chunk's first state
    w = UPDATES["awr"].actor_targets(tr, ConstantCritics(), load_config("vla/habc", options), 4).weights
    step = out.weights
    assert w[1] == w[2] == w[0] == step[0] and w[7] == w[8] == w[6] and w[10] == w[9] == step[9]
    assert w[3] == step[3] and (w[11:] == step[11:]).all()  # a new chunk, and the expert's steps


def test_habc_weights_credit_policy_steps_and_weigh_interventions_by_the_option():
    intervention = torch.tensor([False, False, True])
    viability = Head(torch.tensor([0.0, 1.0, 0.0]), torch.tensor([0.2, 0.8, 0.5]),
                     torch.tensor([0.3, 0.0, 0.5]), torch.tensor([False, True, False]), 0.9)  # fmt: skip
    efficiency = Head(torch.full((3,), -0.02), torch.tensor([-0.5, -0.1, -0.3]),
                      torch.tensor([-0.4, 0.0, -0.3]), torch.tensor([False, True, False]), 0.98)  # fmt: skip
    weights, stats = habc_weights(
        intervention, viability, efficiency, Gate(10.0, 0.5), Weighting(2.0, 20.0), 0.7
    )
    a_v = torch.tensor([0.9 * 0.3 - 0.2, 1.0 - 0.8])
    a_e = torch.tensor([-0.02 + 0.98 * -0.4 + 0.5, -0.02 + 0.1])
    g = torch.sigmoid(10.0 * (torch.tensor([0.2, 0.8]) - 0.5))
    expected = torch.exp(2.0 * ((1 - g) * a_v + g * a_e))
    torch.testing.assert_close(weights, torch.cat([expected, torch.tensor([0.7])]))
    assert stats["viability_mean"] == pytest.approx(0.5) and stats["gate_mean"] == pytest.approx(
        float(g.mean())
    )
    experts = torch.ones(3, dtype=torch.bool)
    everything_expert, none = habc_weights(
        experts, viability, efficiency, Gate(10.0, 0.5), Weighting(2.0, 20.0), 0.7
    )
    assert (everything_expert == 0.7).all() and none == {}
    assert advantage_weights(torch.tensor([100.0]), Weighting(2.0, 20.0)).item() == 20.0


def test_critic_losses_draw_each_head_from_its_own_rows():
    critics = ConstantCritics()
    state = torch.zeros(6, 3)
    targets = CriticTargets(torch.tensor([0, 1, 2]), torch.tensor([1.0, 1.0, 1.0]), torch.tensor([4]),
                            torch.tensor([-0.5]))  # fmt: skip
    v_loss, e_loss = critic_losses(critics, state, targets, 8, torch.Generator().manual_seed(0))
    assert v_loss.item() == pytest.approx(math.log(2)) and e_loss.item() == 0.0  # logit 0 vs 1; u = -0.5
    no_efficiency = targets._replace(e_rows=torch.tensor([], dtype=torch.long), e_target=torch.zeros(0))
    assert critic_losses(critics, state, no_efficiency, 8, torch.Generator().manual_seed(0))[1] is None


def fake_episode(group: int, success: bool, chunk_step: list[int]) -> Episode:
    steps = len(chunk_step)
    return Episode(
        seed=group, group=group, instruction="reach", states=np.zeros((steps + 1, 3), np.float32),
        images=np.zeros((steps + 1, 4, 4, 3), np.uint8), actions=np.zeros((steps, 5), np.float32),
        is_intervention=np.array(chunk_step) < 0, chunk_step=np.array(chunk_step), success=success,
        terminated=success, interventions=0,
    )  # fmt: skip


def test_grpo_trains_on_the_chunks_of_episodes_with_a_signal():
    episodes = [
        fake_episode(0, True, [0, 1, 0]),
        fake_episode(0, False, [0, 1, 2, -1, 0]),
        fake_episode(1, True, [0, 1]),
        fake_episode(1, True, [0]),  # a group that all succeeded carries no signal
    ]
    advantages = group_advantages(episodes, "grpo")
    assert advantages.values[0] > 0 > advantages.values[1] and (advantages.values[2:] == 0).all()
    assert sampled_chunks(episodes, advantages) == [(0, 0, 2), (0, 2, 1), (1, 0, 3), (1, 4, 1)]
    masked = Advantages(advantages.values, torch.tensor([True, False, True, True]))  # e.g. mc_grpo's pivot
    assert sampled_chunks(episodes, masked) == [(0, 0, 2), (0, 2, 1)]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["grpo.advantage=gae"], "grpo.advantage = 'gae' is a temporal advantage"),
        (["grpo.advantage=mc_grpo"], "mc_grpo needs an odd number of rollouts per group"),
        (["grpo.loss=nope"], "grpo.loss = 'nope': unknown loss 'nope'"),
    ],
)
def test_grpo_options_name_registry_entries_of_the_right_kind(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("vla/grpo", overrides)
    config = load_config("vla/grpo", ["rollout.group_size=3", "rollout.num_envs=9", "grpo.advantage=mc_grpo"])
    assert (config.grpo.advantage, config.grpo.loss) == ("mc_grpo", "ppo_clip")
