"""The arm-on-a-table gymnasium environment that every task builds on.

Control: a 5-vector in [-1, 1]: end-effector displacement (dx, dy, dz) in units of MAX_STEP metres and
wrist rotation in units of MAX_YAW_STEP radians per control step, and an absolute gripper command
(-1 fully open, +1 fully closed). Position targets are set relative to the *current* joint positions,
so the next state depends only on the current state and the action (no hidden integrator), which is
what lets a scripted expert take over from any state.

`snapshot_env` / `restore_env` save and restore everything the next steps depend on (a `Snapshot`), so
that several branches can continue one episode from a shared prefix instead of replaying it from reset.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import gymnasium as gym
import mujoco
import numpy as np

from sim.randomization import DomainRandomization, NominalModel, randomize
from sim.render import CameraRenderer

ASSETS = Path(__file__).resolve().parent / "assets"
DEFAULT_SCENE = ASSETS / "arm_table.xml"

CONTROL_HZ = 10
MAX_STEP = 0.03  # m of end-effector travel per control step at |action| = 1
MAX_YAW_STEP = 0.25  # rad of wrist rotation per control step at |action| = 1
GRIPPER_OPEN = 0.04  # m from the centre to each finger's inner face when fully open
CUBE_HALF = 0.02  # m, half the edge of every cube
HOME = np.array([0.0, 0.1, 0.2])  # end-effector start, behind the objects as the camera sees them
OBS_MODES = ("state", "rgb", "state+rgb")

PALETTE = {
    "red": (0.85, 0.1, 0.1),
    "green": (0.1, 0.65, 0.15),
    "blue": (0.1, 0.25, 0.9),
    "yellow": (0.95, 0.85, 0.1),
    "purple": (0.55, 0.2, 0.75),
    "orange": (1.0, 0.5, 0.0),
}
PROPRIO = (("ee_pos", 3), ("ee_yaw", 1), ("ee_vel", 4), ("gripper", 1))  # ee_vel: dx, dy, dz, dyaw
_ARM_STEP = np.array([MAX_STEP, MAX_STEP, MAX_STEP, MAX_YAW_STEP])
_W = mujoco.mjtWarning
_BAD_SIM = [int(_W.mjWARN_BADQPOS), int(_W.mjWARN_BADQVEL), int(_W.mjWARN_BADQACC)]  # MuJoCo reset the data


_SNAPSHOT_STATE = mujoco.mjtState.mjSTATE_INTEGRATION  # qpos, qvel, ctrl, mocap, warm start, time, ...


@dataclass(frozen=True)
class Snapshot:
    """What the next steps of an `ArmEnv` episode depend on, taken between two control steps: MuJoCo's
    integration state (positions, velocities, controls, mocap targets such as goals and pads, the
    solver's warm start, time), the model fields an episode sets (colours, randomised physics), the
    warning counters the instability check reads, the step counter, the instruction and the env's
    RNG."""

    physics: np.ndarray
    model: dict[str, np.ndarray]
    warnings: np.ndarray
    steps: int
    instruction: str
    rng: dict[str, Any]


@dataclass(frozen=True)
class EnvSnapshot:
    """A wrapped env's snapshot: its unwrapped env's own (`snapshot()`) and the wrappers' time-limit
    step counters."""

    state: Any
    elapsed: tuple[int | None, ...]


def load_scene(scene_xml: str | Path, objects_xml: str) -> mujoco.MjModel:
    """Compile the arm-and-table MJCF file with the task's objects inserted before </worldbody>."""
    path = Path(scene_xml)
    if not path.is_file():
        raise FileNotFoundError(
            f"MJCF file not found: {path}. scene_xml must be an MJCF file with the arm, table and "
            f"'front' camera (the default is {DEFAULT_SCENE})."
        )
    text = path.read_text()
    if "</worldbody>" not in text:
        raise ValueError(f"MJCF file {path} has no </worldbody> to add the task's objects to")
    try:
        return mujoco.MjModel.from_xml_string(text.replace("</worldbody>", objects_xml + "</worldbody>"))
    except ValueError as err:
        raise ValueError(f"could not compile MJCF {path} with the task's objects: {err}") from err


class ArmEnv(gym.Env):
    """Base task: subclasses add objects (MJCF), sample an episode variant, and define success."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["rgb_array"], "render_fps": CONTROL_HZ}
    env_id: ClassVar[str] = ""  # the task's id in sim.register_task and gymnasium ("mmrl/Reach-v0")
    max_episode_steps: ClassVar[int] = 100  # registered with gymnasium as the TimeLimit
    task_state: ClassVar[tuple[tuple[str, int], ...]] = ()  # (name, size) after PROPRIO in "state"
    robot_type: ClassVar[str] = "mmrl_gantry_arm"  # recorded in datasets

    def __init__(
        self,
        obs_mode: str = "state",
        render_mode: str | None = None,
        image_size: int = 96,
        randomize: bool | DomainRandomization = False,
        distractors: int = 0,
        terminate_on_success: bool = True,
        max_velocity: float = 100.0,
        scene_xml: str | Path = DEFAULT_SCENE,
    ) -> None:
        if obs_mode not in OBS_MODES:
            raise ValueError(f"obs_mode={obs_mode!r}; choose one of {OBS_MODES}")
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"render_mode={render_mode!r}; only 'rgb_array' (or None) is supported")
        if not 0 <= distractors <= 2:
            raise ValueError(f"distractors={distractors}; 0, 1 or 2 are supported")
        self.obs_mode, self.render_mode, self.image_size = obs_mode, render_mode, image_size
        self.distractors = distractors
        self.randomization = DomainRandomization() if randomize is True else (randomize or None)
        self.terminate_on_success, self.max_velocity = terminate_on_success, max_velocity

        self.model = load_scene(scene_xml, self.objects_xml())
        self.data = mujoco.MjData(self.model)
        self.n_substeps = round(1.0 / (CONTROL_HZ * self.model.opt.timestep))
        self._nominal = NominalModel(self.model)
        self._arm_q = self._qpos_index("x", "y", "z", "yaw")
        self._arm_v = self._dof_index("x", "y", "z", "yaw")
        self._finger_q = self._qpos_index("finger_left", "finger_right")
        self._arm_ctrl = np.array([self.model.actuator(n).id for n in ("x", "y", "z", "yaw")])
        self._finger_ctrl = np.array([self.model.actuator(n).id for n in ("finger_left", "finger_right")])
        self._ctrl_lo, self._ctrl_hi = self.model.actuator_ctrlrange[self._arm_ctrl].T
        self._mocap_id = {self.model.body(b).name: m for b, m in enumerate(self.model.body_mocapid) if m >= 0}

        self.state_layout = self.layout()
        self.proprio_dim = self.state_layout[PROPRIO[-1][0]].stop
        state_dim = max(part.stop for part in self.state_layout.values())
        spaces: dict[str, gym.Space] = {}
        if "state" in obs_mode:
            spaces["state"] = gym.spaces.Box(-np.inf, np.inf, (state_dim,), np.float32)
        if obs_mode == "rgb":
            spaces["proprio"] = gym.spaces.Box(-np.inf, np.inf, (self.proprio_dim,), np.float32)
        if "rgb" in obs_mode:
            spaces["image"] = gym.spaces.Box(0, 255, (image_size, image_size, 3), np.uint8)
        self.observation_space = gym.spaces.Dict(spaces)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (5,), np.float32)

        self._renderer: CameraRenderer | None = None
        self.instruction = ""
        self._steps = 0

    @classmethod
    def layout(cls) -> dict[str, slice]:
        """Where each named part lies in the "state" vector (the same for every instance of a task)."""
        names = PROPRIO + cls.task_state
        offsets = np.cumsum([0] + [size for _, size in names]).tolist()
        return {name: slice(a, b) for (name, _), a, b in zip(names, offsets, offsets[1:], strict=False)}

    # ----- what a task defines -------------------------------------------------------------------
    def objects_xml(self) -> str:
        """MJCF of the task's objects (bodies, mocap markers), inserted into the scene's worldbody."""
        raise NotImplementedError

    def sample_episode(self, rng: np.random.Generator) -> None:
        """Place objects, choose colours and set `self.instruction` for a new episode."""
        raise NotImplementedError

    def task_values(self) -> dict[str, np.ndarray]:
        """Current values of the names in `task_state`."""
        raise NotImplementedError

    def is_success(self) -> bool:
        raise NotImplementedError

    # ----- helpers for tasks ---------------------------------------------------------------------
    def _qpos_index(self, *joints: str) -> np.ndarray:
        return np.array([self.model.jnt_qposadr[self.model.joint(j).id] for j in joints])

    def _dof_index(self, *joints: str) -> np.ndarray:
        return np.array([self.model.jnt_dofadr[self.model.joint(j).id] for j in joints])

    def set_colour(self, geom: str, colour: str) -> None:
        self.model.geom_rgba[self.model.geom(geom).id, :3] = PALETTE[colour]

    def marker(self, body: str) -> np.ndarray:
        """The (writable) position of a mocap marker body such as a goal or pad."""
        return self.data.mocap_pos[self._mocap_id[body]]

    @property
    def ee_pos(self) -> np.ndarray:
        return self.data.qpos[self._arm_q[:3]].copy()

    @property
    def gripper_opening(self) -> float:
        """Mean distance (m) from the hand's centre to the fingers' inner faces."""
        left, right = self.data.qpos[self._finger_q]
        return float(left + right) / 2.0

    # ----- gymnasium API -------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self._nominal.restore(self.model)
        mujoco.mj_resetData(self.model, self.data)
        self._home(self.np_random.uniform(-0.02, 0.02, size=3))
        self.sample_episode(self.np_random)
        if self.randomization is not None:
            randomize(self.model, self._nominal, self.randomization, self.np_random)
        mujoco.mj_forward(self.model, self.data)
        self._steps = 0
        return self._obs(), self._info(success=False, unstable=False)

    def step(self, action):
        action = np.clip(np.asarray(action, dtype=np.float64).reshape(5), -1.0, 1.0)
        target = self.data.qpos[self._arm_q] + action[:4] * _ARM_STEP
        self.data.ctrl[self._arm_ctrl] = np.clip(target, self._ctrl_lo, self._ctrl_hi)
        self.data.ctrl[self._finger_ctrl] = GRIPPER_OPEN * (1.0 - action[4]) / 2.0
        mujoco.mj_step(self.model, self.data, nstep=self.n_substeps)
        self._steps += 1

        unstable = self._unstable()
        if unstable:
            warnings.warn(
                f"{type(self).__name__}: simulation went unstable at step {self._steps} ({unstable}); "
                "ending the episode as a failure",
                RuntimeWarning,
                stacklevel=2,
            )
            mujoco.mj_resetData(self.model, self.data)  # keep the returned observation finite
            self._home(np.zeros(3))
            mujoco.mj_forward(self.model, self.data)
        success = not unstable and self.is_success()
        terminated = bool(unstable) or (success and self.terminate_on_success)
        return self._obs(), float(success), terminated, False, self._info(success, bool(unstable))

    def render(self):
        if self.render_mode == "rgb_array":
            return self._image()
        return None

    def close(self) -> None:
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None

    # ----- snapshots -----------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """This env's state between two steps (`Snapshot`); `restore` puts it back, in this env or in
        another instance of the same task."""
        physics = np.empty(mujoco.mj_stateSize(self.model, _SNAPSHOT_STATE))
        mujoco.mj_getState(self.model, self.data, physics, _SNAPSHOT_STATE)
        return Snapshot(
            physics=physics,
            model={name: getattr(self.model, name).copy() for name in NominalModel.FIELDS},
            warnings=self.data.warning.number.copy(),
            steps=self._steps,
            instruction=self.instruction,
            rng=self.np_random.bit_generator.state,
        )

    def restore(self, snapshot: Snapshot) -> None:
        """Continue from `snapshot`: the next `step` with an action does what it did after the snapshot
        was taken (an observation rendered before that step may differ in the last substep's
        kinematics: take the one recorded with the snapshot)."""
        size = mujoco.mj_stateSize(self.model, _SNAPSHOT_STATE)
        if snapshot.physics.shape != (size,):
            raise ValueError(
                f"{type(self).__name__}: the snapshot holds {snapshot.physics.size} physics values, this "
                f"model {size}: restore a snapshot into an env of the task it was taken from"
            )
        for name, value in snapshot.model.items():
            getattr(self.model, name)[:] = value
        mujoco.mj_setState(self.model, self.data, snapshot.physics, _SNAPSHOT_STATE)
        mujoco.mj_forward(self.model, self.data)
        self.data.warning.number[:] = snapshot.warnings
        self._steps = snapshot.steps
        self.instruction = snapshot.instruction
        self.np_random.bit_generator.state = snapshot.rng

    # ----- observations --------------------------------------------------------------------------
    def get_state(self) -> np.ndarray:
        """The privileged state vector (proprioception, then `task_state`), whatever the obs_mode."""
        values = {
            "ee_pos": self.data.qpos[self._arm_q[:3]],
            "ee_yaw": self.data.qpos[self._arm_q[3:]],
            "ee_vel": self.data.qvel[self._arm_v],
            "gripper": [self.gripper_opening],
            **self.task_values(),
        }
        return np.concatenate([np.ravel(values[name]) for name in self.state_layout]).astype(np.float32)

    def _obs(self) -> dict[str, np.ndarray]:
        obs: dict[str, np.ndarray] = {}
        if "state" in self.obs_mode:
            obs["state"] = self.get_state()
        if self.obs_mode == "rgb":
            obs["proprio"] = self.get_state()[: self.proprio_dim]
        if "rgb" in self.obs_mode:
            obs["image"] = self._image()
        return obs

    def _image(self) -> np.ndarray:
        if self._renderer is None:
            self._renderer = CameraRenderer(self.model, "front", self.image_size, self.image_size)
        return self._renderer.render(self.data)

    def _info(self, success: bool, unstable: bool) -> dict[str, Any]:
        return {"is_success": success, "instruction": self.instruction, "unstable": unstable}

    # ----- internals -----------------------------------------------------------------------------
    def _home(self, offset: np.ndarray) -> None:
        """Arm at HOME + offset with the wrist straight, gripper open, actuators holding that pose."""
        self.data.qpos[self._arm_q] = (*(HOME + offset), 0.0)
        self.data.qpos[self._finger_q] = GRIPPER_OPEN
        self.data.ctrl[self._arm_ctrl] = self.data.qpos[self._arm_q]
        self.data.ctrl[self._finger_ctrl] = GRIPPER_OPEN

    def _unstable(self) -> str:
        """Why the simulation is unusable now ('' if it is fine)."""
        if self.data.warning.number[_BAD_SIM].any():
            return "MuJoCo reported bad qpos/qvel/qacc and reset the data"
        speed = float(np.abs(self.data.qvel).max())
        if not (np.isfinite(self.data.qpos).all() and np.isfinite(speed)):
            return "NaN or inf in qpos/qvel"
        if speed > self.max_velocity:
            return f"|qvel| = {speed:.3g} > max_velocity = {self.max_velocity}"
        return ""


def _wrappers(env: gym.Env) -> Iterator[gym.Wrapper]:
    while isinstance(env, gym.Wrapper):
        yield env
        env = env.env


def snapshot_error(env: gym.Env) -> str | None:
    """Why `snapshot_env` cannot save this env's state (None when it can): the unwrapped env must
    have `snapshot()` and `restore(snapshot)`, as `ArmEnv` has."""
    base = env.unwrapped
    if callable(getattr(base, "snapshot", None)) and callable(getattr(base, "restore", None)):
        return None
    return (
        f"{type(base).__name__} cannot save and restore its state: snapshot branching needs a MuJoCo env "
        "with get/set state (snapshot() and restore(snapshot) on the unwrapped env, which mmrl's own tasks "
        "Reach, Push and PickPlace have)"
    )


def snapshot_env(env: gym.Env) -> EnvSnapshot:
    """The state of a (wrapped) env that `restore_env` puts back, time limits included."""
    problem = snapshot_error(env)
    if problem:
        raise TypeError(problem)
    limits = [w for w in _wrappers(env) if isinstance(w, gym.wrappers.TimeLimit)]
    return EnvSnapshot(env.unwrapped.snapshot(), tuple(w._elapsed_steps for w in limits))


def restore_env(env: gym.Env, snapshot: EnvSnapshot) -> None:
    """Put a (wrapped) env back into `snapshot`, time limits included; an env never reset is reset
    first, as its wrappers' checks expect (the snapshot then overwrites what the reset drew)."""
    problem = snapshot_error(env)
    if problem:
        raise TypeError(problem)
    limits = [w for w in _wrappers(env) if isinstance(w, gym.wrappers.TimeLimit)]
    if len(limits) != len(snapshot.elapsed):
        raise ValueError(
            f"the snapshot was taken through {len(snapshot.elapsed)} time-limit wrappers, this env has "
            f"{len(limits)}: restore into an env made like the one it was taken from"
        )
    if any(isinstance(w, gym.wrappers.OrderEnforcing) and not w.has_reset for w in _wrappers(env)):
        env.reset()
    env.unwrapped.restore(snapshot.state)
    for wrapper, elapsed in zip(limits, snapshot.elapsed, strict=True):
        wrapper._elapsed_steps = elapsed


def sample_positions(
    rng: np.random.Generator,
    n: int,
    min_gap: float,
    low: tuple[float, float] = (-0.18, -0.12),
    high: tuple[float, float] = (0.18, 0.12),
) -> np.ndarray:
    """`n` table positions (x, y) at least `min_gap` apart, each redrawn until it fits."""
    points: list[np.ndarray] = []
    for _ in range(100 * n):
        point = rng.uniform(low, high)
        if all(np.linalg.norm(point - p) >= min_gap for p in points):
            points.append(point)
            if len(points) == n:
                return np.array(points)
    raise RuntimeError(f"could not place {n} objects {min_gap} m apart on the table")
