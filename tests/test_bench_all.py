"""`mmrl bench all`: every bench's ratios in one table and one JSON file, failures reported as rows,
options passed per bench; and `mmrl bench NAME key=value` options checked against the bench."""

import json
import math

import pytest

from mmrl.bench_all import bench_all, bench_kwargs, ratio_rows
from mmrl.bench_core import bench_core
from mmrl.cli import main
from mmrl.config import ConfigError
from mmrl.registry import BENCHES

CALLS = []


def fast(size: int = 10, label: str = "x") -> list[dict]:
    """A bench in the core style: ratio, target and verdict in the row, plus a row without a ratio."""
    CALLS.append(("fast", size, label))
    return [
        {"section": "noise", "name": "draw", "shape": (2, 3), "ratio": 1.2, "target": 1.5, "verdict": "PASS"},
        {"section": "advantage", "name": "grpo", "ms": 0.5},
    ]


def shaped() -> list[dict]:
    """A bench in the diffusion style: two ratios per row, targets without verdicts (<= by default)."""
    CALLS.append(("shaped",))
    return [
        {"variant": "base", "nfe_ratio": 1.0, "nfe_target": None, "time_ratio": 1.0, "time_target": None},
        {"variant": "tree", "nfe_ratio": 0.6, "nfe_target": 0.65, "time_ratio": 0.9, "time_target": 0.71},
        {"variant": "faster", "ratio": 4.0, "target": 3.0, "target_op": ">="},
    ]


def broken() -> list[dict]:
    CALLS.append(("broken",))
    raise ImportError("No module named 'vllm'\nsecond line")


@pytest.fixture
def fake_benches(monkeypatch):
    CALLS.clear()
    entries = {"all": bench_all, "broken": broken, "fast": fast, "shaped": shaped}
    monkeypatch.setattr(BENCHES, "_entries", entries)
    monkeypatch.setattr(BENCHES, "_providers", {})
    monkeypatch.setattr("mmrl.cli.load_plugins", lambda: None)
    return entries


def test_combined_table_and_json(fake_benches, tmp_path, capsys):
    out = tmp_path / "bench" / "all.json"
    table = bench_all(output=str(out), fast={"size": 3})
    assert CALLS == [("broken",), ("fast", 3, "x"), ("shaped",)]  # every bench ran, in name order
    assert [(r["bench"], r["row"], r["ratio"], r["target"], r["verdict"]) for r in table] == [
        ("broken", "(bench failed)", None, None, "ERROR: ImportError: No module named 'vllm'"),
        ("fast", "noise draw 2x3", 1.2, "<= 1.5x", "PASS"),
        ("shaped", "base [nfe_ratio]", 1.0, None, "-"),
        ("shaped", "base [time_ratio]", 1.0, None, "-"),
        ("shaped", "tree [nfe_ratio]", 0.6, "<= 0.65x", "PASS"),
        ("shaped", "tree [time_ratio]", 0.9, "<= 0.71x", "FAIL"),
        ("shaped", "faster", 4.0, ">= 3x", "PASS"),
    ]
    saved = json.loads(out.read_text())
    assert saved["ratios"] == table
    assert saved["summary"] == {"PASS": 3, "FAIL": 1, "ERROR": 1}
    assert saved["benches"]["broken"]["status"] == "failed" and "vllm" in saved["benches"]["broken"]["error"]
    assert saved["benches"]["fast"]["options"] == {"size": 3}
    assert saved["benches"]["fast"]["rows"][0]["shape"] == [2, 3]  # raw rows kept, as JSON
    assert saved["benches"]["fast"]["rows"][1] == {"section": "advantage", "name": "grpo", "ms": 0.5}
    printed = capsys.readouterr().out
    assert "bench broken failed: ImportError" in printed and "side-by-side ratios" in printed
    assert f"wrote {out}" in printed


