"""Several rewards at once (weighted terms, group normalisation, per-term metrics), a held-out gold
reward logged at every evaluation with the reward-hacking flag in eval.json, and the strict scorer
of the shapes world that the gold reward is meant to be."""

import json

import numpy as np
import pytest
import torch

from diffusion_rl.alignment import load_scorer
from diffusion_rl.branch_grpo import BranchGRPOTrainer
from diffusion_rl.branch_rollout import rollout_trees
from diffusion_rl.config import BranchGRPOConfig
from diffusion_rl.models import FlowPipeline
from diffusion_rl.reward_config import weight_at
from diffusion_rl.reward_terms import build_reward_terms, combine_rewards, group_zscore, reward_hacking_record
from diffusion_rl.shapes import (
    Scene,
    ShapeObject,
    prompt_text,
    render,
    render_batch,
    sample_cluttered_scene,
    sample_spec,
    scene_for_spec,
    vocabulary,
)
from diffusion_rl.shapes_strict import strict_checks
from mmrl.cli import load_plugins
from mmrl.config import ConfigError, build, load_config, to_dict
from mmrl.registry import REWARDS
from tests.tiny_flow import SMALL

load_plugins()

TERMS = (
    "reward.terms=[{name: jpeg_incompressibility, weight: 1.0}, "
    "{name: jpeg_compressibility, weight: 0.5, options: {quality: 90}}]"
)
WITH_TERMS = ["reward.name=null", TERMS]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_flow")
    FlowPipeline.tiny(vocabulary(), SMALL).save_pretrained(path)
    return path


def config_for(model_dir, run_dir, *overrides):
    return load_config(
        "diffusion/branchgrpo",
        [
            f"model.path={model_dir}",
            f"output_dir={run_dir}",
            "progress=false",
            "rollout.prompts_per_step=2",
            "rollout.steps=4",
            "rollout.split_steps=[0,2]",  # 4 leaves per prompt
            "rollout.guidance_scale=1.0",
            "reward.name=jpeg_incompressibility",
            "eval.prompts=2",
            "eval.steps=2",
            *overrides,
        ],
    )


def trainer_for(model_dir, run_dir, *overrides, setup=True):
    trainer = BranchGRPOTrainer(config_for(model_dir, run_dir, *overrides))
    if setup:
        trainer.seed_everything()
        trainer.setup()
    return trainer


def rollout(trainer):
    prompts = [trainer.prompts[3], trainer.prompts[5]]
    cond = trainer.pipe.encode_prompts(prompts)
    uncond = trainer.uncond_one[[0, 0]]
    trees, leaves, _ = rollout_trees(
        trainer.pipe, cond, uncond, [3, 5], trainer.plan, trainer.config.rollout, 0, 0
    )
    return trees, leaves, prompts


def fixed(values):
    return lambda images, prompts, **_: torch.tensor(values, dtype=torch.float32)


def rows_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# -- weighting and normalisation --------------------------------------------------------------------


def test_weighted_sum_without_normalisation():
    raw = {"a": torch.tensor([1.0, 2.0, 3.0, 4.0]), "b": torch.tensor([10.0, 0.0, 10.0, 0.0])}
    total = combine_rewards(raw, {"a": 1.0, "b": 0.1}, [2, 2], "none")
    assert total.dtype == torch.float32
    torch.testing.assert_close(total, torch.tensor([2.0, 2.0, 4.0, 4.0]))


def test_group_normalisation_z_scores_each_term_within_each_group_before_weighting():
    # groups [1, 3] | [5, 5] for a, [0, 4] | [2, 6] for b: population std 1 | 0 and 2 | 2
    raw = {"a": torch.tensor([1.0, 3.0, 5.0, 5.0]), "b": torch.tensor([0.0, 4.0, 2.0, 6.0])}
    torch.testing.assert_close(
        group_zscore(raw["a"], [2, 2]),
        torch.tensor([-1.0, 1.0, 0.0, 0.0], dtype=torch.float64),
        atol=1e-5,
        rtol=0,
    )
    assert group_zscore(raw["a"], [2, 2])[2:].eq(0).all()  # equal rewards: exactly 0
    total = combine_rewards(raw, {"a": 2.0, "b": -0.5}, [2, 2], "group")
    # a: [-1, 1, 0, 0] * 2; b: [-1, 1, -1, 1] * -0.5
    torch.testing.assert_close(total, torch.tensor([-1.5, 1.5, 0.5, -0.5]), atol=1e-5, rtol=0)
    # the scale of a term does not matter once normalised
    scaled = combine_rewards({"a": raw["a"] * 1000, "b": raw["b"]}, {"a": 2.0, "b": -0.5}, [2, 2], "group")
    torch.testing.assert_close(scaled, total, atol=1e-5, rtol=0)


