"""`mmrl bench gpu`: one line and exit 0 without CUDA; its code on the tiny replicas on a CPU; the
random-weight checkpoints it trains and serves from."""

import json

import pytest
import torch
from transformers import AutoTokenizer

from mmrl.bench_gpu import NEEDS_CUDA
from mmrl.cli import load_plugins, main
from mmrl.config import ConfigError
from mmrl.registry import BENCHES
from vlm_rl.replicas import FULL, qwen25vl_3b

load_plugins()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA: the bench would run")
def test_without_cuda_it_says_so_in_one_line(tmp_path, capsys):
    output = tmp_path / "gpu.json"
    assert main(["bench", "gpu", f"output={output}"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == NEEDS_CUDA and "Traceback" not in err
    assert not output.exists()


def test_the_sections_run_on_the_tiny_replicas(tmp_path):
    output = tmp_path / "gpu.json"
    rows = BENCHES.get("gpu")(
        device="cpu",
        scale="tiny",
        iterations=1,
        batch=1,
        pool=4,
        pool_prompts=2,
        pool_steps=2,
        rollouts=4,
        vllm=False,
        workdir=str(tmp_path / "models"),
        output=str(output),
    )
    saved = json.loads(output.read_text())
    assert saved["rows"] == json.loads(json.dumps(rows))
    by_section: dict[str, list[dict]] = {}
    for row in rows:
        by_section.setdefault(row["section"], []).append(row)
    assert sorted(by_section) == ["denoiser step", "fp8 pool ranking", "tree vs flat", "vlm rollout"]

    steps = by_section["denoiser step"]
    assert [row["name"] for row in steps] == ["sd35m", "flux_dev"]
    for row in steps:
        assert row["bf16_seconds"] > 0 and row["fp8_seconds"] > 0
        # no FP8 kernels on a CPU: emulated FP8 is full-precision work, so no verdict
        assert row["fp8_linear_layers"].startswith("0 of ") and row["speedup_target"] is None

    (ranking,) = by_section["fp8 pool ranking"]
    assert -1 <= ranking["kendall_tau_min"] <= ranking["kendall_tau"] <= 1

    flat, tree = by_section["tree vs flat"]
    assert (flat["variant"], tree["variant"]) == ("flat GRPO (recipe)", "BranchGRPO")
    assert tree["nfe"] < flat["nfe"]  # shared early steps: fewer model evaluations per prompt
    assert tree["time_ratio"] == pytest.approx(tree["seconds_per_iteration"] / flat["seconds_per_iteration"])
    assert flat["plan_peak_gib"] > 0 and flat["peak_gib"] is None  # a CPU allocator keeps no peak

    (vlm,) = by_section["vlm rollout"]
    assert vlm["tokens"] > 0 and vlm["vllm"] == "vLLM backend: not timed (vllm=false)"
    # the random-weight checkpoints stay for the next run; no half-written one is left
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [
        "pickscore_tiny",
        "prompts.txt",
        "qwen25vl_3b_tiny",
        "sd35m_tiny",
    ]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"sections": ["denoiser", "speed"]}, "unknown section 'speed'"),
        ({"scale": "huge"}, "scale = 'huge'"),
        ({"pool": 0}, "pool = 0"),
    ],
)
def test_bad_options_name_the_key(options, message):
    with pytest.raises(ConfigError, match=message):
        BENCHES.get("gpu")(device="cpu", **options)


def test_the_full_size_qwen_replica_has_the_published_vocabulary(tmp_path):
    directory = qwen25vl_3b(tmp_path / "q", full=True)  # config and tokenizer, no weights
    config = json.loads((directory / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert len(tokenizer) == config["text_config"]["vocab_size"] == FULL["text"]["vocab_size"]
    assert config["image_token_id"] == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert not list(directory.glob("*.safetensors"))
