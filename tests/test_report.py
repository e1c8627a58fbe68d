"""`mmrl report`: the page's contents, its limits, its errors, and what a real browser draws of it."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmrl import compare, method_groups, report
from mmrl.cli import main
from mmrl.report import build_report, json_html, write_report
from mmrl.report_curves import metric_group
from mmrl.runlog import check_run_dir

C0_BLUE = np.array([0x1F, 0x77, 0xB4])  # matplotlib's default line colour, used for every curve


def fake_run(run: Path, steps: int = 40) -> Path:
    """A run directory as a trainer leaves it: one clearly rising metric, one that never changes."""
    (run / "samples").mkdir(parents=True)
    (run / "config.yaml").write_text("trainer: branch_grpo\nseed: 7\ntrain:\n  lr: 0.000321\n")
    rows = [{"step": s, "reward": 0.1 + 0.8 * s / steps, "skipped_steps": 0} for s in range(1, steps + 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = {"before": {"heldout_reward": 0.125, "n": 64}, "after": {"heldout_reward": 0.625, "n": 64}}
    (run / "eval.json").write_text(json.dumps(evals))
    Image.new("RGB", (48, 48), (220, 40, 40)).save(run / "samples" / "step_000010.png")
    return run


def gif_bytes(path: Path) -> bytes:
    frames = [Image.new("RGB", (16, 16), (40 * i, 200, 0)) for i in range(4)]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=80, loop=0)
    return path.read_bytes()


def test_page_holds_config_evaluations_curves_and_media(tmp_path):
    run = fake_run(tmp_path / "run")
    gif = gif_bytes(run / "samples" / "episode.gif")
    (run / "videos").mkdir()
    (run / "videos" / "rollout.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not really a video")
    (run / "eval_vla.json").write_text(
        json.dumps(
            {
                "policy": "runs/vla/final",
                "tasks": [
                    {"task": "Reach", "success_rate": 0.9375, "episodes": 32},
                    {"task": "PickPlace", "success_rate": 0.1875, "episodes": 32},
                ],
            }
        )
    )
    (run / "eval_diffusion.json").write_text(
        json.dumps(
            {
                "num_prompts": 8,
                "models": {"base": {"clip": {"mean": 0.25}}, "tuned": {"clip": {"mean": 0.3125}}},
            }
        )
    )
    (run / "checkpoints" / "step_00000001").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(run / "checkpoints" / "step_00000001" / "inside_checkpoint.png")

    out = write_report(run)
    assert out == run / "report.html"
    page = out.read_text()
    # config, verbatim
    assert "lr: 0.000321" in page and "trainer: branch_grpo" in page
    # eval.json: before, after and the change
    assert re.search(r"heldout_reward</th><td class='num'>0.125</td><td class='num'>0.625</td>", page)
    assert "+0.5" in page
    # evaluator files as tables: a row per task record, and {model: {reward: {mean}}} flattened
    assert "eval_vla.json" in page and "PickPlace" in page and "0.9375" in page
    assert "eval_diffusion.json" in page and "clip.mean" in page and "0.3125" in page
    # curves: the changing metric drawn, the constant one in a table
    assert "<img alt='reward'" in page and "data:image/png;base64," in page
    assert re.search(r"skipped_steps</th><td class='num'>0</td>", page)
    # media inlined: the sample PNG, the GIF byte for byte, the video as a <video>
    assert "samples/step_000010.png" in page
    assert "data:image/gif;base64," + base64.b64encode(gif).decode() in page
    assert '<video controls loop muted src="data:video/mp4;base64,' in page
    # model state is not searched for pictures
    assert "inside_checkpoint" not in page
    # self-contained: nothing fetched from anywhere
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", page)
    assert "<script" not in page and "<link" not in page


def test_many_images_are_spread_over_the_run_and_the_rest_named(tmp_path, monkeypatch):
    run = fake_run(tmp_path / "run")
    for step in range(0, 100, 10):
        Image.new("RGB", (8, 8), (step, 0, 0)).save(run / "samples" / f"grid_{step}.png")
    monkeypatch.setattr(report, "MAX_IMAGES", 3)
    page = build_report(run)
    embedded = re.findall(r'<img alt="(samples/[^"]+)"', page)
    # natural order (grid_0 ... grid_90, then step_000010): first, middle and last are kept
    assert embedded == ["samples/grid_0.png", "samples/grid_50.png", "samples/step_000010.png"]
    assert "8 of 11 files not embedded" in page and "samples/grid_90.png (over the limit of 3)" in page

    monkeypatch.setattr(report, "MAX_IMAGES", 48)
    monkeypatch.setattr(report, "MAX_FILE_BYTES", 10)
    page = build_report(run)
    assert '<img alt="samples/' not in page and "file too large" in page


def test_not_a_run_directory_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_run_dir(tmp_path / "missing")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="is a file"):
        check_run_dir(tmp_path / "notes.txt")
    fake_run(tmp_path / "runs" / "diffusion" / "quick")
    with pytest.raises(FileNotFoundError, match=r"not a run directory .*inside it: .*runs/diffusion/quick"):
        write_report(tmp_path / "runs")
    assert not (tmp_path / "runs" / "report.html").exists()
    assert main(["report", str(tmp_path)]) == 2
    assert "is not a run directory" in capsys.readouterr().err
    # an evaluator's output directory (eval_*.json, no config) is reportable
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "eval_vlm.json").write_text(json.dumps({"accuracy": 0.5}))
    assert "No config.yaml" in write_report(tmp_path / "eval").read_text()


def test_metric_groups():
    assert metric_group("eval_heldout_alignment") == "Held-out evaluation during training"
    assert metric_group("explore_reward") == "Reward and task"
    assert metric_group("approx_kl") == metric_group("grad_norm") == "Optimisation"
    assert metric_group("nfe") == metric_group("step_seconds") == "Cost and throughput"
    assert metric_group("policy/entropy") == "policy"
    assert metric_group("zzz") == "Other"


def test_generic_json_tables():
    # few rows, many columns: turned so that metrics run down the page
    table = json_html({"a": {"x": 1, "y": 2.5, "z": {"w": 3}}, "b": {"x": 4}})
    assert table.index("<th>x</th>") < table.index("<th>y</th>") < table.index("<th>z.w</th>")
    assert "<th></th><th>a</th><th>b</th>" in table and "—" in table
    mixed = json_html({"n": 3, "ids": [1, 2, 3], "deep": {"inner": {"k": "v"}}, "empty": {}})
    assert "[1, 2, 3]" in mixed and "<h4>deep</h4>" in mixed and "<h4>empty</h4>" in mixed
    assert "<script>" not in json_html({"<script>": "<b>"})


def chromium_binary() -> str | None:
    found = shutil.which("chromium")
    return found or ("/usr/bin/chromium" if Path("/usr/bin/chromium").is_file() else None)


@pytest.mark.skipif(
    chromium_binary() is None,
    reason="no chromium (/usr/bin/chromium); install it with `apt-get install -y chromium` (.ci/run does)",
)
def test_browser_renders_the_rising_curve(tmp_path):
    """Headless Chromium's screenshot of the page shows the reward line: enough pixels of the curve
    colour, and they rise from left to right (the one drawn metric rises; images hold no such blue)."""
    run = fake_run(tmp_path / "run")
    page = write_report(run)
    shot = tmp_path / "shot.png"
    command = [
        chromium_binary(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        "--force-device-scale-factor=1",
        f"--user-data-dir={tmp_path / 'profile'}",
        f"--screenshot={shot}",
        "--window-size=1200,2000",
        page.resolve().as_uri(),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0 and shot.is_file(), f"chromium failed: {done.stderr[-2000:]}"

    pixels = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    assert pixels.shape[:2] == (2000, 1200)
    assert (pixels.sum(axis=2) < 600).mean() > 0.01, "the page is (nearly) blank"
    blue = np.abs(pixels - C0_BLUE).max(axis=2) <= 12
    ys, xs = np.nonzero(blue)
    assert len(xs) > 200, f"only {len(xs)} pixels of the curve colour: the curve is not drawn"
    # image rows grow downwards, so a rising line has x and y strongly anti-correlated
    assert np.corrcoef(xs, ys)[0, 1] < -0.9
    assert xs.max() - xs.min() > 150 and ys.max() - ys.min() > 80


# ------------------------------------------------------------------------------- --compare


def seed_run(
    run: Path,
    seed: int,
    evals: dict[int, float],
    *,
    steps: int = 4,
    config: str = "trainer: branch_grpo\nrollout:\n  steps: 8\n",
    metric: str = "heldout_alignment",
    **per_step: list[float],
) -> str:
    """A finished run as a trainer leaves it: config.yaml (with its seed and output_dir), a metrics row
    per step (`per_step` lists give a metric's value at each step) with eval_<metric> at the steps of
    `evals` other than 0 and `steps`, and eval.json with `evals[0]` before and `evals[steps]` after."""
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(f"{config}seed: {seed}\noutput_dir: {run}\nresume: false\n")
    rows = []
    for step in range(1, steps + 1):
        row: dict = {"step": step, "loss": 0.5}
        row.update({name: values[step - 1] for name, values in per_step.items()})
        if step in evals and step != steps:
            row[f"eval_{metric}"] = evals[step]
        rows.append(row)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = {"before": {metric: evals[0], "n": 8}, "after": {metric: evals[steps], "n": 8}}
    (run / "eval.json").write_text(json.dumps(record))
    return str(run)


def drawn(monkeypatch) -> list:
    """The figures compare_runs closes, kept to look at what was drawn."""
    figures = []
    monkeypatch.setattr(compare.plt, "close", figures.append)
    return figures


def test_compare_draws_each_method_once_with_its_spread_over_seeds(tmp_path, monkeypatch):
    # two methods (configs differ in rollout.steps) x 3 seeds; seeds differ in seed and output_dir only
    runs = []
    for seed, (mid, last), seconds in zip(
        range(3), [(0.3, 0.5), (0.4, 0.6), (0.5, 0.9)], [1, 2, 3], strict=True
    ):
        runs.append(
            seed_run(
                tmp_path / f"flat_s{seed}",
                seed,
                {0: 0.1, 2: mid, 4: last},
                step_seconds=[seconds] * 4,
                nfe=[8.0] * 4,
            )
        )
    for seed in range(3):
        runs.append(
            seed_run(
                tmp_path / f"branch_s{seed}",
                seed,
                {0: 0.1, 2: 0.2, 4: 0.3 + 0.1 * seed},
                config="trainer: branch_grpo\nrollout:\n  steps: 16\n",
                step_seconds=[0.5] * 4,
                nfe=[4.0] * 4,
            )
        )
    figures = drawn(monkeypatch)
    png = tmp_path / "out" / "compare.png"
    assert main(["report", *runs, "--compare", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    numbers = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert numbers["metric"] == "heldout_alignment"
    assert list(numbers["x_axes"]) == ["wall_clock_s", "nfe"]  # nobody explored: no all-NFE panel

    flat, branch = numbers["methods"]
    assert (flat["label"], branch["label"]) == ("flat", "branch")
    assert flat["n"] == branch["n"] == 3 and flat["seeds"] == [0, 1, 2]
    assert flat["runs"] == runs[:3] and flat["band"] == "mean +- std"
    assert [p["step"] for p in flat["points"]] == [0, 2, 4]
    mid = flat["points"][1]
    # wall-clock: 2 steps of 1, 2 and 3 s -> 2, 4, 6 s, mean 4; nfe the same for every seed
    assert mid["x"] == {"wall_clock_s": pytest.approx(4.0), "nfe": pytest.approx(16.0)}
    assert mid["values"] == [0.3, 0.4, 0.5]
    assert mid["mean"] == pytest.approx(0.4) and mid["std"] == pytest.approx(0.1)
    assert (mid["min"], mid["max"]) == (0.3, 0.5)
    assert flat["points"][0]["std"] == 0.0  # equal seeds: exactly no spread
    # final: values 0.5, 0.6, 0.9 -> mean 2/3, std sqrt(((-1/6)^2 + (-1/15)^2 + (7/30)^2) / 2)
    std = np.std([0.5, 0.6, 0.9], ddof=1)
    half = 4.3027 * std / np.sqrt(3)
    final = flat["final"]
    assert final["step"] == 4 and final["n"] == 3 and final["t"] == 4.3027
    assert final["mean"] == pytest.approx(2 / 3) and final["std"] == pytest.approx(std)
    assert final["ci95"] == pytest.approx([2 / 3 - half, 2 / 3 + half])
    assert flat["points"][-1]["x"]["wall_clock_s"] == pytest.approx(8.0)

    # drawn: one line and one band per method in each panel, the legend names method, n and band
    (figure,) = figures
    panels = figure.axes
    assert [ax.get_xlabel() for ax in panels] == [
        "training wall-clock (s)\n(sum of step_seconds, mean over seeds)",
        "full-precision denoiser evaluations per prompt\n(sum of nfe, mean over seeds)",
    ]
    for ax in panels:
        assert len(ax.lines) == 2 and len(ax.collections) == 2
    labels = [t.get_text() for t in panels[-1].get_legend().get_texts()]
    assert labels == ["flat (n=3, band mean ± std)", "branch (n=3, band mean ± std)"]
    band = panels[0].collections[0].get_paths()[0].vertices
    assert band[:, 1].max() == pytest.approx(2 / 3 + std)  # the final point's mean + std


def test_compare_two_seeds_draw_min_max_and_one_run_draws_alone(tmp_path, monkeypatch):
    runs = [
        seed_run(tmp_path / "a-seed1", 1, {0: 0.0, 4: 0.2}, nfe=[1.0] * 4),
        seed_run(tmp_path / "a-seed2", 2, {0: 0.0, 4: 0.6}, nfe=[1.0] * 4),
        seed_run(tmp_path / "lonely_s9", 9, {0: 0.0, 4: 0.5}, config="trainer: nft\n", nfe=[2.0] * 4),
    ]
    figures = drawn(monkeypatch)
    compare.compare_runs(runs, "heldout_alignment", tmp_path / "c.png")
    pair, lonely = json.loads((tmp_path / "c.json").read_text())["methods"]
    assert (pair["label"], pair["band"], pair["n"]) == ("a", "min-max", 2)
    assert pair["final"]["ci95"] == pytest.approx([0.4 - 12.7062 * 0.2, 0.4 + 12.7062 * 0.2])
    assert (lonely["label"], lonely["band"], lonely["n"]) == ("lonely_s9", None, 1)
    assert lonely["final"] == {"step": 4, "n": 1, "mean": 0.5, "std": None, "t": None, "ci95": None}
    assert lonely["points"][-1]["std"] is None
    (ax,) = figures[0].axes  # no wall-clock logged: the NFE panel alone
    assert len(ax.lines) == 2 and len(ax.collections) == 1  # the lone run has no band
    band = ax.collections[0].get_paths()[0].vertices
    assert band[:, 1].max() == pytest.approx(0.6) and band[:, 1].min() == pytest.approx(0.0)
    texts = [t.get_text() for t in ax.get_legend().get_texts()]
    assert texts == ["a (n=2, band min-max)", "lonely_s9 (n=1)"]


def test_compare_seeds_may_differ_in_bookkeeping_and_gold_reward_not_in_training(tmp_path):
    base = "trainer: diffusion_nft\ntrain:\n  lr: 0.1\neval:\n  prompts: 8\n"
    runs = [
        # written before model.frozen_dtype existed: its default is what the run did
        seed_run(tmp_path / "nft_s0", 0, {0: 0.1, 4: 0.2}, config=base + "checkpoint_every: 30\n"),
        seed_run(
            tmp_path / "nft_s1",
            1,
            {0: 0.1, 4: 0.4},
            config=base.replace("prompts: 8", "prompts: 8\n  gold_reward: {name: shapes_strict}")
            + "checkpoint_every: 20\nprogress: true\nmodel:\n  frozen_dtype: float32\n",
        ),
        seed_run(tmp_path / "nft_lr_s0", 0, {0: 0.1, 4: 0.3}, config=base.replace("lr: 0.1", "lr: 0.2")),
        seed_run(
            tmp_path / "nft_evalsize_s0",
            0,
            {0: 0.1, 4: 0.3},
            config=base.replace("prompts: 8", "prompts: 16"),
        ),
    ]
    compare.compare_runs(runs, "heldout_alignment", tmp_path / "c.png")
    methods = json.loads((tmp_path / "c.json").read_text())["methods"]
    assert [(m["label"], m["n"]) for m in methods] == [("nft", 2), ("nft_lr_s0", 1), ("nft_evalsize_s0", 1)]
    another_dtype = seed_run(
        tmp_path / "nft_bf16_s0", 0, {0: 0.1, 4: 0.3}, config=base + "model:\n  frozen_dtype: bfloat16\n"
    )
    compare.compare_runs([*runs[:2], another_dtype], "heldout_alignment", tmp_path / "d.png")
    methods = json.loads((tmp_path / "d.json").read_text())["methods"]
    assert [m["n"] for m in methods] == [2, 1]  # a key set to something other than its default


def test_compare_seed_keys_group_seeds_that_fine_tune_their_own_base(tmp_path, capsys):
    def config(seed: int, lr: float = 0.1) -> str:
        return f"trainer: diffusion_nft\ntrain:\n  lr: {lr}\nmodel:\n  path: bases/s{seed}\n"

    runs = [
        seed_run(tmp_path / f"ft_s{seed}", seed, {0: 0.1, 4: 0.2 + seed / 10}, config=config(seed))
        for seed in (0, 1)
    ]
    runs.append(seed_run(tmp_path / "ft_lr_s0", 0, {0: 0.1, 4: 0.3}, config=config(0, lr=0.2)))
    compare.compare_runs(runs, "heldout_alignment", tmp_path / "c.png")  # each base its own method
    assert [m["n"] for m in json.loads((tmp_path / "c.json").read_text())["methods"]] == [1, 1, 1]
    compare.compare_runs(runs, "heldout_alignment", tmp_path / "d.png", seed_keys=["model.path"])
    methods = json.loads((tmp_path / "d.json").read_text())["methods"]
    assert [(m["label"], m["n"]) for m in methods] == [("ft", 2), ("ft_lr_s0", 1)]  # lr still splits
    from mmrl.cli import main

    assert main(["report", runs[0], "--seed-key", "model.path"]) == 2
    assert "--label, --seed-key and --training-metric are for a comparison" in capsys.readouterr().err


def test_compare_refuses_seeds_evaluated_at_different_steps(tmp_path, capsys):
    runs = [
        seed_run(tmp_path / "m_s0", 0, {0: 0.1, 2: 0.2, 4: 0.3}),
        seed_run(tmp_path / "m_s1", 1, {0: 0.1, 1: 0.2, 4: 0.3}),
    ]
    png = tmp_path / "out" / "c.png"
    assert main(["report", *runs, "--compare", str(png)]) == 2
    err = capsys.readouterr().err
    assert "m_s0" in err and "m_s1" in err and "[0, 2, 4] and [0, 1, 4]" in err
    assert not (tmp_path / "out").exists()  # refused before anything is written
    with pytest.raises(compare.ConfigError, match="different steps"):
        compare.compare_runs(runs, "heldout_alignment", png)


def test_compare_warns_when_wall_clock_comes_from_runs_launched_differently(tmp_path, monkeypatch):
    def launched(run: str, threads: int) -> str:
        launch = {"from_step": 0, "device": "cpu", "processes": 1, "cpu_threads": threads}
        (Path(run) / "launches.jsonl").write_text(json.dumps(launch) + "\n")
        return run

    runs = [
        launched(seed_run(tmp_path / f"m_s{seed}", seed, {0: 0.1, 4: 0.2}, step_seconds=[1.0] * 4), 1)
        for seed in range(2)
    ]
    drawn(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same launch settings: nothing to say
        compare.compare_runs(runs, "heldout_alignment", tmp_path / "same.png")
    launched(runs[1], 2)
    with pytest.warns(UserWarning, match=r"1 CPU thread\(s\): .*m_s0; .*2 CPU thread\(s\): .*m_s1"):
        compare.compare_runs(runs, "heldout_alignment", tmp_path / "mixed.png")
    assert "2 CPU thread(s)" in build_report(runs[1])  # the report page lists the launch


def test_compare_panels_follow_what_the_runs_logged(tmp_path, monkeypatch):
    plain = seed_run(tmp_path / "plain", 0, {0: 0.1, 4: 0.2}, step_seconds=[1.0] * 4, nfe=[8.0] * 4)
    explored = seed_run(
        tmp_path / "sol",
        0,
        {0: 0.1, 2: 0.3, 4: 0.4},
        config="trainer: diffusion_nft\n",
        step_seconds=[1.0] * 4,
        nfe=[4.0] * 4,
        explore_nfe=[10.0] * 4,
    )
    figures = drawn(monkeypatch)
    compare.compare_runs([plain, explored], "heldout_alignment", tmp_path / "c.png")
    numbers = json.loads((tmp_path / "c.json").read_text())
    assert list(numbers["x_axes"]) == ["wall_clock_s", "nfe", "all_nfe"]
    plain_m, sol = numbers["methods"]
    assert sol["points"][1]["x"] == {"wall_clock_s": 2.0, "nfe": 8.0, "all_nfe": 28.0}
    assert plain_m["points"][1]["x"] == {"wall_clock_s": 4.0, "nfe": 32.0, "all_nfe": 32.0}
    assert [len(ax.lines) for ax in figures[0].axes] == [2, 2, 2]
    assert "explore_nfe" in figures[0].axes[2].get_xlabel()
    # nothing but the step logged: the step axis, never one no run has
    bare = seed_run(tmp_path / "bare", 0, {0: 0.1, 2: 0.2, 4: 0.3})
    compare.compare_runs([bare], "heldout_alignment", tmp_path / "bare.png")
    numbers = json.loads((tmp_path / "bare.json").read_text())
    assert list(numbers["x_axes"]) == ["step"]
    assert [p["x"]["step"] for p in numbers["methods"][0]["points"]] == [0, 2, 4]


def test_compare_robot_runs_against_env_steps(tmp_path, monkeypatch, capsys):
    """vla trainers log env_steps as a running count and success_rate as their held-out metric (and
    no step_seconds); a diffusion run beside them keeps its own panels."""
    vla = "trainer: vla\nmethod: habc\n"
    counts = [[900, 2000, 2900, 4100], [1100, 2000, 3100, 3900]]
    runs = [
        seed_run(
            tmp_path / f"habc_s{seed}",
            seed,
            {0: 0.4, 2: 0.6 + 0.1 * seed, 4: 0.8},
            config=vla,
            metric="success_rate",
            env_steps=counts[seed],
            success_rate=[1.0, 0.0, 1.0, 1.0],  # training episodes' success, not the held-out one
        )
        for seed in range(2)
    ]
    figures = drawn(monkeypatch)
    assert main(["report", *runs, "--compare", str(tmp_path / "robot.png"), "--metric", "success_rate"]) == 0
    numbers = json.loads((tmp_path / "robot.json").read_text())
    assert list(numbers["x_axes"]) == ["env_steps"] and numbers["metric"] == "success_rate"
    (habc,) = numbers["methods"]
    assert habc["label"] == "habc" and habc["seeds"] == [0, 1]
    assert [p["x"]["env_steps"] for p in habc["points"]] == [0.0, 2000.0, 4000.0]
    assert [p["mean"] for p in habc["points"]] == pytest.approx([0.4, 0.65, 0.8])
    assert figures[0].axes[0].get_xlabel().startswith("environment steps")

    diffusion = seed_run(
        tmp_path / "flow", 0, {0: 0.1, 2: 0.2, 4: 0.3}, step_seconds=[1.0] * 4, nfe=[2.0] * 4
    )
    # robot runs hold no heldout_alignment (the default), a diffusion run no success_rate
    assert main(["report", *runs, diffusion, "--compare", str(tmp_path / "x.png")]) == 2
    assert (
        main(["report", *runs, diffusion, "--compare", str(tmp_path / "x.png"), "--metric", "success_rate"])
        == 2
    )
    assert "flow' has no finished run with held-out 'success_rate'" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "x.json").exists()


def test_compare_a_training_metric_of_robot_runs_at_every_step(tmp_path, monkeypatch, capsys):
    """--training-metric draws what each training step logged (the rollouts' success), not the
    held-out evaluations: one point per step that has it, against the env steps counted up to it."""
    vla = "trainer: vla\nmethod: habc\n"
    rollouts = [[0.25, 0.0, 0.5, 1.0], [0.75, 0.5, 1.0, 1.0]]
    runs = [
        seed_run(
            tmp_path / f"habc_s{seed}",
            seed,
            {0: 0.4, 4: 0.9},
            config=vla,
            metric="success_rate",
            env_steps=[1000 * (step + 1) + 100 * seed for step in range(4)],
            autonomous_success_rate=rollouts[seed],
        )
        for seed in range(2)
    ]
    figures = drawn(monkeypatch)
    png = tmp_path / "rollouts.png"
    assert main(["report", *runs, "--compare", str(png), "--training-metric", "autonomous_success_rate"]) == 0
    numbers = json.loads((tmp_path / "rollouts.json").read_text())
    assert numbers["metric"] == "autonomous_success_rate"
    assert numbers["source"] == "training steps (metrics.jsonl)"
    (habc,) = numbers["methods"]
    assert [p["step"] for p in habc["points"]] == [1, 2, 3, 4]  # no "before" point: nothing was logged
    assert [p["mean"] for p in habc["points"]] == pytest.approx([0.5, 0.25, 0.75, 1.0])
    assert [p["x"]["env_steps"] for p in habc["points"]] == [1050.0, 2050.0, 3050.0, 4050.0]
    assert habc["final"]["mean"] == 1.0 and habc["final"]["std"] == 0.0  # not eval.json's 0.9
    assert figures[0].axes[0].get_ylabel() == "autonomous_success_rate (training steps)"

    # a name no step logged: the error lists what the run has, and nothing is written
    bad = tmp_path / "bad.png"
    assert main(["report", *runs, "--compare", str(bad), "--training-metric", "autonomous_sucess"]) == 2
    err = capsys.readouterr().err
    assert "no training step logged 'autonomous_sucess'" in err and "autonomous_success_rate" in err
    assert not bad.exists() and not bad.with_suffix(".json").exists()
    assert main(["report", runs[0], "--training-metric", "autonomous_success_rate"]) == 2
    assert "pass --compare PNG with them" in capsys.readouterr().err


def test_compare_mixed_runs_each_drawn_where_it_has_the_axis(tmp_path, monkeypatch):
    robot = seed_run(tmp_path / "robot", 0, {0: 0.1, 4: 0.3}, metric="m", env_steps=[10, 20, 30, 40])
    flow = seed_run(tmp_path / "flow", 0, {0: 0.1, 4: 0.2}, config="a: 1\n", metric="m", nfe=[2.0] * 4)
    figures = drawn(monkeypatch)
    compare.compare_runs([robot, flow], "m", tmp_path / "c.png")
    numbers = json.loads((tmp_path / "c.json").read_text())
    assert list(numbers["x_axes"]) == ["nfe", "env_steps"]
    assert [len(ax.lines) for ax in figures[0].axes] == [1, 1]
    assert numbers["methods"][0]["points"][-1]["x"] == {"env_steps": 40.0}
    assert numbers["methods"][1]["points"][-1]["x"] == {"nfe": 8.0}


def test_compare_labels(tmp_path, capsys, monkeypatch):
    drawn(monkeypatch)
    a = [seed_run(tmp_path / "a" / f"seed{s}", s, {0: 0.0, 4: 0.1}) for s in range(2)]
    b = [seed_run(tmp_path / "b" / f"seed{s}", s, {0: 0.0, 4: 0.2}, config="x: 2\n") for s in range(2)]
    png = tmp_path / "c.png"
    assert main(["report", *a, *b, "--compare", str(png)]) == 0
    assert capsys.readouterr().out.split() == [str(png), str(tmp_path / "c.json")]
    labels = [m["label"] for m in json.loads((tmp_path / "c.json").read_text())["methods"]]
    # both name "seed": the paths' common prefixes tell them apart
    assert labels == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert main(["report", *a, *b, "--compare", str(png), "--label", "ours", "--label", "base"]) == 0
    labels = [m["label"] for m in json.loads((tmp_path / "c.json").read_text())["methods"]]
    assert labels == ["ours", "base"]
    capsys.readouterr()
    assert main(["report", *a, *b, "--compare", str(png), "--label", "ours"]) == 2
    assert "--label is given 1 times for 2 method(s)" in capsys.readouterr().err
    assert main(["report", a[0], "--label", "ours"]) == 2
    assert main(["report", a[0], a[0], "--compare", str(png)]) == 2
    assert "given twice" in capsys.readouterr().err
    groups = [[Path("r/x_lr3_s0"), Path("r/x_lr3_s1")], [Path("q/flat-seed-1"), Path("q/flat-seed-2")]]
    assert method_groups.method_labels([*groups, [Path("one_s0")]]) == ["x_lr3", "flat", "one_s0"]


def test_t_quantiles():
    assert compare.t_975(1) == 12.7062 and compare.t_975(30) == 2.0423
    assert compare.t_975(31) == pytest.approx(2.0395, abs=1e-4)
    assert compare.t_975(120) == pytest.approx(1.9799, abs=1e-4)
    assert compare.t_975(10**6) == pytest.approx(1.96, abs=1e-4)
    # between whole degrees of freedom (Welch's): never below the exact quantile, close from 3 on
    from scipy import stats

    for df in (1.5, 2.3, 3.2, 4.7, 10.5, 17.2, 29.9, 30.5, 45.3):
        exact = stats.t.ppf(0.975, df)
        assert compare.t_975(df) >= exact - 1e-4
        if df >= 3:
            assert compare.t_975(df) == pytest.approx(exact, rel=0.004)
