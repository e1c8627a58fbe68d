"""The robot trainer's plan for `mmrl train vla/... --dry-run` (see `mmrl.memory_plan`).

The policy is small next to what a robot run keeps in host memory: every stored transition holds a camera
frame, and the demonstrations are decoded into tensors once. So the plan loads the policy from
`model.path` (our VLAPolicy, or a LeRobot flow-matching policy such as SmolVLA, whose frozen VLM counts
as weights without gradients or optimizer states; both load on the CPU, no meta device), makes one
environment of the task without rendering to read its spaces, instruction and time limit (and to run the
expert when the demonstrations' length must be estimated), and measures each phase on real tensors of the
config's sizes with `LiveTensorBytes`: an actor update (`train.batch_size` action chunks, backward,
optimizer step), a critic update (`critic.batch_size` states per head), a rollout step
(`rollout.num_envs` observations) and an evaluation step (`eval.num_envs`). Beside the phases it counts,
from the config and the spaces, the replay buffer when full (or when it holds everything the run
collects), the flat transition rows an update builds from it, the buffer's second copy while a checkpoint
is written, the decoded demonstrations and the environments (a rough figure per simulator and renderer).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mmrl.config import ConfigError, shipped_path
from mmrl.memory_plan import (
    MemoryPlan,
    PhasePeak,
    measure_phase,
    optimizer_state_bytes,
    parameter_count,
    weight_bytes,
)
from vla_rl.config import ENV_BYTES, VLAOnlineConfig
from vla_rl.lerobot_checks import load_info
from vla_rl.loading import is_lerobot_policy_dir, load
from vla_rl.methods import UPDATES
from vla_rl.methods.critics import Critics
from vla_rl.policy import instruction_words

# bytes per transition beside its frame, state and action: reward (float32), is_intervention (bool),
# chunk_step (int64)
STEP_EXTRA_BYTES = 4 + 1 + 8
# bytes per row of the flat transitions an update builds (`vla_rl.online.Transitions`) beside its two
# state vectors and action: eight int64 / bool index columns, rounded up
FLAT_EXTRA_BYTES = 64
EXPERT_PROBE_EPISODES = 4  # expert episodes run to estimate the demonstrations' length


def task_env(task: str, max_episode_steps: int) -> Any:
    """One environment of `task` with the run's time limit, without rendering: its spaces, instruction
    and limit are the run's, and the expert probe steps it."""
    import sim

    kwargs: dict[str, Any] = {"obs_mode": "state"}
    if max_episode_steps:
        kwargs["max_episode_steps"] = max_episode_steps
    return sim.make(task, **kwargs)


def expert_episode_steps(env: Any, task: str, episodes: int = EXPERT_PROBE_EPISODES) -> float:
    """The scripted expert's mean episode length on reset seeds 0 .. episodes-1."""
    from sim import expert_for

    expert, steps = expert_for(task), 0
    for seed in range(episodes):
        env.reset(seed=seed)
        done = False
        while not done:
            _, _, terminated, truncated, _ = env.step(expert.act(env))
            done, steps = terminated or truncated, steps + 1
    return steps / episodes


def demo_frames(config: VLAOnlineConfig, env: Any) -> tuple[int, str]:
    """How many demonstration frames the run decodes, and how that was found."""
    t = config.train
    if t.demos:
        info = load_info(shipped_path(t.demos))
        return int(info["total_frames"]), f"{info['total_frames']:,d} frames in train.demos"
    if t.demo_episodes:
        length = expert_episode_steps(env, config.rollout.task)
        return round(t.demo_episodes * length), (
            f"about {t.demo_episodes} episodes (train.demo_episodes) x {length:.0f} steps, the expert's "
            f"mean on {EXPERT_PROBE_EPISODES} reset seeds"
        )
    return 0, "none"


