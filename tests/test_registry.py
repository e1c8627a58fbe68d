"""Registry kinds: an entry declares what it is called with, registration checks its signature, and a
config option that accepts only some kinds refuses the others in one line naming those it accepts."""

import importlib
import pkgutil
import subprocess
import sys
import textwrap

import pytest

from mmrl import registry
from mmrl.cli import load_plugins, main
from mmrl.registry import ADVANTAGES, LOSSES, EntryKind, Registry, UnknownNameError

load_plugins()
GROUP_OR_TREE = (
    "grpo, grpo_global_std, mc_grpo, rloo, tree_depthwise, tree_depthwise_nested, "
    "tree_depthwise_population_std, tree_value, treepo"
)


def test_an_entry_whose_signature_does_not_fit_its_kind_is_refused():
    def swapped(group_ids, rewards):
        return rewards

    with pytest.raises(
        TypeError, match=r"first parameters must be \(rewards, group_ids\).*group_ids, rewards"
    ):
        ADVANTAGES.register("test_swapped", kind="group")(swapped)
    with pytest.raises(TypeError, match=r"\(logp, old_logp, advantages, mask\)"):
        LOSSES.register("test_no_mask", kind="policy")(lambda logp, old_logp, advantages: logp)
    assert "test_swapped" not in ADVANTAGES and "test_no_mask" not in LOSSES


@pytest.mark.parametrize("kind", [None, "flat"])
def test_an_entry_without_a_known_kind_is_refused(kind):
    with pytest.raises(ValueError, match="register it with kind= one of group, tree, temporal"):
        ADVANTAGES.register("test_kindless", kind=kind)
    assert "test_kindless" not in ADVANTAGES


def test_an_entry_that_fits_its_kind_is_looked_up_with_it(monkeypatch):
    monkeypatch.setattr(registry, "ALL_REGISTRIES", {})  # the test registry stays out of `mmrl list`
    kinds = (EntryKind("pair", ("a", "b"), "thing"), EntryKind("one", ("a",), "thing"))
    things = Registry("thing", "test entries", kinds=kinds)

    @things.register("add", kind="pair")
    def add(a, b, scale=1.0):
        return scale * (a + b)

    things.register("neg", kind="one")(lambda a: -a)
    assert things.get("add") is add and things.get("add")(1, 2, scale=2.0) == 6.0
    assert things.kind_of("add").name == "pair" and things.kind_of("neg").name == "one"
    assert things.names_of_kind(("pair",)) == ["add"]
    assert things.names_of_kind(("one", "pair")) == ["add", "neg"]
    assert things.kind_of("add").describe() == "a pair thing (a, b)"
    with pytest.raises(ValueError, match="already has an entry named 'add'"):
        things.register("add", kind="pair")(add)


def test_a_kind_in_a_registry_without_kinds_is_refused(monkeypatch):
    monkeypatch.setattr(registry, "ALL_REGISTRIES", {})
    plain = Registry("plain", "test entries")
    with pytest.raises(ValueError, match="the plain registry has no kinds; drop kind="):
        plain.register("x", kind="group")
    assert "x" not in plain


