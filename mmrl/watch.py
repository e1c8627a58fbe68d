"""A watchdog for collectives: say so when a process has waited long for the others.

When one rank of a multi-process run is paused (SIGSTOP, a debugger, a swapped-out node) or stuck,
the others block in the next all-reduce, gather or barrier until the process group's timeout, which
is often half an hour, and print nothing. `CollectiveWatch` runs one daemon thread per process; the
trainer marks each collective with ``with watch.phase("what"):`` and the thread prints a line to
stderr each time the phase has lasted another `warn_after` seconds, naming the rank and the phase.
A single process never waits for others, so the watch does nothing there.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator


class CollectiveWatch:
    def __init__(self, warn_after: float, rank: int, world: int) -> None:
        self.warn_after = warn_after
        self.rank = rank
        self.world = world
        self._lock = threading.Lock()
        self._phase: tuple[str, float] | None = None  # (what, monotonic start)
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def phase(self, what: str) -> Iterator[None]:
        """Mark the code inside as waiting for the other processes in `what`."""
        if self.world <= 1:
            yield
            return
        self._start_thread()
        with self._lock:
            outer, self._phase = self._phase, (what, time.monotonic())
        try:
            yield
        finally:
            with self._lock:
                self._phase = outer

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mmrl-collective-watch", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        warned: tuple[str, float] | None = None
        warnings_given = 0
        while True:
            time.sleep(min(1.0, self.warn_after / 4))
            with self._lock:
                phase = self._phase
            if phase is None:
                continue
            if phase != warned:
                warned, warnings_given = phase, 0
            waited = time.monotonic() - phase[1]
            if waited >= self.warn_after * (warnings_given + 1):
                warnings_given += 1
                print(
                    f"warning: process {self.rank} of {self.world} has waited {waited:.0f} s in "
                    f"{phase[0]}: another process may be paused, stuck or dead (this line repeats every "
                    f"collective_warn_seconds = {self.warn_after:g} s until it goes on or the process "
                    "group times out)",
                    file=sys.stderr,
                    flush=True,
                )
