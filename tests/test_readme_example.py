"""The README's Python example runs as written: it trains the tiny core recipe for a few steps (an
untrained model, no pretraining needed) and writes a run directory, in a few seconds."""

import contextlib
import io
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def readme_example() -> str:
    blocks = PYTHON_BLOCK.findall((ROOT / "README.md").read_text())
    assert len(blocks) == 1, f"the README should hold one ```python example, it holds {len(blocks)}"
    return blocks[0]


def test_example_is_short_and_cheap():
    code = readme_example()
    lines = [line for line in code.splitlines() if line.strip()]
    assert len(lines) <= 12, f"the README's example has {len(lines)} lines: keep it to about ten"
    assert "core/tiny_grpo" in code and "steps=" in code, "the example should train core/tiny_grpo briefly"
    compile(code, "README.md", "exec")


def test_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the example's output_dir is relative: the run lands under tmp_path
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(readme_example(), "README.md", "exec"), {"__name__": "readme_example"})
    output = printed.getvalue()
    assert "grpo" in output and "tree_depthwise" in output, output  # ADVANTAGES.names()
    runs = [p.parent for p in tmp_path.glob("runs/*/eval.json")]
    assert len(runs) == 1, f"the example should write one run under runs/: {list(tmp_path.rglob('*'))[:20]}"
    results = json.loads((runs[0] / "eval.json").read_text())
    assert set(results) >= {"before", "after"}
    assert 0.0 <= results["after"]["heldout_reward"] <= 1.0
    assert (runs[0] / "metrics.jsonl").read_text().count("\n") >= 1
    assert (runs[0] / "config.yaml").exists()
