"""Domain randomisation of physical and visual parameters, drawn per episode from the episode's seed.

Off by default so that evaluation numbers are exactly reproducible and comparable across runs;
turn it on (`randomize=True` or a `DomainRandomization(...)`) when collecting demonstrations or
training a policy that should not overfit one table, one lighting and one camera pose.
"""

from __future__ import annotations

from dataclasses import dataclass

import mujoco
import numpy as np


@dataclass(frozen=True)
class DomainRandomization:
    """Ranges of the per-episode jitter; every value is applied around the model's nominal value."""

    friction: tuple[float, float] = (0.7, 1.3)  # scale of each geom's sliding friction
    mass: tuple[float, float] = (0.7, 1.3)  # scale of each free object's mass and inertia
    colour: float = 0.08  # +- on each RGB channel of every geom
    light: float = 0.2  # +- relative change of light intensity
    light_pos: float = 0.1  # m, +- on each coordinate of each light
    camera_pos: float = 0.01  # m, +- on each coordinate of each camera
    camera_angle: float = 0.03  # rad, rotation of each camera about a random axis


class NominalModel:
    """The model's parameters as compiled: each episode jitters these, not the last episode's values."""

    FIELDS = (
        "geom_friction",
        "geom_rgba",
        "body_mass",
        "body_inertia",
        "light_diffuse",
        "light_pos",
        "cam_pos",
        "cam_quat",
    )

    def __init__(self, model: mujoco.MjModel) -> None:
        self.values = {name: getattr(model, name).copy() for name in self.FIELDS}
        self.free_bodies = np.array(
            [
                model.jnt_bodyid[j]
                for j in range(model.njnt)
                if model.jnt_type[j] == mujoco.mjtJoint.mjJNT_FREE
            ],
            dtype=int,
        )

    def restore(self, model: mujoco.MjModel) -> None:
        for name, value in self.values.items():
            getattr(model, name)[:] = value


def randomize(
    model: mujoco.MjModel, nominal: NominalModel, dr: DomainRandomization, rng: np.random.Generator
) -> None:
    """Jitter `model` in place around `nominal`; the draws depend only on `rng`."""
    v = nominal.values
    model.geom_friction[:, 0] = v["geom_friction"][:, 0] * rng.uniform(*dr.friction, size=model.ngeom)
    scale = rng.uniform(*dr.mass, size=len(nominal.free_bodies))
    model.body_mass[nominal.free_bodies] = v["body_mass"][nominal.free_bodies] * scale
    model.body_inertia[nominal.free_bodies] = v["body_inertia"][nominal.free_bodies] * scale[:, None]
    jitter = rng.uniform(-dr.colour, dr.colour, size=(model.ngeom, 3))
    model.geom_rgba[:, :3] = np.clip(model.geom_rgba[:, :3] + jitter, 0.0, 1.0)
    intensity = 1.0 + rng.uniform(-dr.light, dr.light, size=(model.nlight, 1))
    model.light_diffuse[:] = np.clip(v["light_diffuse"] * intensity, 0.0, 1.0)
    model.light_pos[:] = v["light_pos"] + rng.uniform(-dr.light_pos, dr.light_pos, size=(model.nlight, 3))
    model.cam_pos[:] = v["cam_pos"] + rng.uniform(-dr.camera_pos, dr.camera_pos, size=(model.ncam, 3))
    for cam in range(model.ncam):
        axis = rng.normal(size=3)
        turn = np.zeros(4)
        mujoco.mju_axisAngle2Quat(turn, axis / np.linalg.norm(axis), rng.uniform(-1, 1) * dr.camera_angle)
        mujoco.mju_mulQuat(model.cam_quat[cam], turn, v["cam_quat"][cam].copy())
