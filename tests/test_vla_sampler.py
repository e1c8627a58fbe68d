"""Robot task variants from the sampler registry: the reset seeds a group gets, what the sampler is fed,
Beta-Thompson concentrating on the variants solved about half the time, the sampler's state across a
resume, and the config errors."""

import numpy as np
import pytest
import torch
from pinned_runs import metric_rows

from mmrl.config import ConfigError, load_config
from mmrl.samplers import BetaThompsonSampler, DynamicFilterSampler, Sampler, UniformSampler
from vla_rl.config import group_seeds, seed_block
from vla_rl.online import Episode, GroupSeeds
from vla_rl.policy import VLAConfig, VLAPolicy, task_vocabulary
from vla_rl.trainer import VLAOnlineTrainer


def episode(group: int, seed: int, success: bool) -> Episode:
    return Episode(
        seed=seed, group=group, instruction="reach", states=np.zeros((2, 3), np.float32),
        images=np.zeros((2, 4, 4, 3), np.uint8), actions=np.zeros((1, 5), np.float32),
        is_intervention=np.zeros(1, bool), chunk_step=np.zeros(1, np.int64), success=success,
        terminated=success, interventions=0,
    )  # fmt: skip


def wave_episodes(seeds: list[int], groups: list[int], successes: list[list[bool]]) -> list[Episode]:
    return [
        episode(group, seed, s)
        for seed, group, row in zip(seeds, groups, successes, strict=True)
        for s in row
    ]


class Recording(Sampler):
    """Draws variants 3, 1, 3, ... and records every update."""

    def __init__(self, num_items: int, seed: int = 0) -> None:
        super().__init__(num_items, seed)
        self.updates: list[tuple[list[int], list[float], list[int]]] = []

    def sample(self, n: int) -> list[int]:
        return [3, 1, 3][:n]

    def update(self, indices, rewards, group_ids):
        self.updates.append((list(indices), rewards.tolist(), group_ids.tolist()))
        return torch.tensor([True, False, True][: len(indices)])


def test_fresh_seeds_are_the_iteration_block_and_double_as_group_ids():
    config = load_config("vla/grpo", [])
    seeds = group_seeds(config)
    assert seeds.sampler is None
    seeds.start(2)
    first = config.rollout.seed + 2 * seed_block(config)
    assert seeds.wave(1) == ([first + 2, first + 3], [first + 2, first + 3])  # 8 envs / groups of 4
    seeds.feed([episode(first + 2, first + 2, True)])  # no sampler: nothing to feed, nothing dropped
    assert seeds.dropped == set()


def test_the_sampler_draws_each_groups_variant_and_is_fed_its_successes():
    seeds = GroupSeeds(first_seed=500, group_size=2, per_wave=3, block=10, sampler=Recording(5))
    seeds.start(4)
    reset, groups = seeds.wave(1)
    assert reset == [503, 501, 503]  # the pool's seeds: rollout.seed + variant
    assert groups == [543, 544, 545]  # unique ids from the iteration's block, though variant 3 repeats
    seeds.feed(wave_episodes(reset, groups, [[True, False], [False, False], [True, True]]))
    assert seeds.sampler.updates == [([3, 1, 3], [1.0, 0.0, 0.0, 0.0, 1.0, 1.0], [0, 0, 1, 1, 2, 2])]
    assert seeds.dropped == {544}  # the sampler's keep mask: grpo skips the groups it drops
    seeds.start(5)
    assert seeds.dropped == set() and seeds.variant_of == {}


def test_dynamic_filter_drops_the_groups_outside_its_success_range():
    seeds = GroupSeeds(0, 4, 3, 3, DynamicFilterSampler(6, lo=0.25, hi=0.75))
    seeds.start(0)
    reset, groups = seeds.wave(0)
    successes = [[True] * 4, [True, False, False, False], [True, True, False, False]]
    seeds.feed(wave_episodes(reset, groups, successes))
    assert seeds.dropped == {groups[0]}  # all succeeded: no signal; 1/4 and 2/4 are inside [0.25, 0.75]


@pytest.mark.parametrize("kind", ["beta_thompson", "uniform"])
def test_beta_thompson_concentrates_on_variants_solved_about_half_the_time(kind):
    """12 variants: 4 always solved, 4 never, 4 half the time. Beta-Thompson, fed each group's
    successes, must draw the half-solved ones far more often than a third of the time; the uniform
    sampler (the control) draws them about a third of the time."""
    solve_rate = np.array([1.0] * 4 + [0.0] * 4 + [0.5] * 4)
    sampler = BetaThompsonSampler(12, seed=0) if kind == "beta_thompson" else UniformSampler(12, seed=0)
    seeds = GroupSeeds(first_seed=1000, group_size=8, per_wave=2, block=4, sampler=sampler)
    rng = np.random.default_rng(0)
    drawn = []
    for step in range(60):
        seeds.start(step)
        for wave in range(2):
            reset, groups = seeds.wave(wave)
            variants = [s - 1000 for s in reset]
            drawn += variants if step >= 30 else []
            successes = [list(rng.random(8) < solve_rate[v]) for v in variants]
            seeds.feed(wave_episodes(reset, groups, successes))
    half = np.isin(drawn, np.arange(8, 12)).mean()
    if kind == "beta_thompson":
        assert half > 0.7
    else:
        assert 0.2 < half < 0.45


