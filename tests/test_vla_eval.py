"""`mmrl eval vla` (policies side by side on the same seeded episodes, expert takeovers, GIFs, clear
errors) and `mmrl bench vla` at a tiny size, with tiny random policies saved to tmp_path."""

import json
import math

import numpy as np
import pytest
import torch

import vla_rl.register  # noqa: F401  (registers bench and evaluator "vla")
from mmrl.bench_all import ratio_rows
from mmrl.cli import main
from mmrl.config import ConfigError
from mmrl.registry import BENCHES, EVALUATORS
from vla_rl.bench import bench_vla
from vla_rl.episodes import Outcome, Step
from vla_rl.evaluate import Episodes, ExpertGaps, evaluate_policy, wilson_interval
from vla_rl.policy import VLAConfig, VLAPolicy, task_vocabulary
from vla_rl.policy_comparison import (
    VLAPoliciesEvalConfig,
    eval_vla,
    evaluate_policies,
    format_gaps,
    gap_summary,
)

SIZE = 32


def tiny_policy(seed: int) -> VLAPolicy:
    torch.manual_seed(seed)
    config = VLAConfig(
        vocabulary=task_vocabulary(),
        image_size=SIZE,
        channels=[8, 8],
        keypoints=8,
        word_dim=8,
        text_dim=16,
        hidden=32,
    )
    return VLAPolicy(config).eval()


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    root = tmp_path_factory.mktemp("policies")
    paths = []
    for seed in (0, 1):
        tiny_policy(seed).save_pretrained(root / f"p{seed}")
        paths.append(str(root / f"p{seed}"))
    return paths


def run(policies, tmp_path, *overrides):
    """eval vla on Reach (50-step episodes) without progress bars; returns the results dict."""
    return eval_vla(
        [
            f"policies=[{','.join(policies)}]",
            "task=Reach",
            "progress=false",
            f"output_dir={tmp_path}",
            *overrides,
        ]
    )


@pytest.mark.parametrize(
    ("successes", "n", "low", "high"),
    [(5, 10, 0.2366, 0.7634), (0, 10, 0.0, 0.2775), (8, 10, 0.4902, 0.9433), (10, 10, 0.7225, 1.0)],
)
def test_wilson_interval_known_values(successes, n, low, high):
    got = wilson_interval(successes, n)
    assert got == pytest.approx((low, high), abs=1e-4)


def test_wilson_interval_needs_episodes():
    with pytest.raises(ValueError, match="at least one episode"):
        wilson_interval(0, 0)


def test_registered():
    assert EVALUATORS.get("vla") is eval_vla and BENCHES.get("vla") is bench_vla


@pytest.mark.needs_rendering
def test_two_policies_side_by_side_same_seeds_same_results(policies, tmp_path, capsys):
    first = run(policies, tmp_path / "a", "episodes=3", "num_envs=2")
    second = run(policies, tmp_path / "b", "episodes=3", "num_envs=2")
    for results in (first, second):
        for entry in results["policies"].values():
            del entry["videos"]
    assert first == second
    saved = json.loads((tmp_path / "a" / "eval_vla.json").read_text())
    assert list(saved["policies"]) == policies and saved["task"] == "mmrl/Reach-v0"
    for path, entry in first["policies"].items():
        episodes = entry["per_episode"]
        assert episodes["seed"] == [1_000_000, 1_000_001, 1_000_002]
        assert entry["episodes"] == 3 and entry["successes"] == sum(episodes["success"])
        assert (entry["success_ci_low"], entry["success_ci_high"]) == wilson_interval(entry["successes"], 3)
        assert entry["mean_steps"] == pytest.approx(np.mean(episodes["steps"]))
        assert entry["median_steps"] == float(np.median(episodes["steps"]))
        assert all(1 <= s <= 50 for s in episodes["steps"])
        assert entry["interventions"] == 0 and entry["expert_steps"] == 0
        assert ("vs_first" in entry) == (path != policies[0])
    printed = capsys.readouterr().out
    assert "95% CI" in printed and policies[1] in printed and "eval_vla.json" in printed


