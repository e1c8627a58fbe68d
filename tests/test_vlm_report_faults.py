"""User-facing faults, each through the CLI: a VLM benchmark or training image that Qwen2-VL's
processor cannot resize (one side over 200 times the other), and `mmrl report` on damaged run files
(eval.json, metrics.jsonl, safetensors), an unknown --seed-key and a directory that does not exist.
A user's mistake is one `error:` line and exit code 2, with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from mmrl.cli import main
from tests.test_displacement import make_run, make_start, unit
from tests.test_report import fake_run, seed_run
from tests.test_vlm_benchmarks import b64, hr_row, image_bytes, write_tsv
from vlm_rl.eval_benchmarks import resolve_model
from vlm_rl.loading import load
from vlm_rl.models import ImageSizeError
from vlm_rl.question_jsonl import write_benchmark
from vlm_rl.tasks import make_examples

WIDE = (4000, 2)  # aspect ratio 2000: Qwen2-VL's smart_resize refuses above 200


def one_error_line(err: str) -> str:
    """The one `error:` line of stderr (transformers may draw a progress bar there when a model loads)."""
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


# ---------------------------------------------------------------------------------------------
# VLM: an image the processor cannot resize


def test_the_adapter_names_an_image_it_cannot_resize():
    vlm = load(resolve_model(None))
    for call in (vlm.resized_size, vlm.encode_image):
        with pytest.raises(ImageSizeError, match=r"image of 4000x2 pixels cannot be resized .*aspect ratio"):
            call(Image.new("RGB", WIDE))
    assert vlm.resized_size(Image.new("RGB", (600, 3))) == vlm.encode_image(Image.new("RGB", (600, 3))).size


def test_eval_vlm_skips_counts_and_reports_a_row_whose_image_cannot_be_resized(tmp_path, capsys):
    good, wide = b64(image_bytes()), b64(image_bytes(size=WIDE))
    rows = [hr_row(0, "A", 0, good), hr_row(1, "B", 1, wide), hr_row(2, "C", 2, good)]
    path = write_tsv(tmp_path / "hr.tsv", rows)
    out = tmp_path / "out"
    args = [f"benchmark={path}", f"model={resolve_model(None)}", "modes=[auto]", f"output_dir={out}"]
    args += ["rollout.max_new_tokens=4", "rollout.max_turns=1", "progress=false", "device=cpu"]
    assert main(["eval", "vlm", *args]) == 0
    printed = capsys.readouterr()
    warning = "skipped while evaluating: row 1 (1), line 3: image of 4000x2 pixels cannot be resized"
    assert warning in printed.err
    assert "rows: 3 read, 1 skipped, 2 scored" in printed.out
    report = json.loads((out / "eval_vlm.json").read_text())
    assert (report["rows_read"], report["scored"], report["skipped"]) == (3, 2, 1)
    (skipped,) = report["skipped_rows"]
    assert (skipped["row"], skipped["id"], skipped["line"]) == (1, "1", 3)
    assert "aspect ratio" in skipped["reason"]
    assert report["results"]["auto"]["scored"] == 2  # accuracy over the rows scored
    predictions = (out / "eval_vlm_predictions.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["row"] for line in predictions) == [0, 2]


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_training_refuses_a_question_whose_image_cannot_be_resized_before_writing(tmp_path, capsys, split):
    train = write_benchmark(make_examples(4, seed=1), tmp_path / "train")
    held = write_benchmark(make_examples(2, seed=1, split="heldout"), tmp_path / "held")
    bad = train if split == "train" else held
    rows = [json.loads(line) for line in bad.read_text().splitlines()]
    for row in rows:  # every question, so that the first step or the first evaluation draws one
        Image.new("RGB", WIDE).save(bad.parent / row["image"])
    out = tmp_path / "run"
    args = ["train", "vlm/tool_grpo", f"data.source={train}", f"data.heldout_file={held}", "steps=1"]
    args += ["train.questions_per_step=2", "train.group_size=2", "eval_modes=[auto]", "progress=false"]
    args += ["rollout.max_new_tokens=4", f"output_dir={out}"]
    assert main(args) == 2
    err = one_error_line(capsys.readouterr().err)
    key = "data.source" if split == "train" else "data.heldout_file"
    assert f"{key} = {str(bad)!r}: question_id={rows[0]['question_id']!r}" in err
    assert str(bad.parent / rows[0]["image"]) in err and "4000x2 pixels cannot be resized" in err
    assert "pad or crop that image" in err
    assert not out.exists()  # refused before the run wrote anything


def test_training_refuses_a_question_whose_image_does_not_open(tmp_path, capsys):
    train = write_benchmark(make_examples(2, seed=1), tmp_path / "train")
    held = write_benchmark(make_examples(2, seed=1, split="heldout"), tmp_path / "held")
    first = json.loads(train.read_text().splitlines()[0])
    (train.parent / first["image"]).write_bytes(b"not an image")
    out = tmp_path / "run"
    args = ["train", "vlm/tool_grpo", f"data.source={train}", f"data.heldout_file={held}", "steps=1"]
    args += ["train.questions_per_step=2", "train.group_size=2", "progress=false", f"output_dir={out}"]
    assert main(args) == 2
    err = one_error_line(capsys.readouterr().err)
    assert f"question_id={first['question_id']!r}" in err and "cannot be read" in err
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# mmrl report on damaged run files


def two_seeds(tmp_path: Path) -> list[str]:
    return [seed_run(tmp_path / f"m_s{seed}", seed, {0: 0.1, 4: 0.2 + seed / 10}) for seed in (0, 1)]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"before": {"heldout_alignment": 0.1', "is not valid JSON"),
        ('{"before": 1, "after": {"heldout_alignment": 0.2}}', "'before' is 1, not an object of held-out"),
        ("[1, 2]", "holds a list, not a JSON object"),
    ],
)
def test_compare_refuses_a_damaged_eval_json(tmp_path, capsys, text, says):
    runs = two_seeds(tmp_path)
    (Path(runs[0]) / "eval.json").write_text(text)
    png = tmp_path / "out" / "c.png"
    assert main(["report", *runs, "--compare", str(png)]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert str(Path(runs[0]) / "eval.json") in err and says in err and "copy it again" in err
    assert not (tmp_path / "out").exists()


def test_a_metrics_row_whose_step_is_not_a_number_is_refused_by_every_report(tmp_path, capsys):
    runs = two_seeds(tmp_path)
    with (Path(runs[0]) / "metrics.jsonl").open("a") as file:
        file.write(json.dumps({"step": "x", "loss": 0.5}) + "\n")
    png = tmp_path / "out" / "c.png"
    for extra in (["--compare", str(png)], ["--compare", str(png), "--training-metric", "loss"]):
        assert main(["report", *runs, *extra]) == 2
        err = one_error_line(capsys.readouterr().err)
        assert f"{str(Path(runs[0]) / 'metrics.jsonl')!r}: row 5 has step = 'x', not a number" in err
    assert not (tmp_path / "out").exists()
    page = fake_run(tmp_path / "page")
    with (page / "metrics.jsonl").open("a") as file:
        file.write(json.dumps({"step": "x", "reward": 1.0}) + "\n")
    assert main(["report", str(page)]) == 2
    assert "row 41 has step = 'x'" in one_error_line(capsys.readouterr().err)
    assert not (page / "report.html").exists()


def test_displacement_refuses_a_truncated_safetensors_file(tmp_path, capsys):
    start = make_start(tmp_path / "start")
    for seed in range(2):
        make_run(tmp_path / f"a_s{seed}", tmp_path / "start", start, 1, seed, unit(0), own=1.0)
    final = tmp_path / "a_s1" / "final" / "model.safetensors"
    data = final.read_bytes()
    runs = [str(tmp_path / "a_s0"), str(tmp_path / "a_s1")]
    for cut in (len(data) // 2, 5):  # the tensors cut short; the header cut short
        final.write_bytes(data[:cut])
        assert main(["report", *runs, "--displacement"]) == 2
        err = one_error_line(capsys.readouterr().err)
        assert f"{str(final)!r} is not a readable safetensors file" in err and "copy it again" in err


def test_an_unknown_seed_key_is_refused_naming_the_keys_there_are(tmp_path, capsys):
    runs = two_seeds(tmp_path)
    png = tmp_path / "out" / "c.png"
    assert main(["report", *runs, "--compare", str(png), "--seed-key", "nosuch.key"]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert "--seed-key 'nosuch.key': no run's config.yaml has this key" in err
    assert "the keys at the top level are: " in err and "rollout" in err and "trainer" in err
    assert main(["report", *runs, "--compare", str(png), "--seed-key", "rollout.stepz"]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert "(did you mean 'rollout.steps'?); the keys under 'rollout' are: " in err
    assert not (tmp_path / "out").exists()
    assert main(["report", *runs, "--compare", str(png), "--seed-key", "rollout.steps"]) == 0


def test_a_run_directory_that_does_not_exist_is_named_as_missing(tmp_path, capsys):
    runs = two_seeds(tmp_path)
    missing = str(tmp_path / "m_s2")
    for extra in (["--compare", str(tmp_path / "c.png")], ["--displacement"]):
        assert main(["report", *runs, missing, *extra]) == 2
        err = one_error_line(capsys.readouterr().err)
        assert f"run directory {missing!r} does not exist" in err and "no finished run" not in err
