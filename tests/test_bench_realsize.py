"""`mmrl bench realsize`: a run whose plan does not fit is reported with its launch and allocates
nothing; a run that fits is launched and its peak resident memory set against its plan (here on the
tiny replicas, which the real-size runs' code takes as it takes the full-size ones)."""

from __future__ import annotations

import pytest

from diffusion_rl.bench.real_size import sd35m
from mmrl.bench_realsize import RealSizeRun, measure
from mmrl.cli import load_plugins, main
from mmrl.resources import LIMIT_ENV

load_plugins()


def tiny(run: RealSizeRun) -> RealSizeRun:
    return RealSizeRun(run.recipe, run.replicas, run.overrides, run.launch, run.files, full=False)


def test_a_run_that_does_not_fit_is_not_run_and_names_its_launch(tmp_path, monkeypatch):
    monkeypatch.setenv(LIMIT_ENV, "0.001")
    row = measure("sd35m", tiny(sd35m()), tmp_path / "sd35m")
    assert row["verdict"] == "not run: does not fit" and row["measured_gib"] is None
    assert f"{LIMIT_ENV} allows 0.0 GiB" in row["note"] and row["plan_gib"] > 0
    assert not (tmp_path / "sd35m" / "sd35m").exists()  # no weights were written


@pytest.mark.slow
def test_a_run_that_fits_is_measured_against_its_plan(tmp_path):
    row = measure("sd35m", tiny(sd35m()), tmp_path / "sd35m")
    assert row["measured_gib"] > 0 and row["baseline_rss_gib"] > 0
    assert row["setup_seconds"] > 0 and row["step_seconds"] > 0 and row["rest_seconds"] > 0
    assert row["plan_ratio"] == pytest.approx(row["plan_gib"] / row["measured_gib"])
    assert row["verdict"].startswith(("PASS", "FAIL"))


def test_an_unknown_run_is_one_error_line(capsys):
    assert main(["bench", "realsize", "runs=[sdxl]"]) == 2
    err = capsys.readouterr().err
    assert "runs: unknown run 'sdxl'" in err and "qwen25vl_3b" in err and "Traceback" not in err