def test_score_weights_the_terms_per_tree_and_keeps_their_means(model_dir, tmp_path):
    trainer = trainer_for(model_dir, tmp_path, *WITH_TERMS, "reward.normalize=group")
    a = [0.0, 2.0, 0.0, 2.0, 1.0, 1.0, 1.0, 1.0]  # tree 0: z = -1, 1, -1, 1; tree 1: all equal, 0
    b = [3.0, 3.0, 3.0, 3.0, 0.0, 0.0, 4.0, 4.0]  # tree 0: 0; tree 1: z = -1, -1, 1, 1
    trainer.reward_terms = [
        trainer.reward_terms[0]._replace(fn=fixed(a)),
        trainer.reward_terms[1]._replace(fn=fixed(b)),
    ]
    trees, leaves, prompts = rollout(trainer)
    rewards, images = trainer.score(trees, leaves, prompts)
    assert images.shape[0] == 8
    expected = torch.tensor([-1.0, 1.0, -1.0, 1.0, -0.5, -0.5, 0.5, 0.5])  # 1.0 * z(a) + 0.5 * z(b)
    torch.testing.assert_close(rewards, expected, atol=1e-5, rtol=0)
    assert trainer.reward_metrics() == {
        "reward_jpeg_incompressibility": 1.0,
        "reward_jpeg_compressibility": 2.5,
    }

    trainer.config.reward.normalize = "none"
    rewards, _ = trainer.score(trees, leaves, prompts)
    torch.testing.assert_close(rewards, torch.tensor(a) + 0.5 * torch.tensor(b))


def test_the_same_reward_with_other_options_is_a_second_term_under_its_label(model_dir, tmp_path):
    trainer = trainer_for(
        model_dir,
        tmp_path,
        "reward.name=null",
        "reward.terms=[{name: jpeg_compressibility, options: {quality: 90}}, "
        "{name: jpeg_compressibility, weight: 0.5, options: {quality: 10}, label: jpeg_q10}]",
    )
    assert [(t.name, t.label, t.weight) for t in trainer.reward_terms] == [
        ("jpeg_compressibility", "jpeg_compressibility", 1.0),
        ("jpeg_compressibility", "jpeg_q10", 0.5),
    ]
    trees, leaves, prompts = rollout(trainer)
    rewards, images = trainer.score(trees, leaves, prompts)
    high = REWARDS.get("jpeg_compressibility")(quality=90)(images, prompts=prompts)
    low = REWARDS.get("jpeg_compressibility")(quality=10)(images, prompts=prompts)
    assert not torch.allclose(high, low)  # the options reach each term's own scorer
    torch.testing.assert_close(rewards, high + 0.5 * low)
    metrics = trainer.reward_metrics()
    assert metrics.keys() == {"reward_jpeg_compressibility", "reward_jpeg_q10"}
    assert metrics["reward_jpeg_q10"] == pytest.approx(low.mean().item())
    assert set(trainer.heldout_rewards()) == {"jpeg_compressibility", "jpeg_q10", "gold"}


def test_one_reward_is_scored_as_before_and_logs_no_terms(model_dir, tmp_path):
    trainer = trainer_for(model_dir, tmp_path)
    values = [0.0, 2.0, 0.0, 2.0, 1.0, 1.0, 1.0, 1.0]
    trainer.reward_fn = fixed(values)
    trees, leaves, prompts = rollout(trainer)
    rewards, _ = trainer.score(trees, leaves, prompts)
    assert torch.equal(rewards, torch.tensor(values))
    assert trainer.reward_metrics() == {}
    trainer.config.reward.normalize = "group"  # one reward, normalised: z-scored, its raw mean logged
    rewards, _ = trainer.score(trees, leaves, prompts)
    torch.testing.assert_close(rewards, torch.tensor([-1.0, 1.0, -1.0, 1.0, 0, 0, 0, 0]), atol=1e-5, rtol=0)
    assert trainer.reward_metrics() == {"reward_jpeg_incompressibility": 1.0}


