"""Atomic, verifiable checkpoints: safetensors for tensors, JSON for everything else.

A checkpoint is a folder ``checkpoints/step_XXXXXXXX/`` holding tensor groups as
``<group>.safetensors`` (model, optimizer state, RNG states, ...), ``state.json`` with the
non-tensor state, and ``manifest.json`` listing every file's SHA-256. The folder is written under
a temporary name and renamed into place, and the manifest is written last, so a killed writer
leaves either a complete checkpoint or nothing that looks like one; a write that fails (a full disk)
removes its temporary folder and raises `CheckpointWriteError`, the earlier checkpoints untouched. On
load, a checkpoint whose files do not match its manifest is reported and the previous good one is used.

Nested state (an optimizer's ``state_dict()``, RNG states, a sampler's state) is split by
`pack` into a JSON tree, with tensors replaced by references, and a flat tensor dict. The tree is
strict JSON: a NaN or infinite float is kept as ``{"__float__": "nan"}``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import random
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

STEP_PREFIX = "step_"
REPLACED_PREFIX = ".replaced-"  # a checkpoint of the same step being replaced by a new write


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (its `errno`: ENOSPC for a full disk); its temporary folder is
    removed and every checkpoint written before is as it was. `directory` is where it was written."""

    def __init__(self, code: int | None, message: str, directory: Path) -> None:
        super().__init__(code, message)
        self.directory = directory


# ---------------------------------------------------------------------------------------------
# Nested state <-> (JSON tree, tensors)


