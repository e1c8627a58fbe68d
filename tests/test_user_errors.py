"""User mistakes that used to end in a traceback (or a silently random model): a model.path of the
wrong kind for each trainer, a reward server URL that is not http(s), prune depths outside the tree,
and `mmrl pretrain` given a path. Each must stop before any training step with exit code 2 and one
``error:`` line that names the key."""

import json
from pathlib import Path

import pytest

from mmrl.cli import load_plugins, main
from mmrl.examples.digits import TinyModelConfig, build_model
from vla_rl.policy import PAD, UNK, VLAConfig, VLAPolicy
from vlm_rl.models import VLMAdapter

load_plugins()
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """One small saved model of each kind, plus broken directories."""
    root = tmp_path_factory.mktemp("models")
    build_model(TinyModelConfig(hidden_size=8, layers=1, heads=2), digits=4).save_pretrained(root / "lm")
    policy = VLAPolicy(
        VLAConfig(vocabulary=[PAD, UNK, "red"], image_size=16, channels=[4], keypoints=4, hidden=8)
    )
    policy.save_pretrained(root / "vla")
    VLMAdapter.tiny(["red"]).save_pretrained(root / "vlm")
    (root / "not_json").mkdir()
    (root / "not_json" / "config.json").write_text("{model_type: qwen2")
    (root / "no_weights").mkdir()
    (root / "no_weights" / "config.json").write_text((root / "lm" / "config.json").read_text())
    return {path.name: path for path in root.iterdir()}


def error_line(capsys) -> str:
    """The one `error:` line on stderr; no traceback."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def train(tmp_path: Path, recipe: str, *overrides: str) -> int:
    return main(["train", recipe, f"output_dir={tmp_path / 'run'}", "steps=1", "progress=false", *overrides])


@pytest.mark.parametrize(
    ("model", "found"),
    [
        ("vla", "no model_type"),
        ("vlm", "'qwen2_vl'"),
        ("not_json", "not valid JSON"),
        ("no_weights", "does not load"),
    ],
)
def test_tiny_grpo_refuses_another_model(saved, tmp_path, capsys, model, found):
    assert train(tmp_path, "core/tiny_grpo", f"model.path={saved[model]}") == 2
    line = error_line(capsys)
    assert f"model.path = '{saved[model]}'" in line and found in line and "mmrl pretrain tiny_lm" in line


@pytest.mark.parametrize(("model", "found"), [("lm", "'qwen2' model"), ("vlm", "'qwen2_vl' model")])
def test_diffusion_refuses_another_model(saved, tmp_path, capsys, model, found):
    assert train(tmp_path, "diffusion/flat_grpo", f"model.path={saved[model]}") == 2
    line = error_line(capsys)
    assert "model.path" in line and found in line and "not a text-to-image pipeline" in line


@pytest.mark.parametrize(("model", "found"), [("lm", "'qwen2' model"), ("vla", "no model_type")])
def test_tool_grpo_refuses_another_model(saved, tmp_path, capsys, model, found):
    assert train(tmp_path, "vlm/tool_grpo", f"model.path={saved[model]}") == 2
    line = error_line(capsys)
    assert "model.path" in line and found in line and "not a chat VLM" in line


@pytest.mark.needs_robot
def test_vla_online_refuses_another_model(saved, tmp_path, capsys):
    lm = saved["lm"]
    assert (lm / "config.json").is_file() and (lm / "model.safetensors").is_file()  # files habc checks for
    assert train(tmp_path, "vla/habc", f"model.path={lm}") == 2
    line = error_line(capsys)
    assert f"model.path = '{lm}'" in line and "'qwen2' model, not a VLAPolicy" in line


@pytest.mark.parametrize("url", ["ftp://x", "file:///etc/passwd", "localhost:8000"])
def test_reward_server_url_must_be_http(tmp_path, capsys, url):
    options = f"reward.options={json.dumps({'url': url})}"
    assert train(tmp_path, "diffusion/flat_grpo", "reward.name=http_reward", options) == 2
    line = error_line(capsys)
    assert f"reward.options.url = '{url}'" in line and "http" in line


@pytest.mark.parametrize(
    ("overrides", "key", "fix"),
    [
        (["prune.depths=[9]"], "prune.depths = [9]: no depth 9", "between 1 and 4"),
        (["prune.depths=[1,2,3,4]"], "prune.depths = [1, 2, 3, 4] prunes every depth", "gives depths 1 to 4"),
        (["prune.width=best_worst_quarter", "prune.depths=[4]"], "prune.width", "remove 4 from prune.depths"),
        (
            ["explore.enabled=true", "explore.keep=32", "rollout.split_steps=[0,3]"],
            "explore.keep = 32",
            "has 16",
        ),
    ],
)
def test_prune_and_explore_keys_must_fit_the_tree(tmp_path, capsys, overrides, key, fix):
    assert train(tmp_path, "diffusion/branchgrpo", *overrides) == 2
    line = error_line(capsys)
    assert key in line and fix in line


@pytest.mark.parametrize("name", ["../../configs/core/tiny_grpo", "tiny_lm.yaml", "/etc/x", "tiny_llm"])
def test_pretrain_takes_recipe_names_only(capsys, name):
    assert main(["pretrain", name]) == 2
    line = error_line(capsys)
    assert f"mmrl pretrain '{name}'" in line and "tiny_lm" in line and "mmrl train PATH.yaml" in line
