"""HABC's mechanism as pure functions: the critics and their targets, the gate, the one-step and chunk
advantages, and the actor weights (the trainer, `vla_rl.trainer`, only wires them up).

Two critic heads on one shared trunk over the privileged env state (a small MLP: cheap, and in
simulation the critic may see what the policy may not; the actor still sees image + proprio).
Viability V_v(s) ~ P(success | s) is trained on policy-executed segments only; efficiency V_e(s) (-1 per
step) only on policy segments that ended in the policy's own success. One-step advantages
A_x = r_x + gamma_x V_x(s') - V_x(s) (the `td1` estimator); the gate g = sigmoid(k (V_v(s) - tau))
mixes them, A = (1 - g) A_v + g A_e, viability first while success is uncertain; actor weights
min(exp(beta A), w_max) on the log-likelihood of action chunks.

Intervention-aware credit: a policy segment is labelled with the episode's outcome only when it ends
the episode; one that ends in a take-over is labelled failure (the supervisor judged that the policy
could not finish), so the success the expert then brings never reaches the policy's actions.
Intervention segments are demonstrations: actor weight `habc.intervention_weight`, never credited with
an outcome, never critic data. A_e is measured in units of 1 / (1 - gamma_e) steps (the head predicts
(1 - gamma_e) V_e in [-1, 0]) so that both advantages live on comparable [-1, 1] scales.

Critic targets are TD(lambda) returns within a segment (`critic.lam`; 1 = the binary outcome itself,
which needs no target network); advantages are always one-step. Per chunk (`actor.per_chunk`), a chunk
the policy sampled is one decision: its advantage is the discounted sum of the one-step advantages of
the steps executed from it (the chunk's n-step TD error), and its weight goes to each of those steps.
The TD math is HABC's fixed mechanism, so it calls `mmrl.advantages.td1` / `gae` directly.

Ablations (`habc.ablate`, `ABLATIONS`) take one part out at a time: without the viability critic A =
A_e (g = 1), without the efficiency critic A = A_v (g = 0), without the gate a fixed even mix (g =
1/2 in every state), without intervention-aware credit every policy segment gets its episode's
outcome (the expert's success after a take-over is credited to the policy's actions before it) and
the efficiency head trains on every policy segment of a successful episode.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mmrl.advantages import gae, td1
from mmrl.losses import awr_weights
from vla_rl.online import Transitions


class Head(NamedTuple):
    """One critic head's one-step TD inputs, one entry per transition."""

    rewards: Tensor
    values: Tensor  # V(s)
    next_values: Tensor  # V(s')
    dones: Tensor  # bool: nothing is bootstrapped from s'
    gamma: float


ABLATIONS = ("viability_critic", "efficiency_critic", "gate", "intervention_credit")


class Gate(NamedTuple):
    """g = sigmoid(k (V_v - tau)): k its sharpness, tau the viability at which it is half open;
    `ablate` the parts of the mix taken out (of `ABLATIONS`: the critics and the gate)."""

    k: float
    tau: float
    ablate: frozenset[str] = frozenset()


class Weighting(NamedTuple):
    """Actor weights min(exp(beta A), w_max), A first standardised over the batch with `normalize`."""

    beta: float
    w_max: float
    normalize: bool = False


class Chunks(NamedTuple):
    """The policy's decisions as rows of the flat transitions (`executed_chunks`)."""

    decisions: Tensor  # (D,) rows where a chunk was sampled
    rows: Tensor  # (D, horizon) rows of the steps executed from it (clamped)
    executed: Tensor  # (D, horizon) bool: the position was executed from that chunk


class HABCAdvantages(NamedTuple):
    """A_v, A_e, the gate and the mixed advantage, one entry per transition or per decision."""

    a_v: Tensor
    a_e: Tensor
    gate: Tensor
    advantage: Tensor


