"""Several models in one pool: the memory each fellow has left beside the models it holds, and loading a model a
request asks for (auto-load), making room for it by unloading the least recently used idle model where the admin
allows it (evict idle).

Room. A fellow's memory for serving is what it reports free plus what its loaded stages' weights hold (its
heartbeat's ``placement``): about constant while models come and go. From that the leader takes what every stage it
placed there needs (weights, KV budget, working memory: StagePlan.need_bytes) -- stages still loading included, whose
memory the fellow does not report yet -- so models placed one after the other fit together.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from swarm.errors import ModelNotLoaded, PlacementError
from swarm.leader.planning.placement import GB, FellowCapacity
from swarm.leader.serving.models import ModelStatus

if TYPE_CHECKING:
    from swarm.leader.serving.models import ModelServing
    from swarm.leader.serving.serving import Serving

log = logging.getLogger(__name__)

AUTO_LOAD = "auto_load"  # store settings the admin page writes; unset: SWARM_SERVE_AUTO_LOAD ...
EVICT_IDLE = "evict_idle"  # ... and SWARM_SERVE_EVICT_IDLE


def room(serving: Serving, fellows: list, releasing: frozenset[str] = frozenset()) -> list[FellowCapacity]:
    """Each of ``fellows`` (FellowConns) with the memory it has for one more stage: its memory for serving less what
    the stages the leader placed on it need, leaving out the models in ``releasing`` (about to be unloaded)."""
    device = serving.settings.device
    out = []
    for f in fellows:
        held = sum(int(p.get("bytes") or 0) for p in serving.placements.get(f.id, {}).values()
                   if isinstance(p, dict))
        placed = sum(s.plan.need_bytes for m in serving.models.values()
                     if m.name not in releasing and m.status != ModelStatus.FAILED for s in m.stages
                     if f.id in (s.plan.fellow_id, s.cover))  # a hot cover holds a copy of its stage
        reported = f.hardware.serving_free_bytes(device)
        free = reported + held - placed if placed else reported  # nothing placed: as it reports
        out.append(FellowCapacity(f.id, f.name, max(0, free)))
    return out


class AutoLoad:
    """Loads the model a request asks for when it is imported but not loaded (SWARM_SERVE_AUTO_LOAD, or the admin
    page's switch), one load at a time, unloading idle models first when the pool has no room and that is allowed
    (SWARM_SERVE_EVICT_IDLE)."""

    def __init__(self, serving: Serving):
        self.serving = serving
        self.last_used: dict[str, float] = {}  # model -> when a request last asked for it (trio clock)
        self._lock = trio.Lock()

    def touch(self, name: str) -> None:
        self.last_used[name] = trio.current_time()

    async def switches(self) -> dict[str, bool]:
        store, settings = self.serving.store, self.serving.settings

        def read() -> dict[str, bool]:
            return {"auto_load": bool(store.get_setting(AUTO_LOAD, settings.serve_auto_load)),
                    "evict_idle": bool(store.get_setting(EVICT_IDLE, settings.serve_evict_idle))}

        return await trio.to_thread.run_sync(read)

    async def set_switches(self, changes: dict[str, bool]) -> dict[str, bool]:
        store = self.serving.store
        keys = {"auto_load": AUTO_LOAD, "evict_idle": EVICT_IDLE}

        def write() -> None:
            for name, value in changes.items():
                store.set_setting(keys[name], value)

        await trio.to_thread.run_sync(write)
        return await self.switches()

    async def comes_back(self, name: str) -> bool:
        """Whether a request for ``name``, not loaded, loads it: it went idle, or auto-load is on."""
        return name in self.serving.reload_on_request or (await self.switches())["auto_load"]

    async def ensure(self, name: str) -> ModelServing | None:
        """The serving model ``name``, loading it for a request when it is not loaded and comes back (None when it
        does not). ModelNotLoaded, saying what to unload, when the pool has no room for it and no idle model may go."""
        serving = self.serving
        self.touch(name)
        async with self._lock:  # two requests for one model load it once; evictions are decided one at a time
            current = serving.models.get(name)
            if current is not None:
                return current
            if not await self.comes_back(name):
                return None
            row = await serving.model_row(name)
            why = "it was unloaded while idle" if name in serving.reload_on_request else "auto-load is on"
            # its own context, read from its config: what placement budgets KV for
            await serving.contexts.context_of(name)
            try:
                serving.loader.placement(name, row.manifest, None, None, serving.loader.kind_of(name, row.manifest),
                                  row.pool_id)
            except PlacementError as exc:
                await self._make_room(name, row, exc)
            log.info("loading %s for a request (%s)", name, why)
            return await serving.loader.load(name)

    def idle_models(self, pool_id: int | None, but: str) -> list[str]:
        """The pool's ready models that no request runs on or waits for, least recently used first."""
        serving = self.serving
        idle = [m.name for m in serving.models.values()
                if m.name != but and m.pool_id == pool_id and m.status == ModelStatus.READY
                and not serving.book.of_model(m.name) and not serving.book.queued(m.name)]
        return sorted(idle, key=lambda n: self.last_used.get(n, 0.0))

    async def _make_room(self, name: str, row, refused: PlacementError) -> None:
        """Unload the fewest least-recently-used idle models that make ``name`` fit, when evict idle is on; else
        ModelNotLoaded saying what happened, what is needed and what to do."""
        serving = self.serving
        idle = self.idle_models(row.pool_id, name)
        evict = (await self.switches())["evict_idle"]
        if evict:
            for n in range(1, len(idle) + 1):
                going = frozenset(idle[:n])
                try:
                    serving.loader.placement(name, row.manifest, None, None, serving.loader.kind_of(name, row.manifest),
                                      row.pool_id, releasing=going)
                except PlacementError:
                    continue
                for victim in idle[:n]:
                    log.info("unloading %s, idle, to make room for %s (evict idle is on)", victim, name)
                    await serving.loader.unload(victim, reason=f"model {victim} was unloaded to make room for {name}")
                    serving.reload_on_request.add(victim)  # a request for it loads it again
                return
        raise ModelNotLoaded(self.no_room(name, row.pool_id, refused, idle, evict))

    def no_room(self, name: str, pool_id: int | None, refused: PlacementError, idle: list[str], evict: bool) -> str:
        serving = self.serving
        loaded = [m for m in serving.models.values() if m.pool_id == pool_id and m.status != ModelStatus.FAILED]
        if not loaded:  # no other model takes the room: the pool is too small (or has no fellow online)
            return f"model {name} is not loaded, and loading it for this request failed: {refused}"
        held = "; ".join(f"{m.name} ({sum(s.plan.need_bytes for s in m.stages) / GB:.1f} GB, "
                         f"{'idle' if m.name in idle else m.status if m.status != 'ready' else 'in use'})"
                         for m in loaded)
        if idle and evict:
            hint = ("Unloading every idle model would not make room either. Unload a model in use or serve on more "
                    "fellows, then send the request again.")
        elif idle:
            hint = (f"Unload {idle[0]} (swarm model-unload {idle[0]}, or Unload on the chat page) and send the "
                    "request again, or turn on Evict idle models on the admin page to let the leader do it.")
        else:
            hint = ("Every model there is in use: unload one when it is done, or add a fellow, then send the "
                    "request again.")
        return (f"model {name} is not loaded, and the pool has no room to load it: {refused} Loaded there: {held}. "
                f"{hint}")
