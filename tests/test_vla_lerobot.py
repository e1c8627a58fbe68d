"""LeRobot policies behind the sim evaluation (`vla_rl.lerobot_policy`): tiny ACT, Diffusion and
SmolVLA policies built from configs for the Reach task, saved with their processors, loaded by the
adapter. SmolVLA's VLM backbone (config, tokenizer, processor) is a tiny one written to tmp_path, so
nothing is downloaded; it needs transformers < 5, as LeRobot's smolvla extra pins.

Only the missing-LeRobot tests run without LeRobot; the others skip with the reason (LeRobot pins an
older torch, so it lives in a separate venv: docs/robot.md, LeRobot policies)."""

import json
import sys

import numpy as np
import pytest
import torch

from mmrl.cli import load_plugins, main
from mmrl.config import ConfigError, load_config
from vla_rl.lerobot_policy import LeRobotPolicy, import_lerobot
from vla_rl.loading import is_lerobot_policy_dir, load
from vla_rl.policy_comparison import VLAPoliciesEvalConfig, check_config


def _lerobot_error() -> str | None:
    try:
        import_lerobot()
    except ImportError as err:
        return repr(err.__cause__ or err)
    return None


def _smolvla_error() -> str | None:
    if LEROBOT_ERROR is not None:
        return LEROBOT_ERROR
    try:
        from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy  # noqa: F401
        from transformers import SmolVLMConfig, SmolVLMProcessor  # noqa: F401
    except Exception as err:  # transformers missing, or one SmolVLA does not work with
        return repr(err)
    return None


LEROBOT_ERROR = _lerobot_error()
SMOLVLA_ERROR = _smolvla_error()
needs_lerobot = pytest.mark.skipif(
    LEROBOT_ERROR is not None,
    reason=f"LeRobot >= 0.4 is not importable ({LEROBOT_ERROR}); pip install 'mmrl[lerobot]', in its own "
    "venv (docs/robot.md: LeRobot policies)",
)
needs_smolvla = pytest.mark.skipif(
    SMOLVLA_ERROR is not None,
    reason=f"SmolVLA is not usable ({SMOLVLA_ERROR}); it needs LeRobot's smolvla extra (transformers<5)",
)
KINDS = ["act", "diffusion", pytest.param("smolvla", marks=needs_smolvla)]
SIZE, PROPRIO, ACTIONS = 32, 9, 5  # Reach with image_size=32: camera, proprioception, action sizes


def tiny_smolvlm(directory):
    """A tiny SmolVLM backbone for the sim's instruction words (`vla_rl.smolvla_replica`)."""
    from vla_rl.policy import INSTRUCTION_TEMPLATES
    from vla_rl.smolvla_replica import tiny_smolvlm as build

    words = sorted({w for t in INSTRUCTION_TEMPLATES for w in t.split()} | {"red", "green", "blue"})
    return build(directory, words, SIZE)


def tiny_config(kind: str, directory):
    """A tiny ACT, Diffusion or SmolVLA config whose features are the Reach task's camera-mode
    observations (SmolVLA's backbone goes to `directory`)."""
    from lerobot.configs.types import FeatureType, PolicyFeature

    features = {
        "input_features": {
            "observation.image": PolicyFeature(FeatureType.VISUAL, (3, SIZE, SIZE)),
            "observation.state": PolicyFeature(FeatureType.STATE, (PROPRIO,)),
        },
        "output_features": {"action": PolicyFeature(FeatureType.ACTION, (ACTIONS,))},
        "device": "cpu",
        "push_to_hub": False,
    }
    if kind == "act":
        from lerobot.policies.act.configuration_act import ACTConfig

        return ACTConfig(
            **features,
            chunk_size=4,
            n_action_steps=4,
            dim_model=32,
            n_heads=2,
            dim_feedforward=64,
            n_encoder_layers=1,
            n_decoder_layers=1,
            n_vae_encoder_layers=1,
            latent_dim=8,
            pretrained_backbone_weights=None,  # no download: random resnet18
        )
    if kind == "smolvla":
        from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig

        return SmolVLAConfig(
            **features,
            vlm_model_name=str(tiny_smolvlm(directory / "smolvlm")),
            load_vlm_weights=False,
            chunk_size=4,
            n_action_steps=4,
            num_steps=2,
            resize_imgs_with_padding=(SIZE, SIZE),
            tokenizer_max_length=16,
            max_state_dim=16,
            max_action_dim=8,
        )
    from lerobot.policies.diffusion.configuration_diffusion import DiffusionConfig

    return DiffusionConfig(
        **features,
        n_obs_steps=2,
        horizon=8,
        n_action_steps=4,
        down_dims=(16, 32),
        diffusion_step_embed_dim=16,
        spatial_softmax_num_keypoints=8,
        num_train_timesteps=10,
    )


