"""Scripted experts: a pure function of the privileged state vector to an action.

They keep no memory: the phase (approach, grasp, carry, place, ...) is read off the state, so an expert
can take over from whatever state a policy left the robot in (interventions), and can label any
stored state with an action (DAgger-style relabelling).
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np

from sim.env import CUBE_HALF, GRIPPER_OPEN, MAX_STEP, MAX_YAW_STEP, ArmEnv
from sim.external import ExternalTask
from sim.tasks import PickPlaceEnv

OPEN, CLOSE = -1.0, 1.0


def move(ee: np.ndarray, target: np.ndarray, grip: float, yaw_error: float = 0.0) -> np.ndarray:
    """Action that moves the end-effector toward `target` and turns the wrist by `yaw_error` (a full step
    each if far), with a gripper command."""
    step = np.clip((target - ee) / MAX_STEP, -1.0, 1.0)
    return np.array([*step, np.clip(yaw_error / MAX_YAW_STEP, -1.0, 1.0), grip], dtype=np.float32)


def cube_yaw(quat: np.ndarray) -> float:
    """Yaw of the cube's nearest face to the x axis, in [-pi/4, pi/4] (a cube looks the same every pi/2)."""
    w, x, y, z = quat
    yaw = np.arctan2(2 * (w * z + x * y), 1 - 2 * (y * y + z * z))
    return float((yaw + np.pi / 4) % (np.pi / 2) - np.pi / 4)


class Expert:
    """Base expert: call it with a state vector (or a batch of them) of the task it was made for."""

    def __init__(self, task: type[ArmEnv] | ExternalTask) -> None:
        self.layout = task.layout()

    def __call__(self, state: np.ndarray) -> np.ndarray:
        state = np.asarray(state, dtype=np.float64)
        if state.ndim == 2:
            return np.stack([self(s) for s in state])
        return self.act_on(self.parts(state))

    def parts(self, state: np.ndarray) -> dict[str, np.ndarray]:
        """The named entries (ee_pos, cube_pos, ...) of one state vector."""
        return {name: np.asarray(state, dtype=np.float64)[part] for name, part in self.layout.items()}

    def release_fails(self, state: np.ndarray) -> bool:
        """Whether opening the gripper now would lose the episode (drop a held object away from its
        goal); the supervisor's release guard asks. Tasks that carry nothing: never."""
        return False

    def failure(self, states: np.ndarray) -> str | None:
        """How a failed episode failed, in a few words, from the privileged states it visited (T+1,
        state_dim), by the task's own phases; None where the task names no failure modes."""
        return None

    def act(self, env: gym.Env) -> np.ndarray:
        """Action for the env's current state, whatever its obs_mode."""
        return self(env.get_wrapper_attr("get_state")())

    def act_on(self, s: dict[str, np.ndarray]) -> np.ndarray:
        raise NotImplementedError


class ReachExpert(Expert):
    def act_on(self, s: dict[str, np.ndarray]) -> np.ndarray:
        return move(s["ee_pos"], s["goal_pos"], OPEN, -s["ee_yaw"][0])


class PushExpert(Expert):
    """Go above a point behind the cube (on the goal line), lower the closed gripper, push along the line."""

    push_z = 0.02  # fingertips 1 cm above the table
    travel_z = 0.08  # height to move at when not pushing
    contact = CUBE_HALF + 0.012  # pusher centre to cube centre when touching (closed fingers are 2.4 cm)

    def act_on(self, s: dict[str, np.ndarray]) -> np.ndarray:
        ee, cube, goal = s["ee_pos"], s["cube_pos"], s["goal_pos"]
        straighten = -float(s["ee_yaw"][0])
        to_goal = goal[:2] - cube[:2]
        dist = np.linalg.norm(to_goal)
        u = to_goal / max(dist, 1e-6)
        rel = ee[:2] - cube[:2]
        along = rel @ u
        lateral = np.linalg.norm(rel - along * u)
        if -0.07 < along < -0.02 and lateral < 0.012 and ee[2] < 0.035:  # in place: push
            target_xy = cube[:2] + u * (min(dist, MAX_STEP) - self.contact)
            return move(ee, np.append(target_xy, self.push_z), CLOSE, straighten)
        behind = cube[:2] - u * (self.contact + 0.02)
        if np.linalg.norm(ee[:2] - behind) < 0.01:  # above the start point: lower
            return move(ee, np.append(behind, self.push_z), CLOSE, straighten)
        if ee[2] < self.travel_z - 0.03 and np.linalg.norm(rel) < 0.07:  # low next to the cube: rise first
            return move(ee, np.append(ee[:2], self.travel_z), CLOSE, straighten)
        return move(ee, np.append(behind, self.travel_z), CLOSE, straighten)


