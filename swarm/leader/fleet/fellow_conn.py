"""One enrolled fellow as the leader sees it: what its hello said, its control link's outbox, its latest heartbeat."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import trio

from swarm import __version__, wire
from swarm.messages import Hardware
from swarm.tunnel.channel import NoiseChannel
from swarm.tunnel.keys import fingerprint

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class FellowConn:
    id: int
    name: str
    public_key: bytes
    pool_id: int
    hardware: Hardware
    serve_host: str | None
    serve_port: int | None
    version: str
    channel: NoiseChannel
    last_heartbeat: float
    standby: bool = False  # left alone by plain loads: it takes over stages of fellows that drop out
    protocol: int = wire.PROTOCOL_VERSION  # the wire protocol it speaks (its hello's "v")
    updates: bool = False  # it installs the leader's version when told to (`swarm update`), and restarts itself
    drafting: bool = False  # its stages run and verify guessed tokens (drafting ahead; its hello says so)
    draft_model: bool = False  # its last stage can hold a draft model (SWARM_SERVE_DRAFT_MODEL; its hello says so)
    prefix_cache: bool = False  # its stages carry out prefix cache plans, replies' blocks included (its hello says so)
    narrowing: bool = False  # a link may narrow its stage to a sub-range of its layers (its hello says so)
    extending: bool = False  # it loads what its stage lacks beside it, spliced in at a link (its hello says so)
    kv_extension: bool = False  # it holds a KV handover's rows of the layers its stage lacks with those parts (hello)
    update_error: str | None = None  # why its last update failed, as it said
    disk_free_bytes: int | None = None  # free disk where it caches model files, as its hello said
    calibration: dict | None = None  # how fast it runs a decoder layer, as its hello or heartbeat said (planner)
    held: dict = dataclasses.field(default_factory=dict)  # model -> {"requests", "caches"} its stage holds
    last_seen: float = 0.0  # when anything last arrived from it
    credential: str = ""  # this connection's node credential (file downloads, relay); never logged
    malformed: int = 0  # messages skipped as malformed
    touched_at: float = -math.inf  # when its last_seen_at was last written to the database
    # Messages to the fellow wait here for the connection's writer task, so whoever posts one -- the loop reading
    # another fellow's link, a client's request -- never waits on this fellow's network.
    outbox: trio.MemorySendChannel = dataclasses.field(init=False, repr=False)
    _outbox_reader: trio.MemoryReceiveChannel = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.outbox, self._outbox_reader = trio.open_memory_channel(math.inf)

    def post(self, message: Any) -> None:
        """Queue a message for the fellow; it goes out in order. A closed connection drops it."""
        try:
            self.outbox.send_nowait(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            log.debug("dropped a message for %s: its link is closed", self.name)

    async def write_outbox(self) -> None:
        async for message in self._outbox_reader:
            await self.channel.send(wire.encode(message))

    @property
    def compatible(self) -> bool:
        """Whether it reads this leader's messages: only such a fellow is given a stage, a cover or a link."""
        return self.protocol == wire.PROTOCOL_VERSION

    @property
    def outdated(self) -> bool:
        """Whether it runs another version of swarm than the leader (the admin page marks it)."""
        return not self.compatible or self.version != __version__

    def why_incompatible(self) -> str:
        return (f"{self.name} runs swarm {self.version} (protocol {self.protocol}); this leader needs protocol "
                f"{wire.PROTOCOL_VERSION} — run swarm update on {self.name}.")

    def summary(self) -> dict:
        return {
            "id": self.id,
            "name": self.name,
            "fingerprint": fingerprint(self.public_key),
            "state": "online",
            "hardware": self.hardware.to_wire(),
            "hardware_text": self.hardware.describe(),
            "serve": {"host": self.serve_host, "port": self.serve_port},
            "version": self.version,
            "protocol": self.protocol,
            "outdated": self.outdated,
            "update_error": self.update_error,
            "standby": self.standby,
            "held": self.held,
        }
