"""The small VLA: shapes, its clipped-Gaussian chunk distribution, chunk execution, saving, behaviour
cloning on recorded demonstrations, and `mmrl pretrain vla` end to end with its config errors."""

import dataclasses
import inspect
import json
import math

import numpy as np
import pytest
import torch

import sim
import vla_rl.register  # noqa: F401  (registers vla_bc until the entry point is installed)
from mmrl.cli import load_plugins, main
from mmrl.config import ConfigError, load_config
from mmrl.registry import TASKS
from vla_rl.evaluate import wilson_interval
from vla_rl.lerobot_policy import LeRobotPolicy
from vla_rl.policy import UNK, ClippedGaussian, VLAConfig, VLAPolicy, chunk_nll, task_vocabulary
from vla_rl.pretrain import frame_tensors, object_positions
from vla_rl.recording import record_episodes

load_plugins()
SIZE = 32
TINY_RUN = [
    "steps=4",
    "checkpoint_every=2",
    "progress=false",
    "data.episodes=2",
    f"data.image_size={SIZE}",
    "eval.episodes=2",
    "eval.num_envs=2",
    "train.batch_size=8",
    "train.warmup_steps=1",
    "model.channels=[8,8]",
    "model.keypoints=8",
    "model.hidden=32",
]


def tiny_policy(seed=0, **overrides):
    torch.manual_seed(seed)
    fields = {"vocabulary": task_vocabulary(), "image_size": SIZE, "channels": [8, 8], "keypoints": 8}
    fields.update({"hidden": 32, "horizon": 4, "n_action_steps": 2, **overrides})
    return VLAPolicy(VLAConfig(**fields))