def pack(obj: Any, tensors: dict[str, torch.Tensor], path: str = "") -> Any:
    """Replace tensors in a nested structure by references into `tensors`; keep int dict keys."""
    if isinstance(obj, torch.Tensor):
        key = path or "value"
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        key = path or "value"
        tensors[key] = torch.from_numpy(np.ascontiguousarray(obj))
        return {"__ndarray__": key, "dtype": str(obj.dtype)}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and "__tensor__" not in obj:
            return {k: pack(v, tensors, f"{path}.{k}" if path else k) for k, v in obj.items()}
        items = [[k, pack(v, tensors, f"{path}.{k}" if path else str(k))] for k, v in obj.items()]
        return {"__items__": items}
    if isinstance(obj, tuple):
        return {"__tuple__": [pack(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [pack(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]
    if isinstance(obj, np.integer | np.floating):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"__float__": str(obj)}
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise TypeError(f"cannot checkpoint a value of type {type(obj).__name__} at {path!r}")


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with every one that shares memory with an earlier one copied, as safetensors needs
    (e.g. AdamW8bit's code books, one tensor in the state of every parameter)."""
    seen: set[int] = set()
    out = {}
    for key, tensor in tensors.items():
        pointer = tensor.untyped_storage().data_ptr()
        if tensor.numel() and pointer in seen:
            tensor = tensor.clone()
        seen.add(pointer)
        out[key] = tensor
    return out


def unpack(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of `pack`."""
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__ndarray__" in obj:
            return tensors[obj["__ndarray__"]].numpy().astype(obj["dtype"], copy=True)
        if "__items__" in obj:
            return {_key(k): unpack(v, tensors) for k, v in obj["__items__"]}
        if "__tuple__" in obj:
            return tuple(unpack(v, tensors) for v in obj["__tuple__"])
        if "__float__" in obj:
            return float(obj["__float__"])
        return {k: unpack(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [unpack(v, tensors) for v in obj]
    return obj


def _key(k: Any) -> Any:
    return tuple(k) if isinstance(k, list) else k


# ---------------------------------------------------------------------------------------------
# RNG state


def rng_state() -> dict[str, Any]:
    """Every global RNG this process uses: Python, NumPy, torch CPU and CUDA."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------------
# Writing and reading checkpoint folders


@dataclass
class Checkpoint:
    step: int
    path: Path
    state: dict[str, Any]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def replace_text(path: Path, text: str) -> None:
    """Write `path` through a temporary sibling renamed into place, so that a reader, or a run that
    resumes after a kill, never meets half a file: it finds the old text or the new."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    checkpoint_dir: Path,
    step: int,
    state: dict[str, Any],
    model: torch.nn.Module | None = None,
    keep: int = 3,
) -> Path:
    """Write ``step_XXXXXXXX`` atomically: `model` weights plus nested `state`; prune old ones.

    Each top-level entry of `state` becomes its own safetensors file (its tensors) and a section
    of ``state.json`` (the rest). A write that fails removes its temporary folder and raises
    `CheckpointWriteError`; the checkpoints written before stay as they were.
    """
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir / f"{STEP_PREFIX}{step:08d}"
    tmp = checkpoint_dir / f".tmp-{final.name}-{os.getpid()}"
    try:
        _write_checkpoint_files(tmp, step, state, model)
    except (OSError, SafetensorError) as err:
        shutil.rmtree(tmp, ignore_errors=True)
        code = write_errno(err)
        reason = os.strerror(code) if code else f"{type(err).__name__}: {err}"
        raise CheckpointWriteError(
            code,
            f"the checkpoint of step {step} could not be written in {checkpoint_dir} ({reason})",
            checkpoint_dir,
        ) from err
    replaced = checkpoint_dir / f"{REPLACED_PREFIX}{final.name}"
    if final.exists():  # a re-save of the same step (e.g. after resume) replaces it, never losing it
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
    os.replace(tmp, final)
    _fsync(checkpoint_dir)
    shutil.rmtree(replaced, ignore_errors=True)
    for old in list_checkpoints(checkpoint_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _write_checkpoint_files(
    tmp: Path, step: int, state: dict[str, Any], model: torch.nn.Module | None
) -> None:
    """The checkpoint's files, fsynced, into the new folder `tmp`, its manifest last."""
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    files = []
    if model is not None:
        # the live tensors where they are on the CPU already (save_file reads them now), not a copy of
        # the whole model; tied weights are copied once, as safetensors needs
        model_state = _unshared({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()})
        save_file(model_state, tmp / "model.safetensors")
        files.append("model.safetensors")
    json_state: dict[str, Any] = {"step": step}
    for group, value in state.items():
        tensors: dict[str, torch.Tensor] = {}
        json_state[group] = pack(value, tensors)
        if tensors:
            save_file(_unshared(tensors), tmp / f"{group}.safetensors")
            files.append(f"{group}.safetensors")
    (tmp / "state.json").write_text(json.dumps(json_state, allow_nan=False))
    files.append("state.json")
    for name in files:
        _fsync(tmp / name)
    manifest = {"step": step, "files": {name: _sha256(tmp / name) for name in files}}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    _fsync(tmp / "manifest.json")


def write_errno(err: BaseException) -> int | None:
    """The errno of a failed write: an OSError's own, or the one safetensors names in its message
    (``IoError(Os { code: 28, ... })``), ENOSPC for a full disk; None when there is none."""
    if isinstance(err, OSError) and err.errno:
        return err.errno
    text = str(err)
    if "No space left on device" in text or "StorageFull" in text:
        return errno.ENOSPC
    return None


def list_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """Checkpoint folders, oldest first (temporary folders of killed writers are ignored)."""
    if not checkpoint_dir.is_dir():
        return []
    found = [p for p in checkpoint_dir.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX)]
    return sorted(found, key=lambda p: p.name)


def remove_unfinished_writes(checkpoint_dir: Path) -> list[Path]:
    """Delete the temporary folders that killed writers left behind, and put back a checkpoint whose
    re-save was killed before the new one was in place; return what was removed. Only one process
    writes a run's checkpoints, so call this before it starts writing."""
    if not checkpoint_dir.is_dir():
        return []
    leftovers = []
    for path in sorted(checkpoint_dir.iterdir()):
        if not path.is_dir():
            continue
        if path.name.startswith(REPLACED_PREFIX):  # killed while a re-save replaced it
            target = checkpoint_dir / path.name.removeprefix(REPLACED_PREFIX)
            if not target.exists():
                os.replace(path, target)  # the new write did not land: the old one is the checkpoint
                continue
        elif not path.name.startswith(f".tmp-{STEP_PREFIX}"):
            continue
        shutil.rmtree(path, ignore_errors=True)
        leftovers.append(path)
    return leftovers


def verify_checkpoint(path: Path) -> str | None:
    """None if the folder is a complete checkpoint whose files match the manifest, else what is wrong.

    The manifest's own file list is not trusted: it must name ``state.json`` and every other file
    of the folder, so a manifest emptied or cut short does not vouch for files it does not cover."""
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        return "manifest.json is missing (the write did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        return "manifest.json is unreadable"
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and len(v) == 64 for k, v in files.items()
    ):
        return "manifest.json's file list is not a mapping of file names to SHA-256 digests"
    if manifest.get("step") != _folder_step(path):
        return f"manifest.json names step {manifest.get('step')!r}, not the folder's"
    if "state.json" not in files:
        return "manifest.json does not list state.json"
    on_disk = {p.name for p in path.iterdir() if p.name != "manifest.json"}
    unlisted = sorted(on_disk - files.keys())
    if unlisted:
        return f"manifest.json does not list {', '.join(unlisted)}"
    for name, digest in files.items():
        file = path / name
        if Path(name).name != name or not file.is_file():
            return f"{name} is missing"
        if _sha256(file) != digest:
            return f"{name} does not match its checksum (corrupt or partly written)"
    return None


def _folder_step(path: Path) -> int | None:
    try:
        return int(path.name.removeprefix(STEP_PREFIX))
    except ValueError:
        return None


class NoUsableCheckpoint(Exception):
    """Checkpoints exist but none verifies and loads; `problems` says what is wrong with each."""

    def __init__(self, checkpoint_dir: Path, problems: list[tuple[Path, str]]) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.problems = problems
        listed = "; ".join(f"{p.name}: {why}" for p, why in problems)
        super().__init__(f"every checkpoint in {checkpoint_dir} is corrupt ({listed})")


def load_latest_checkpoint(checkpoint_dir: Path) -> Checkpoint | None:
    """The newest checkpoint that verifies and loads, warning about each newer one that does not;
    None when there is none at all. Raises NoUsableCheckpoint when there are checkpoints and every
    one is corrupt, so that a caller never mistakes that for a fresh run."""
    problems = []
    for path in reversed(list_checkpoints(checkpoint_dir)):
        problem = verify_checkpoint(path)
        if problem is None:
            try:
                return load_checkpoint(path)
            except (OSError, ValueError, KeyError, TypeError, SafetensorError) as err:
                problem = f"cannot be read ({type(err).__name__}: {err})"
        warnings.warn(f"skipping checkpoint {path}: {problem}; trying the previous one", stacklevel=2)
        problems.append((path, problem))
    if problems:
        raise NoUsableCheckpoint(checkpoint_dir, problems)
    return None


def set_aside(checkpoint_dir: Path, paths: list[Path]) -> Path:
    """Move unusable checkpoint folders into ``checkpoint_dir/corrupt/`` (kept for inspection, out
    of the way of new checkpoints of the same steps); return that folder."""
    aside = checkpoint_dir / "corrupt"
    aside.mkdir(exist_ok=True)
    for path in paths:
        target = aside / path.name
        if target.exists():
            shutil.rmtree(target)
        os.replace(path, target)
    return aside


def load_checkpoint(path: Path) -> Checkpoint:
    json_state = json.loads((path / "state.json").read_text())
    step = json_state.pop("step")
    state = {}
    for group, value in json_state.items():
        file = path / f"{group}.safetensors"
        tensors = load_file(file) if file.is_file() else {}
        state[group] = unpack(value, tensors)
    return Checkpoint(step=step, path=path, state=state)


def load_model_weights(model: torch.nn.Module, checkpoint: Checkpoint) -> None:
    """Copy the checkpoint's weights into `model`; every key and shape must match, else a ValueError
    that names the differences (the run's config builds another model than the one saved)."""
    weights = load_file(checkpoint.path / "model.safetensors")
    expected = model.state_dict()
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    reshaped = sorted(k for k in expected.keys() & weights.keys() if expected[k].shape != weights[k].shape)
    if missing or unexpected or reshaped:
        parts = [
            f"{label}: {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}"
            for label, keys in (("missing", missing), ("unexpected", unexpected), ("other shapes", reshaped))
            if keys
        ]
        raise ValueError(
            f"checkpoint {checkpoint.path} holds another model than the config builds ({'; '.join(parts)})"
        )
    model.load_state_dict(weights, strict=True)
