"""`mmrl eval diffusion`: paired side-by-side evaluation of diffusion models on fixed prompts and seeds."""

import json
import shutil

import numpy as np
import pytest
import torch

from diffusion_rl import evaluate
from diffusion_rl.evaluate import DiffusionEvalConfig, evaluate_models, paired
from diffusion_rl.models import LORA_FILE, LORA_WEIGHTS, FlowPipeline
from diffusion_rl.shapes import vocabulary
from mmrl.cli import load_plugins, main
from mmrl.config import REPO_ROOT, ConfigError
from tests.test_lora_export import save_lora_result
from tests.tiny_flow import SMALL

load_plugins()


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    pipe = FlowPipeline.tiny(vocabulary(), SMALL)
    pipe.save_pretrained(root / "a")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a second model: the same one with every weight perturbed
        for p in pipe.denoiser.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    pipe.save_pretrained(root / "b")
    return str(root / "a"), str(root / "b")


def test_paired_statistics():
    reference = torch.tensor([0.1, 0.5, 0.9, 0.3])
    other = torch.tensor([0.2, 0.5, 0.7, 0.3])
    stats = paired(reference, other)
    assert stats["diff"] == pytest.approx(-0.025)
    assert stats["se"] == pytest.approx(float((other - reference).std()) / 2)
    assert (stats["better"], stats["worse"]) == (1, 1)
    one = paired(reference[:1], other[:1])
    assert one == {"diff": pytest.approx(0.1), "se": None, "better": 1, "worse": 0}


def test_models_side_by_side_are_paired_and_written(two_models, tmp_path):
    a, b = two_models
    copy = tmp_path / "copy_of_a"
    shutil.copytree(a, copy)
    cfg = DiffusionEvalConfig(
        models=[a, b, str(copy)],
        num_prompts=5,
        seeds=2,
        steps=2,
        rewards=[
            "geneval_mini",
            "jpeg_compressibility",
            {"name": "geneval_mini", "options": {"unmentioned": True}},
        ],
        grid_prompts=3,
        output_dir=str(tmp_path / "out"),
    )
    results = evaluate_models(cfg)
    assert results["num_prompts"] == 5 and results["seeds"] == 2
    first, other, same = (results["models"][m] for m in cfg.models)
    assert set(first) == {"geneval_mini", "jpeg_compressibility", "geneval_mini(unmentioned=True)"}
    assert "diff" not in first["geneval_mini"]
    assert first["geneval_mini(unmentioned=True)"]["mean"] != first["geneval_mini"]["mean"]
    for name in first:
        assert other[name]["diff"] == pytest.approx(other[name]["mean"] - first[name]["mean"], abs=1e-6)
        # the same weights draw the same images from the same noise: exactly no difference
        assert (same[name]["diff"], same[name]["better"], same[name]["worse"]) == (0.0, 0, 0)
    assert other["jpeg_compressibility"]["diff"] != 0.0
    assert json.loads((tmp_path / "out" / "eval_diffusion.json").read_text()) == results
    assert (tmp_path / "out" / "grid.png").stat().st_size > 0


def test_scores_are_broken_down_by_prompt_template_and_kept_per_prompt(two_models, tmp_path):
    a, b = two_models
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(
        "a red circle\ntwo blue squares\na green cross on the left\na white square at the top\n"
        "a red circle and a blue square\n"
    )
    cfg = DiffusionEvalConfig(
        models=[a, b],
        prompts=str(prompts),
        steps=2,
        rewards=["geneval_mini", "jpeg_compressibility"],
        grid_prompts=0,
        output_dir=str(tmp_path / "out"),
    )
    results = evaluate_models(cfg)
    rows = [json.loads(line) for line in (tmp_path / "out" / "prompt_scores.jsonl").read_text().splitlines()]
    assert [row["template"] for row in rows] == ["count", "count", "position", "position", "pair"]
    for model in cfg.models:
        for name, stats in results["models"][model].items():
            scores = torch.tensor([row["scores"][model][name] for row in rows])
            assert stats["mean"] == pytest.approx(float(scores.mean()), abs=1e-6)
            parts = stats["by_template"]
            assert {t: part["prompts"] for t, part in parts.items()} == {"count": 2, "pair": 1, "position": 2}
            assert parts["position"]["mean"] == pytest.approx(float(scores[2:4].mean()), abs=1e-6)
            # the templates' paired differences, weighted by their prompts, add up to the whole
            if model == b:
                whole = sum(part["prompts"] * part["diff"] for part in parts.values()) / 5
                assert whole == pytest.approx(stats["diff"], abs=1e-6)
                assert parts["pair"]["se"] is None  # one prompt: no standard error, not NaN
                assert parts["count"]["se"] > 0
            else:
                assert "diff" not in parts["pair"]

    def no_nan(constant):
        raise AssertionError(f"eval_diffusion.json holds {constant}")

    json.loads((tmp_path / "out" / "eval_diffusion.json").read_text(), parse_constant=no_nan)
    assert "+- n/a (one prompt)" in evaluate.format_table(results)

    prompts.write_text("a photo of a cat\na red circle\n")  # outside the shapes grammar: no breakdown
    cfg.rewards, cfg.output_dir = ["jpeg_compressibility"], str(tmp_path / "free")
    results = evaluate_models(cfg)
    assert "by_template" not in results["models"][b]["jpeg_compressibility"]
    rows = [json.loads(line) for line in (tmp_path / "free" / "prompt_scores.jsonl").read_text().splitlines()]
    assert [set(row) for row in rows] == [{"prompt", "scores"}] * 2


