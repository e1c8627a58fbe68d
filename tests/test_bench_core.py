from mmrl.bench_core import NOISE_TARGET_RATIO, bench_core
from mmrl.registry import BENCHES


def test_bench_core_runs_small_and_reports_every_estimator(capsys):
    assert BENCHES.get("core") is bench_core
    rows = bench_core(repeats=1, n_groups=64)
    noise = [row for row in rows if row["section"] == "noise"]
    advantage = [row for row in rows if row["section"] == "advantage"]
    assert len(noise) == 5
    for row in noise:
        assert row["ours_ms"] > 0 and row["baseline_ms"] > 0
        assert row["ratio"] == row["ours_ms"] / row["baseline_ms"]
        assert row["verdict"] == ("PASS" if row["ratio"] <= NOISE_TARGET_RATIO else "FAIL")
    names = [
        "grpo",
        "grpo_global_std",
        "rloo",
        "mc_grpo",
        "tree_depthwise",
        "treepo",
        "tree_depthwise_nested",
        "tree_value",
        "awr_weights",
        "gae",
        "td1",
    ]
    assert [row["name"] for row in advantage] == names
    assert all(row["ms"] > 0 for row in advantage)
    printed = capsys.readouterr().out
    assert "Deterministic noise" in printed and "Advantage estimators" in printed