class CriticTargets(NamedTuple):
    """The rows each head trains on and their regression targets."""

    v_rows: Tensor
    v_target: Tensor  # viability in [0, 1]
    e_rows: Tensor
    e_target: Tensor  # scaled efficiency u in [-1, 0]


# ---------------------------------------------------------------------------------------------
# Advantages and weights


def gate(viability: Tensor, k: float, tau: float) -> Tensor:
    """g = sigmoid(k (V_v - tau)): near 0 while success is unlikely, near 1 once it is likely."""
    return torch.sigmoid(k * (viability - tau))


def one_step_advantage(head: Head) -> Tensor:
    """A = r + gamma (1 - done) V(s') - V(s) per transition (`td1` on length-1 sequences)."""
    values = torch.stack([head.values, head.next_values], -1)
    return td1(head.rewards[:, None], values, head.dones[:, None], gamma=head.gamma).values[:, 0]


def executed_chunks(chunk_step: Tensor, seg_left: Tensor, horizon: int) -> Chunks:
    """Where the policy sampled its chunks in the flat transitions, and which steps it executed from
    each (a chunk ends early at a take-over or at the segment's end)."""
    decisions = torch.nonzero(chunk_step == 0).flatten()
    offsets = torch.arange(horizon)
    rows = (decisions[:, None] + offsets).clamp(max=len(chunk_step) - 1)
    executed = (offsets < seg_left[decisions, None]) & (chunk_step[rows] == offsets)
    return Chunks(decisions, rows, executed)


def chunk_advantage(step_advantage: Tensor, rows: Tensor, executed: Tensor, gamma: float) -> Tensor:
    """A decision's one-step advantage in the semi-MDP whose actions are chunks: the discounted sum of
    the one-step advantages of the k steps executed from it, sum_i gamma^i A(t+i) (the TD terms
    telescope to r_t + ... + gamma^k V(s_{t+k}) - V(s_t))."""
    discount = gamma ** torch.arange(rows.shape[1], dtype=step_advantage.dtype)
    return (step_advantage[rows] * discount * executed).sum(1)


def spread_over_chunks(weights: Tensor, decision_weights: Tensor, chunks: Chunks) -> None:
    """Give every step executed from a chunk its decision's weight, in place in the per-transition
    `weights` (steps no chunk executed keep theirs)."""
    weights[chunks.rows[chunks.executed]] = decision_weights[:, None].expand_as(chunks.rows)[chunks.executed]


def habc_advantages(
    viability: Head, efficiency: Head, gate_params: Gate, chunks: Chunks | None = None
) -> HABCAdvantages:
    """A_v and A_e (one-step, each head with its own rewards, values and terminal flags), the gate g
    from V_v(s), and A = (1 - g) A_v + g A_e, one entry per transition.

    With `chunks`, one entry per decision instead: A_v and A_e are the chunk's advantages
    (`chunk_advantage`) and g is read at the state where the chunk was sampled, so per-step and
    per-chunk weighting share one gate mix."""
    a_v = one_step_advantage(viability)
    a_e = one_step_advantage(efficiency)
    g = gate(viability.values, gate_params.k, gate_params.tau)
    if "gate" in gate_params.ablate:
        g = torch.full_like(g, 0.5)
    if "viability_critic" in gate_params.ablate:
        g = torch.ones_like(g)
    if "efficiency_critic" in gate_params.ablate:
        g = torch.zeros_like(g)
    if chunks is not None:
        a_v = chunk_advantage(a_v, chunks.rows, chunks.executed, viability.gamma)
        a_e = chunk_advantage(a_e, chunks.rows, chunks.executed, efficiency.gamma)
        g = g[chunks.decisions]
    return HABCAdvantages(a_v, a_e, g, (1 - g) * a_v + g * a_e)


def advantage_weights(advantages: Tensor, weighting: Weighting) -> Tensor:
    """min(exp(beta A), w_max) through the shared `awr_weights` (whose temperature divides A)."""
    return awr_weights(
        advantages, beta=1.0 / weighting.beta, max_weight=weighting.w_max, normalize=weighting.normalize
    )


