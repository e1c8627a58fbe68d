"""Meta-World tasks through mmrl's sim API (`metaworld/<task>`): reset, step and success, the scripted
policy as the supervisor's expert, and behaviour cloning and HABC end to end on pick-place-v3."""

import json

import numpy as np
import pytest

import sim
from mmrl.config import ConfigError, load_config
from sim import expert_for
from sim.metaworld import CARRY_TASKS, LIFTED, MAX_EPISODE_STEPS, MOVED, instruction
from vla_rl.bench import bench_vla
from vla_rl.policy import VLAConfig, VLAPolicy, task_vocabulary
from vla_rl.pretrain import VLABCTrainer
from vla_rl.trainer import VLAOnlineTrainer

pytestmark = pytest.mark.needs_metaworld
TASK = "metaworld/pick-place-v3"
SIZE = 32
TINY_MODEL = ["model.channels=[8,8]", "model.keypoints=8", "model.hidden=32", "model.horizon=4"]
TINY_MODEL += ["model.n_action_steps=2"]


def test_reset_step_and_success_through_our_api():
    env = sim.make(TASK)
    obs, info = env.reset(seed=0)
    assert obs["state"].shape == (39,) and obs["state"].dtype == np.float32
    assert env.observation_space.contains(obs)
    assert info["instruction"] == "pick place" == instruction("pick-place-v3") and not info["is_success"]
    assert env.get_wrapper_attr("proprio_dim") == 7 and env.get_wrapper_attr("robot_type") == "sawyer"
    assert list(env.get_wrapper_attr("state_layout")) == ["hand", "goal", "objects"]
    assert env.spec.max_episode_steps == MAX_EPISODE_STEPS
    again, _ = env.reset(seed=0)
    other, _ = env.reset(seed=1)
    np.testing.assert_array_equal(again["state"], obs["state"])  # a seed is a scene
    assert not np.array_equal(other["state"], obs["state"])  # another seed, another placement
    _, reward, terminated, truncated, info = env.step(np.zeros(4, np.float32))
    assert reward == 0.0 and not (terminated or truncated or info["is_success"])
    env.close()


@pytest.mark.needs_rendering
def test_camera_frames_show_the_scene_upright():
    env = sim.make(TASK, obs_mode="state+rgb", image_size=SIZE)
    obs, _ = env.reset(seed=0)
    image = obs["image"]
    assert image.shape == (SIZE, SIZE, 3) and image.dtype == np.uint8 and env.observation_space.contains(obs)
    # upright: the floor (bright, grey-white) fills the bottom rows, not the top ones
    assert image[-4:].mean() > image[:4].mean() - 10 and image.std() > 10
    env.close()


@pytest.mark.needs_rendering
@pytest.mark.parametrize("size", [96, 224])
def test_frames_from_the_simplified_meshes_match_the_full_ones(size):
    """The renderer draws a copy of the model with its meshes clustered to about a pixel: far fewer
    faces, nearly the same frame, and the physics model untouched."""
    frames, faces = [], []
    for full in (True, False):
        env = sim.make(TASK, obs_mode="state+rgb", image_size=size, full_meshes=full)
        env.reset(seed=3)
        for _ in range(10):
            obs, *_ = env.step(np.array([0.5, -0.3, 0.2, 1.0], np.float32))
        frames.append(obs["image"].astype(int))
        sawyer = env.unwrapped.sawyer
        renderer_model = env.unwrapped._renderers[0]._renderer.model
        faces.append(int(renderer_model.mesh_facenum.sum()))
        assert (renderer_model is sawyer.model) == full  # physics keeps the original either way
        env.close()
    assert faces[1] < faces[0] / (3 if size == 96 else 2)
    difference = np.abs(frames[0] - frames[1]).max(-1)
    assert difference.mean() < 1.0 and (difference > 16).mean() < 0.01


def test_mesh_clustering_keeps_whole_faces_of_original_vertices():
    import mujoco

    from sim.render import coarse_meshes

    # a unit box mesh split into many faces: clustering on a coarse grid leaves fewer, valid faces
    grid = np.linspace(0, 1, 6)
    vert = np.array([[x, y, 0.0] for x in grid for y in grid] + [[0.5, 0.5, 1.0]])
    apex = len(vert) - 1
    face = [[i * 6 + j, i * 6 + j + 1, apex] for i in range(6) for j in range(5)]
    xml = f"""<mujoco><asset><mesh name="m" vertex="{" ".join(map(str, vert.ravel()))}"
      face="{" ".join(map(str, np.ravel(face)))}"/></asset>
      <worldbody><geom type="mesh" mesh="m" contype="0" conaffinity="0"/></worldbody></mujoco>"""
    model = mujoco.MjModel.from_xml_string(xml)
    original = model.mesh_face.copy(), model.mesh_facenum.copy()
    coarse = coarse_meshes(model, 0.45)
    kept = coarse.mesh_face[: coarse.mesh_facenum[0]]
    assert 0 < len(kept) < model.mesh_facenum[0] == coarse.mesh_face.shape[0]
    assert all(len(set(f)) == 3 for f in kept.tolist())  # no collapsed face
    assert len({tuple(sorted(f)) for f in kept.tolist()}) == len(kept)  # no repeated face
    assert kept.max() < model.mesh_vertnum[0]
    np.testing.assert_array_equal(model.mesh_face, original[0])  # the original is untouched
    np.testing.assert_array_equal(model.mesh_facenum, original[1])
    with pytest.raises(ValueError, match="positive size"):
        coarse_meshes(model, 0.0)


