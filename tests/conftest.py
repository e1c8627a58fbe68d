"""With the environment variable CI set (`.ci/run` sets it), a skip for something `.ci/run` installs
fails instead: it means CI stopped exercising what the README claims, and a skip would hide that.

Such skips are recognised by their reason, so tests that skip for these causes use these words.
"""

import os

import pytest

EGL_PACKAGES = "libegl1 libopengl0 libegl-mesa0 libgl1-mesa-dri"
CI_PROVIDES = {  # words of a skip reason -> what installs the missing piece
    "no headless rendering": f"MuJoCo's EGL rendering needs `apt-get install -y {EGL_PACKAGES}`",
    "no chromium": "the report's browser test needs `apt-get install -y chromium`",
    "the robot extra": "install the dev extra: `pip install -e '.[dev]'`",
    "gymnasium[mujoco]": "install the dev extra: `pip install -e '.[dev]'`",
    "the fetch extra": "install the dev extra (it has gymnasium-robotics): `pip install -e '.[dev]'`",
    "vla_fetch_reach needs an optional extra": "install the dev extra (it has gymnasium-robotics)",
}


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