def test_each_terms_mean_is_logged_every_step_and_the_total_is_trained(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("diffusion_rl.trainer.evaluate_alignment", lambda *a, **k: {"heldout_alignment": 0.0})
    trainer = trainer_for(model_dir, tmp_path, *WITH_TERMS, "steps=2", "checkpoint_every=2", setup=False)
    trainer.train()
    rows = rows_of(tmp_path)
    assert len(rows) == 2
    for row in rows:
        incompressible, compressible = (
            row["reward_jpeg_incompressibility"],
            row["reward_jpeg_compressibility"],
        )
        assert incompressible > 0 > compressible  # kB, and minus kB at quality 90
        assert row["reward"] == pytest.approx(incompressible + 0.5 * compressible, rel=1e-4)


def test_a_weight_schedule_gives_each_step_its_weight():
    held = {"steps": [0, 10, 20], "values": [0.0, 1.0, 3.0], "interpolate": "step"}
    assert [weight_at(held, step) for step in (0, 5, 10, 15, 20, 99)] == [0.0, 0.0, 1.0, 1.0, 3.0, 3.0]
    line = {"steps": [10, 20], "values": [1.0, 3.0], "interpolate": "linear"}
    assert [weight_at(line, step) for step in (1, 10, 15, 19, 20, 30)] == [1.0, 1.0, 2.0, 2.8, 3.0, 3.0]
    assert weight_at(0.5, 7) == 0.5


def test_a_scheduled_run_trains_each_step_on_its_weights_and_logs_them(model_dir, tmp_path, monkeypatch):
    """Term a is trained alone at step 1 and term b alone from step 2 on (weights swapped halfway):
    the trained reward follows the schedule, and the weights are logged with the terms."""
    monkeypatch.setattr("diffusion_rl.trainer.evaluate_alignment", lambda *a, **k: {"heldout_alignment": 0.0})
    schedule = (
        "reward.terms=[{name: jpeg_incompressibility, weight: {steps: [1, 2], values: [1.0, 0.0]}}, "
        "{name: jpeg_compressibility, label: smooth, weight: {steps: [1, 2], values: [0.0, 1.0]}}]"
    )
    trainer = trainer_for(
        model_dir, tmp_path, "reward.name=null", schedule, "steps=3", "checkpoint_every=3", setup=False
    )
    trainer.train()
    rows = rows_of(tmp_path)
    assert [(row["reward_weight_jpeg_incompressibility"], row["reward_weight_smooth"]) for row in rows] == [
        (1.0, 0.0),
        (0.0, 1.0),
        (0.0, 1.0),
    ]
    assert rows[0]["reward"] == pytest.approx(rows[0]["reward_jpeg_incompressibility"], rel=1e-4)
    for row in rows[1:]:
        assert row["reward"] == pytest.approx(row["reward_smooth"], rel=1e-4) and row["reward"] < 0


# -- configuration --------------------------------------------------------------------------------


def test_terms_load_with_defaults_and_survive_a_saved_config(tmp_path):
    config = load_config("diffusion/branchgrpo", [*WITH_TERMS, "reward.normalize=group"])
    assert config.reward.name is None
    assert config.reward.terms == [
        {"name": "jpeg_incompressibility", "weight": 1.0, "options": {}, "label": "jpeg_incompressibility"},
        {
            "name": "jpeg_compressibility",
            "weight": 0.5,
            "options": {"quality": 90},
            "label": "jpeg_compressibility",
        },
    ]
    assert build(BranchGRPOConfig, to_dict(config)) == config  # config.yaml of a run reloads
    plain = load_config("diffusion/branchgrpo")
    assert (plain.reward.name, plain.reward.terms, plain.reward.normalize) == ("geneval_mini", None, "none")
    assert build(BranchGRPOConfig, to_dict(plain)) == plain
    weight_one = load_config(
        "diffusion/nft", ["reward.name=null", "reward.options={}", "reward.terms=[{name: geneval_mini}]"]
    )
    assert weight_one.reward.terms == [
        {"name": "geneval_mini", "weight": 1.0, "options": {}, "label": "geneval_mini"}
    ]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["reward.terms=[]"], r"reward.terms is an empty list"),
        (
            ["reward.terms=[{name: genevl_mini}]"],
            r"reward.terms\[0\].name = 'genevl_mini'.*did you mean 'geneval_mini'",
        ),
        (
            ["reward.terms=[{name: geneval_mini, weight: .nan}]"],
            r"reward.terms\[0\].weight = nan is not a finite",
        ),
        (
            ["reward.terms=[{name: geneval_mini, weight: -.inf}]"],
            r"reward.terms\[0\].weight = -inf is not a finite",
        ),
        (
            ["reward.terms=[{name: geneval_mini, weight: heavy}]"],
            r"reward.terms\[0\].weight = 'heavy' is not a number",
        ),
        (["reward.terms=[{name: geneval_mini, weight: 0}]"], r"every weight is 0"),
        (
            ["reward.terms=[{name: geneval_mini}, {name: geneval_mini, weight: 2}]"],
            r"reward.terms\[1\] is logged as 'geneval_mini' like reward.terms\[0\].*another label",
        ),
        (
            ["reward.terms=[{name: geneval_mini, label: shapes_strict}, {name: shapes_strict}]"],
            r"reward.terms\[1\] is logged as 'shapes_strict' like reward.terms\[0\]",
        ),
        (
            ["reward.terms=[{name: geneval_mini, label: Strict-1}]"],
            r"reward.terms\[0\].label = 'Strict-1' is not a label of lower-case letters",
        ),
        (
            ["reward.terms=[{name: geneval_mini, label: gold}]"],
            r"reward.terms\[0\].label = 'gold' would overwrite the metric heldout_gold",
        ),
        (
            ["reward.terms=[{name: geneval_mini, wieght: 2}]"],
            r"'reward.terms\[0\].wieght'.*did you mean 'reward.terms\[0\].weight'",
        ),
        (["reward.terms=[{weight: 2}]"], r"reward.terms\[0\].name is missing"),
        (
            ["reward.terms=[{name: geneval_mini, weight: {steps: [0, 5], values: [1.0]}}]"],
            r"reward.terms\[0\].weight = .*two lists of one length",
        ),
        (
            ["reward.terms=[{name: geneval_mini, weight: {steps: [5, 5], values: [1, 2]}}]"],
            r"reward.terms\[0\].weight.steps = \[5, 5\]: the steps must increase",
        ),
        (
            ["reward.terms=[{name: geneval_mini, weight: {steps: [0, 1.5], values: [1, 2]}}]"],
            r"reward.terms\[0\].weight.steps\[1\] = 1.5 is not a step",
        ),
        (
            ["reward.terms=[{name: geneval_mini, weight: {steps: [0], values: [1], interpolate: cubic}}]"],
            r"reward.terms\[0\].weight.interpolate = 'cubic'",
        ),
        (
            ["reward.terms=[{name: geneval_mini, weight: {steps: [0], values: [.nan]}}]"],
            r"reward.terms\[0\].weight.values\[0\] = nan is not a finite",
        ),
        (
            ["reward.terms=[{name: geneval_mini, weight: {step: [0], values: [1]}}]"],
            r"'reward.terms\[0\].weight.step'.*did you mean 'reward.terms\[0\].weight.steps'",
        ),
        (
            ["reward.terms=[{name: geneval_mini, weight: {steps: [0, 9], values: [0, 0]}}]"],
            r"every weight is 0",
        ),
        (["reward.terms=[3]"], r"reward.terms\[0\] = 3 is not a mapping"),
        (["reward.terms={name: geneval_mini}"], r"reward.terms = .* is not a list"),
        (
            ["reward.terms=[{name: geneval_mini, options: 3}]"],
            r"reward.terms\[0\].options = 3 is not a mapping",
        ),
        (
            ["reward.options={quality: 3}", "reward.terms=[geneval_mini]"],
            r"reward.options = .* is given with reward.terms.*set reward.options=\{\}",
        ),
        (["reward.normalize=groups"], r"reward.normalize = 'groups' is not allowed.*did you mean 'group'"),
        (
            ["eval.gold_reward.name=shapes_stric"],
            r"eval.gold_reward.name = 'shapes_stric'.*did you mean 'shapes_strict'",
        ),
        (
            ["eval.gold_reward.nme=shapes_strict"],
            r"'eval.gold_reward.nme'.*did you mean 'eval.gold_reward.name'",
        ),
        (["eval.gold_reward=[1]"], r"eval.gold_reward = \[1\] is not a mapping"),
    ],
)
def test_bad_reward_lists_are_one_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("diffusion/branchgrpo", ["reward.name=null", *overrides])


