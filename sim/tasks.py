"""The three tasks: reach a coloured ball, push a cube onto a coloured circle, put a cube on a pad.

Object 0 of each kind is the one the instruction names; `distractors` adds objects of other colours
that appear only in images (the privileged "state" holds the instructed objects only).
"""

from __future__ import annotations

import numpy as np

from sim.env import CUBE_HALF, PALETTE, ArmEnv, sample_positions


def _cube_xml(i: int) -> str:
    return (
        f'<body name="cube{i}" pos="{0.1 * i - 0.1} 0.25 {CUBE_HALF}"><freejoint name="cube{i}"/>'
        f'<geom name="cube{i}" type="box" size="{CUBE_HALF} {CUBE_HALF} {CUBE_HALF}" mass="0.05" '
        'friction="1 0.005 0.0001" condim="4"/></body>'
    )


def _marker_xml(name: str, geom: str) -> str:
    """A mocap body with a visual-only geom: placed per episode through data.mocap_pos."""
    return (
        f'<body name="{name}" mocap="true" pos="0 0 0">'
        f'<geom name="{name}" {geom} contype="0" conaffinity="0"/></body>'
    )


def _colours(rng: np.random.Generator, n: int) -> list[str]:
    return [str(c) for c in rng.choice(list(PALETTE), size=n, replace=False)]


class ReachEnv(ArmEnv):
    """Bring the gripper (the point between the fingertips) to the named ball."""

    env_id = "mmrl/Reach-v0"
    max_episode_steps = 50
    task_state = (("goal_pos", 3),)
    success_dist = 0.025

    def objects_xml(self) -> str:
        ball = 'type="sphere" size="0.02"'
        return "".join(_marker_xml(f"target{i}", ball) for i in range(1 + self.distractors))

    def sample_episode(self, rng: np.random.Generator) -> None:
        n = 1 + self.distractors
        colours = _colours(rng, n)
        xy = sample_positions(rng, n, min_gap=0.08)
        z = rng.uniform(0.05, 0.22, size=n)
        for i in range(n):
            self.marker(f"target{i}")[:] = (*xy[i], z[i])
            self.set_colour(f"target{i}", colours[i])
        self.instruction = f"move the gripper to the {colours[0]} ball"

    def task_values(self) -> dict[str, np.ndarray]:
        return {"goal_pos": self.marker("target0")}

    def is_success(self) -> bool:
        return bool(np.linalg.norm(self.ee_pos - self.marker("target0")) < self.success_dist)


class _CubeTask(ArmEnv):
    """Shared by the cube tasks: cube 0 is the instructed cube, its pose and velocity are in the state."""

    max_episode_steps = 100
    task_state = (("cube_pos", 3), ("cube_quat", 4), ("cube_vel", 3), ("goal_pos", 3))
    goal_marker = "goal0"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._cube_q = self._qpos_index("cube0")[0]
        self._cube_v = self._dof_index("cube0")[0]

    def _place_cube(self, i: int, xy: np.ndarray, rng: np.random.Generator) -> None:
        yaw = rng.uniform(-np.pi / 4, np.pi / 4)
        q = self._qpos_index(f"cube{i}")[0]
        self.data.qpos[q : q + 7] = (*xy, CUBE_HALF, np.cos(yaw / 2), 0.0, 0.0, np.sin(yaw / 2))

    @property
    def cube_pos(self) -> np.ndarray:
        return self.data.qpos[self._cube_q : self._cube_q + 3].copy()

    def task_values(self) -> dict[str, np.ndarray]:
        q, v = self._cube_q, self._cube_v
        return {
            "cube_pos": self.data.qpos[q : q + 3],
            "cube_quat": self.data.qpos[q + 3 : q + 7],
            "cube_vel": self.data.qvel[v : v + 3],
            "goal_pos": self.marker(self.goal_marker),
        }


class PushEnv(_CubeTask):
    """Push the named cube until its centre is inside the coloured circle (no lifting needed)."""

    env_id = "mmrl/Push-v0"
    goal_radius = 0.04

    def objects_xml(self) -> str:
        disc = f'type="cylinder" size="{self.goal_radius} 0.001" pos="0 0 0.001"'
        return _marker_xml("goal0", disc) + "".join(_cube_xml(i) for i in range(1 + self.distractors))

    def sample_episode(self, rng: np.random.Generator) -> None:
        n = 1 + self.distractors
        colours = _colours(rng, n + 1)
        xy = sample_positions(rng, n + 1, min_gap=0.1)
        self.marker("goal0")[:] = (*xy[n], 0.0)
        self.set_colour("goal0", colours[n])
        for i in range(n):
            self._place_cube(i, xy[i], rng)
            self.set_colour(f"cube{i}", colours[i])
        self.instruction = f"push the {colours[0]} cube onto the {colours[n]} circle"

    def is_success(self) -> bool:
        cube, goal = self.cube_pos, self.marker("goal0")
        return bool(np.linalg.norm(cube[:2] - goal[:2]) < self.goal_radius and cube[2] < CUBE_HALF + 0.01)


class PickPlaceEnv(_CubeTask):
    """Pick up the named cube and put it down on the named pad, gripper released."""

    env_id = "mmrl/PickPlace-v0"
    goal_marker = "pad0"
    pad_half = 0.04
    success_dist = 0.03

    def objects_xml(self) -> str:
        pad = f'type="box" size="{self.pad_half} {self.pad_half} 0.001" pos="0 0 0.001"'
        n = 1 + self.distractors
        return "".join(_marker_xml(f"pad{i}", pad) + _cube_xml(i) for i in range(n))

    def sample_episode(self, rng: np.random.Generator) -> None:
        n = 1 + self.distractors
        colours = _colours(rng, 2 * n)
        xy = sample_positions(rng, 2 * n, min_gap=0.1)
        for i in range(n):
            self._place_cube(i, xy[i], rng)
            self.set_colour(f"cube{i}", colours[i])
            self.marker(f"pad{i}")[:] = (*xy[n + i], 0.0)
            self.set_colour(f"pad{i}", colours[n + i])
        self.instruction = f"put the {colours[0]} cube on the {colours[n]} pad"

    def is_success(self) -> bool:
        cube, pad = self.cube_pos, self.marker("pad0")
        on_pad = np.linalg.norm(cube[:2] - pad[:2]) < self.success_dist and cube[2] < CUBE_HALF + 0.005
        released = self.gripper_opening > CUBE_HALF + 0.004
        return bool(on_pad and released)