def online_memory_plan(config: VLAOnlineConfig, recipe: str, processes: int) -> MemoryPlan:
    r, t, c = config.rollout, config.train, config.critic
    path = shipped_path(config.model.path)
    lerobot = is_lerobot_policy_dir(path)
    try:
        policy = load(path).train()
    except (FileNotFoundError, ConfigError) as err:
        raise ConfigError(f"config error: model.path = {config.model.path!r}: {err}") from None
    size, horizon = policy.config.image_size, policy.config.horizon
    env = task_env(r.task, r.max_episode_steps)
    try:
        task = {
            "state_dim": env.observation_space["state"].shape[0],
            "action_dim": env.action_space.shape[0],
            "instruction": env.get_wrapper_attr("instruction"),
            "max_steps": env.spec.max_episode_steps if env.spec is not None else None,
        }
        frames, frames_source = demo_frames(config, env)
    finally:
        env.close()
    if not lerobot:
        policy.add_words(instruction_words(task["instruction"]))
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=t.lr)
    generator = torch.Generator().manual_seed(0)
    critics = Critics(task["state_dim"], c.hidden)
    critic_optimizer = torch.optim.Adam(critics.parameters(), lr=c.lr)
    uses_critics = UPDATES[config.method].trains_critics

    def observations(rows: int) -> dict[str, Any]:
        return {
            "image": np.zeros((rows, size, size, 3), np.uint8),
            "state": np.zeros((rows, task["state_dim"]), np.float32),
        }

    def batch(rows: int) -> dict[str, Any]:
        inputs = policy.prepare(observations(rows), [task["instruction"]] * rows)
        return inputs if lerobot else inputs | {"state": torch.zeros(rows, task["state_dim"])}

    def actor_update() -> None:
        actions = torch.zeros(t.batch_size, horizon, task["action_dim"])
        if lerobot:
            ones = torch.ones(t.batch_size, horizon)
            loss = policy.chunk_loss(batch(t.batch_size), actions, ones.bool(), ones, generator)
        else:
            dist = policy(batch(t.batch_size))
            loss = -dist.log_prob(actions).mean()
            if dist.state_loss is not None:
                loss = loss + dist.state_loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def critic_update() -> None:
        states = torch.zeros(2 * c.batch_size, task["state_dim"])  # one minibatch per head
        logit, u = critics(states)
        (logit.square().mean() + u.square().mean()).backward()
        critic_optimizer.step()
        critic_optimizer.zero_grad(set_to_none=True)

    def act(rows: int) -> None:
        policy.sample_chunks(observations(rows), [task["instruction"]] * rows, generator)

    actor_update()  # the first steps create the optimizers' states, which every later phase holds
    critic_update()
    phases = {f"actor update ({t.batch_size} chunks)": measure_phase(actor_update, policy, optimizer)}
    if uses_critics:
        critic = measure_phase(critic_update, policy, optimizer)
        phases[f"critic update ({c.batch_size} states per head)"] = critic
    phases[f"rollout step ({r.num_envs} envs)"] = measure_phase(lambda: act(r.num_envs), policy, optimizer)
    phases[f"evaluation step ({config.eval.num_envs} envs)"] = measure_phase(
        lambda: act(config.eval.num_envs), policy, optimizer
    )

    collected = config.steps * r.env_steps
    # each kind holds at most its capacity; the expert's steps only with take-overs on
    online = min(t.buffer_capacity, collected) * (2 if config.intervention.enabled else 1)
    transitions = online + min(t.failure_capacity, collected)
    state_bytes = 4 * task["state_dim"]
    step_bytes = 3 * size * size + state_bytes + 4 * task["action_dim"] + STEP_EXTRA_BYTES
    buffer = transitions * step_bytes
    flat = online * (2 * state_bytes + 4 * task["action_dim"] + FLAT_EXTRA_BYTES)
    weights, states = weight_bytes([policy]), optimizer_state_bytes(optimizer)
    update = max(phases.values(), key=lambda p: p.transient)
    phases["update on the buffer's flat rows"] = PhasePeak(weights, states, update.transient + flat)
    if config.checkpoint_every:
        phases["checkpoint (a copy of the buffer)"] = PhasePeak(weights, states, buffer)
    # per decoded frame: image, state (and proprio and tokens for our policy; the instruction's index
    # for a LeRobot one), the action chunk and its mask
    words = 8 if lerobot else 4 * policy.config.proprio_dim + 8 * policy.config.max_words
    frame_bytes = 3 * size * size + state_bytes + words + horizon * (4 * task["action_dim"] + 1)
    other = {"critics": weight_bytes([critics]) + optimizer_state_bytes(critic_optimizer)}
    held = {
        "replay buffer": buffer,
        "demonstrations": frames * frame_bytes,
        "environments": (r.num_envs + config.eval.num_envs) * ENV_BYTES,
    }
    iv = config.intervention
    per_episode = f"at most {iv.max_per_episode}" if iv.max_per_episode else "any number"
    expert = (
        f"take-overs of {iv.takeover_steps} steps, {per_episode} per episode"
        if iv.enabled
        else "no take-overs (intervention.enabled = false)"
    )
    work = {
        "env steps": f"at least {r.env_steps:,d} (rollout.env_steps), in waves of {r.num_envs} episodes",
        "episode length": f"at most {task['max_steps']} steps" if task["max_steps"] else "unlimited",
        "expert": f"{expert}; demonstrations: {frames_source}",
        "actor updates": f"{t.updates} of {t.batch_size} chunks (train.updates x train.batch_size)",
        "critic updates": f"{c.updates} of {c.batch_size} states per head" if uses_critics else "none",
        "replay buffer": f"{transitions:,d} transitions when full, {step_bytes:,d} bytes each "
        f"({size} px frames)",
        "environments": f"{r.num_envs} + {config.eval.num_envs} (rollout.num_envs + eval.num_envs), about "
        f"{ENV_BYTES / 2**20:.0f} MiB each: a rough figure per simulator and renderer",
    }
    warnings = []
    if processes > 1:
        warnings.append(
            f"the vla_online trainer runs in one process; --processes {processes} would be refused at start"
        )
    return MemoryPlan(
        recipe=recipe,
        processes=processes,
        parameters=parameter_count([policy, critics]),
        trainable=parameter_count([policy, critics], trainable=True),
        gradients=sum(p.numel() * p.element_size() for p in trainable),
        other_weights=other,
        phases=phases,
        held=held,
        work=work,
        batch=[f"rollout.num_envs = {r.num_envs}, train.batch_size = {t.batch_size}, one process"],
        warnings=warnings,
    )