def test_name_and_terms_together_are_refused():
    with pytest.raises(
        ConfigError, match=r"reward.name = 'geneval_mini' and reward.terms are both given.*null"
    ):
        load_config("diffusion/branchgrpo", ["reward.terms=[{name: jpeg_compressibility}]"])


def test_a_recipes_options_left_for_another_reward_name_the_fix():
    config = load_config("diffusion/nft", ["reward.name=geneval_mini"])  # count_shapes stays
    with pytest.raises(ConfigError, match=r"count_shapes.*reward.options=\{\} for none"):
        build_reward_terms(config.reward)
    cleared = load_config("diffusion/nft", ["reward.name=geneval_mini", "reward.options={}"])
    assert build_reward_terms(cleared.reward)[0].name == "geneval_mini"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [
                *WITH_TERMS[:1],
                "reward.terms=[{name: geneval_mini}, {name: jpeg_compressibility, options: {quality: 0}}]",
            ],
            r"reward.terms\[1\].options.quality = 0",
        ),
        (
            [*WITH_TERMS[:1], "reward.terms=[{name: jpeg_compressibility, options: {qualty: 9}}]"],
            r"reward.terms\[0\].options = \{'qualty': 9\}",
        ),
        (
            ["eval.gold_reward={name: jpeg_compressibility, options: {quality: 500}}"],
            r"eval.gold_reward.options.quality",
        ),
        (
            ["eval.gold_reward=jpeg_incompressibility"],
            r"eval.gold_reward.name = 'jpeg_incompressibility' is also a trained",
        ),
    ],
)
def test_reward_options_and_a_trained_gold_reward_fail_at_setup_naming_the_key(
    model_dir, tmp_path, overrides, message
):
    trainer = trainer_for(model_dir, tmp_path, *overrides, setup=False)
    with pytest.raises(ConfigError, match=message):
        trainer.setup()


# -- the gold reward and the reward-hacking flag ----------------------------------------------------


