"""HABC, one of the update rules on the replay buffer (`HABC`, a `vla_rl.methods.buffer.BufferUpdate`):
its mechanism as pure functions, the critics' targets, the gate, the one-step and chunk advantages and
the actor weights. The critics themselves are `vla_rl.methods.critics`.

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

Ablations (`habc.ablate`, `vla_rl.config.ABLATIONS`) take one part out at a time: without the
viability critic A = A_e (g = 1), without the efficiency critic A = A_v (g = 0), without the gate a
fixed even mix (g = 1/2 in every state), without intervention-aware credit every policy segment gets
its episode's outcome (the expert's success after a take-over is credited to the policy's actions
before it) and the efficiency head trains on every policy segment of a successful episode.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from mmrl.advantages import gae, td1
from vla_rl.config import VLAOnlineConfig
from vla_rl.methods.buffer import ActorTargets, BufferUpdate
from vla_rl.methods.critics import Critics, CriticTargets
from vla_rl.methods.weighting import (
    Chunks,
    Weighting,
    advantage_weights,
    executed_chunks,
    spread_over_chunks,
    weight_stats,
)
from vla_rl.online import Transitions


class Head(NamedTuple):
    """One critic head's one-step TD inputs, one entry per transition."""

    rewards: Tensor
    values: Tensor  # V(s)
    next_values: Tensor  # V(s')
    dones: Tensor  # bool: nothing is bootstrapped from s'
    gamma: float


class Gate(NamedTuple):
    """g = sigmoid(k (V_v - tau)): k its sharpness, tau the viability at which it is half open;
    `ablate` the parts of the mix taken out (of `ABLATIONS`: the critics and the gate)."""

    k: float
    tau: float
    ablate: frozenset[str] = frozenset()


class HABCAdvantages(NamedTuple):
    """A_v, A_e, the gate and the mixed advantage, one entry per transition or per decision."""

    a_v: Tensor
    a_e: Tensor
    gate: Tensor
    advantage: Tensor


# ---------------------------------------------------------------------------------------------
# Advantages and weights


def gate(viability: Tensor, k: float, tau: float) -> Tensor:
    """g = sigmoid(k (V_v - tau)): near 0 while success is unlikely, near 1 once it is likely."""
    return torch.sigmoid(k * (viability - tau))


def one_step_advantage(head: Head) -> Tensor:
    """A = r + gamma (1 - done) V(s') - V(s) per transition (`td1` on length-1 sequences)."""
    values = torch.stack([head.values, head.next_values], -1)
    return td1(head.rewards[:, None], values, head.dones[:, None], gamma=head.gamma).values[:, 0]


def chunk_advantage(step_advantage: Tensor, rows: Tensor, executed: Tensor, gamma: float) -> Tensor:
    """A decision's one-step advantage in the semi-MDP whose actions are chunks: the discounted sum of
    the one-step advantages of the k steps executed from it, sum_i gamma^i A(t+i) (the TD terms
    telescope to r_t + ... + gamma^k V(s_{t+k}) - V(s_t))."""
    discount = gamma ** torch.arange(rows.shape[1], dtype=step_advantage.dtype)
    return (step_advantage[rows] * discount * executed).sum(1)


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
# Critic targets


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


# ---------------------------------------------------------------------------------------------
# The update rule


def habc_critic_targets(tr: Transitions, critics: Critics, cfg: VLAOnlineConfig) -> CriticTargets:
    """Viability on policy segments, efficiency on the policy's own successes (`critic_targets`)."""
    c = cfg.critic
    credit = "intervention_credit" not in cfg.habc.ablate
    return critic_targets(critics, tr, c.gamma_v, c.gamma_e, c.lam, credit)


def habc_actor_targets(tr: Transitions, critics: Critics, cfg: VLAOnlineConfig, horizon: int) -> ActorTargets:
    """The executed chunks, weighted by HABC's gated advantage (`habc_weights`)."""
    c, a, h = cfg.critic, cfg.actor, cfg.habc
    viability, efficiency = heads(critics, tr, c.gamma_v, c.gamma_e, "intervention_credit" not in h.ablate)
    chunks = executed_chunks(tr.chunk_step, tr.seg_left, horizon) if a.per_chunk else None
    weights, stats = habc_weights(
        tr.intervention,
        viability,
        efficiency,
        Gate(h.gate_k, h.gate_tau, frozenset(h.ablate)),
        Weighting(a.beta, a.w_max, a.normalize),
        h.intervention_weight,
        chunks,
    )
    return ActorTargets(tr.actor_rows, weights, False, stats)


HABC = BufferUpdate(habc_critic_targets, habc_actor_targets)