def test_the_scripted_policy_solves_scenes_and_takes_over_from_a_stray_state():
    env = sim.make(TASK)
    expert = expert_for(TASK)
    assert type(expert_for(env)) is type(expert)
    rng = np.random.default_rng(0)
    for seed in range(3):
        env.reset(seed=seed)
        for t in range(MAX_EPISODE_STEPS):
            action = rng.uniform(-1, 1, 4) if seed == 1 and t < 15 else expert.act(env)  # seed 1 strays first
            _, reward, terminated, truncated, info = env.step(action)
            if terminated or truncated:
                break
        assert info["is_success"] and reward == 1.0 and terminated, (seed, t)
    env.close()


def test_the_object_variant_puts_the_first_object_among_the_policys_inputs():
    plain, seen = sim.make(TASK), sim.make(TASK + ".object")
    assert seen.get_wrapper_attr("proprio_dim") == plain.get_wrapper_attr("proprio_dim") + 3 == 10
    layout = seen.get_wrapper_attr("state_layout")
    assert list(layout) == ["hand", "goal", "object", "objects"]  # proprio first: the policy reads 10
    plain_objects = plain.get_wrapper_attr("state_layout")["objects"]
    expert = expert_for(TASK + ".object")
    for seed in (0, 1):
        p, _ = plain.reset(seed=seed)
        s, info = seen.reset(seed=seed)
        assert info["instruction"] == "pick place"
        puck = p["state"][plain_objects][:3]
        np.testing.assert_array_equal(s["state"][layout["object"]], puck)  # the same scene, the puck seen
        np.testing.assert_array_equal(s["state"][layout["objects"]], p["state"][plain_objects])
        np.testing.assert_array_equal(expert.act(seen), expert_for(TASK).act(plain))
    with pytest.raises(ConfigError, match="no task 'pick-plce-v3'"):
        load_config("pretrain/vla", ["data.task=metaworld/pick-plce-v3.object"])
    plain.close()
    seen.close()


def expert_states(task: str, seed: int = 0) -> np.ndarray:
    """The privileged states of the scripted policy's episode from reset `seed` (T+1, 39)."""
    env = sim.make(task)
    expert = expert_for(task)
    obs, _ = env.reset(seed=seed)
    states = [obs["state"]]
    for _ in range(MAX_EPISODE_STEPS):
        obs, _, terminated, truncated, info = env.step(expert.act(env))
        states.append(obs["state"])
        if terminated or truncated:
            break
    env.close()
    assert info["is_success"]
    return np.stack(states)


def test_carry_task_failures_are_named_by_how_far_the_object_got():
    """`failure` follows the first object: cut and edited from an expert episode, whose object rises."""
    expert = expert_for(TASK)
    states = expert_states(TASK)
    objects = expert.layout["objects"]
    start_z = states[0, objects][2]
    rise = states[:, objects][:, 2] - start_z
    up = int(np.argmax(rise > LIFTED))
    assert up > 0 and rise[-1] > LIFTED  # the scripted policy lifts the puck and ends holding it up

    def lowered(rows):  # the same path with the object kept at its starting height
        rows = rows.copy()
        rows[:, objects.start + 2] = start_z
        return rows

    moved = int(np.argmax(np.linalg.norm(states[:, objects][:, :3] - states[0, objects][:3], axis=1) > MOVED))
    assert expert.failure(states[:1]) == "never reached the object"
    assert expert.failure(states[:moved]) == "reached the object, never moved it"
    assert expert.failure(lowered(states)) == "moved the object, never lifted it"
    assert expert.failure(states[: up + 1]) == "lifted the object, still up short of the goal"
    dropped = np.vstack([states[: up + 1], lowered(states[up + 1 : up + 2])])
    assert expert.failure(dropped) == "lifted and dropped the object"
    assert "reach-v3" not in CARRY_TASKS and expert_for("metaworld/reach-v3").failure(states) is None
    suite = expert_for("metaworld/MT10")  # in a suite, the episode's task (its one-hot) decides
    for task, named in (("pick-place-v3", "never reached the object"), ("reach-v3", None)):
        one_hot = np.eye(len(suite.tasks))[suite.tasks.index(task)]
        assert suite.failure(np.hstack([states[:1], one_hot[None]])) == named


