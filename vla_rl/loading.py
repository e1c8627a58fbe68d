"""Loading a robot policy directory: `load(path)`, whatever kind of policy it holds.

Two kinds of directory are read, told apart by config.json (`is_lerobot_policy_dir`): our `VLAPolicy`
(`vla_rl.policy`; config.json and model.safetensors, as `VLAPolicy.save_pretrained` writes them) and a
LeRobot (>= 0.4) policy with its pre/post-processors (`vla_rl.lerobot_policy`), whose config.json
names the policy `type` ("act", "diffusion", "smolvla", ...), which VLAPolicy's lacks. Each kind is
read by its class's own `from_pretrained`, from local files only.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vla_rl.lerobot_policy import LeRobotPolicy
from vla_rl.policy import VLAPolicy


def load(path: str | Path, *, device: str | torch.device = "cpu") -> VLAPolicy | LeRobotPolicy:
    """The policy in the directory `path` on `device`: a LeRobot policy with its processors, or else a
    VLAPolicy. A directory that holds neither is a ConfigError (or FileNotFoundError) of the VLAPolicy
    reader that says what was found and what is expected."""
    if is_lerobot_policy_dir(path):
        return LeRobotPolicy.from_pretrained(path, device)
    return VLAPolicy.from_pretrained(path, device)


def is_lerobot_policy_dir(path: str | Path) -> bool:
    """Whether `path` holds a LeRobot policy: its config.json names the policy `type`."""
    config = Path(path) / "config.json"
    try:
        return isinstance(json.loads(config.read_text()).get("type"), str)
    except (OSError, ValueError, AttributeError):
        return False
