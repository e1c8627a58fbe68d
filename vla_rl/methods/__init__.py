"""The robot trainer's update rules, peers behind one interface (`interface.MethodUpdate`): `UPDATES`
maps the config's `method` to its update. habc (`habc`), awr, bc and dagger (`buffer`) learn from the
whole replay buffer through one update (critics on the method's targets, then weighted chunk
regression); grpo (`grpo`) from each iteration's own episodes."""

from vla_rl.methods.buffer import AWR, DAGGER, ONLINE_BC
from vla_rl.methods.grpo import GRPO
from vla_rl.methods.habc import HABC
from vla_rl.methods.interface import MethodUpdate

UPDATES: dict[str, MethodUpdate] = {"habc": HABC, "awr": AWR, "bc": ONLINE_BC, "dagger": DAGGER, "grpo": GRPO}