def test_mt10_draws_a_task_per_episode_and_its_expert_follows():
    env = sim.make("metaworld/MT10")
    expert = expert_for("metaworld/MT10")
    layout = env.get_wrapper_attr("state_layout")
    assert list(layout) == ["hand", "goal", "objects", "task"] and env.get_wrapper_attr("proprio_dim") == 7
    vocabulary = set(env.get_wrapper_attr("instruction").split())
    seen = {}
    for seed in range(12):
        obs, info = env.reset(seed=seed)
        one_hot = obs["state"][layout["task"]]
        assert one_hot.sum() == 1 and set(info["instruction"].split()) <= vocabulary
        seen.setdefault(int(one_hot.argmax()), set()).add(info["instruction"])
        if seed < 3:
            for _ in range(MAX_EPISODE_STEPS):
                _, _, terminated, truncated, info = env.step(expert.act(env))
                if terminated or truncated:
                    break
            assert info["is_success"], (seed, info["instruction"])
    assert len(seen) >= 5 and all(len(names) == 1 for names in seen.values())  # one instruction per task
    env.close()


def test_a_name_meta_world_lacks_is_a_config_error_with_the_closest_one():
    with pytest.raises(ConfigError, match=r"no task 'pick-plce-v3'.*Did you mean 'metaworld/pick-place-v3'"):
        load_config("pretrain/vla", ["data.task=metaworld/pick-plce-v3"])


@pytest.mark.needs_rendering
def test_behaviour_cloning_end_to_end(tmp_path):
    overrides = [f"output_dir={tmp_path}", "steps=20", "checkpoint_every=20", "progress=false"]
    overrides += [f"data.task={TASK}", "data.episodes=3", f"data.image_size={SIZE}"]
    overrides += [
        "eval.episodes=1",
        "eval.num_envs=1",
        "train.batch_size=16",
        "train.warmup_steps=1",
        *TINY_MODEL,
    ]
    VLABCTrainer(load_config("pretrain/vla", overrides)).train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert np.mean(losses[-5:]) < np.mean(losses[:5])  # it learns from the demonstrations
    info = json.loads((tmp_path / "demos" / "meta" / "info.json").read_text())  # LeRobotDataset layout
    assert info["robot_type"] == "sawyer" and info["features"]["action"]["shape"] == [4]
    assert info["features"]["observation.state"]["names"][:4] == ["hand.0", "hand.1", "hand.2", "hand.3"]
    assert info["total_episodes"] == 3
    policy = VLAPolicy.from_pretrained(tmp_path / "policy")
    assert (policy.config.proprio_dim, policy.config.action_dim) == (7, 4)
    assert "pick" in policy.config.vocabulary


@pytest.mark.needs_rendering
def test_habc_steps_end_to_end(tmp_path):
    tiny = {"image_size": SIZE, "channels": [8, 8], "keypoints": 8, "hidden": 32, "horizon": 4}
    config = VLAConfig(vocabulary=task_vocabulary(), proprio_dim=7, action_dim=4, n_action_steps=2, **tiny)
    VLAPolicy(config).save_pretrained(tmp_path / "base")
    overrides = [f"output_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'base'}", f"rollout.task={TASK}"]
    overrides += ["rollout.env_steps=12", "rollout.num_envs=1", "rollout.max_episode_steps=12", "steps=1"]
    overrides += ["checkpoint_every=1", "progress=false", "eval.episodes=1", "eval.num_envs=1"]
    overrides += ["eval.videos=0", "train.updates=2", "train.batch_size=8", "critic.updates=3"]
    overrides += ["critic.batch_size=16", "intervention.window=3", "intervention.threshold=0.4"]
    overrides += ["intervention.takeover_steps=4", "train.demos=null", "train.demo_episodes=2"]
    result = VLAOnlineTrainer(load_config("vla/habc", overrides)).train()
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["env_steps"] >= 12 and row["actor_updates"] == 2
    assert row["interventions_per_episode"] > 0  # the scripted policy took over from the untrained one
    assert 0 <= result["success_rate"] <= 1


@pytest.mark.needs_rendering
def test_bench_rows_put_the_policy_in_the_loop_beside_raw_stepping(capsys):
    rows = bench_vla(steps=3, num_envs=2, repeats=1, image_size=SIZE, branch_group_size=2, branch_every=1)
    meta = [row for row in rows if row["section"] == "(e)"]
    assert [row["target"] for row in meta] == [0.5, None, None]
    assert (
        meta[0]["name"].startswith(TASK)
        and meta[0]["baseline"] == f"{TASK}: rgb {SIZE}px obs, random actions"
    )
    assert meta[1]["baseline"] == f"{TASK}: state obs, random actions"
    assert meta[2]["name"] == meta[0]["baseline"]
    assert meta[2]["baseline"] == f"{TASK}: rgb {SIZE}px obs from the full meshes, random actions"
    for row in meta:
        assert row["steps_per_s"] > 0 and row["ratio"] == pytest.approx(
            row["steps_per_s"] / row["baseline_steps_per_s"]
        )
    assert meta[0]["verdict"] == ("PASS" if meta[0]["ratio"] >= 0.5 else "FAIL")
    with pytest.raises(ConfigError, match="metaworld_task = 'metaworld/nope-v3'"):
        bench_vla(steps=3, num_envs=2, repeats=1, image_size=SIZE, metaworld_task="metaworld/nope-v3")