class PickPlaceExpert(Expert):
    """Open above the cube, turn to its faces, lower around it, close, lift, carry above the pad, lower,
    open, retreat."""

    above_z = 0.1  # pre-grasp height of the end-effector
    carry_z = 0.12  # carry height: the cube's bottom clears other cubes

    @staticmethod
    def held(s: dict[str, np.ndarray]) -> bool:
        """The cube sits between the closed fingers."""
        ee, cube = s["ee_pos"], s["cube_pos"]
        near = np.linalg.norm(ee[:2] - cube[:2]) < 0.02 and abs(ee[2] - cube[2]) < 0.02
        return bool(near and float(s["gripper"][0]) < CUBE_HALF + 0.002)

    def release_fails(self, state: np.ndarray) -> bool:
        s = self.parts(state)
        away = np.linalg.norm(s["cube_pos"][:2] - s["goal_pos"][:2]) > PickPlaceEnv.success_dist
        return self.held(s) and bool(away)

    def failure(self, states: np.ndarray) -> str:
        """Held at the end; held and then lost off the pad; never held, waiting above the cube (with
        the wrist turned to its faces or not: this expert lowers only once it is); never held."""
        visited = [self.parts(state) for state in states]
        last = visited[-1]
        if self.held(last):
            return "still holding the cube"
        if any(self.held(s) for s in visited):
            return "held the cube, lost it off the pad"
        ee, cube = last["ee_pos"], last["cube_pos"]
        if np.linalg.norm(ee[:2] - cube[:2]) < 0.02 and ee[2] > cube[2] + 0.04:
            turn = cube_yaw(last["cube_quat"]) - float(last["ee_yaw"][0])
            return "waits above the cube, wrist not turned" if abs(turn) > 0.1 else "waits above the cube"
        return "never held the cube"

    def act_on(self, s: dict[str, np.ndarray]) -> np.ndarray:
        ee, cube, pad = s["ee_pos"], s["cube_pos"], s["goal_pos"]
        opening = float(s["gripper"][0])
        off_xy = np.linalg.norm(ee[:2] - cube[:2])
        if self.held(s):
            return self._carry(ee, cube, pad)
        if np.linalg.norm(cube[:2] - pad[:2]) < 0.02 and cube[2] < CUBE_HALF + 0.005:  # placed: retreat
            return move(ee, np.append(ee[:2], self.above_z), OPEN)
        turn = cube_yaw(s["cube_quat"]) - float(s["ee_yaw"][0])
        if off_xy > 0.01 or abs(turn) > 0.1:  # not above the cube: rise if low near it, else go above it
            if ee[2] < cube[2] + 0.05 and off_xy < 0.06:
                return move(ee, np.append(ee[:2], self.above_z), OPEN)
            return move(ee, np.append(cube[:2], self.above_z), OPEN, turn)
        grasp = np.append(cube[:2], max(cube[2], 0.015))
        if ee[2] - grasp[2] > 0.008:  # above the cube: lower once the fingers are wide open
            wide = opening > GRIPPER_OPEN - 0.005
            return move(ee, grasp if wide else ee, OPEN, turn)
        if opening < CUBE_HALF - 0.004:  # closed on nothing: open up again
            return move(ee, ee, OPEN)
        return move(ee, grasp, CLOSE, turn)

    def _carry(self, ee: np.ndarray, cube: np.ndarray, pad: np.ndarray) -> np.ndarray:
        in_hand = ee - cube  # keep the cube's offset in the hand when aiming it at the pad
        if np.linalg.norm(cube[:2] - pad[:2]) > 0.01:
            if cube[2] < self.carry_z - in_hand[2] - 0.03 and np.linalg.norm(cube[:2] - pad[:2]) > 0.03:
                return move(ee, np.append(ee[:2], self.carry_z), CLOSE)  # lift before moving
            return move(ee, np.append(pad[:2] + in_hand[:2], self.carry_z), CLOSE)
        if cube[2] > CUBE_HALF + 0.004:  # over the pad: lower
            return move(ee, np.append(pad[:2] + in_hand[:2], CUBE_HALF + in_hand[2]), CLOSE)
        return move(ee, ee, OPEN)  # on the pad: release


class FetchReachExpert(Expert):
    """gymnasium-robotics' FetchReach: move the gripper straight at the goal (proportional, a full step
    when far). The gripper command is 0: that task ignores it."""

    step = 0.05  # m the gripper's target moves per unit action (gymnasium_robotics/envs/fetch/fetch_env.py)

    def act_on(self, s: dict[str, np.ndarray]) -> np.ndarray:
        delta = np.clip((s["desired_goal"] - s["achieved_goal"]) / self.step, -1.0, 1.0)
        return np.append(delta, 0.0).astype(np.float32)