def test_command_line_and_bad_input(two_models, tmp_path, capsys):
    a, b = two_models
    code = main(
        [
            "eval",
            "diffusion",
            f"models=[{a},{b}]",
            "num_prompts=3",
            "steps=2",
            "grid_prompts=0",
            f"output_dir={tmp_path}",
        ]
    )
    assert code == 0 and "vs the first" in capsys.readouterr().out
    for overrides, message in [
        (["models=[]"], "models is empty"),
        ([f"models=[{a},{a}]"], "twice"),
        ([f"models=[{a}]", "rewards=[geneval_mni]"], "did you mean 'geneval_mini'"),
        (
            [f"models=[{a}]", "rewards=[{name: geneval_mini, options: {unmentionned: true}}]"],
            "rewards[0].options",
        ),
        (
            [f"models=[{a}]", "rewards=[{name: geneval_mini, option: {}}]"],
            "did you mean 'rewards[0].options'",
        ),
        ([f"models=[{a}]", "prompts=/nonexistent.txt"], "does not exist"),
        (["models=[/nonexistent/model]"], "is not a directory"),
        ([f"models=[{a}]", "seeds=0"], "seeds"),
    ]:
        assert main(["eval", "diffusion", *overrides, f"output_dir={tmp_path}"]) == 2
        assert message in capsys.readouterr().err


@pytest.fixture(scope="module")
def lora_and_merged(two_models, tmp_path_factory):
    """A LoRA result on model a (alpha != rank, non-zero weights) and the same adapter merged into a
    full model in memory and saved with save_pretrained."""
    root = tmp_path_factory.mktemp("lora")
    trainer = save_lora_result(root / "run", two_models[0])
    trainer.pipe.denoiser.fuse_lora()
    trainer.pipe.denoiser.unload_lora()
    trainer.pipe.save_pretrained(root / "merged")
    return str(root / "run" / "final"), str(root / "merged")


def test_a_lora_result_scores_as_its_merged_model(two_models, lora_and_merged, tmp_path):
    a, _ = two_models
    lora, merged = lora_and_merged
    cfg = DiffusionEvalConfig(
        models=[a, merged, lora],
        num_prompts=4,
        steps=2,
        rewards=["geneval_mini", "jpeg_compressibility"],
        grid_prompts=2,
        output_dir=str(tmp_path),
    )
    base, full, adapter = (evaluate_models(cfg)["models"][m] for m in cfg.models)
    for name in base:
        assert adapter[name]["mean"] == pytest.approx(full[name]["mean"], abs=1e-6)
        assert adapter[name]["diff"] == pytest.approx(full[name]["diff"], abs=1e-6)
    assert adapter["jpeg_compressibility"]["diff"] != 0.0  # the adapter changes the images


