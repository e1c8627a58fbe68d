"""`optimizer: adamw_8bit` (bitsandbytes' AdamW8bit): the states the memory plan counts, training and
exact resume with it, and the error without bitsandbytes."""

import importlib.util

import pytest
import torch
from safetensors.torch import load_file

from mmrl.config import ConfigError, load_config
from mmrl.examples.tiny_grpo import TinyGRPOTrainer
from mmrl.memory_plan import optimizer_state_bytes
from mmrl.trainer import build_optimizer

bitsandbytes = pytest.importorskip("bitsandbytes", reason="optimizer adamw_8bit needs the adam8bit extra")

TINY = [
    "model.path=null",
    "model.hidden_size=64",  # 64 x 64 blocks: tensors of 4096 elements and more get 8-bit moments
    "task.train_prompts=256",
    "task.heldout_prompts=16",
    "rollout.prompts_per_step=4",
    "progress=false",
    "optimizer=adamw_8bit",
]


def shapes() -> list[tuple[int, ...]]:
    return [(64, 128), (5000,), (128,), (33, 257)]  # 8-bit, 8-bit with a partial block, float32, odd


def test_the_plan_counts_what_adamw_8bit_holds():
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes()]
    real = build_optimizer("adamw_8bit", params, lr=1e-3, weight_decay=0.0)
    for p in params:
        p.grad = torch.randn_like(p)
    real.step()
    tensors = [v for state in real.state.values() for v in state.values() if torch.is_tensor(v)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    held = sum(storages.values())  # the code books are shared: each storage once
    eight_bit = [s["state1"].dtype for s in real.state.values()]
    assert eight_bit == [torch.uint8, torch.uint8, torch.float32, torch.uint8]

    with torch.device("meta"):
        planned = [torch.nn.Parameter(torch.empty(shape)) for shape in shapes()]
    stand_in = torch.optim.AdamW(planned)
    assert optimizer_state_bytes(stand_in, "adamw_8bit") == held
    full = sum(2 * 4 * torch.Size(shape).numel() for shape in shapes())
    assert held < full / 3  # a quarter, plus scales and code books


def run(run_dir, *overrides):
    config = load_config("core/tiny_grpo", [*TINY, f"output_dir={run_dir}", *overrides])
    trainer = TinyGRPOTrainer(config)
    trainer.train()
    return trainer


def test_training_with_adamw_8bit_resumes_exactly(tmp_path):
    straight = run(tmp_path / "straight", "steps=4", "checkpoint_every=2")
    optimizer = straight.optimizer.optimizer  # under Accelerate's wrapper
    assert isinstance(optimizer, bitsandbytes.optim.AdamW8bit)
    assert any(state["state1"].dtype == torch.uint8 for state in optimizer.state.values())

    run(tmp_path / "resumed", "steps=2", "checkpoint_every=2")
    with pytest.warns(UserWarning, match="config changes in: steps"):
        run(tmp_path / "resumed", "steps=4", "checkpoint_every=2", "resume=true")  # from step 2
    a = load_file(tmp_path / "straight" / "checkpoints" / "step_00000004" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "checkpoints" / "step_00000004" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    first = load_file(tmp_path / "resumed" / "checkpoints" / "step_00000002" / "model.safetensors")
    assert any(not torch.equal(first[name], a[name]) for name in a)  # the last two steps moved the weights


def test_without_bitsandbytes_the_trainer_says_how_to_install_it(tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else find_spec(name, *a)
    )
    config = load_config("core/tiny_grpo", [*TINY, f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"adamw_8bit.*mmrl\[adam8bit\].*optimizer=adamw"):
        TinyGRPOTrainer(config)
    assert not (tmp_path / "run").exists()
