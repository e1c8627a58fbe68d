"""`mmrl report RUN ... --displacement`: the split of each method's move into the part its seeds share
and their own, and the angle between methods' shared parts, recovered on runs built with known ones."""

import math

import pytest
import torch
import yaml
from safetensors.torch import save_file

from mmrl.cli import main
from mmrl.config import ConfigError
from mmrl.displacement import displacement_summary

SIZE = 20_000


def make_start(path):
    path.mkdir(parents=True)
    start = {
        "a.weight": torch.randn(SIZE // 2, generator=torch.Generator().manual_seed(0)).view(100, -1),
        "b.bias": torch.zeros(SIZE // 2),
    }
    save_file(start, path / "model.safetensors")
    return start


def make_run(path, start_dir, start, method, seed, shared, own):
    """A finished run of `method` whose final weights are start + shared + a random part of length `own`."""
    path.mkdir(parents=True)
    config = {
        "trainer": "x",
        "seed": seed,
        "output_dir": str(path),
        "lr": method,
        "model": {"path": str(start_dir)},
    }
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    noise = torch.randn(SIZE, generator=torch.Generator().manual_seed(1000 + seed + 100 * int(method)))
    move = shared + own * noise / noise.norm()
    (path / "final").mkdir()
    save_file(
        {
            "a.weight": start["a.weight"] + move[: SIZE // 2].view(100, -1),
            "b.bias": start["b.bias"] + move[SIZE // 2 :],
        },
        path / "final" / "model.safetensors",
    )


def unit(index):
    v = torch.zeros(SIZE)
    v[index] = 1.0
    return v


def test_shared_and_own_parts_and_the_angle_between_methods(tmp_path):
    start = make_start(tmp_path / "start")
    angle = math.pi / 3
    shared_a = 2.0 * unit(0)
    shared_b = 1.0 * (math.cos(angle) * unit(0) + math.sin(angle) * unit(1))
    runs = []
    for seed in range(4):
        runs.append(tmp_path / f"a_s{seed}")
        make_run(runs[-1], tmp_path / "start", start, 1, seed, shared_a, own=3.0)
    for seed in range(4, 8):  # seeds of their own: runs of one seed are not paired across methods
        runs.append(tmp_path / f"b_s{seed}")
        make_run(runs[-1], tmp_path / "start", start, 2, seed, shared_b, own=1.0)
    summary = displacement_summary(runs)
    a, b = summary["methods"]
    assert (a["method"], b["method"], len(a["runs"])) == ("a", "b", 4)
    assert a["shared"] == pytest.approx(2.0, rel=0.1) and a["own"] == pytest.approx(3.0, rel=0.05)
    assert b["shared"] == pytest.approx(1.0, rel=0.1) and b["own"] == pytest.approx(1.0, rel=0.05)
    (pair,) = summary["pairs"]
    assert pair["pairs_of_runs"] == 16
    assert pair["shared_alignment"] == pytest.approx(math.cos(angle), abs=0.08)


def test_runs_of_one_seed_are_not_paired_across_methods(tmp_path):
    start = make_start(tmp_path / "start")
    runs = [tmp_path / "a_s0", tmp_path / "a_s1", tmp_path / "b_s0", tmp_path / "b_s2"]
    for run, method, seed in zip(runs, [1, 1, 2, 2], [0, 1, 0, 2], strict=True):
        make_run(run, tmp_path / "start", start, method, seed, unit(0), own=1.0)
    (pair,) = displacement_summary(runs)["pairs"]
    assert pair["pairs_of_runs"] == 3  # a_s0 with b_s0 is left out


def test_report_prints_the_tables_and_refuses_unfinished_runs(tmp_path, capsys):
    start = make_start(tmp_path / "start")
    for seed in range(2):
        make_run(tmp_path / f"a_s{seed}", tmp_path / "start", start, 1, seed, unit(0), own=1.0)
    assert main(["report", str(tmp_path / "a_s0"), str(tmp_path / "a_s1"), "--displacement"]) == 0
    out = capsys.readouterr().out
    assert "shared" in out and "own" in out
    (tmp_path / "a_s1" / "final" / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="no final weights"):
        displacement_summary([tmp_path / "a_s0", tmp_path / "a_s1"])
    assert main(["report", str(tmp_path / "a_s0"), str(tmp_path / "a_s1"), "--displacement"]) == 2
