"""Config loading: YAML + dotted overrides into a trainer's dataclass; one-line errors for mistakes."""

from pathlib import Path

import pytest

from mmrl.cli import load_plugins, main
from mmrl.config import ConfigError, all_keys, load_config

load_plugins()
CONFIGS = Path(__file__).resolve().parent.parent / "configs"
RECIPES = sorted(
    str(path.relative_to(CONFIGS).with_suffix(""))
    for path in CONFIGS.rglob("*.yaml")
    if path.parts[len(CONFIGS.parts)] != "accelerate"  # launch configs are not recipes
)
NEEDS_EXTRA = {"pretrain/vla_fetch_reach": "gymnasium_robotics"}  # recipe -> module of its optional extra


def test_recipe_loads_with_overrides():
    config = load_config(
        "core/tiny_grpo",
        ["train.lr=1e-5", "seed=3", "rollout.split_positions=[0,2]", "train.advantage=tree_depthwise"],
    )
    assert config.train.lr == 1e-5  # YAML 1.1 reads 1e-5 as a string; floats accept it
    assert config.seed == 3
    assert config.rollout.split_positions == [0, 2]
    assert config.model.hidden_size == 64  # untouched default from the YAML


def test_resume_is_a_top_level_key():
    assert load_config("core/tiny_grpo", ["resume=true"]).resume is True


def _error(overrides, name="core/tiny_grpo"):
    with pytest.raises(ConfigError) as info:
        load_config(name, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_unknown_key_names_key_value_and_closest():
    message = _error(["train.lrr=0.1"])
    assert "unknown key 'train.lrr'" in message and "0.1" in message
    assert "did you mean 'train.lr'" in message


def test_unknown_key_at_wrong_level_points_to_section():
    assert "did you mean 'train.lr'" in _error(["lr=0.1"])


def test_wrong_type():
    message = _error(["train.ppo_epochs=two"])
    assert "train.ppo_epochs" in message and "'two'" in message and "integer" in message
    assert "true or false" in _error(["resume=maybe"])
    assert "a number" in _error(["train.lr=fast"])


def test_out_of_range():
    message = _error(["train.clip_low=1.5"])
    assert "train.clip_low" in message and "1.5" in message and "<= 1.0" in message
    assert ">= 1" in _error(["steps=0"])


def test_registry_value_lists_choices_and_closest():
    message = _error(["train.advantage=grp"])
    assert "train.advantage" in message and "'grp'" in message
    assert "grpo" in message and "rloo" in message and "did you mean 'grpo'" in message


def test_section_given_a_value():
    assert "must be a section" in _error(["train=3"])


def test_cross_field_check():
    assert "split_positions" in _error(["rollout.split_positions=[0,9]"])


def test_bad_override_syntax():
    assert "key=value" in _error(["train.lr"])


def test_missing_recipe_suggests_closest():
    message = _error([], name="core/tiny_grp")
    assert "did you mean 'core/tiny_grpo'" in message


def test_missing_file():
    assert "does not exist" in _error([], name="nowhere/x.yaml")


def test_invalid_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: tiny_grpo\ntrain: [unclosed\n")
    assert "not valid YAML" in _error([], name=str(bad))


def test_unknown_trainer(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("trainer: tiny_grp\n")
    assert "did you mean 'tiny_grpo'" in _error([], name=str(path))


def test_cli_prints_one_line_error_and_exits_2(capsys):
    assert main(["train", "core/tiny_grpo", "train.lrr=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: config error: unknown key 'train.lrr'")
    assert len(err.splitlines()) == 1


def test_all_keys_lists_dotted_keys():
    from mmrl.examples.tiny_grpo import TinyGRPOConfig

    keys = all_keys(TinyGRPOConfig)
    assert "train.lr" in keys and "rollout.branch_factor" in keys and "seed" in keys


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_loads_into_its_trainers_config(recipe):
    """A typo in a recipe's key or value fails here, not an hour into a chain of runs."""
    if recipe in NEEDS_EXTRA:
        pytest.importorskip(NEEDS_EXTRA[recipe], reason=f"{recipe} needs an optional extra")
    cfg = load_config(recipe, ["output_dir=unused"])
    assert cfg.trainer and cfg.steps > 0


def test_shipped_path_finds_package_assets_but_never_a_runs_output_in_the_repository(tmp_path, monkeypatch):
    from mmrl.config import REPO_ROOT, shipped_path

    monkeypatch.chdir(tmp_path)
    assert shipped_path("vla_rl/assets/tiny_vla") == REPO_ROOT / "vla_rl/assets/tiny_vla"
    assert shipped_path("runs/pretrain/vla/policy") == Path("runs/pretrain/vla/policy")
    (tmp_path / "vla_rl/assets/tiny_vla").mkdir(parents=True)  # the working directory's own comes first
    assert shipped_path("vla_rl/assets/tiny_vla") == Path("vla_rl/assets/tiny_vla")