def test_gold_reward_is_logged_at_every_evaluation(model_dir, tmp_path):
    trainer = trainer_for(
        model_dir,
        tmp_path,
        *WITH_TERMS,
        "eval.gold_reward=shapes_strict",
        "steps=2",
        "eval_every=1",
        "checkpoint_every=2",
        setup=False,
    )
    trainer.train()
    evals = json.loads((tmp_path / "eval.json").read_text())
    expected = {
        "heldout_alignment",
        "heldout_jpeg_incompressibility",
        "heldout_jpeg_compressibility",
        "heldout_reward",
        "heldout_gold",
    }
    for when in ("before", "after"):
        assert set(evals[when]) == expected
        assert 0.0 <= evals[when]["heldout_gold"] <= 1.0
        terms = (
            evals[when]["heldout_jpeg_incompressibility"] + 0.5 * evals[when]["heldout_jpeg_compressibility"]
        )
        assert evals[when]["heldout_reward"] == pytest.approx(terms)
    rows = rows_of(tmp_path)
    assert {f"eval_{key}" for key in expected} <= set(rows[0])  # eval_every=1: after step 1 of 2
    assert isinstance(evals["divergence"]["reward_hacking_suspected"], bool)
    assert evals["divergence"]["trained_metric"] == "heldout_reward"


class ScriptedEvaluation:
    """evaluate_alignment's stand-in: every call the trained rewards' held-out means move by
    `trained_step` and the gold reward's by `gold_step`, each prompt's score by the same step plus,
    when `spread` > 0, a fixed per-prompt offset drawn anew each call (noise that pairs do not cancel)."""

    def __init__(self, trained_step, gold_step, spread=0.0, prompts=16):
        self.calls, self.trained_step, self.gold_step = 0, trained_step, gold_step
        self.spread, self.prompts = spread, prompts

    def __call__(self, *args, rewards=None, per_prompt=None, **kwargs):
        n, self.calls = self.calls, self.calls + 1
        metrics = {"heldout_alignment": 0.5}
        noise = torch.Generator().manual_seed(n)
        for key in rewards or {}:
            step = self.gold_step if key == "gold" else self.trained_step
            offsets = torch.randn(self.prompts, generator=noise, dtype=torch.float64) * self.spread
            scores = 1.0 + n * step + offsets - offsets.mean()  # the mean moves by exactly `step`
            metrics[f"heldout_{key}"] = float(scores.mean())
            if per_prompt is not None:
                per_prompt[f"heldout_{key}"] = scores.tolist()
        return metrics


def train_with_gold_reward(model_dir, tmp_path, monkeypatch, evaluation) -> None:
    """Two steps with a gold reward, evaluated before, after step 1 and after by `evaluation`."""
    monkeypatch.setattr("diffusion_rl.trainer.evaluate_alignment", evaluation)
    trainer = trainer_for(
        model_dir,
        tmp_path,
        "eval.gold_reward={name: shapes_strict}",
        "steps=2",
        "eval_every=1",
        "checkpoint_every=2",
        setup=False,
    )
    trainer.train()


@pytest.mark.parametrize(
    ("trained_step", "gold_step", "suspected", "degraded"),
    [
        (0.1, -0.05, True, False),
        (0.1, 0.05, False, False),
        (-0.1, -0.05, False, True),  # both fall: the run degraded, it does not game its reward
        (0.0, -0.05, False, True),
    ],
)
def test_divergence_of_trained_and_gold_rewards_is_flagged(
    model_dir, tmp_path, monkeypatch, capsys, trained_step, gold_step, suspected, degraded
):
    evaluation = ScriptedEvaluation(trained_step, gold_step)
    train_with_gold_reward(model_dir, tmp_path, monkeypatch, evaluation)
    assert evaluation.calls == 3  # before, after step 1, after
    record = json.loads((tmp_path / "eval.json").read_text())["divergence"]
    assert record["reward_hacking_suspected"] is suspected
    assert record["gold_fell"] is (suspected or degraded)
    assert record["trained_metric"] == "heldout_jpeg_incompressibility"
    assert record["trained_delta"] == pytest.approx(2 * trained_step)
    assert record["gold_delta"] == pytest.approx(2 * gold_step)
    assert record["gold_se"] == pytest.approx(0.0, abs=1e-12)  # every prompt moved alike
    scores = json.loads((tmp_path / "heldout_scores.json").read_text())
    assert set(scores) == {"before", "after"}
    assert len(scores["after"]["heldout_gold"]) == 16
    err = capsys.readouterr().err
    hacking = [line for line in err.splitlines() if "reward hacking suspected" in line]
    worse = [line for line in err.splitlines() if "the run degraded" in line]
    assert (len(hacking), len(worse)) == (int(suspected), int(degraded))
    if suspected:
        assert "trained reward's heldout_jpeg_incompressibility rose by +0.2000" in hacking[0]
        assert "shapes_strict (heldout_gold) fell by -0.1000" in hacking[0]
    if degraded:
        assert f"moved by {2 * trained_step:+.4f}" in worse[0]


