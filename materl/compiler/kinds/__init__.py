"""Every op kind the compiler knows, one module per family, registered here (explicitly: the
``SPECS`` of each module go into ``materl.compiler.spec.OPS``). A new op kind is a module with
its ``OpSpec`` (role, outputs, implementations and their rules), one entry below, and a test."""

from materl.compiler.kinds import (
    advantages,
    agents,
    custom,
    distill,
    forward,
    judge,
    losses,
    principles,
    rewards,
    rollout,
    self_play,
)
from materl.compiler.spec import OPS

SPECS = (*rollout.SPECS, *custom.SPECS, *rewards.SPECS, *advantages.SPECS, *forward.SPECS, *losses.SPECS,
         *agents.SPECS, *judge.SPECS, *distill.SPECS, *principles.SPECS, *self_play.SPECS)

for _spec in SPECS:
    OPS.register(_spec.kind, _spec)