def random_batch(policy, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = policy.config
    return {
        "image": torch.randint(
            0, 256, (n, 3, cfg.image_size, cfg.image_size), generator=g, dtype=torch.uint8
        ),
        "proprio": torch.randn(n, cfg.proprio_dim, generator=g),
        "tokens": policy.tokenize(["put the red cube on the green pad"] * n),
    }


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    root = tmp_path_factory.mktemp("demos") / "pickplace"
    return record_episodes("PickPlace", None, 2, 0, root, obs_mode="state+rgb", image_size=SIZE)


def test_vocabulary_covers_every_task_instruction():
    policy = tiny_policy()
    unk = policy.config.vocabulary.index(UNK)
    for name in sim.arm_task_ids():
        env = sim.make(name, distractors=2)
        instructions = [env.reset(seed=seed)[1]["instruction"] for seed in range(12)]
        assert not (policy.tokenize(instructions) == unk).any(), instructions
        env.close()
    first, second = policy.tokenize(
        ["put the red cube on the green pad", "put the green cube on the red pad"]
    )
    assert not torch.equal(first, second)  # word order is kept


def test_shapes_and_std_bounds():
    policy = tiny_policy()
    dist = policy(random_batch(policy))
    assert dist.mean.shape == dist.std.shape == (3, 4, 5)
    assert (dist.std >= policy.config.min_std).all() and (dist.std <= policy.config.max_std).all()
    chunk = dist.sample(generator=torch.Generator().manual_seed(1))
    assert chunk.shape == (3, 4, 5) and chunk.abs().max() <= 1
    assert policy.log_prob(random_batch(policy), chunk).shape == (3,)


def test_clipped_gaussian_log_prob_matches_its_samples():
    mean, std = torch.tensor([0.3, 1.4, -0.9]), torch.tensor([0.5, 0.4, 0.2])
    dist, normal = ClippedGaussian(mean, std), torch.distributions.Normal(mean, std)
    inside = torch.tensor([0.1, 0.5, -0.95])
    torch.testing.assert_close(dist.log_prob(inside), normal.log_prob(inside))
    at_bounds = dist.log_prob(torch.tensor([1.0, 1.0, -1.0]))
    expected = torch.stack(
        [1 - normal.cdf(torch.tensor(1.0))[i] for i in (0, 1)] + [normal.cdf(torch.tensor(-1.0))[2]]
    )
    torch.testing.assert_close(at_bounds, expected.log())
    far = ClippedGaussian(torch.tensor([30.0, -30.0]), torch.tensor([0.02, 0.02]))
    assert torch.isfinite(far.log_prob(torch.tensor([-1.0, 1.0]))).all()  # even 1500 stds away
    # samples: the share on the upper bound is its probability; density plus atoms integrate to 1
    draws = torch.stack([dist.sample(generator=torch.Generator().manual_seed(s)) for s in range(4000)])
    share = (draws[:, 1] == 1.0).float().mean()
    assert abs(share - at_bounds[1].exp()) < 0.03
    grid = torch.linspace(-1, 1, 20001)[1:-1]
    density = dist.log_prob(grid[:, None].expand(-1, 3)).exp()
    atoms = dist.log_prob(torch.ones(3)).exp() + dist.log_prob(-torch.ones(3)).exp()
    torch.testing.assert_close(
        torch.trapezoid(density, grid, dim=0) + atoms, torch.ones(3), atol=1e-3, rtol=0
    )


def test_log_prob_of_a_sampled_chunk_and_the_mask():
    policy = tiny_policy()
    batch = random_batch(policy)
    dist = policy(batch)
    chunk = dist.sample(noise=torch.full(dist.mean.shape, 3.0))  # large noise: many entries clip to 1
    assert (chunk == 1.0).any()
    total = policy.log_prob(batch, chunk)
    torch.testing.assert_close(total, dist.log_prob(chunk).sum((1, 2)))
    assert torch.isfinite(total).all()
    mask = torch.tensor([[True, True, False, False]] * 3)
    torch.testing.assert_close(policy.log_prob(batch, chunk, mask), dist.log_prob(chunk)[:, :2].sum((1, 2)))


def test_every_policy_acts_deterministically_by_default():
    defaults = {
        cls: inspect.signature(cls.act).parameters["deterministic"].default
        for cls in (VLAPolicy, LeRobotPolicy)
    }
    assert defaults == {VLAPolicy: True, LeRobotPolicy: True}


@pytest.mark.needs_rendering
def test_act_executes_chunks_single_and_batched():
    policy = tiny_policy().eval()
    env = sim.make("PickPlace", obs_mode="rgb", image_size=SIZE)
    obs, info = env.reset(seed=0)
    with torch.no_grad():
        expected = policy(policy.prepare({k: v[None] for k, v in obs.items()}, [info["instruction"]])).mode()[
            0
        ]
    first = [policy.act(obs, info["instruction"], deterministic=True) for _ in range(2)]
    np.testing.assert_allclose(np.stack(first), expected[:2].numpy(), atol=1e-6)  # the chunk's first 2
    assert first[0].shape == (5,) and first[0].dtype == np.float32
    batch = {k: np.stack([v, v]) for k, v in obs.items()}
    actions = policy.act(batch, [info["instruction"]] * 2, deterministic=True)
    assert actions.shape == (2, 5)
    policy.act(batch, [info["instruction"]] * 2, deterministic=True)
    policy.reset([1])  # row 1's episode ended: it replans, row 0 goes on with its chunk
    step2 = policy.act(batch, [info["instruction"]] * 2, deterministic=True)
    np.testing.assert_allclose(step2[1], expected[0].numpy(), atol=1e-6)
    with pytest.raises(ValueError, match="one instruction per row"):
        policy.act(batch, info["instruction"])
    env.close()


def test_save_load_round_trip(tmp_path):
    policy = tiny_policy(seed=3, state_index=[9, 10])
    policy.set_normalization(np.arange(12.0), np.full(12, 2.0))
    assert policy.state_mean.tolist() == [9.0, 10.0]
    policy.save_pretrained(tmp_path / "policy")
    loaded = VLAPolicy.from_pretrained(tmp_path / "policy")
    assert loaded.config == policy.config
    batch = random_batch(policy)
    batch["state"] = torch.randn(len(batch["image"]), 12)
    with torch.no_grad():
        a, b = policy(batch), loaded(batch)
    assert (
        torch.equal(a.mean, b.mean) and torch.equal(a.std, b.std) and torch.equal(a.state_loss, b.state_loss)
    )
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        (tmp_path / "policy" / "model.safetensors").unlink()
        VLAPolicy.from_pretrained(tmp_path / "policy")


def test_bad_policy_config_is_refused():
    with pytest.raises(ValueError, match="n_action_steps = 5; between 1 and horizon = 4"):
        VLAConfig(vocabulary=task_vocabulary(), horizon=4, n_action_steps=5)
    with pytest.raises(ValueError, match="vocabulary must start with"):
        VLAConfig(vocabulary=["red"])


@pytest.mark.needs_rendering
def test_behaviour_cloning_steps_reduce_the_loss(demos):
    policy = tiny_policy()
    frames = frame_tensors(demos, policy)
    assert frames["image"].shape == (len(demos), 3, SIZE, SIZE) and frames["actions"].shape == (
        len(demos),
        4,
        5,
    )
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        loss = chunk_nll(policy(frames), frames["actions"], frames["mask"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.needs_rendering
def test_the_auxiliary_head_learns_object_positions_from_the_image(demos):
    layout = sim.make("PickPlace").get_wrapper_attr("state_layout")
    index = object_positions(layout, 9)
    assert [layout["cube_pos"].start, layout["goal_pos"].start] == [index[0], index[3]] and len(index) == 6
    policy = tiny_policy(state_index=index)
    frames = frame_tensors(demos, policy)
    policy.set_normalization(frames["state"].mean(0), frames["state"].std(0))
    assert policy({k: v for k, v in frames.items() if k != "state"}).state_loss is None  # acting
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        loss = policy(frames).state_loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    # standardised targets: predicting their mean scores 1, reading them off the images well below it
    assert losses[0] > 0.5 and losses[-1] < 0.5 * losses[0], losses


@pytest.mark.needs_rendering
def test_pretrain_vla_end_to_end(tmp_path, capsys):
    assert main(["pretrain", "vla", f"output_dir={tmp_path}", *TINY_RUN]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    evaluation = json.loads((tmp_path / "eval.json").read_text())
    assert set(evaluation) == {"before", "after"} and evaluation["after"] == result
    assert result["episodes"] == 2 and 0 <= result["success_ci_low"] <= result["success_rate"] <= 1
    policy = VLAPolicy.from_pretrained(tmp_path / "policy")
    assert policy.config.image_size == SIZE and policy.config.channels == [8, 8]
    assert policy.config.state_index == [9, 10, 11, 19, 20, 21]  # PickPlace's cube and pad positions
    assert (tmp_path / "demos" / "meta" / "info.json").is_file()
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 4 and all(m["loss"] > m["nll"] and m["state_loss"] > 0 for m in metrics[:2])
    assert (
        main(["pretrain", "vla", f"output_dir={tmp_path / 'plain'}", "train.state_weight=0", *TINY_RUN]) == 0
    )
    assert VLAPolicy.from_pretrained(tmp_path / "plain" / "policy").state_head is None


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.task=Stack", "data.task = 'Stack': unknown sim task"),
        ("data.task=Ant-v5", "data.task = 'Ant-v5': 'Ant-v5' is a gymnasium env, but mmrl has no adapter"),
        ("model.horizon=0", "model.horizon = 0 is out of range: allowed >= 1"),
        ("model.n_action_steps=9", "model.n_action_steps = 9 must be <= model.horizon = 8"),
        ("eval.seed=10", "overlap the demonstration seeds"),
        ("model.min_std=2.0", "model.min_std = 2.0 must be < model.max_std"),
    ],
)
def test_config_errors_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config("pretrain/vla", [override])


def test_external_task_without_its_package_is_a_config_error(monkeypatch):
    fetch = TASKS.get("FetchReach-v4")
    missing = dataclasses.replace(fetch.task, package="mmrl_no_such_package")
    monkeypatch.setitem(TASKS._entries, "FetchReach-v4", dataclasses.replace(fetch, task=missing))
    with pytest.raises(ConfigError, match=r"data.task = 'FetchReach-v4'.*pip install 'mmrl\[fetch\]'"):
        load_config("pretrain/vla", ["data.task=FetchReach-v4"])


def test_config_error_on_the_command_line(capsys):
    assert main(["pretrain", "vla", "model.horizon=0"]) == 2
    assert "model.horizon = 0" in capsys.readouterr().err


def test_wilson_interval():
    low, high = wilson_interval(30, 100)
    assert math.isclose(low, 0.2189, abs_tol=1e-3) and math.isclose(high, 0.3958, abs_tol=1e-3)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == 1.0


def test_random_shift_crops_the_border_padded_frame():
    from vla_rl.policy import random_shift

    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (16, 3, 12, 12), generator=g, dtype=torch.uint8)
    assert random_shift(images, 0, g) is images
    shifted = random_shift(images, 2, g)
    assert shifted.shape == images.shape and shifted.dtype == torch.uint8
    padded = torch.nn.functional.pad(images.float(), (2, 2, 2, 2), mode="replicate").to(torch.uint8)
    crops = [[padded[i, :, y : y + 12, x : x + 12] for y in range(5) for x in range(5)] for i in range(16)]
    found = [[j for j, crop in enumerate(crops[i]) if torch.equal(crop, shifted[i])] for i in range(16)]
    assert all(found)  # every output is one of the 25 shifts of its own frame
    assert len({f[0] for f in found}) > 1  # and the shifts differ between frames
