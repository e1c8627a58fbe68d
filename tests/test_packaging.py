"""Packaging and CI: torch is pinned, no extra that shares the venv may pull another torch (that drags
in GBs of CUDA), and under CI a skip for something CI installs is a failure (tests/conftest.py)."""

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]
OWN_VENV = {"lerobot"}  # pins an older torch and diffusers: the README builds it in its own venv


def dry_run_install(extra: str, report: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--report", str(report)]
    return subprocess.run([*command, "-e", f"{ROOT}[{extra}]"], capture_output=True, text=True, timeout=900)


def test_torch_is_pinned_and_extras_do_not_name_it():
    assert "torch==2.13.0" in PYPROJECT["project"]["dependencies"]
    for extra, requirements in PYPROJECT["project"]["optional-dependencies"].items():
        for requirement in requirements:
            name = requirement.split("[")[0].split("=")[0].split("<")[0].split(">")[0].strip().lower()
            assert name != "torch", f"extra {extra!r} names torch: {requirement}"


def test_extras_with_their_own_venv_are_documented():
    readme = (ROOT / "README.md").read_text()
    for extra in OWN_VENV:
        assert extra in EXTRAS, f"{extra!r} is no longer an extra: update OWN_VENV"
        assert f".venv-{extra}" in readme, f"the README does not say how to build the {extra!r} venv"


@pytest.mark.slow
@pytest.mark.parametrize("extra", sorted(set(EXTRAS) - OWN_VENV))
def test_extra_resolves_without_another_torch(extra, tmp_path):
    result = dry_run_install(extra, tmp_path / "report.json")
    assert result.returncode == 0, f"extra {extra!r} does not resolve: {result.stderr[-2000:]}"
    installs = {
        i["metadata"]["name"].lower(): i["metadata"]["version"]
        for i in json.loads((tmp_path / "report.json").read_text())["install"]
    }
    assert "torch" not in installs, f"extra {extra!r} would install torch {installs.get('torch')}"
    assert not [n for n in installs if n.startswith("nvidia-")], (
        f"extra {extra!r} would install CUDA packages"
    )


@pytest.mark.slow
@pytest.mark.parametrize("extra", sorted(OWN_VENV))
def test_extra_with_its_own_venv_is_refused_here(extra, tmp_path):
    """The README says pip refuses it beside this project's pins; when that stops being true, merge it."""
    result = dry_run_install(extra, tmp_path / "report.json")
    assert result.returncode != 0 and "ResolutionImpossible" in result.stderr, result.stdout[-2000:]
    conflict = result.stdout.partition("conflict is caused by")[2]
    assert extra in conflict, result.stdout[-2000:]


CI_SKIPS = """
import pytest

pytestmark = pytest.mark.skipif(True, reason="no headless rendering: EGL is missing")


def test_renders():
    pass
"""


def copy_conftest(folder: Path, text: str) -> None:
    """`text` as folder/conftest.py, with the module it imports first (tests/fixed_isa.py) beside it."""
    (folder / "conftest.py").write_text(text)
    (folder / "fixed_isa.py").write_text((ROOT / "tests" / "fixed_isa.py").read_text())


@pytest.mark.parametrize("ci", ["true", ""])
def test_ci_fails_a_skip_for_missing_rendering(ci, tmp_path):
    copy_conftest(tmp_path, (ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_skips.py").write_text(CI_SKIPS)
    (tmp_path / "test_module_skip.py").write_text(
        'import pytest\n\npytest.skip("the robot extra (mujoco, gymnasium) is not installed", '
        "allow_module_level=True)\n"
    )
    env = {**os.environ, "CI": ci}
    command = [sys.executable, "-m", "pytest", "-q", "-rsE", "-p", "no:cacheprovider", str(tmp_path)]
    command.append("--continue-on-collection-errors")  # see both kinds of skip in one run
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    if ci:
        assert result.returncode == 1 and "2 errors" in result.stdout, result.stdout
        assert "CI must not skip this (Skipped: no headless rendering: EGL is missing)" in result.stdout
        assert "apt-get install -y libegl1" in result.stdout and "pip install -e '.[dev]'" in result.stdout
    else:
        assert result.returncode == 0 and "2 skipped" in result.stdout, result.stdout


MARKED = """
import pytest


@pytest.mark.needs_robot
def test_robot():
    pass


@pytest.mark.needs_rendering
def test_rendering():
    pass


@pytest.mark.needs_fetch
def test_fetch():
    pass


def test_adapts(rendering_error):
    assert rendering_error == "the robot extra (mujoco, gymnasium) is not installed"
"""


@pytest.mark.parametrize("ci", ["true", ""])
def test_without_the_robot_extra_its_tests_skip_and_ci_fails_them(ci, tmp_path):
    """conftest's markers and robot modules on a machine without mujoco (simulated)."""
    conftest = (ROOT / "tests" / "conftest.py").read_text()
    assert "\nHAS_ROBOT = all(" in conftest
    copy_conftest(tmp_path, conftest.replace("\nHAS_ROBOT = all(", "\nHAS_ROBOT = False and all("))
    (tmp_path / "test_marked.py").write_text(MARKED)
    (tmp_path / "test_sim_envs.py").write_text("import no_such_robot_stack\n\n\ndef test_x():\n    pass\n")
    env = {**os.environ, "CI": ci}
    command = [sys.executable, "-m", "pytest", "-q", "-rsE", "-p", "no:cacheprovider", str(tmp_path)]
    command.append("--continue-on-collection-errors")
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    if ci:
        assert result.returncode == 1 and "1 passed, 4 errors" in result.stdout, result.stdout
        summary = [line for line in result.stdout.splitlines() if line.startswith("ERROR ")]
        assert len(summary) == 4 and all(
            "CI must not skip this (Skipped: the robot extra" in s for s in summary
        )
    else:
        assert result.returncode == 0 and "1 passed, 4 skipped" in result.stdout, result.stdout
