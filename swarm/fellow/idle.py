"""When a stage may unload as idle (SWARM_MODEL_IDLE_UNLOAD_S): a pure rule over the stage's clocks, so its timing
is tested without a ring.

A model is idle only once it has been ready -- every stage loaded and linked, which the leader tells each stage with
``ring_ready`` -- and nobody has used it for the limit since. The idle clock starts at that moment and restarts with
every message a request brings the stage (a later stage sees the hidden states of every chat). A stage whose ring is
not ready is never idle: the model is still loading (its other stages are not loaded or linked yet), or recovering (the
leader unlinked it until a lost stage is replaced), or the stage is a hot cover waiting to take over. Unloading one
then would fail the load or the recovery for every stage, as a model loading for longer than the limit once did.
"""

from __future__ import annotations


def idle_seconds(now: float, *, ready_since: float | None, last_used: float, busy: bool) -> float:
    """How long the stage has been idle at ``now``: 0 while its ring is not ready or it holds a request."""
    if ready_since is None or busy:
        return 0.0
    return max(0.0, now - max(ready_since, last_used))


def unload_due(now: float, *, limit: float, ready_since: float | None, last_used: float, busy: bool) -> bool:
    """Whether the stage should unload as idle now (``limit`` <= 0: never, SWARM_MODEL_IDLE_UNLOAD_S=0)."""
    return limit > 0 and idle_seconds(now, ready_since=ready_since, last_used=last_used, busy=busy) >= limit