@pytest.fixture
def things(monkeypatch, tmp_path) -> Registry:
    """A test registry that module sources name as ``THINGS`` (as a plugin's name ``REWARDS``), kept out
    of `mmrl list`, with modules written to `tmp_path` importable."""
    monkeypatch.setattr(registry, "ALL_REGISTRIES", {})
    things = Registry("thing", "test entries")
    monkeypatch.setattr(registry, "THINGS", things, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    return things


def test_a_provided_module_lists_its_entries_and_is_imported_on_first_use(things, monkeypatch, tmp_path):
    (tmp_path / "lazy_things.py").write_text(
        textwrap.dedent(
            """
            from mmrl.registry import THINGS

            @THINGS.register("wide")
            def wide():
                return "wide"

            @THINGS.register(
                "tall",
            )
            def tall():
                return "tall"
            """
        )
    )
    unnamed = "from mmrl.registry import THINGS\nTHINGS.register(NAME)(len)\n"
    (tmp_path / "unnamed_things.py").write_text(unnamed)
    (tmp_path / "no_things.py").write_text("x = 1\n")
    registry.provide("lazy_things")
    assert things.names() == ["tall", "wide"] and "wide" in things and "lazy_things" not in sys.modules
    assert things.get("wide")() == "wide" and "lazy_things" in sys.modules
    with pytest.raises(ValueError, match="already has an entry named 'wide'"):
        registry.provide("lazy_things")
    with pytest.raises(ValueError, match=r"unnamed_things.py:2: THINGS.register needs the entry's name as a"):
        registry.provide("unnamed_things")
    with pytest.raises(ValueError, match="no_things registers no entry that can be read from its source"):
        registry.provide("no_things")
    with pytest.raises(ValueError, match="missing_module_of_things is declared but no source file"):
        registry.provide("missing_module_of_things")
    monkeypatch.delitem(sys.modules, "lazy_things")


def test_a_provided_module_that_fails_to_import_says_so_on_first_use(things, tmp_path):
    (tmp_path / "broken_things.py").write_text(
        "import a_library_not_installed\nfrom mmrl.registry import THINGS\n\n"
        '@THINGS.register("gone")\ndef gone(): ...\n'
    )
    registry.provide("broken_things")
    assert things.names() == ["gone"]
    with pytest.raises(UnknownNameError, match="'gone' comes from broken_things, which cannot be imported"):
        things.get("gone")


def test_a_module_imported_before_its_plugin_is_declared_keeps_its_entries(things, monkeypatch, tmp_path):
    """A test may import a trainer's module before the plugins are loaded: declaring it then is no clash."""
    (tmp_path / "early_things.py").write_text(
        'from mmrl.registry import THINGS\n\n@THINGS.register("early")\ndef early():\n    return "early"\n'
    )
    early = importlib.import_module("early_things").early
    registry.provide("early_things")
    assert things.get("early") is early
    monkeypatch.delitem(sys.modules, "early_things")


def test_every_declared_plugin_entry_is_what_its_module_registers():
    """The plugins' register modules name each entry and the module that registers it: each declared
    module registers its names, and every entry the plugin packages register is declared (an undeclared
    one would stay unknown until something else imported its module)."""
    for reg in registry.ALL_REGISTRIES.values():
        for name in reg.names():
            reg.get(name)  # imports the declared module, which must register the name
    for package in ("diffusion_rl", "vlm_rl", "vla_rl", "mmrl.examples"):
        for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
            try:
                importlib.import_module(info.name)
            except ImportError:  # an optional extra's module (LeRobot's policy): it registers nothing
                continue
    plugin_modules = ("diffusion_rl.", "vlm_rl.", "vla_rl.", "mmrl.examples.")
    for kind, reg in registry.ALL_REGISTRIES.items():
        for name, entry in reg._entries.items():
            if entry.__module__.startswith(plugin_modules):
                assert reg._providers.get(name) == entry.__module__, f"{kind} {name!r} is not declared"


def test_a_command_imports_only_the_plugin_code_it_runs():
    """Listing the registries imports no model library: `mmrl --help` and a robot run start fast."""
    code = (
        "import sys; from mmrl.cli import load_plugins; load_plugins(); "
        "from mmrl.registry import TRAINERS; TRAINERS.get('vla_online'); "
        "print(sorted(m for m in ('diffusers', 'transformers', 'peft') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_an_unknown_entry_names_the_closest():
    with pytest.raises(UnknownNameError, match="unknown advantage 'gpro'.*did you mean 'grpo'"):
        ADVANTAGES.get("gpro")


@pytest.mark.parametrize(
    ("recipe", "allowed", "needs"),
    [
        ("core/tiny_grpo", GROUP_OR_TREE, "group advantage (rewards, group_ids) or a tree advantage"),
        ("diffusion/branchgrpo", GROUP_OR_TREE, "group advantage (rewards, group_ids) or a tree advantage"),
        ("vlm/tool_grpo", GROUP_OR_TREE, "group advantage (rewards, group_ids) or a tree advantage"),
    ],
)
def test_an_estimator_of_another_kind_is_refused_naming_the_allowed_ones(recipe, allowed, needs, capsys):
    assert main(["train", recipe, "train.advantage=gae"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "train.advantage = 'gae' is a temporal advantage (rewards, values, dones)" in lines[0]
    assert needs in lines[0]
    assert lines[0].endswith(f"choose one of {allowed}")


@pytest.mark.parametrize(
    ("recipe", "extra"),
    [
        ("core/tiny_grpo", ["model.path=null"]),
        ("diffusion/branchgrpo_quick", []),
        ("vlm/tool_grpo_quick", []),
    ],
)
def test_a_bad_sampler_option_names_the_key(recipe, extra, tmp_path, capsys):
    out = tmp_path / "run"
    bad = ["train.sampler=beta_thompson", "train.sampler_options={treshold: 0.5}", f"output_dir={out}"]
    assert main(["train", recipe, *bad, *extra]) == 2
    err = capsys.readouterr().err
    assert "error: config error: train.sampler_options = {'treshold': 0.5} for sampler 'beta_thompson'" in err
    assert "treshold" in err and "Traceback" not in err


def test_a_filled_registry_imports_its_module_when_first_listed(things, monkeypatch, tmp_path):
    (tmp_path / "computed_things.py").write_text(
        "from mmrl.registry import THINGS\n\nfor size in (1, 2):\n    THINGS.register(f'size{size}')(size)\n"
    )
    things.fill_from("computed_things")
    things.fill_from("absent_module_of_things")
    assert "computed_things" not in sys.modules
    assert things.names() == ["size1", "size2"] and things.get("size2") == 2
    with pytest.raises(
        UnknownNameError, match="absent_module_of_things, which registers thing entries, cannot"
    ):
        things.get("size3")
    monkeypatch.delitem(sys.modules, "computed_things")