@pytest.mark.needs_rendering
def test_failed_episodes_are_counted_by_how_they_failed(policies, tmp_path, capsys):
    """PickPlace's expert names failure modes: every failed episode has one, and the counts add up;
    Reach names none."""
    results = run(policies[:1], tmp_path / "pp", "task=PickPlace", "episodes=3", "num_envs=3")
    (entry,) = results["policies"].values()
    how = entry["per_episode"]["failure"]
    failed = [not ok for ok in entry["per_episode"]["success"]]
    assert [h is not None for h in how] == failed and sum(failed) > 0  # an untrained policy fails
    assert sum(entry["failures"].values()) == sum(failed)
    assert set(entry["failures"]) <= {
        "still holding the cube",
        "held the cube, lost it off the pad",
        "waits above the cube, wrist not turned",
        "waits above the cube",
        "never held the cube",
    }
    assert "failures: " in capsys.readouterr().out
    reach = run(policies[:1], tmp_path / "reach", "episodes=2", "num_envs=2")
    (entry,) = reach["policies"].values()
    assert entry["failures"] == {} and entry["per_episode"]["failure"] == [None, None]


@pytest.mark.needs_rendering
def test_sampled_actions_are_repeatable(policies, tmp_path):
    args = ("episodes=2", "num_envs=2", "deterministic=false")
    first = run(policies[:1], tmp_path / "a", *args)["policies"][policies[0]]["per_episode"]
    second = run(policies[:1], tmp_path / "b", *args)["policies"][policies[0]]["per_episode"]
    assert first == second


@pytest.mark.needs_rendering
def test_expert_takeover_rule(policies, tmp_path):
    # threshold 0 and patience 1: the expert takes over at the first step and keeps the episode
    patience = ["intervention.enabled=true", "intervention.window=0", "intervention.patience=1"]
    patience += ["intervention.max_per_episode=0"]
    results = run(
        policies[:1],
        tmp_path / "always",
        "episodes=2",
        *patience,
        "intervention.threshold=0",
        "intervention.takeover_steps=100",
        "intervention.release_guard=true",  # Reach holds nothing: the guard never fires there
    )
    assert results["takeover"] == {
        "enabled": True,
        "threshold": 0.0,
        "window": 0,
        "patience": 1,
        "takeover_steps": 100,
        "deadline": 0,
        "max_per_episode": 0,
        "release_guard": True,
    }
    always = results["policies"][policies[0]]
    assert always["interventions"] == 2 and always["episodes_with_interventions"] == 2
    assert always["per_episode"]["expert_steps"] == always["per_episode"]["steps"]
    assert (
        always["expert_step_fraction"] == 1.0 and always["success_rate"] == 1.0
    )  # the Reach expert succeeds
    # an RMS difference of actions in [-1, 1] never exceeds 2: the expert never takes over
    never = run(policies[:1], tmp_path / "never", "episodes=2", *patience, "intervention.threshold=2")
    entry = never["policies"][policies[0]]
    assert entry["interventions"] == 0 and entry["expert_steps"] == 0
    # short takeovers hand back to the policy, which strays again: several takeovers per episode
    short = run(
        policies[:1],
        tmp_path / "short",
        "episodes=1",
        *patience,
        "intervention.threshold=0",
        "intervention.takeover_steps=2",
    )["policies"][policies[0]]
    assert short["interventions"] > 1 and short["expert_steps"] <= 2 * short["interventions"]


@pytest.mark.needs_rendering
def test_videos_are_readable_gifs(policies, tmp_path):
    from PIL import Image

    results = run(policies, tmp_path, "episodes=2", "videos=2", "video_size=48")
    for index, entry in enumerate(results["policies"].values()):
        assert len(entry["videos"]) == 2
        for k, path in enumerate(entry["videos"]):
            assert f"/videos/{index}-" in path and path.endswith(".gif")
            with Image.open(path) as gif:
                assert gif.format == "GIF" and gif.size == (48, 48)
                # the reset frame, then one per step, at 10 fps (PIL merges identical neighbours)
                total_ms = 0
                for frame in range(gif.n_frames):
                    gif.seek(frame)
                    total_ms += gif.info["duration"]
                assert total_ms == 100 * (entry["per_episode"]["steps"][k] + 1)


