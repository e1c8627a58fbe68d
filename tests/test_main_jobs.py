"""The README's three main jobs start from a clean clone of the repository (committed files only: the
shipped base models must be in git) and write held-out metrics before and after training.

Each job takes minutes, so these are slow tests, run on purpose: `pytest -m slow tests/test_main_jobs.py`.
The README's figures come from the same commands.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# recipe -> the held-out metric its eval.json must hold before and after training
MAIN_JOBS = {
    "diffusion/branchgrpo_quick": "heldout_shapes_strict",
    "vlm/tool_grpo_quick": "auto_accuracy",
    "vla/habc_quick": "success_rate",
}


@pytest.fixture(scope="module")
def clean_clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    clone = tmp_path_factory.mktemp("clone") / "mmrl"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=300)
    return clone


def test_main_jobs_are_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    for recipe in MAIN_JOBS:
        assert f"mmrl train {recipe}" in readme, f"the README does not list the main job {recipe}"


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(MAIN_JOBS))
def test_main_job_runs_from_a_clean_clone(recipe: str, clean_clone: Path):
    run_dir = clean_clone / "runs" / recipe
    # the clone's own code, not the checkout the venv was installed from
    env = {**os.environ, "PYTHONPATH": str(clean_clone), "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")}
    result = subprocess.run(
        [sys.executable, "-m", "mmrl", "train", recipe, "progress=false"],
        cwd=clean_clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((run_dir / "eval.json").read_text())
    metric = MAIN_JOBS[recipe]
    for when in ("before", "after"):
        value = results[when][metric]
        assert 0.0 <= value <= 1.0, f"{recipe}: eval.json[{when!r}][{metric!r}] = {value}"
    print(f"{recipe}: {metric} {results['before'][metric]:.3f} -> {results['after'][metric]:.3f}")