def save_tiny(kind: str, directory, seed: int = 0):
    """Build, save (policy and processors, with non-trivial statistics) and return the directory."""
    from lerobot.policies.factory import get_policy_class, make_pre_post_processors

    torch.manual_seed(seed)
    config = tiny_config(kind, directory.parent)
    stats = {
        "observation.image": {
            "mean": torch.tensor([0.4, 0.5, 0.6]).view(3, 1, 1),
            "std": torch.full((3, 1, 1), 0.25),
            "min": torch.zeros(3, 1, 1),
            "max": torch.ones(3, 1, 1),
        },
        "observation.state": {
            "mean": torch.linspace(-0.2, 0.2, PROPRIO),
            "std": torch.full((PROPRIO,), 0.5),
            "min": torch.full((PROPRIO,), -1.0),
            "max": torch.full((PROPRIO,), 1.0),
        },
        "action": {
            "mean": torch.full((ACTIONS,), 0.1),
            "std": torch.full((ACTIONS,), 0.3),
            "min": torch.full((ACTIONS,), -1.0),
            "max": torch.full((ACTIONS,), 1.0),
        },
    }
    policy = get_policy_class(kind)(config).eval()
    preprocessor, postprocessor = make_pre_post_processors(config, dataset_stats=stats)
    for part in (policy, preprocessor, postprocessor):
        part.save_pretrained(directory)
    return directory


def reference(directory):
    """The same policy loaded by LeRobot itself, with its own processors."""
    from lerobot.policies.factory import get_policy_class, make_pre_post_processors

    config = json.loads((directory / "config.json").read_text())
    policy = get_policy_class(config["type"]).from_pretrained(directory).eval()
    return policy, *make_pre_post_processors(policy.config, pretrained_path=str(directory))


def observations(steps: int, batch: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "image": rng.integers(0, 256, (batch, SIZE, SIZE, 3), dtype=np.uint8),
            "proprio": rng.normal(0, 0.3, (batch, PROPRIO)).astype(np.float32),
        }
        for _ in range(steps)
    ]


def lerobot_action(policy, preprocessor, postprocessor, obs: dict[str, np.ndarray], tasks: list[str]):
    """What LeRobot's own gym evaluation does: preprocess_observation, task, processors, select_action."""
    from lerobot.envs.utils import preprocess_observation

    batch = preprocess_observation({"pixels": obs["image"], "agent_pos": obs["proprio"]})
    batch["task"] = tasks
    with torch.no_grad():
        return postprocessor(policy.select_action(preprocessor(batch))).numpy().clip(-1, 1)


# ----- without LeRobot (CI) ------------------------------------------------------------------------


@pytest.fixture
def no_lerobot(monkeypatch):
    """LeRobot unimportable, as if not installed, even where it is."""
    for name in [m for m in sys.modules if m == "lerobot" or m.startswith("lerobot.")] + ["lerobot"]:
        monkeypatch.setitem(sys.modules, name, None)


