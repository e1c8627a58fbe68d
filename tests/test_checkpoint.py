"""Checkpoints: exact round trip of nested state, atomic layout, corrupt ones skipped with a warning."""

import random

import numpy as np
import pytest
import torch

from mmrl.checkpoint import (
    list_checkpoints,
    load_latest_checkpoint,
    load_model_weights,
    pack,
    rng_state,
    save_checkpoint,
    set_rng_state,
    unpack,
)


def _trained_adam():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.9))
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).mean().backward()
        opt.step()
    return model, opt


def test_pack_roundtrip_keeps_int_keys_tuples_and_tensors():
    _, opt = _trained_adam()
    state = {"opt": opt.state_dict(), "t": (1, 2.5, None, "x"), "rng": rng_state()}
    tensors = {}
    restored = unpack(pack(state, tensors), tensors)
    assert set(restored["opt"]["state"]) == set(opt.state_dict()["state"])  # int keys kept
    assert restored["t"] == (1, 2.5, None, "x")
    for k, v in opt.state_dict()["state"][0].items():
        assert torch.equal(restored["opt"]["state"][0][k], v)


def test_optimizer_and_rng_resume_exactly(tmp_path):
    model, opt = _trained_adam()
    save_checkpoint(tmp_path, 3, {"optimizer": opt.state_dict(), "rng": rng_state()}, model)
    expected_draws = (random.random(), np.random.rand(), torch.rand(3))
    x = torch.randn(5, 4)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    expected_params = [p.detach().clone() for p in model.parameters()]

    fresh, fresh_opt = _trained_adam()  # different weights and moments
    ckpt = load_latest_checkpoint(tmp_path)
    assert ckpt.step == 3
    load_model_weights(fresh, ckpt)
    fresh_opt.load_state_dict(ckpt.state["optimizer"])
    set_rng_state(ckpt.state["rng"])
    draws = (random.random(), np.random.rand(), torch.rand(3))
    assert draws[0] == expected_draws[0] and draws[1] == expected_draws[1]
    assert torch.equal(draws[2], expected_draws[2])
    fresh_opt.zero_grad()
    fresh(x).pow(2).mean().backward()
    fresh_opt.step()
    for p, q in zip(fresh.parameters(), expected_params, strict=True):
        assert torch.equal(p, q)


def test_keeps_newest_and_ignores_temporary_dirs(tmp_path):
    model = torch.nn.Linear(2, 2)
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, {}, model, keep=2)
    (tmp_path / ".tmp-step_00000005-123").mkdir()  # a writer killed mid-write
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    assert load_latest_checkpoint(tmp_path).step == 4


@pytest.mark.parametrize("damage", ["flip", "truncate", "no_manifest"])
def test_corrupt_checkpoint_falls_back_with_warning(tmp_path, damage):
    model = torch.nn.Linear(2, 2)
    save_checkpoint(tmp_path, 1, {"extra": {"a": torch.ones(2)}}, model)
    newest = save_checkpoint(tmp_path, 2, {"extra": {"a": torch.ones(2)}}, model)
    weights = newest / "model.safetensors"
    if damage == "flip":
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF
        weights.write_bytes(bytes(data))
    elif damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:20])
    else:
        (newest / "manifest.json").unlink()
    with pytest.warns(UserWarning, match="skipping checkpoint .*step_00000002"):
        ckpt = load_latest_checkpoint(tmp_path)
    assert ckpt.step == 1


def test_no_checkpoint_returns_none(tmp_path):
    assert load_latest_checkpoint(tmp_path / "none") is None
