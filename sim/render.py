"""Headless offscreen rendering of a fixed camera.

MuJoCo's EGL backend registers `eglTerminate` at exit the first time it makes a context; a
renderer garbage-collected after that prints a traceback. So we register our own exit hook
*after* the first context exists (atexit runs last-in first-out) and close every live renderer
before EGL goes away.
"""

from __future__ import annotations

import atexit
import os
import sys
import weakref

import mujoco
import numpy as np

_LIVE: weakref.WeakSet[CameraRenderer] = weakref.WeakSet()
_hook_registered = False


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
            raise RuntimeError(
                "mujoco chose its GLFW (windowed) backend, which needs a display: libEGL is not installed "
                "(Debian: apt-get install libegl1 libopengl0 libegl-mesa0 libgl1-mesa-dri), or mujoco was "
                "imported before MUJOCO_GL was set. Install EGL and import sim before mujoco (sim sets "
                "MUJOCO_GL=egl), export MUJOCO_GL=egl / osmesa, or use obs_mode='state'."
            )
        try:
            self._renderer = mujoco.Renderer(model, height=height, width=width)
        except Exception as err:  # the backend's own errors are cryptic; say what to check
            raise RuntimeError(
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


def headless_rendering_error() -> str | None:
    """None if a 16x16 offscreen render works here, else why not (tests skip with this reason)."""
    model = mujoco.MjModel.from_xml_string(
        '<mujoco><worldbody><camera name="c" pos="0 0 1"/><geom size=".1"/></worldbody></mujoco>'
    )
    try:
        renderer = CameraRenderer(model, "c", 16, 16)
    except RuntimeError as err:
        return str(err)
    try:
        renderer.render(mujoco.MjData(model))
    except Exception as err:
        return f"offscreen render failed: {type(err).__name__}: {err}"
    finally:
        renderer.close()
    return None
