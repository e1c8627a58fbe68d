"""Test plugin (`mmrl train ... --plugin tests/kill_in_write.py`): the process SIGKILLs itself in the
middle of one write, chosen by environment variables, so that a test can land a kill inside a write
deterministically (tests/test_sigkill_resume.py).

Inside a checkpoint write:

- ``MMRL_TEST_KILL_CHECKPOINT_STEP``: the step whose checkpoint write is cut (unset: no kill).
- ``MMRL_TEST_KILL_CHECKPOINT_AFTER``: where. A number N: just after the N-th safetensors file of that
  checkpoint is written (1: the model's only; the optimizer's, the trainer state's and the RNGs'
  follow, then ``state.json``). ``manifest``: every file and the manifest written and synced, the
  folder not yet renamed into place. ``renamed``: the folder renamed into place, older checkpoints
  not yet pruned.

Inside a run-directory file written whole (`Path.write_text`: ``config.yaml``, ``eval.json``, the
rewrite of ``metrics.jsonl`` at a resume, ...):

- ``MMRL_TEST_KILL_FILE``: a file name; the kill cuts a write of a file whose name holds it (so also
  of a temporary sibling such as ``.eval.json.tmp-PID``) after half of the text is written.
- ``MMRL_TEST_KILL_FILE_NTH``: which of those writes of this process (default 1, the first).

It wraps the writer functions `mmrl.checkpoint.save_checkpoint` calls (safetensors' `save_file` and
`_fsync` as that module names them) and `pathlib.Path.write_text`; the package holds no hook for it.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import mmrl.checkpoint

STEP = os.environ.get("MMRL_TEST_KILL_CHECKPOINT_STEP")
AFTER = os.environ.get("MMRL_TEST_KILL_CHECKPOINT_AFTER", "1")
POINTS = ("manifest", "renamed")
CUT = None if STEP is None else f"{mmrl.checkpoint.STEP_PREFIX}{int(STEP):08d}"  # its folder's name

FILE = os.environ.get("MMRL_TEST_KILL_FILE")
FILE_NTH = int(os.environ.get("MMRL_TEST_KILL_FILE_NTH", "1"))

_save_file = mmrl.checkpoint.save_file
_fsync = mmrl.checkpoint._fsync
_write_text = Path.write_text
_written = 0  # safetensors files of the cut checkpoint written so far
_file_writes = 0  # writes of files named like FILE so far


def _is_cut(folder: Path) -> bool:
    """Whether `folder` is the temporary folder of the checkpoint being cut."""
    return CUT is not None and folder.name.startswith(f".tmp-{CUT}-")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def save_file(tensors: dict[str, Any], filename: str | os.PathLike[str], *args: Any, **kwargs: Any) -> None:
    """safetensors' `save_file`, then the kill once the chosen number of files of the cut checkpoint
    is on disk."""
    global _written
    _save_file(tensors, filename, *args, **kwargs)
    if AFTER not in POINTS and _is_cut(Path(filename).parent):
        _written += 1
        if _written == int(AFTER):
            _die()


def fsync(path: Path) -> None:
    """`mmrl.checkpoint._fsync`, then the kill after the cut checkpoint's manifest is synced (before
    the rename) or after its folder is renamed into place (the sync of the checkpoints folder)."""
    _fsync(path)
    if AFTER == "manifest" and path.name == "manifest.json" and _is_cut(path.parent):
        _die()
    if AFTER == "renamed" and CUT is not None and (path / CUT).is_dir():
        _die()


def write_text(self: Path, data: str, *args: Any, **kwargs: Any) -> int:
    """`Path.write_text`, except that the FILE_NTH-th write of a file named like FILE stops half way
    with the kill."""
    global _file_writes
    if FILE is not None and FILE in self.name:
        _file_writes += 1
        if _file_writes == FILE_NTH:
            _write_text(self, data[: len(data) // 2], *args, **kwargs)
            _die()
    return _write_text(self, data, *args, **kwargs)


if AFTER not in POINTS and not AFTER.isdigit():
    raise ValueError(f"MMRL_TEST_KILL_CHECKPOINT_AFTER = {AFTER!r}: a number of files, or one of {POINTS}")
mmrl.checkpoint.save_file = save_file
mmrl.checkpoint._fsync = fsync
Path.write_text = write_text