@pytest.mark.needs_rendering
def test_evaluate_policy_keeps_its_summary():
    result = evaluate_policy(tiny_policy(0), "Reach", 2, 5, num_envs=2, progress=False)
    assert set(result) == {"success_rate", "success_ci_low", "success_ci_high", "episodes", "mean_steps"}
    assert result["episodes"] == 2.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["policies=[]"], "policies is empty"),
        (["policies=[{missing}]"], "is not a directory"),
        (["policies=[{p0},{p0}]"], "twice"),
        (["policies=[{p0}]", "task=Stack"], "task = 'Stack': unknown sim task"),
        (["policies=[{p0}]", "episodes=0"], "episodes = 0 is out of range"),
        (["policies=[{p0}]", "episode=3"], "did you mean 'episodes'"),
        (["policies=[{p0}]", "rescue_at=[0]"], "distinct step numbers >= 1"),
        (["policies=[{p0}]", "rescue_at=[5,5]"], "distinct step numbers >= 1"),
        (
            ["policies=[{p0}]", "intervention.enabled=true", "intervention.window=0"],
            "the expert never takes over",
        ),
        (
            ["policies=[{p0}]", "rescue_at=[5]", "intervention.enabled=true"],
            "pairs each take-over with the policy alone",
        ),
    ],
)
def test_bad_inputs_are_clear_errors(policies, tmp_path, overrides, message):
    filled = [o.format(p0=policies[0], missing=tmp_path / "nope") for o in overrides]
    with pytest.raises(ConfigError, match=message):
        eval_vla([f"output_dir={tmp_path}", *filled])
    assert not (tmp_path / "eval_vla.json").exists()


