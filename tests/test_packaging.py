"""Packaging: torch is pinned, and no extra may pull another torch (that drags in GBs of CUDA)."""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_torch_is_pinned_and_extras_do_not_name_it():
    assert "torch==2.13.0" in PYPROJECT["project"]["dependencies"]
    for extra, requirements in PYPROJECT["project"]["optional-dependencies"].items():
        for requirement in requirements:
            name = requirement.split("[")[0].split("=")[0].split("<")[0].split(">")[0].strip().lower()
            assert name != "torch", f"extra {extra!r} names torch: {requirement}"


@pytest.mark.slow
@pytest.mark.parametrize("extra", sorted(PYPROJECT["project"]["optional-dependencies"]))
def test_extra_resolves_without_another_torch(extra, tmp_path):
    report = tmp_path / "report.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--quiet",
            "--report",
            str(report),
            "-e",
            f"{ROOT}[{extra}]",
        ],
        check=True,
        capture_output=True,
        timeout=900,
    )
    installs = {
        i["metadata"]["name"].lower(): i["metadata"]["version"]
        for i in json.loads(report.read_text())["install"]
    }
    assert "torch" not in installs, f"extra {extra!r} would install torch {installs.get('torch')}"
    assert not [n for n in installs if n.startswith("nvidia-")], (
        f"extra {extra!r} would install CUDA packages"
    )