# ----- config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.sampler=beta_thompson"], "rollout.sampler = 'beta_thompson' .* draws from the pool of "
         "rollout.task_variants, but rollout.task_variants = 0"),
        (["rollout.sampler_options={target: 0.5}"], "rollout.task_variants = 0 gives every group a fresh "
         "seed"),
        (["rollout.task_variants=1"], "rollout.task_variants = 1 is fewer than the 2 groups of a wave"),
        (["rollout.task_variants=8", "rollout.sampler=beta_thompson", "rollout.sampler_options={tagret: 1}"],
         r"rollout.sampler_options = \{'tagret': 1\} for sampler 'beta_thompson': .*tagret"),
        (["rollout.task_variants=8", "rollout.sampler=dynamic_filter", "rollout.sampler_options={low: 0.3}"],
         "rollout.sampler_options = .* for sampler 'dynamic_filter'"),
        (["rollout.task_variants=8", "rollout.sampler=nope"], "rollout.sampler = 'nope': unknown sampler"),
        (["rollout.task_variants=8", "eval.seed=100004"], "eval.seed = 100004 makes evaluation seeds "
         "100004..100103 overlap the training seeds 100000..100007"),
    ],
)  # fmt: skip
def test_config_refuses_bad_task_variant_settings(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("vla/grpo", overrides)


def test_a_pool_frees_the_seeds_after_it():
    with pytest.raises(ConfigError, match="overlap the training seeds"):
        load_config("vla/grpo", ["rollout.seed=0", "eval.seed=500", "eval.episodes=10"])
    config = load_config(
        "vla/grpo", ["rollout.seed=0", "eval.seed=500", "eval.episodes=10", "rollout.task_variants=100"]
    )
    assert group_seeds(config).sampler.num_items == 100


# ----- resume -----------------------------------------------------------------------------------------

SIZE = 32
TINY = [
    "rollout.task=Reach",
    "rollout.env_steps=30",
    "rollout.num_envs=2",
    "rollout.group_size=2",
    "rollout.max_episode_steps=15",
    "rollout.task_variants=5",
    "rollout.sampler=beta_thompson",
    "method=grpo",
    "intervention.enabled=false",
    "checkpoint_every=1",
    "progress=false",
    "eval.episodes=2",
    "eval.num_envs=2",
    "train.updates=2",
    "train.batch_size=8",
    "train.demo_episodes=0",
]


@pytest.mark.needs_rendering
@pytest.mark.parametrize("branch_every", [0, 1])
def test_the_sampler_state_survives_a_resume(tmp_path, branch_every):
    """Flat and snapshot-branched groups: a run stopped after one iteration and resumed repeats the
    straight run's later iterations and ends with the same sampler state."""
    torch.manual_seed(0)
    config = VLAConfig(vocabulary=task_vocabulary(), image_size=SIZE, channels=[8, 8], keypoints=8,
                       hidden=32, horizon=4, n_action_steps=2)  # fmt: skip
    VLAPolicy(config).save_pretrained(tmp_path / "base")

    def run(name, *overrides):
        paths = [f"output_dir={tmp_path / name}", f"model.path={tmp_path / 'base'}"]
        cfg = load_config("vla/habc", [*paths, *TINY, f"grpo.branch_every={branch_every}", *overrides])
        trainer = VLAOnlineTrainer(cfg)
        trainer.train()
        return trainer.group_seeds.sampler.state_dict(), metric_rows(tmp_path / name)

    straight, rows = run("straight", "steps=3")
    run("stopped", "steps=1")
    with pytest.warns(UserWarning, match="config changes"):
        resumed, resumed_rows = run("stopped", "steps=3", "resume=true")
    assert resumed_rows[1:] == rows[1:] and "dropped_groups" in rows[-1]
    assert straight["alpha"].sum() + straight["beta"].sum() > 2 * 5  # it was fed: the posteriors moved
    for key in ("alpha", "beta", "generator_state"):
        assert torch.equal(resumed[key], straight[key])


@pytest.mark.needs_rendering
def test_branched_groups_draw_variants_and_skip_the_groups_the_filter_drops(tmp_path):
    """Branched GRPO with dynamic_filter over a pool of 6 variants: every leaf starts from a pool seed,
    and as the untrained policy fails every episode, the filter drops every group and grpo trains on
    none (an iteration with nothing to train on is not an error)."""
    torch.manual_seed(0)
    config = VLAConfig(vocabulary=task_vocabulary(), image_size=SIZE, channels=[8, 8], keypoints=8,
                       hidden=32, horizon=4, n_action_steps=2)  # fmt: skip
    VLAPolicy(config).save_pretrained(tmp_path / "base")
    overrides = [f"output_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'base'}", *TINY]
    overrides += ["rollout.sampler=dynamic_filter", "rollout.task_variants=6", "grpo.branch_every=1"]
    trainer = VLAOnlineTrainer(load_config("vla/habc", overrides))
    trainer.setup()
    groups = trainer.collect_branched(0)
    assert {leaf.seed for leaf in groups.leaves} <= set(range(100_000, 100_006))
    assert trainer.group_seeds.sampler.groups_seen == len(groups.trees)
    metrics = trainer.train_step(1)
    assert metrics["success_rate"] == 0.0 and metrics["branch_points"] > 0
    assert metrics["dropped_groups"] == metrics["rollout_episodes"] // 2
    assert metrics["grpo_chunks"] == 0 and metrics["actor_updates"] == 0
    for env in trainer.envs:
        env.close()