def test_command_line_options_only_and_skip(fake_benches, tmp_path):
    out = tmp_path / "all.json"
    assert main(["bench", "all", f"output={out}", "only=[fast,shaped]", "skip=[shaped]", "fast.label=y"]) == 0
    assert CALLS == [("fast", 10, "y")]
    assert [r["bench"] for r in json.loads(out.read_text())["ratios"]] == ["fast"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["only=[fats]"], "only: unknown bench 'fats'.*did you mean 'fast'"),
        (["fast.sise=3"], "unknown key 'fast.sise'.*did you mean 'fast.size'"),
        (["fast.size=big"], "fast.size = 'big' is not an integer"),
        (["fast=3"], "fast = 3 must be a section"),
        (["nosuch.x=1"], "unknown key 'nosuch'"),
    ],
)
def test_bad_options_fail_before_any_bench_runs(fake_benches, tmp_path, capsys, args, message):
    assert main(["bench", "all", f"output={tmp_path / 'all.json'}", *args]) == 2
    assert CALLS == []
    err = capsys.readouterr().err
    assert err.startswith("error: config error:")
    with pytest.raises(ConfigError, match=message):
        bench_all(**bench_kwargs(bench_all, _parsed(args)))
    assert not (tmp_path / "all.json").exists()


def _parsed(args: list[str]) -> dict:
    from mmrl.config import apply_overrides

    return apply_overrides({}, args)


def test_single_bench_takes_checked_options(fake_benches, capsys):
    assert main(["bench", "fast", "size=4"]) == 0 and CALLS == [("fast", 4, "x")]
    assert main(["bench", "shaped", "size=4"]) == 2
    assert "unknown key 'size'" in capsys.readouterr().err


def test_ratio_rows_skip_non_numbers_and_fractions():
    rows = [
        {"name": "a", "ratio": "n/a"},
        {"name": "b", "ratio": True},
        {"name": "c", "speed_ratio": 2, "speed_target": None, "tool_ratio": 0.2},  # tool_ratio: no target key
        {"name": "d", "ratio": 2.0, "target": 3.0, "target_op": ">="},
    ]
    assert ratio_rows("x", rows) == [
        {"bench": "x", "row": "c [speed_ratio]", "ratio": 2.0, "target": None, "verdict": "-"},
        {"bench": "x", "row": "d", "ratio": 2.0, "target": ">= 3x", "verdict": "FAIL"},
    ]


def test_rich_table_keeps_brackets(capsys):
    from mmrl.bench_all import print_table

    print_table("t", ["row"], [["base [nfe_ratio]"]])
    assert "[nfe_ratio]" in capsys.readouterr().out


def test_a_wide_table_keeps_every_cell_whole_in_a_log(capsys):
    from mmrl.bench_all import print_table

    name = "metaworld/pick-place-v3: rgb 96px obs from the full meshes, random actions"
    print_table("t", ["variant", "baseline", "steps/s", "ratio"], [[name, name, "33.8", "1.69x"]] * 2)
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if name in line]
    assert len(rows) == 2 and all(line.count(name) == 2 and "1.69x" in line for line in rows)


def test_real_small_run(monkeypatch, tmp_path, rendering_error):
    """core (and vla, when the robot extra renders here) at tiny sizes, through the real registry."""
    entries = {"all": bench_all, "core": bench_core}
    options: dict = {"core": {"repeats": 1, "n_groups": 64}}
    if rendering_error is None:
        from vla_rl.bench import bench_vla

        entries["vla"] = bench_vla
        options["vla"] = {"steps": 3, "num_envs": 2, "repeats": 1, "image_size": 32}
    monkeypatch.setattr(BENCHES, "_entries", entries)
    monkeypatch.setattr(BENCHES, "_providers", {})
    table = bench_all(output=str(tmp_path / "all.json"), **options)
    assert {row["bench"] for row in table} == set(options)
    assert sum(row["bench"] == "core" for row in table) == 5  # the noise rows; advantage rows have no ratio
    assert all(math.isfinite(row["ratio"]) and row["ratio"] > 0 for row in table)
    assert all(row["verdict"] in ("PASS", "FAIL", "-") for row in table)
    assert json.loads((tmp_path / "all.json").read_text())["ratios"] == table