@pytest.mark.parametrize(("spread", "flagged"), [(0.5, False), (0.01, True)])
def test_a_gold_fall_within_the_paired_noise_is_not_flagged(
    model_dir, tmp_path, monkeypatch, capsys, spread, flagged
):
    """The same mean changes (trained +0.2, gold -0.1): with per-prompt scores that move apart by
    about 0.7 between evaluations, a 0.1 fall over 16 prompts is within two paired standard errors
    and not flagged; with prompts that move together it is."""
    train_with_gold_reward(model_dir, tmp_path, monkeypatch, ScriptedEvaluation(0.1, -0.05, spread=spread))
    record = json.loads((tmp_path / "eval.json").read_text())["divergence"]
    assert record["gold_delta"] == pytest.approx(-0.1)
    assert (record["gold_se"] > 0.05) is not flagged
    assert record["reward_hacking_suspected"] is flagged and record["gold_fell"] is flagged
    assert ("reward hacking suspected" in capsys.readouterr().err) is flagged


def test_without_a_gold_reward_evaluation_and_eval_json_are_as_before(model_dir, tmp_path, monkeypatch):
    calls = []

    def evaluation(*args, **kwargs):
        calls.append(kwargs)
        return {"heldout_alignment": 0.5}

    monkeypatch.setattr("diffusion_rl.trainer.evaluate_alignment", evaluation)
    trainer = trainer_for(
        model_dir, tmp_path, "eval.gold_reward=null", "steps=1", "checkpoint_every=1", setup=False
    )
    trainer.train()
    assert calls == [{}, {}]  # no extra rewards asked for
    assert json.loads((tmp_path / "eval.json").read_text()) == {
        "before": {"heldout_alignment": 0.5},
        "after": {"heldout_alignment": 0.5},
    }


def test_reward_hacking_record():
    first = {"heldout_reward": 1.0, "heldout_gold": 0.5}
    record = reward_hacking_record(
        first, {"heldout_reward": 1.5, "heldout_gold": 0.25}, "heldout_reward", "heldout_gold"
    )
    assert record == {
        "reward_hacking_suspected": True,
        "gold_fell": True,
        "trained_metric": "heldout_reward",
        "trained_delta": 0.5,
        "trained_se": None,
        "gold_metric": "heldout_gold",
        "gold_delta": -0.25,
        "gold_se": None,
    }
    same = reward_hacking_record(first, first, "heldout_reward", "heldout_gold")
    assert same["reward_hacking_suspected"] is False and same["gold_fell"] is False
    small = {"heldout_reward": 1.005, "heldout_gold": 0.3}  # the trained reward rose by less than 0.01
    assert reward_hacking_record(first, small, "heldout_reward", "heldout_gold")["reward_hacking_suspected"]
    assert not reward_hacking_record(first, small, "heldout_reward", "heldout_gold", margin=0.01)[
        "reward_hacking_suspected"
    ]
    assert reward_hacking_record(None, first, "heldout_reward", "heldout_gold") is None
    assert reward_hacking_record(first, {"heldout_reward": 2.0}, "heldout_reward", "heldout_gold") is None


def test_reward_hacking_record_pairs_the_per_prompt_scores():
    first = {"heldout_reward": 0.5, "heldout_gold": 0.5}
    last = {"heldout_reward": 0.6, "heldout_gold": 0.4}
    before = {"heldout_reward": [0.4, 0.6, 0.5, 0.5], "heldout_gold": [0.2, 0.8, 0.5, 0.5]}
    # gold changes per prompt: -0.1, -0.3, +0.1, -0.1 (mean -0.1, std 0.163, s.e. 0.0816)
    after = {"heldout_reward": [0.5, 0.7, 0.6, 0.6], "heldout_gold": [0.1, 0.5, 0.6, 0.4]}
    record = reward_hacking_record(first, last, "heldout_reward", "heldout_gold", 0.01, before, after)
    assert record["trained_se"] == pytest.approx(0.0, abs=1e-12)
    assert record["gold_se"] == pytest.approx(np.std([-0.1, -0.3, 0.1, -0.1], ddof=1) / 2)
    assert record["gold_fell"] is False and record["reward_hacking_suspected"] is False  # 1.2 s.e.
    tight = {**after, "heldout_gold": [0.1, 0.7, 0.4, 0.4]}  # every prompt -0.1: s.e. 0
    record = reward_hacking_record(first, last, "heldout_reward", "heldout_gold", 0.01, before, tight)
    assert record["gold_fell"] is True and record["reward_hacking_suspected"] is True
    # scores that do not pair (another prompt count) leave the margin alone to decide
    short = {"heldout_gold": [0.1, 0.7, 0.4]}
    record = reward_hacking_record(first, last, "heldout_reward", "heldout_gold", 0.01, before, short)
    assert record["gold_se"] is None and record["reward_hacking_suspected"] is True


# -- the strict scorer ------------------------------------------------------------------------------