def weight_stats(weights: Tensor, w_max: float) -> dict[str, float]:
    """Mean, max and clipped share of the policy's actor weights."""
    return {
        "weight_mean": float(weights.mean()),
        "weight_max": float(weights.max()),
        "weight_clip_fraction": float((weights >= w_max * (1 - 1e-6)).float().mean()),
    }


def habc_weights(
    intervention: Tensor,
    viability: Head,
    efficiency: Head,
    gate_params: Gate,
    weighting: Weighting,
    intervention_weight: float,
    chunks: Chunks | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Per-transition actor weights: the clipped exp(beta A) on policy steps (with `chunks`, a
    decision's weight on every step executed from its chunk), `intervention_weight` on intervention
    steps; and their statistics."""
    policy = ~intervention
    weights = torch.full((len(intervention),), intervention_weight)
    if not policy.any():
        return weights, {}
    out = habc_advantages(viability, efficiency, gate_params, chunks)
    if chunks is None:  # one entry per transition, of which the policy's count
        out = HABCAdvantages(*(x[policy] for x in out))
    w = advantage_weights(out.advantage, weighting)
    if chunks is not None:
        spread_over_chunks(weights, w, chunks)
    else:
        weights[policy] = w
    stats = {
        "gate_mean": float(out.gate.mean()),
        "viability_mean": float(viability.values[policy].mean()),
        "adv_v_mean": float(out.a_v.mean()),
        "adv_e_mean": float(out.a_e.mean()),
        "adv_std": float(out.advantage.std(unbiased=False)),
    }
    return weights, stats | weight_stats(w, weighting.w_max)


# ---------------------------------------------------------------------------------------------
# Critics and their targets


class Critics(nn.Module):
    """Viability and efficiency heads on one shared trunk over the privileged env state.

    A small MLP on the state vector (not the image): cheap to train every iteration on CPU, and in
    simulation a critic may use what the deployed policy cannot see. Inputs are standardised with
    statistics fixed from the first rollouts. Outputs: V_v = sigmoid(logit) in [0, 1] and the scaled
    efficiency u = (1 - gamma_e) V_e = -sigmoid(.) in [-1, 0].
    """

    def __init__(self, state_dim: int, hidden: int) -> None:
        super().__init__()
        self.trunk = nn.Sequential(
            nn.Linear(state_dim, hidden),
            nn.LayerNorm(hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
        )
        self.heads = nn.Linear(hidden, 2)
        self.register_buffer("mean", torch.zeros(state_dim))
        self.register_buffer("std", torch.ones(state_dim))
        self.register_buffer("ready", torch.tensor(False))

    def fit_normalization(self, states: Tensor) -> None:
        """Fix the input statistics once, from the first states seen."""
        if not bool(self.ready):
            self.mean.copy_(states.mean(0))
            self.std.copy_(states.std(0).clamp(min=1e-3))
            self.ready.fill_(True)

    def forward(self, state: Tensor) -> tuple[Tensor, Tensor]:
        """(viability logit, scaled efficiency u) per state."""
        out = self.heads(self.trunk((state - self.mean) / self.std))
        return out[:, 0], -torch.sigmoid(out[:, 1])


def viability_rewards(tr: Transitions, credit: bool = True) -> tuple[Tensor, Tensor]:
    """Intervention-aware outcome rewards of the viability head, and its terminal flags.

    A policy segment ends at its last step: with the episode's outcome when it ends the episode, with
    0 when the expert takes over after it. Intervention rows get reward 0 and are never trained on,
    so the outcome reaches policy-executed steps only. Without `credit` (the ablation) every policy
    segment ends with its episode's outcome."""
    ends = tr.seg_ends_episode if credit else torch.ones_like(tr.seg_ends_episode)
    label = (tr.success & ends & ~tr.intervention).float()
    last = tr.last & ~tr.intervention
    return torch.where(last, label, 0.0), last


def efficiency_rewards(tr: Transitions, gamma_e: float) -> tuple[Tensor, Tensor]:
    """-1 per step in units of 1 / (1 - gamma_e), terminal at a successful final step."""
    return torch.full((len(tr),), -(1.0 - gamma_e)), tr.terminated & tr.success


def head_rows(tr: Transitions, credit: bool = True) -> tuple[Tensor, Tensor]:
    """Rows each head trains on: viability on every policy-executed step (never an intervention step),
    efficiency on the policy segments that ended in the policy's own success (without `credit`: on
    every policy segment of a successful episode)."""
    policy = ~tr.intervention
    own = tr.seg_ends_episode if credit else torch.ones_like(tr.seg_ends_episode)
    return torch.nonzero(policy).flatten(), torch.nonzero(policy & tr.success & own).flatten()


def heads(
    critics: Critics, tr: Transitions, gamma_v: float, gamma_e: float, credit: bool = True
) -> tuple[Head, Head]:
    """The viability and efficiency heads' TD inputs on every transition, from the critics' current
    values (no gradient); `credit` as in `viability_rewards`."""
    with torch.no_grad():
        logit, u = critics(tr.state)
        logit_next, u_next = critics(tr.next_state)
    r_v, done_v = viability_rewards(tr, credit)
    r_e, done_e = efficiency_rewards(tr, gamma_e)
    return (
        Head(r_v, torch.sigmoid(logit), torch.sigmoid(logit_next), done_v, gamma_v),
        Head(r_e, u, u_next, done_e, gamma_e),
    )


def segment_returns(head: Head, tr: Transitions, rows: Tensor, lam: float) -> Tensor:
    """TD(lambda) targets of `rows` (whole segments, in order), segment by segment through `gae`."""
    targets = torch.empty(len(rows))
    if not len(rows):
        return targets
    seg = tr.seg[rows]
    bounds = torch.cat(
        [torch.tensor([0]), torch.nonzero(seg[1:] != seg[:-1]).flatten() + 1, torch.tensor([len(rows)])]
    )
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        r = rows[lo:hi]
        values = torch.cat([head.values[r], head.next_values[r[-1:]]])
        targets[lo:hi] = gae(head.rewards[r], values, head.dones[r], gamma=head.gamma, lam=lam).returns
    return targets


def critic_targets(
    critics: Critics, tr: Transitions, gamma_v: float, gamma_e: float, lam: float, credit: bool = True
) -> CriticTargets:
    """Each head's rows (`head_rows`) and TD(lambda) targets, clamped to the head's range."""
    viability, efficiency = heads(critics, tr, gamma_v, gamma_e, credit)
    v_rows, e_rows = head_rows(tr, credit)
    v_target = segment_returns(viability, tr, v_rows, lam)
    e_target = segment_returns(efficiency, tr, e_rows, lam)
    return CriticTargets(v_rows, v_target.clamp(0, 1), e_rows, e_target.clamp(-1, 0))


def critic_losses(
    critics: Critics, state: Tensor, targets: CriticTargets, batch_size: int, generator: torch.Generator
) -> tuple[Tensor, Tensor | None]:
    """One minibatch per head, drawn from its rows: BCE of the viability logits and MSE of u (None
    while no policy segment has ended in the policy's own success)."""
    v_pick = torch.randint(len(targets.v_rows), (batch_size,), generator=generator)
    logit, _ = critics(state[targets.v_rows[v_pick]])
    v_loss = F.binary_cross_entropy_with_logits(logit, targets.v_target[v_pick])
    if not len(targets.e_rows):
        return v_loss, None
    e_pick = torch.randint(len(targets.e_rows), (batch_size,), generator=generator)
    _, u = critics(state[targets.e_rows[e_pick]])
    return v_loss, F.mse_loss(u, targets.e_target[e_pick])