def fake_lerobot_dir(tmp_path):
    directory = tmp_path / "act_policy"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"type": "act", "chunk_size": 4}))
    return directory


def test_lerobot_dirs_are_told_apart_by_config_type(tmp_path):
    assert is_lerobot_policy_dir(fake_lerobot_dir(tmp_path))
    own = tmp_path / "vla"
    own.mkdir()
    (own / "config.json").write_text(json.dumps({"vocabulary": ["<pad>", "<unk>"], "image_size": 96}))
    assert not is_lerobot_policy_dir(own)
    assert not is_lerobot_policy_dir(tmp_path / "missing")


def test_missing_lerobot_names_the_extra_and_the_recipe(tmp_path, no_lerobot):
    directory = fake_lerobot_dir(tmp_path)
    for reader in (LeRobotPolicy.from_pretrained, load):
        with pytest.raises(
            ImportError, match=r"pip install 'mmrl\[lerobot\]'.*torch==2\.13\.0.*docs/robot\.md"
        ):
            reader(directory)
    with pytest.raises(ConfigError, match=r"is a LeRobot policy: .*pip install 'mmrl\[lerobot\]'"):
        check_config(VLAPoliciesEvalConfig(policies=[str(directory)], task="Reach"))


def test_cli_names_the_recipe_without_lerobot(tmp_path, no_lerobot, capsys):
    directory = fake_lerobot_dir(tmp_path)
    assert main(["eval", "vla", f"policies=[{directory}]", "task=Reach"]) == 2
    assert "is a LeRobot policy" in capsys.readouterr().err


def test_fine_tuning_a_lerobot_policy_without_lerobot_names_the_install(tmp_path, no_lerobot):
    from vla_rl.trainer import VLAOnlineTrainer

    directory = fake_lerobot_dir(tmp_path)
    (directory / "model.safetensors").write_bytes(b"")
    config = load_config("vla/smolvla_habc", [f"model.path={directory}", f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"is a LeRobot policy: .*pip install 'mmrl\[lerobot\]'"):
        VLAOnlineTrainer(config)
    assert not (tmp_path / "run").exists()


def test_the_smolvla_replica_without_lerobot_says_so(tmp_path, no_lerobot, capsys):
    assert main(["replica", "smolvla", f"output_dir={tmp_path / 'r'}"]) == 2
    assert "mmrl replica smolvla needs LeRobot" in capsys.readouterr().err
    assert main(["replica", "smolvla", f"output_dir={tmp_path / 'r'}", "full=true"]) == 2
    assert "no full-size replica" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_cli_skips_a_plugin_that_cannot_be_imported(monkeypatch, capsys):
    """A LeRobot venv has an older transformers than vlm_rl needs; `mmrl eval vla` must still run."""

    class Broken:
        name = "broken_plugin"

        def load(self):
            raise ImportError("cannot import name 'Something' from 'transformers'")

    monkeypatch.setattr("mmrl.cli.entry_points", lambda group: [Broken()])
    load_plugins()
    assert "warning: mmrl plugin broken_plugin not loaded" in capsys.readouterr().err


# ----- with LeRobot --------------------------------------------------------------------------------


@needs_lerobot
def test_directory_without_processors_is_refused(tmp_path):
    from lerobot.policies.act.modeling_act import ACTPolicy

    ACTPolicy(tiny_config("act", tmp_path)).save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="policy_preprocessor.json.*migrate_policy_normalization"):
        LeRobotPolicy.from_pretrained(tmp_path)