def test_every_entry_prompt_and_reward_is_checked_before_any_sampling(
    two_models, lora_and_merged, tmp_path, monkeypatch, capsys
):
    a, _ = two_models
    lora, _ = lora_and_merged
    sampled = []

    def counting_sampler(pipe, prompts, *args):
        sampled.append(len(prompts))
        return torch.zeros(len(prompts), 3, 16, 16)

    monkeypatch.setattr(evaluate, "sample_ode", counting_sampler)

    def lora_copy(name, record=None, weights=None):
        path = tmp_path / name
        shutil.copytree(lora, path)
        if record is not None:
            (path / LORA_FILE).write_text(json.dumps(record))
        if weights is not None:
            (path / LORA_WEIGHTS).write_bytes(weights)
        return str(path)

    no_record = lora_copy("no_record")
    (tmp_path / "no_record" / LORA_FILE).unlink()
    bad_json = tmp_path / "bad_json"
    shutil.copytree(a, bad_json)
    (bad_json / "mmrl_pipeline.json").write_text("{")
    text_model = tmp_path / "text_model"
    text_model.mkdir()
    (text_model / "config.json").write_text('{"model_type": "clip_text_model"}')
    shipped = str(REPO_ROOT / "diffusion_rl" / "assets" / "tiny_flow")
    cases = [
        ("/nonexistent/model", "is not a directory"),
        (lora_copy("moved_base", {"base": "/nonexistent/base"}), "base model '/nonexistent/base'"),
        (no_record, "no mmrl_lora.json"),
        (lora_copy("wrong_base", {"base": shipped}), "no LoRA weights for a unet"),
        (lora_copy("corrupt", weights=b"not safetensors"), "not a readable safetensors file"),
        (lora_copy("own_base", {"base": str(tmp_path / "own_base")}), "leads back"),
        (str(bad_json), "is not valid JSON"),
        (str(text_model), "not a text-to-image pipeline"),
    ]
    for bad, message in cases:
        cfg = DiffusionEvalConfig(models=[a, bad], num_prompts=2, steps=1, output_dir=str(tmp_path / "out"))
        with pytest.raises(ConfigError, match=message) as err:
            evaluate_models(cfg)
        assert str(err.value).startswith(f"config error: models[1] = {bad!r}") and "\n" not in str(err.value)
    assert sampled == []

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na purple elephant\n")
    with pytest.raises(ConfigError, match="'geneval_mini' cannot score these prompts"):
        evaluate_models(DiffusionEvalConfig(models=[a, lora], prompts=str(prompts), output_dir=str(tmp_path)))
    assert sampled == []

    code = main(["eval", "diffusion", f"models=[{a},{cases[1][0]}]", f"output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "models[1]" in err and sampled == []


def test_objects_are_read_per_shape_over_the_prompts_that_ask_for_them(two_models, tmp_path):
    a, other_model = two_models
    # two seeds of one method: the perturbed model and an unchanged copy of the first
    b, unchanged = write_run(tmp_path, "run_s0", 0), write_run(tmp_path, "run_s1", 1)
    shutil.copytree(other_model, b)
    shutil.copytree(a, unchanged)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(
        "a red circle\ntwo blue squares\na green cross on the left\na white square at the top\n"
        "a red circle and a blue square\n"
    )
    cfg = DiffusionEvalConfig(
        models=[a, b, unchanged],
        prompts=str(prompts),
        seeds=2,
        steps=2,
        rewards=["jpeg_compressibility"],
        objects=True,
        grid_prompts=0,
        output_dir=str(tmp_path / "out"),
    )
    results = evaluate_models(cfg)
    rows = [json.loads(line) for line in (tmp_path / "out" / "prompt_scores.jsonl").read_text().splitlines()]
    other = results["models"][b]
    shapes = ("circle", "square", "triangle", "cross")
    # no prompt asks for a triangle: nothing to find; the others cover the prompts that ask for them
    assert set(other) == {
        "jpeg_compressibility",
        "objects.all",
        "found.circle",
        "found.square",
        "found.cross",
    } | {f"objects.{shape}" for shape in shapes}
    assert {shape: other[f"found.{shape}"]["prompts"] for shape in ("circle", "square", "cross")} == {
        "circle": 2,
        "square": 3,
        "cross": 1,
    }
    assert [sorted(k for k in row["scores"][b] if k.startswith("found.")) for row in rows] == [
        ["found.circle"],
        ["found.square"],
        ["found.cross"],
        ["found.square"],
        ["found.circle", "found.square"],
    ]
    for model in cfg.models:
        entry = results["models"][model]
        total = sum(entry[f"objects.{shape}"]["mean"] for shape in shapes)
        assert entry["objects.all"]["mean"] == pytest.approx(total, abs=1e-5)
        circles = [
            row["scores"][model]["found.circle"] for row in rows if "found.circle" in row["scores"][model]
        ]
        assert entry["found.circle"]["mean"] == pytest.approx(sum(circles) / 2, abs=1e-6)
        assert entry["found.square"]["by_template"]["position"]["prompts"] == 1
        assert "pair" not in entry["found.cross"]["by_template"]
    assert other["objects.all"]["diff"] == pytest.approx(
        other["objects.all"]["mean"] - results["models"][a]["objects.all"]["mean"], abs=1e-5
    )
    (method,) = results["methods"].values()
    assert method["models"] == [b, unchanged] and method["seeds"] == [0, 1]
    for name, change in method["change"].items():
        assert change["values"] == [other[name]["diff"], 0.0]
    assert "run (2 seeds)" in evaluate.format_table(results) and results["between_methods"] == {}

    prompts.write_text("a photo of a cat\n")
    cfg.output_dir = str(tmp_path / "free")
    with pytest.raises(ConfigError, match="objects=true reads objects of the coloured-shapes world"):
        evaluate_models(cfg)
    assert not (tmp_path / "free").exists()


def write_run(root, name: str, seed: int, lr: float = 1e-4) -> str:
    """A run directory holding only its config.yaml; the model path is its final/."""
    run = root / name
    run.mkdir()
    (run / "config.yaml").write_text(f"trainer: diffusion_nft\nseed: {seed}\ntrain: {{lr: {lr}}}\n")
    return str(run / "final")


def test_seeds_of_a_method_are_pooled_and_methods_compared_by_welch(tmp_path):
    from scipy import stats

    base = str(tmp_path / "base")
    a = [write_run(tmp_path, f"nft_s{s}", s) for s in range(3)]
    b = [write_run(tmp_path, f"nft_lr_s{s}", s, lr=2e-4) for s in range(4)]
    same_seed = [write_run(tmp_path, f"twin_{i}", 7, lr=3e-4) for i in range(2)]  # not distinct seeds
    lone = write_run(tmp_path, "lone", 0, lr=5e-4)
    checkpoint = str(tmp_path / "nft_s0" / "step_20")  # another directory of a run: another method
    names = [base, *a, checkpoint, *b, *same_seed, lone]
    diffs = {name: 0.01 * (i % 5) - 0.013 * (i % 3) for i, name in enumerate(names)}
    models = {base: {"r": {"mean": 0.3}}}
    for name in names[1:]:
        models[name] = {"r": {"mean": 0.3 + diffs[name], "diff": diffs[name], "by_template": {}}}
        models[name]["r"]["by_template"]["pair"] = {"diff": 2 * diffs[name]}
    models[b[0]]["r"]["by_template"]["count"] = {"diff": 1.0}  # not every seed has it: not pooled
    methods, between = evaluate.method_changes(models, names)

    assert {label: (m["models"], m["seeds"]) for label, m in methods.items()} == {
        "nft": (a, [0, 1, 2]),
        "nft_lr": (b, [0, 1, 2, 3]),
    }
    for method, members in zip(methods.values(), (a, b), strict=True):
        values = [diffs[name] for name in members]
        change = method["change"]["r"]
        low, high = stats.t.interval(0.95, len(values) - 1, loc=np.mean(values), scale=stats.sem(values))
        assert change["values"] == values and change["mean"] == pytest.approx(np.mean(values))
        assert change["ci95"] == pytest.approx([low, high], abs=1e-5)
        assert list(change["by_template"]) == ["pair"]
        assert change["by_template"]["pair"]["mean"] == pytest.approx(2 * np.mean(values))
    assert list(between) == ["nft_lr minus nft"]
    welch = between["nft_lr minus nft"]["r"]
    first, second = [diffs[n] for n in a], [diffs[n] for n in b]
    exact = stats.ttest_ind(second, first, equal_var=False)
    assert welch["diff"] == pytest.approx(np.mean(second) - np.mean(first))
    assert welch["df"] == pytest.approx(exact.df)
    exact_low, exact_high = exact.confidence_interval(0.95)
    low, high = welch["ci95"]
    # t between whole degrees of freedom is never below the exact quantile: never narrower
    assert low <= exact_low + 1e-9 and high >= exact_high - 1e-9
    assert (high - low) == pytest.approx(exact_high - exact_low, rel=0.005)
    table = evaluate.format_table(
        {
            "num_prompts": 5,
            "prompts": "heldout",
            "seeds": 1,
            "steps": 2,
            "guidance_scale": 1.0,
            "models": {},
            "methods": methods,
            "between_methods": between,
        }
    )
    assert "nft_lr minus nft (Welch's 95% interval)" in table and "nft (3 seeds)" in table


def test_a_nan_score_is_written_as_null_and_named(two_models, tmp_path, monkeypatch, capsys):
    """eval_diffusion.json stays strict JSON when a reward scores NaN (a model's bad output is data)."""
    real = evaluate.build_reward

    def nan_jpeg(name, options, key):
        fn = real(name, options, key)
        return (
            (lambda images, **k: torch.full((len(images),), float("nan")))
            if name == "jpeg_compressibility"
            else fn
        )

    monkeypatch.setattr(evaluate, "build_reward", nan_jpeg)
    cfg = DiffusionEvalConfig(
        models=list(two_models),
        num_prompts=2,
        seeds=1,
        steps=2,
        rewards=["geneval_mini", "jpeg_compressibility"],
        grid_prompts=0,
        output_dir=str(tmp_path / "out"),
    )
    evaluate_models(cfg)
    text = (tmp_path / "out" / "eval_diffusion.json").read_text()
    written = json.loads(text, parse_constant=lambda name: pytest.fail(f"bare {name} in eval_diffusion.json"))
    assert written["models"][two_models[0]]["jpeg_compressibility"]["mean"] is None
    assert isinstance(written["models"][two_models[0]]["geneval_mini"]["mean"], float)
    assert "jpeg_compressibility.mean = nan" in capsys.readouterr().err