def test_bad_input_on_the_command_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("mmrl.cli.load_plugins", lambda: None)  # vla_rl.register is imported above
    assert main(["eval", "vla", f"policies=[{tmp_path / 'nope'}]", f"output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: config error: policies:") and "nope" in err


def test_config_defaults_match_the_held_out_seeds():
    assert VLAPoliciesEvalConfig().seed == 1_000_000 and VLAPoliciesEvalConfig().task == "PickPlace"


@pytest.mark.needs_rendering
def test_evaluate_policies_refuses_unknown_task_before_loading(policies, tmp_path):
    cfg = VLAPoliciesEvalConfig(policies=policies, task="Reachh", output_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="Did you mean 'mmrl/Reach-v0'"):
        evaluate_policies(cfg)


@pytest.mark.needs_rendering
def test_bench_vla_tiny(capsys, monkeypatch):
    monkeypatch.setattr("sim.metaworld.installed", lambda: False)  # rows (e): tests/test_metaworld.py
    rows = bench_vla(steps=3, num_envs=2, repeats=1, image_size=SIZE)
    assert [row["section"] for row in rows] == ["(a)", "(a)", "(b)", "(c)", "(c)", "(d)"]
    branched, rows = rows[-1], rows[:-1]  # (d), env steps per trained decision: tests/test_vla_branching.py
    assert branched["verdict"] == ("PASS" if branched["ratio"] <= branched["target"] else "FAIL")
    for row in rows:
        assert {
            "name",
            "steps_per_s",
            "baseline",
            "baseline_steps_per_s",
            "ratio",
            "target",
            "verdict",
        } <= set(row)
        assert math.isfinite(row["ratio"]) and row["ratio"] > 0
        assert row["ratio"] == pytest.approx(row["steps_per_s"] / row["baseline_steps_per_s"])
        if row["target"] is None:
            assert row["verdict"] == "-"
        else:
            assert row["verdict"] == ("PASS" if row["ratio"] >= row["target"] else "FAIL")
    assert [row["target"] for row in rows] == [0.5, None, None, None, 1.0]
    assert rows[0]["baseline"].startswith("raw: rgb") and rows[1]["baseline"].startswith("raw: state")
    combined = ratio_rows("vla", rows)
    assert [r["verdict"] for r in combined] == [r["verdict"] for r in rows]
    assert combined[0]["target"] == ">= 0.5x"
    printed = capsys.readouterr().out
    assert "VLA env steps per second" in printed
    assert "(e) Meta-World rows skipped: Meta-World is not installed (pip install --no-deps" in printed


def test_bench_vla_bad_options(tmp_path):
    with pytest.raises(ConfigError, match="unknown sim task"):
        bench_vla(task="Stack")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        bench_vla(model=str(tmp_path / "nope"))


@pytest.mark.needs_rendering
def test_the_shipped_base_is_found_from_any_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    results = eval_vla(
        ["policies=[vla_rl/assets/tiny_vla]", "episodes=2", "progress=false", "output_dir=out"]
    )
    (entry,) = results["policies"].values()
    assert entry["episodes"] == 2 and (tmp_path / "out/eval_vla.json").is_file()


class _Env:
    """Stands in for an env: the expert reads `state` through get_wrapper_attr, as from a sim env."""

    def __init__(self) -> None:
        self.state = np.zeros(1)

    def get_wrapper_attr(self, name):
        assert name == "get_state"
        return lambda: self.state


class _ConstantExpert:
    def act(self, env):
        return np.zeros(4, dtype=np.float32)


def _step(action: float, by_expert: bool = False) -> Step:
    return Step({}, np.full(4, action, np.float32), np.zeros(4), by_expert, -1, {})


def test_expert_gaps_take_the_largest_window_mean_of_consecutive_policy_steps():
    gaps = ExpertGaps(_ConstantExpert(), window=2)
    env = _Env()
    gaps.begin(0, env, {}, {})
    # policy gaps 0.1, 0.3, then an expert step (left out, and the window starts afresh after it, as in
    # the take-over rule), 0.5, 0.1
    for action, by_expert in [(0.1, False), (0.3, False), (1.0, True), (0.5, False), (0.1, False)]:
        gaps.step(0, env, _step(action, by_expert))
    gaps.end(0, Outcome(0, "", False, False, 5, 1, 1))
    assert gaps.largest == {0: pytest.approx(0.3)}  # windows 0.2 and 0.3; none spans the expert step
    gaps.begin(1, env, {}, {})
    gaps.step(1, env, _step(0.9))  # one policy step: shorter than the window, no value
    assert 1 not in gaps.largest


def _episodes(success: list[bool], gaps: dict[int, float]) -> Episodes:
    n = len(success)
    zeros = np.zeros(n, dtype=np.int64)
    return Episodes(list(range(n)), np.array(success), zeros + 10, zeros, zeros, expert_gaps=gaps)


def test_gap_summary_names_the_thresholds_that_separate_failures_from_successes():
    separated = gap_summary(_episodes([True, False, True, False], {0: 0.6, 1: 0.9, 2: 0.5, 3: 1.1}), 8)
    assert separated == {
        "window": 8,
        "successes_max": 0.6,
        "failures_min": 0.9,
        "failures": 2,
        "failures_fired_at_successes_max": 2,
    }
    assert format_gaps(separated).endswith("intervention.threshold in [0.600, 0.900) separates them")
    # a failure below the successes' largest gap, and one too short for a value: neither is caught
    overlap = gap_summary(_episodes([True, False, False, False], {0: 0.7, 1: 0.65, 2: 0.9}), 8)
    assert overlap["failures_fired_at_successes_max"] == 1 and overlap["failures_min"] == 0.65
    assert format_gaps(overlap).endswith("at 0.700, the window rule fires in 1 of 3 failed episodes")


@pytest.mark.needs_rendering
def test_eval_reports_expert_gaps_by_outcome(policies, tmp_path, capsys):
    results = run(policies[:1], tmp_path, "episodes=3", "num_envs=3", "gap_window=4")
    (entry,) = results["policies"].values()
    per_episode = entry["per_episode"]
    assert all(0.0 <= g <= 2.0 for g in per_episode["expert_gap"])  # RMS of entries in [-1, 1]
    failed = [g for g, ok in zip(per_episode["expert_gap"], per_episode["success"], strict=True) if not ok]
    assert entry["expert_gap"]["failures"] == len(failed) > 0  # an untrained policy fails Reach
    assert entry["expert_gap"]["failures_min"] == min(failed)
    assert "largest mean gap to the expert over 4 policy steps" in capsys.readouterr().out
    assert "expert_gap" not in run(policies[:1], tmp_path / "off", "episodes=1")["policies"][policies[0]]


@pytest.mark.needs_rendering
def test_rescue_counts_the_failures_a_take_over_at_each_step_saves(policies, tmp_path, capsys):
    """At step 1 the Reach expert drives whole episodes and saves every failure of an untrained policy;
    after the 50-step episodes have ended, a take-over changes nothing."""
    results = run(policies[:1], tmp_path, "episodes=3", "num_envs=3", "rescue_at=[1,1000]")
    (entry,) = results["policies"].values()
    first, late = entry["rescue"]
    failures = entry["episodes"] - entry["successes"]
    assert failures > 0  # an untrained policy fails Reach
    assert first == {
        "step": 1,
        "successes": 3,
        "episodes": 3,
        "rescued": failures,
        "failures": failures,
        "lost": 0,
    }
    assert late == {
        "step": 1000,
        "successes": entry["successes"],
        "episodes": 3,
        "rescued": 0,
        "failures": failures,
        "lost": 0,
    }
    assert f"expert takes over at step 1: 3/3 succeed, {failures} of the {failures} failures rescued" in (
        capsys.readouterr().out
    )
    assert run(policies[:1], tmp_path / "off", "episodes=1")["policies"][policies[0]]["rescue"] == []