@needs_lerobot
@pytest.mark.parametrize("kind", KINDS)
def test_adapter_acts_as_lerobot_does(tmp_path, kind):
    directory = save_tiny(kind, tmp_path / kind)
    adapter = load(directory)
    assert isinstance(adapter, LeRobotPolicy)
    assert (adapter.config.image_size, adapter.config.state_dim, adapter.config.action_dim) == (
        SIZE,
        PROPRIO,
        5,
    )
    assert adapter.config.image_key == "observation.image" and adapter.config.state_key == "observation.state"
    policy, preprocessor, postprocessor = reference(directory)
    tasks = ["move the gripper to the red ball", "move the gripper to the blue ball"]
    adapter.reset()
    for step, obs in enumerate(observations(6, 2)):  # past the end of the first 4-action chunk
        torch.manual_seed(step)  # Diffusion and SmolVLA sample: the same noise for both
        ours = adapter.act(obs, tasks)
        torch.manual_seed(step)
        theirs = lerobot_action(policy, preprocessor, postprocessor, obs, tasks)
        assert ours.shape == (2, ACTIONS) and ours.dtype == np.float32
        assert np.all(np.abs(ours) <= 1.0)
        np.testing.assert_allclose(ours, theirs, atol=1e-5)
    single = observations(1, 1, seed=1)[0]
    adapter.reset()
    action = adapter.act({k: v[0] for k, v in single.items()}, tasks[0])
    assert action.shape == (ACTIONS,)


@needs_lerobot
def test_seeded_sampling_repeats(tmp_path):
    adapter = LeRobotPolicy.from_pretrained(save_tiny("diffusion", tmp_path / "diffusion"))
    obs, tasks = observations(1, 2)[0], ["a", "b"]

    def first_action(seed: int) -> np.ndarray:
        adapter.reset()
        return adapter.act(obs, tasks, generator=torch.Generator().manual_seed(seed))

    np.testing.assert_array_equal(first_action(0), first_action(0))
    assert not np.allclose(first_action(0), first_action(1))


@needs_lerobot
def test_reset_of_some_rows_gives_them_a_fresh_chunk(tmp_path):
    """Rows 0 and 2 go on with their chunks as if nothing happened; row 1 acts as a policy reset at
    step 2 that sees row 1 alone."""
    directory = save_tiny("act", tmp_path / "act")
    adapter = LeRobotPolicy.from_pretrained(directory)
    whole, alone = reference(directory), reference(directory)
    tasks = ["move the gripper to the red ball"] * 3
    adapter.reset()
    for step, obs in enumerate(observations(9, 3)):
        if step == 2:
            adapter.reset([1])
        ours = adapter.act(obs, tasks)
        expected = lerobot_action(*whole, obs, tasks)
        np.testing.assert_allclose(ours[[0, 2]], expected[[0, 2]], atol=1e-5)
        if step >= 2:
            row = {k: v[1:2] for k, v in obs.items()}
            np.testing.assert_allclose(ours[1:2], lerobot_action(*alone, row, tasks[1:2]), atol=1e-5)
        if step in (2, 3):  # row 1's new chunk is not the one the others still execute
            assert not np.allclose(ours[1], expected[1], atol=1e-3)
    assert len(adapter._cohorts) == 2


@needs_lerobot
@pytest.mark.needs_rendering
@pytest.mark.parametrize("kind", KINDS)
def test_evaluate_policy_on_reach(tmp_path, kind):
    import sim
    from vla_rl.evaluate import evaluate_policy

    env = sim.make("Reach", obs_mode="rgb", image_size=SIZE)
    assert env.observation_space["image"].shape == (SIZE, SIZE, 3)
    assert env.observation_space["proprio"].shape == (PROPRIO,) and env.action_space.shape == (ACTIONS,)
    env.close()
    policy = load(save_tiny(kind, tmp_path / kind))
    result = evaluate_policy(policy, "Reach", episodes=2, seed=0, num_envs=2, progress=False)
    assert result["episodes"] == 2 and 0.0 <= result["success_rate"] <= 1.0
    assert 1 <= result["mean_steps"] <= 50