def scenes_and_prompts(n=36, seed=0):
    rng = np.random.default_rng(seed)
    specs = [sample_spec(rng, template) for template in ("count", "position", "pair") for _ in range(n // 3)]
    return [scene_for_spec(spec, rng) for spec in specs], specs, rng


def with_extra_object(scene, rng):
    """The scene and one more object (a random kind) that touches none of its objects."""
    while True:
        (extra,) = sample_cluttered_scene(rng, max_objects=1).objects
        if all(
            np.hypot(extra.x - o.x, extra.y - o.y) > (extra.size + o.size) / 2 + 0.03 for o in scene.objects
        ):
            return Scene((*scene.objects, extra))


def test_strict_scorer_ranks_clean_correct_images_above_speckled_noisy_and_extra_objects():
    scenes, specs, rng = scenes_and_prompts()
    clean = render_batch(scenes)
    generator = torch.Generator().manual_seed(0)
    speckle = torch.rand(clean.shape[0], 1, 32, 32, generator=generator) < 0.06
    speckled = torch.where(speckle, torch.rand(clean.shape, generator=generator), clean)
    noisy = (clean + 0.08 * torch.randn(clean.shape, generator=generator)).clamp(0, 1)
    extra = render_batch([with_extra_object(scene, rng) for scene in scenes])
    clean_checks = strict_checks(clean, specs)
    assert clean_checks["count"].eq(1).all() and clean_checks["background"].eq(1).all()
    assert clean_checks["score"].mean() > 0.85
    for name, images in {"speckled": speckled, "noisy": noisy, "extra object": extra}.items():
        checks = strict_checks(images, specs)
        assert (checks["score"] < clean_checks["score"]).all(), name  # every image ranks below its clean one
        assert checks["score"].mean() < clean_checks["score"].mean() - 0.1, name
    assert strict_checks(extra, specs)["count"].eq(0.5).all()  # one object too many
    assert (strict_checks(speckled, specs)["background"] < 1).all()
    # geneval_mini lets most of the pixel noise and of the extra objects slide
    geneval = load_scorer()
    for images in (noisy, extra):
        geneval_drop = geneval.score(clean, specs).mean() - geneval.score(images, specs).mean()
        strict_drop = clean_checks["score"].mean() - strict_checks(images, specs)["score"].mean()
        assert strict_drop > 2 * geneval_drop


def test_strict_scorer_with_identity_gives_a_wrong_shape_no_shape_credit_and_keeps_clean_scores():
    # without identity a shape drawn for another keeps most of its credit: the hole it closes
    swaps = [("circle", "cross"), ("cross", "circle"), ("square", "circle"), ("circle", "square")]
    for drawn, asked in swaps:
        image = render(Scene((ShapeObject("red", drawn, 0.5, 0.5, 0.3),)))[None]
        assert strict_checks(image, [f"a red {asked}"])["shape"].item() > 0.6
        assert strict_checks(image, [f"a red {asked}"], identity=True)["shape"].item() == 0.0
        assert strict_checks(image, [f"a red {drawn}"], identity=True)["shape"].item() > 0.9
    # a pair prompt whose first object is drawn as the second's shape: its credit goes, the other's stays
    scene = Scene((ShapeObject("red", "square", 0.3, 0.5, 0.3), ShapeObject("blue", "square", 0.7, 0.5, 0.3)))
    image = render(scene)[None]
    prompt = ["a red circle and a blue square"]
    plain, strict = (strict_checks(image, prompt, identity) for identity in (False, True))
    assert plain["shape"].item() > 0.85 and strict["shape"].item() == pytest.approx(0.5)  # (0 + 1) / 2
    # clean renders of every template and size keep their score: the asked shape fits best
    scenes, specs, _ = scenes_and_prompts(n=90)
    clean = render_batch(scenes)
    plain, strict = (strict_checks(clean, specs, identity)["score"] for identity in (False, True))
    assert (strict <= plain).all() and (strict == plain).float().mean() > 0.95
    reward = REWARDS.get("shapes_strict")(identity=True)
    torch.testing.assert_close(reward(clean, prompts=[prompt_text(spec) for spec in specs]), strict)


def test_strict_scorer_counting_shapes_makes_a_wrong_shape_cost_more_than_a_missing_object():
    # the default counts a circle drawn for the asked triangle as found, so drawing circles pays
    prompt = ["a red triangle and a blue square"]
    blue_square = ShapeObject("blue", "square", 0.7, 0.5, 0.3)
    circle_for_triangle = render(Scene((ShapeObject("red", "circle", 0.3, 0.5, 0.3), blue_square)))[None]
    triangle_left_out = render(Scene((blue_square,)))[None]
    both_right = render(Scene((ShapeObject("red", "triangle", 0.3, 0.5, 0.3), blue_square)))[None]
    for count_shapes, expected in ((False, (1.0, 0.5, 1.0)), (True, (1 / 3, 0.5, 1.0))):
        counts = [
            strict_checks(image, prompt, count_shapes=count_shapes)["count"].item()
            for image in (circle_for_triangle, triangle_left_out, both_right)
        ]
        assert counts == pytest.approx(expected), count_shapes
    # clean renders of every template and size keep their count: each object's shape fits it best
    scenes, specs, _ = scenes_and_prompts(n=90)
    clean = render_batch(scenes)
    plain, by_shape = (strict_checks(clean, specs, count_shapes=c) for c in (False, True))
    assert (by_shape["count"] <= plain["count"]).all()
    assert (by_shape["count"] == plain["count"]).float().mean() > 0.95
    torch.testing.assert_close(by_shape["shape"], plain["shape"])  # the shape term is untouched
    as_a_list = strict_checks([circle_for_triangle[0]], prompt, count_shapes=True)  # images of any sizes
    assert as_a_list["count"].item() == pytest.approx(1 / 3)
    reward = REWARDS.get("shapes_strict")(count_shapes=True)
    torch.testing.assert_close(
        reward(clean, prompts=[prompt_text(spec) for spec in specs]), by_shape["score"]
    )


def test_strict_scorer_over_the_asked_objects_makes_leaving_one_out_cost_its_shape_fit():
    prompt = ["a red triangle and a blue square"]
    blue_square = ShapeObject("blue", "square", 0.7, 0.5, 0.3)
    images = torch.cat(
        [
            render(Scene((ShapeObject("red", "triangle", 0.3, 0.5, 0.3), blue_square)))[None],
            render(Scene((ShapeObject("red", "circle", 0.3, 0.5, 0.3), blue_square)))[None],
            render(Scene((blue_square,)))[None],
        ]
    )
    drawn = strict_checks(images, prompt * 3, count_shapes=True)
    asked = strict_checks(images, prompt * 3, count_shapes=True, shape_over_asked=True)
    # drawn as asked, or a circle for the triangle: two objects drawn, two asked, the same fit
    torch.testing.assert_close(asked["shape"][:2], drawn["shape"][:2])
    # the triangle left out: its fit counts as 0, so the square's fit is halved
    assert asked["shape"][2].item() == pytest.approx(drawn["shape"][2].item() / 2)
    assert drawn["score"][2] > drawn["score"][1]  # counting by shape alone pays for leaving it out ...
    assert asked["score"][2] <= asked["score"][1] < asked["score"][0] / 3  # ... over the asked, no more
    # clean renders: unchanged wherever every asked object is drawn apart (touching ones merge)
    scenes, specs, _ = scenes_and_prompts(n=90)
    clean = render_batch(scenes)
    apart = strict_checks(clean, specs)["count"] == 1
    assert apart.float().mean() > 0.95
    torch.testing.assert_close(
        strict_checks(clean, specs, count_shapes=True, shape_over_asked=True)["shape"][apart],
        strict_checks(clean, specs, count_shapes=True)["shape"][apart],
    )
    reward = REWARDS.get("shapes_strict")(count_shapes=True, shape_over_asked=True)
    torch.testing.assert_close(reward(images, prompts=prompt * 3), asked["score"])
    torch.testing.assert_close(
        strict_checks(list(images), prompt * 3, count_shapes=True, shape_over_asked=True)["shape"],
        asked["shape"],
    )


def test_strict_reward_returns_one_term_when_asked():
    scenes, specs, _ = scenes_and_prompts(n=12)
    prompts = [prompt_text(spec) for spec in specs]
    noisy = (
        render_batch(scenes) + 0.2 * torch.randn(12, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    ).clamp(0, 1)
    checks = strict_checks(noisy, specs, count_shapes=True)
    for term in ("background", "count", "shape", "score"):
        reward = REWARDS.get("shapes_strict")(count_shapes=True, term=term)
        torch.testing.assert_close(reward(noisy, prompts=prompts), checks[term])
    assert len({float(checks[t].mean()) for t in ("background", "count", "shape")}) == 3  # three factors
    with pytest.raises(ConfigError, match=r"reward.options.term = 'shap' is not a term of shapes_strict"):
        REWARDS.get("shapes_strict")(term="shap")


def test_strict_scorer_as_a_reward_takes_prompts_lists_and_other_sizes():
    scenes, specs, _ = scenes_and_prompts(n=6)
    prompts = [prompt_text(spec) for spec in specs]
    strict = REWARDS.get("shapes_strict")()
    clean = render_batch(scenes)
    scores = strict(clean, prompts=prompts)
    assert scores.shape == (6,) and scores.dtype == torch.float32
    torch.testing.assert_close(scores, strict_checks(clean, specs)["score"])
    torch.testing.assert_close(strict(list(clean), prompts=prompts), scores)
    larger = torch.stack([render(scene, 64) for scene in scenes])  # drawn at 64 px, scored as drawn
    assert strict(larger, prompts=prompts).mean() > 0.85
    blank = torch.full((6, 3, 32, 32), 0.12)
    assert strict(blank, prompts=prompts).max() == 0.0  # no object, no credit
    with pytest.raises(ValueError, match="unknown word"):
        strict(clean[:1], prompts=["a red dog"])
