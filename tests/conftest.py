"""What the tests need that a plain install may lack, said once, and the CI rule for skips.

- ``@pytest.mark.needs_robot``: skip without the robot extra (mujoco, gymnasium).
- ``@pytest.mark.needs_rendering``: skip without MuJoCo's headless rendering (implies needs_robot).
- ``@pytest.mark.needs_fetch``: skip without the fetch extra (gymnasium-robotics; implies needs_robot).
- ``@pytest.mark.needs_metaworld``: skip without Meta-World (installed apart, see README; implies
  needs_robot).
- the ``rendering_error`` fixture: why MuJoCo cannot render here, or None, for a test that adapts
  instead of skipping.
- A module in `ROBOT_MODULES` imports the robot stack at its top, so without the extra it is skipped
  whole before it is imported. With the extra, conftest imports sim before any test module, so that
  sim selects MuJoCo's headless EGL backend before anything loads mujoco.

With the environment variable CI set (`.ci/run` sets it), a skip for something `.ci/run` installs fails
instead: it means CI stopped exercising what the README claims, and a skip would hide that. Such skips
are recognised by the words of their reason, so tests that skip for these causes use these words.

The first import, `fixed_isa`, caps PyTorch, MKL and oneDNN at AVX2 kernels before anything loads
torch, so that pinned runs compute the same bits on any x86 processor (see tests/fixed_isa.py).
"""

import fixed_isa  # noqa: F401, I001  (first: it sets torch's kernel choice before torch loads)
import functools
import importlib.util
import os

# Under pytest-xdist (the README's `pytest -n 2`) each worker, and each command a test starts, gets its
# share of the cores instead of all of them: set before torch loads, which reads it once
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))

import pytest

EGL_PACKAGES = "libegl1 libopengl0 libegl-mesa0 libgl1-mesa-dri"
CI_PROVIDES = {  # words of a skip reason -> what installs the missing piece
    "no headless rendering": f"MuJoCo's EGL rendering needs `apt-get install -y {EGL_PACKAGES}`",
    "no chromium": "the report's browser test needs `apt-get install -y chromium`",
    "the robot extra": "install the dev extra: `pip install -e '.[dev]'`",
    "gymnasium[mujoco]": "install the dev extra: `pip install -e '.[dev]'`",
    "the fetch extra": "install the dev extra (it has gymnasium-robotics): `pip install -e '.[dev]'`",
    "vla_fetch_reach needs an optional extra": "install the dev extra (it has gymnasium-robotics)",
    "the metaworld package": "install it as .ci/run does: `pip install --no-deps metaworld==3.1.1`",
    "the adam8bit extra": "install the dev extra (it has bitsandbytes): `pip install -e '.[dev]'`",
}
HAS_ROBOT = all(importlib.util.find_spec(name) is not None for name in ("mujoco", "gymnasium"))
NO_ROBOT = "the robot extra (mujoco, gymnasium) is not installed"
if HAS_ROBOT:
    import sim  # noqa: F401  (before a test module imports mujoco: sim selects the headless EGL backend)
HAS_FETCH = HAS_ROBOT and importlib.util.find_spec("gymnasium_robotics") is not None
NO_FETCH = "the fetch extra (gymnasium-robotics) is not installed"
HAS_METAWORLD = HAS_ROBOT and importlib.util.find_spec("metaworld") is not None
NO_METAWORLD = "the metaworld package is not installed (`pip install --no-deps metaworld==3.1.1 scipy`)"
ROBOT_MODULES = frozenset(
    {
        "test_metaworld.py",
        "test_plugins.py",
        "test_sim_adapters.py",
        "test_sim_envs.py",
        "test_sim_experts.py",
        "test_sim_vector.py",
        "test_vla_eval.py",
        "test_vla_fetch.py",
        "test_vla_habc.py",
        "test_vla_methods.py",
        "test_vla_policy.py",
    }
)


@functools.cache
def headless_rendering_error() -> str | None:
    """Why MuJoCo cannot render camera frames here (None when it can)."""
    if not HAS_ROBOT:
        return NO_ROBOT
    import sim
    from sim.render import RenderingError

    env = sim.make("Reach", obs_mode="rgb", image_size=16)  # a camera frame, drawn at reset
    try:
        env.reset(seed=0)
    except RenderingError as err:
        return f"no headless rendering: {err}"
    except Exception as err:  # the backend's own failure at the first frame
        return f"no headless rendering: offscreen render failed: {type(err).__name__}: {err}"
    finally:
        env.close()
    return None


@pytest.fixture(scope="session")
def rendering_error() -> str | None:
    return headless_rendering_error()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"needs_robot: skipped when {NO_ROBOT}")
    config.addinivalue_line("markers", "needs_rendering: skipped without MuJoCo's headless rendering")
    config.addinivalue_line("markers", f"needs_fetch: skipped when {NO_FETCH}")
    config.addinivalue_line("markers", f"needs_metaworld: skipped when {NO_METAWORLD}")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("needs_rendering") and (reason := headless_rendering_error()):
        pytest.skip(reason)
    if item.get_closest_marker("needs_robot") and not HAS_ROBOT:
        pytest.skip(NO_ROBOT)
    if item.get_closest_marker("needs_fetch") and not HAS_FETCH:
        pytest.skip(NO_FETCH if HAS_ROBOT else NO_ROBOT)
    if item.get_closest_marker("needs_metaworld") and not HAS_METAWORLD:
        pytest.skip(NO_METAWORLD if HAS_ROBOT else NO_ROBOT)


class _SkippedRobotModule(pytest.File):
    def collect(self):
        pytest.skip(NO_ROBOT)


def pytest_pycollect_makemodule(module_path, parent):
    if not HAS_ROBOT and module_path.name in ROBOT_MODULES:
        return _SkippedRobotModule.from_parent(parent, path=module_path)
    return None


def in_ci() -> bool:
    """True when the environment variable CI is set to anything but empty, 0, false or no."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _fail_ci_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    if not report.skipped or not in_ci():
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    for words, fix in CI_PROVIDES.items():
        if words in reason:
            report.outcome = "failed"
            report.longrepr = f"CI must not skip this ({reason}): {fix}; .ci/run is meant to provide it"
            return


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_ci_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_ci_skip(outcome.get_result())