@needs_lerobot
@pytest.mark.needs_rendering
def test_eval_vla_with_takeovers(tmp_path):
    """`mmrl eval vla` on LeRobot directories; expert takeovers hand single rows back (reset(rows))."""
    from vla_rl.policy_comparison import eval_vla

    dirs = [save_tiny(kind, tmp_path / kind) for kind in ("act", "diffusion")]
    results = eval_vla(
        [
            f"policies=[{dirs[0]},{dirs[1]}]",
            "task=Reach",
            "episodes=2",
            "num_envs=2",
            "intervention.enabled=true",
            "intervention.threshold=0.5",
            "intervention.window=0",
            "intervention.patience=3",
            "intervention.takeover_steps=10",
            "intervention.max_per_episode=0",
            "progress=false",
            f"output_dir={tmp_path / 'eval'}",
        ]
    )
    assert set(results["policies"]) == {str(d) for d in dirs}
    assert (tmp_path / "eval" / "eval_vla.json").is_file()
    assert all(entry["interventions"] >= 1 for entry in results["policies"].values())


# ----- fine-tuning SmolVLA (vla/smolvla_habc) on its replica ----------------------------------------

TINY_RUN = ["rollout.env_steps=24", "rollout.num_envs=2", "rollout.max_episode_steps=12", "steps=2"]
TINY_RUN += ["checkpoint_every=1", "progress=false", "eval.episodes=2", "eval.num_envs=2", "eval.videos=0"]
TINY_RUN += ["train.updates=2", "train.batch_size=8", "critic.updates=3", "critic.batch_size=16"]
TINY_RUN += ["train.demo_episodes=2"]


@pytest.fixture(scope="module")
def smolvla_replica(tmp_path_factory):
    """`mmrl replica smolvla`: a tiny SmolVLA for PickPlace with its processors and VLM backbone."""
    if SMOLVLA_ERROR is not None:
        pytest.skip(f"SmolVLA is not usable ({SMOLVLA_ERROR})")
    directory = tmp_path_factory.mktemp("replica") / "smolvla"
    assert main(["replica", "smolvla", f"output_dir={directory}"]) == 0
    return directory


def smolvla_config(replica, run_dir, *overrides):
    return load_config(
        "vla/smolvla_habc", [f"model.path={replica}", f"output_dir={run_dir}", *TINY_RUN, *overrides]
    )


@needs_smolvla
@pytest.mark.needs_rendering
@pytest.mark.parametrize("method", ["habc", "dagger"])
def test_the_smolvla_recipe_fine_tunes_its_replica(smolvla_replica, tmp_path, method):
    from vla_rl.trainer import VLAOnlineTrainer

    VLAOnlineTrainer(smolvla_config(smolvla_replica, tmp_path / "run", f"method={method}")).train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and rows[-1]["env_steps"] >= 48
    assert all(r["actor_updates"] == 2 and r["skipped_updates"] == 0 and np.isfinite(r["loss"]) for r in rows)
    assert rows[0]["interventions_per_episode"] > 0  # the expert supervised the untrained policy
    evals = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert set(evals) == {"before", "after"}
    trained = LeRobotPolicy.from_pretrained(tmp_path / "run" / "policy")
    original = LeRobotPolicy.from_pretrained(smolvla_replica)
    changed, frozen_kept = 0, 0
    before = dict(original.named_parameters())
    for name, param in trained.named_parameters():
        same = torch.equal(param, before[name])
        if before[name].requires_grad:
            changed += not same
        else:  # SmolVLA trains its action expert only: the VLM stays as it was
            assert same, name
            frozen_kept += 1
    assert changed > 0 and frozen_kept > 0


