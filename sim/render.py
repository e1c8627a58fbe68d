"""Headless offscreen rendering of a fixed camera.

MuJoCo's EGL backend registers `eglTerminate` at exit the first time it makes a context; a
renderer garbage-collected after that prints a traceback. So we register our own exit hook
*after* the first context exists (atexit runs last-in first-out) and close every live renderer
before EGL goes away.
"""

from __future__ import annotations

import atexit
import copy
import os
import sys
import weakref

import mujoco
import numpy as np

_LIVE: weakref.WeakSet[CameraRenderer] = weakref.WeakSet()
_hook_registered = False


class RenderingError(RuntimeError):
    """MuJoCo cannot render offscreen here; the message says what to install or set."""


def _close_all() -> None:
    for renderer in list(_LIVE):
        renderer.close()


class CameraRenderer:
    """Renders one named camera of a model to HxWx3 uint8 (shadows and anti-aliasing are off in the MJCF)."""

    def __init__(self, model: mujoco.MjModel, camera: str, height: int, width: int) -> None:
        global _hook_registered
        self._renderer = None
        if (
            mujoco.GLContext.__module__ == "mujoco.glfw"
            and sys.platform == "linux"
            and not os.environ.get("DISPLAY")
        ):
            # GLFW aborts the whole process without a display; fail with a reason instead
            raise RenderingError(
                "mujoco chose its GLFW (windowed) backend, which needs a display: libEGL is not installed "
                "(Debian: apt-get install libegl1 libopengl0 libegl-mesa0 libgl1-mesa-dri), or mujoco was "
                "imported before MUJOCO_GL was set. Install EGL and import sim before mujoco (sim sets "
                "MUJOCO_GL=egl), export MUJOCO_GL=egl / osmesa, or use obs_mode='state'."
            )
        try:
            self._renderer = mujoco.Renderer(model, height=height, width=width)
        except Exception as err:  # the backend's own errors are cryptic; say what to check
            raise RenderingError(
                f"could not create a headless MuJoCo renderer ({type(err).__name__}: {err}). "
                "Headless rendering needs MUJOCO_GL=egl (GPU or Mesa EGL) or MUJOCO_GL=osmesa set before "
                "mujoco is first imported (importing sim first sets egl), or use obs_mode='state'."
            ) from err
        self.camera = camera
        _LIVE.add(self)
        if not _hook_registered:
            atexit.register(_close_all)
            _hook_registered = True

    def render(self, data: mujoco.MjData) -> np.ndarray:
        self._renderer.update_scene(data, camera=self.camera)
        return self._renderer.render()

    def close(self) -> None:
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None

    def __del__(self) -> None:
        self.close()


def coarse_meshes(model: mujoco.MjModel, cell: float) -> mujoco.MjModel:
    """A copy of `model` for rendering only, each mesh simplified by vertex clustering on a grid of
    `cell` metres: every vertex is replaced by the first vertex of its cell, and the faces that
    collapse or repeat are dropped. Software rendering (llvmpipe) costs about the mesh faces drawn,
    and a camera of a few dozen pixels cannot show detail below a pixel's footprint; so a cell of
    about that footprint gives nearly the same frame for a fraction of the faces. The copy keeps the
    original's sizes and ids, so it renders the original's MjData; physics never sees it.

    Only face lists change (the kept faces index original vertices, normals and texture
    coordinates); unused vertices stay in place."""
    if cell <= 0:
        raise ValueError(f"cell = {cell}: the clustering grid needs a positive size in metres")
    coarse = copy.deepcopy(model)
    for mesh in range(coarse.nmesh):
        v0, nv = coarse.mesh_vertadr[mesh], coarse.mesh_vertnum[mesh]
        f0, nf = coarse.mesh_faceadr[mesh], coarse.mesh_facenum[mesh]
        cells = np.floor(coarse.mesh_vert[v0 : v0 + nv] / cell).astype(np.int64)
        _, first, which = np.unique(cells, axis=0, return_index=True, return_inverse=True)
        faces = first[which.ravel()][coarse.mesh_face[f0 : f0 + nf]]  # corners moved to their cell's vertex
        a, b, c = faces.T
        kept = np.flatnonzero((a != b) & (b != c) & (a != c))
        _, unique = np.unique(np.sort(faces[kept], axis=1), axis=0, return_index=True)
        kept = kept[np.sort(unique)]  # one face per corner triple, in the original order
        n = len(kept)
        coarse.mesh_face[f0 : f0 + n] = faces[kept]
        coarse.mesh_facenormal[f0 : f0 + n] = coarse.mesh_facenormal[f0 + kept]
        if coarse.mesh_texcoordnum[mesh]:
            coarse.mesh_facetexcoord[f0 : f0 + n] = coarse.mesh_facetexcoord[f0 + kept]
        coarse.mesh_facenum[mesh] = n
    return coarse
