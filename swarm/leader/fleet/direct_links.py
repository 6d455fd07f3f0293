"""The leader's side of direct links: for each hop not already on a direct TCP link, gather both ends' UDP
candidates and tell both to punch at the same moment; try again later when it fails or the tunnel is lost.

Off unless an admin turned Direct links on (swarm admin direct-links on); SWARM_PIPELINE_TRANSPORT=relay on the
leader keeps every hop on the relay whatever the switch says.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

import trio

from swarm import control_links as cl
from swarm import wire
from swarm.errors import SwarmError
from swarm.leader.serving.models import ModelStatus

log = logging.getLogger(__name__)


DIRECT_LINKS = "direct_links"  # the store setting the admin page and `swarm admin direct-links` write
CANDIDATES_TIMEOUT_S = 15.0  # a fellow's rendezvous takes at most ~2 s; opening its hop first may take a relay wait
RESULT_TIMEOUT_S = 30.0  # punch (8 s) + QUIC handshake + Noise, with room for slow links
START_IN_S = 0.5  # how far ahead the common start is: well over a control message's one-way trip
RETRY_S = (10.0, 30.0, 60.0, 120.0)  # after a failed attempt; NATs rarely change, so back off
WATCH_S = 5.0  # how often a hop on the tunnel is checked for having fallen back


class DirectLinkCoordinator:
    def __init__(self, store, serving):
        self.store = store
        self.serving = serving
        self.rendezvous_port: int | None = None
        self.tokens: dict[bytes, int] = {}  # rendezvous "who" token -> fellow id
        # (hop, role, reply) -> (the fellow asked, where its answer goes)
        self._waiting: dict[tuple[str, str, str], tuple[int, trio.MemorySendChannel]] = {}
        self._active: set[str] = set()  # hops with a coordination loop running

    def allow(self, who: bytes) -> bool:
        return who in self.tokens

    async def enabled(self) -> bool:
        if self.serving.settings.pipeline_transport == "relay" or self.rendezvous_port is None:
            return False
        return bool(await trio.to_thread.run_sync(self.store.get_setting, DIRECT_LINKS, False))

    async def start(self, model) -> None:
        if not await self.enabled():
            return
        for i, hop_id in enumerate(model.hop_ids):
            if hop_id not in self._active:
                self._active.add(hop_id)
                self.serving.start_task(self._hop_loop, model, i, hop_id, model.ring_id)

    async def start_all(self) -> None:
        """Direct links were just turned on: look for better paths for every model already serving."""
        for model in list(self.serving.models.values()):
            if model.status == ModelStatus.READY and model.hop_ids:
                await self.start(model)

    def on_message(self, conn, message: cl.PunchAnswer) -> None:
        key = (message.hop_id, message.role, wire.type_of(message))
        waiting = self._waiting.get(key)
        if waiting is None:
            return
        fellow_id, channel = waiting
        if conn.id == fellow_id:  # only the fellow asked answers: another cannot steer this hop's punch
            try:
                channel.send_nowait(message)
            except (trio.WouldBlock, trio.BrokenResourceError):
                # the hop's punch gave up waiting (or is full): the answer is moot
                pass

    def _current(self, model, ring_id: str | None) -> bool:
        """Whether the ring generation a hop loop works for is still the one serving (not unloaded, not rebuilt)."""
        live = self.serving.models.get(model.name)
        return live is model and model.status == ModelStatus.READY and model.ring_id == ring_id

    async def _hop_loop(self, model, i: int, hop_id: str, ring_id: str | None) -> None:
        try:
            await self._hop_attempts(model, i, hop_id, ring_id)
        finally:
            self._active.discard(hop_id)

    async def _hop_attempts(self, model, i: int, hop_id: str, ring_id: str | None) -> None:
        failures = 0
        while self._current(model, ring_id) and await self.enabled():
            try:
                outcome = await self._attempt(model, i)
            except* SwarmError as group:  # both ends are asked at once: a nursery's group, or a plain failure
                outcome = "failed: " + "; ".join(str(exc) for exc in group.exceptions)
            log.info("hop %s (stage %d -> %d) of %s: %s", hop_id, i, (i + 1) % len(model.stages), model.name,
                     outcome)
            if outcome in ("direct", "tunnel"):
                failures = 0
                # Stay while the hop keeps that path; a tunnel that went silent falls back to the relay.
                while self._current(model, ring_id):
                    await trio.sleep(WATCH_S)
                    if self.serving.hop_stats.get(hop_id, {}).get("transport") == "relay":
                        break
                continue
            await trio.sleep(RETRY_S[min(failures, len(RETRY_S) - 1)])
            failures += 1

    async def _ask(self, fellow_id: int, message: Any, reply: str, role: str, timeout: float) -> Any:
        conn = self.serving.hub.online.get(fellow_id)
        if conn is None:
            raise SwarmError("a fellow of the hop is offline")
        key = (message.hop_id, role, reply)
        send, receive = trio.open_memory_channel(1)
        self._waiting[key] = (fellow_id, send)
        try:
            conn.post(message)
            with trio.fail_after(timeout):
                return await receive.receive()
        except trio.TooSlowError:
            raise SwarmError(f"no {reply} from {conn.name} within {timeout:.0f} s") from None
        finally:
            self._waiting.pop(key, None)

    async def _round_trip(self, fellow_id: int, hop_id: str, role: str) -> float:
        """The control link's round trip to a fellow, in seconds (the best of three pings)."""
        best = float("inf")
        for _ in range(3):
            started = trio.current_time()
            await self._ask(fellow_id, cl.PunchPing(hop_id, role), wire.type_of(cl.PunchPong), role, 5.0)
            best = min(best, trio.current_time() - started)
        return best

    async def _attempt(self, model, i: int) -> str:
        n = len(model.stages)
        hop_id = model.hop_ids[i]
        ends = {"a": model.stages[i].plan.fellow_id, "b": model.stages[(i + 1) % n].plan.fellow_id}
        candidates = {}
        tokens = []
        try:
            for role in ("a", "b"):
                who = secrets.token_urlsafe(16)
                self.tokens[who.encode()] = ends[role]
                tokens.append(who.encode())
                assert self.rendezvous_port is not None  # no attempt starts without it (enabled)
                prepare = cl.PunchPrepare(model.name, hop_id, role, who, self.rendezvous_port)
                answer = await self._ask(ends[role], prepare, wire.type_of(cl.PunchCandidates), role,
                                         CANDIDATES_TIMEOUT_S)
                if answer.skip:
                    return answer.skip
                candidates[role] = answer.candidates
        finally:
            for token in tokens:
                self.tokens.pop(token, None)
        secret = secrets.token_bytes(32)
        # A common moment: each start message is on its way for about half that fellow's round trip, so each
        # fellow is told to wait that much less and both begin together (what matters with masquerading NATs, see
        # swarm.mesh.hole_punch).
        rtt = {role: await self._round_trip(ends[role], hop_id, role) for role in ("a", "b")}
        results = {}

        async def run(role: str, other: str) -> None:
            results[role] = await self._ask(ends[role], cl.PunchStart(
                model.name, hop_id, role, secret, candidates[other], max(0.05, START_IN_S - rtt[role] / 2)),
                wire.type_of(cl.PunchResult), role, RESULT_TIMEOUT_S)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "a", "b")
            nursery.start_soon(run, "b", "a")
        if results["a"].ok and results["b"].ok:
            return "tunnel"
        return "failed: " + "; ".join(str(r.message) for r in results.values() if not r.ok)