@needs_smolvla
@pytest.mark.needs_rendering
def test_a_smolvla_run_resumes_exactly(smolvla_replica, tmp_path):
    from vla_rl.trainer import VLAOnlineTrainer

    VLAOnlineTrainer(smolvla_config(smolvla_replica, tmp_path / "straight")).train()
    VLAOnlineTrainer(smolvla_config(smolvla_replica, tmp_path / "resumed", "steps=1")).train()
    with pytest.warns(UserWarning, match="config changes in: steps"):
        VLAOnlineTrainer(smolvla_config(smolvla_replica, tmp_path / "resumed", "resume=true")).train()
    straight = LeRobotPolicy.from_pretrained(tmp_path / "straight" / "policy").state_dict()
    resumed = LeRobotPolicy.from_pretrained(tmp_path / "resumed" / "policy").state_dict()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


@needs_smolvla
@pytest.mark.parametrize("heavier", [1.0, -1.0])
def test_weighted_flow_matching_pulls_toward_the_heavier_chunk(smolvla_replica, heavier):
    """Two target chunks (+0.6 and -0.6 everywhere) for the same observation: the one with 20x the
    weight is where the sampled chunks go. Swapped or ignored weights fail this."""
    policy = LeRobotPolicy.from_pretrained(smolvla_replica).train()
    obs = {k: np.repeat(v[:1], 2, axis=0) for k, v in observations(1, 1)[0].items()}
    tasks = ["put the red cube on the blue pad"] * 2
    horizon = policy.config.horizon
    actions = torch.tensor([0.6, -0.6]).view(2, 1, 1).expand(2, horizon, ACTIONS)
    weight = torch.tensor([1.0, 0.05] if heavier > 0 else [0.05, 1.0]).view(2, 1).expand(2, horizon)
    mask = torch.ones(2, horizon, dtype=torch.bool)
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(60):
        batch = policy.prepare(obs, tasks)
        loss = policy.chunk_loss(batch, actions, mask, weight, generator)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    policy.eval()
    sampled = policy.sample_chunks(obs, tasks, torch.Generator().manual_seed(1))
    assert heavier * sampled.mean() > 0.3, sampled.mean()


@needs_smolvla
def test_fine_tuning_refuses_what_a_lerobot_policy_cannot_do(smolvla_replica, tmp_path):
    from vla_rl.trainer import VLAOnlineTrainer

    act = save_tiny("act", tmp_path / "act")
    cases = [
        (act, [], "fine-tuning takes flow-matching policies"),
        (smolvla_replica, ["method=grpo", "rollout.group_size=2"], "no action log-probabilities for GRPO"),
        (smolvla_replica, ["rollout.std_scale=0.3"], "set rollout.std_scale=1.0"),
    ]
    for directory, overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            VLAOnlineTrainer(smolvla_config(directory, tmp_path / "run", *overrides))
        assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="no action log-probabilities for GRPO"):  # --dry-run too
        config = smolvla_config(smolvla_replica, tmp_path / "run", "method=grpo", "rollout.group_size=2")
        VLAOnlineTrainer.memory_plan(config, "vla/smolvla_habc", 1)


@needs_smolvla
def test_the_smolvla_recipe_plans_its_memory_before_the_run(smolvla_replica, tmp_path, capsys):
    """--dry-run loads the SmolVLA replica, measures its phases and counts its frozen VLM as weights
    without gradients or optimizer states; it writes nothing."""
    from vla_rl.trainer import VLAOnlineTrainer

    config = smolvla_config(smolvla_replica, tmp_path / "run")
    plan = VLAOnlineTrainer.memory_plan(config, "vla/smolvla_habc", 1)
    policy = LeRobotPolicy.from_pretrained(smolvla_replica)
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    assert 0 < trainable < sum(p.numel() for p in policy.parameters())
    assert plan.gradients == 4 * trainable
    assert "actor update (8 chunks)" in plan.phases and plan.held["demonstrations"] > 0
    out = tmp_path / "cli"
    assert (
        main(["train", "vla/smolvla_habc", f"model.path={smolvla_replica}", f"output_dir={out}", "--dry-run"])
        == 0
    )
    assert "replay buffer" in capsys.readouterr().out and not out.exists()
