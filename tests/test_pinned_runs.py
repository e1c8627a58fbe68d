"""Every training recipe, and the robot episode loops, compute what tests/pinned/runs.json recorded:
a short seeded run gives the same metrics, held-out numbers and final weights (one thread, CPU, the
AVX2 kernels that tests/fixed_isa.py selects on any x86 processor), to the float rounding by which
processors of other models differ (tests/pinned_runs.py: RTOL, WEIGHT_RTOL); the robot loops' episode
outcomes and recorded dataset exactly. A refactor must leave these unchanged; a change of numbers
that is meant re-records them (`python tests/pinned_runs.py --record NAME`) and says why in its
commit."""

import json

import pytest
from fixed_isa import fixed_isa_problem
from pinned_runs import PINNED, RUNS, differences, fingerprint, robot_loops, weight_differences
from test_replicas import REAL_MODEL_RECIPES

from mmrl.cli import load_plugins

load_plugins()
EXPECTED = json.loads(PINNED.read_text())


def test_every_training_recipe_is_pinned():
    from mmrl.config import list_recipes

    # the real-model recipes need weights from a local path: tests/test_replicas.py runs them on replicas
    training = [r for r in list_recipes() if not r.startswith("pretrain/") and r not in REAL_MODEL_RECIPES]
    # the *_quick recipes differ from their full recipe only in sizes the pinned runs override
    full = sorted(r for r in training if not r.endswith("_quick") or r == "diffusion/branchgrpo_quick")
    assert sorted(RUNS) == full
    assert set(EXPECTED) == {*RUNS, "robot_loops"}


@pytest.mark.parametrize(
    "recipe", [pytest.param(r, marks=pytest.mark.needs_robot) if r.startswith("vla/") else r for r in RUNS]
)
def test_recipe_computes_what_was_pinned(recipe, tmp_path):
    problem = fixed_isa_problem()
    assert problem is None, problem
    got = fingerprint(recipe, RUNS[recipe], tmp_path / "run")
    expected = EXPECTED[recipe]
    problems = differences(got["metrics"], expected["metrics"], "metrics")
    problems += differences(got["eval"], expected["eval"], "eval")
    problems += weight_differences(got["weights"], expected["weights"])
    assert not problems, "\n".join(problems[:20])


@pytest.mark.needs_robot
def test_robot_loops_compute_what_was_pinned(tmp_path):
    problem = fixed_isa_problem()
    assert problem is None, problem
    assert robot_loops(tmp_path) == EXPECTED["robot_loops"]


def test_a_fingerprint_differs_beyond_float_rounding_only():
    row = {"step": 1, "loss": 0.5, "reward": 0.25, "method": "grpo"}
    assert differences({**row, "loss": 0.5 * (1 + 1e-3)}, row) == []  # another processor's rounding
    assert differences({**row, "loss": 0.51}, row) == [".loss: 0.51 != 0.5"]
    assert differences({**row, "step": 2}, row) and differences({**row, "step": 1.0}, row)
    assert differences([row], [row, row]) and differences({**row, "extra": 1}, row)
    tensor = ["torch.float32", [4, 4], 2.0, 0.3]
    assert weight_differences({"w": ["torch.float32", [4, 4], 2.0, 0.3 + 1e-5]}, {"w": tensor}) == []
    assert weight_differences({"w": ["torch.float32", [4, 4], 2.0, 0.3 + 1e-3]}, {"w": tensor})
    assert weight_differences({"w": ["torch.bfloat16", [4, 4], 2.0, 0.3]}, {"w": tensor})
