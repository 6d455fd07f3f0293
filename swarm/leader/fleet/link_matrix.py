"""The links between a pool's fellows, measured (issue 37): every PROBE_EVERY_S, and soon after a fellow joins, the
leader asks each online fellow to measure round-trip time and throughput to the other fellows of its pool over the
path a ring hop would take (swarm.fellow.link_probe): the direct link, else the relay, for which it opens one relay
channel per ordered pair and round (closed at the next round). It keeps the latest figures of each ordered pair for the
admin page's matrix (GET /api/v1/links). A probe costs about 10 KB a pair, whichever the path (measured through the
relay: 8.5-12 KB a pair, tests/test_link_matrix_e2e.py): some 10 KB a minute per pair."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from swarm import control_links as cl
from swarm.leader.planning.link_placement import link_hops
from swarm.leader.planning.planner import Hop

if TYPE_CHECKING:
    from swarm.leader.serving.serving import Serving

log = logging.getLogger(__name__)

PROBE_EVERY_S = 60.0
# A pair's round trip is the least of its latest rounds over the same path (and its throughput the most): a probe that
# meets a fellow busy loading a model or a machine under load reads high, while a link is never faster than it is;
# one slow round must not leave a fellow out of a ring (the estimator TCP's and BBR's min-RTT filters use).
WINDOW_ROUNDS = 5
JOIN_SETTLE_S = 2.0  # after a fellow joins, the next probe waits this long for others joining with it


class LinkMatrix:
    def __init__(self, serving: Serving):
        self.serving = serving
        self.links: dict[tuple[int, int], dict] = {}  # (from fellow id, to fellow id) -> its latest figures
        self._wake = trio.Event()
        self._round = 0
        self._relay_channels: list[str] = []  # the relay channels of the latest round's probes

    def fleet_changed(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        """Probe now and then, for as long as the leader serves."""
        while True:
            with trio.move_on_after(PROBE_EVERY_S):
                await self._wake.wait()
                await trio.sleep(JOIN_SETTLE_S)
            self._wake = trio.Event()
            self.probe_all()

    def probe_all(self) -> None:
        """Ask each online fellow to measure its links to the other online fellows of its pool."""
        online = self.serving.hub.online if self.serving.hub is not None else {}
        direct_ok = self.serving.settings.pipeline_transport != "relay"
        relay = self.serving.relay
        for hop_id in self._relay_channels:
            relay.close_channel(hop_id)
        self._relay_channels = []
        self._round += 1
        fellows = list(online.values())
        for conn in fellows:
            peers, listen = [], []
            for peer in fellows:
                if peer.id == conn.id or peer.pool_id != conn.pool_id:
                    continue
                probe_id = f"{self._round}-{conn.id}-{peer.id}"
                relay_id = f"probe-{probe_id}"  # conn dials it, peer listens
                relay.open_channel(relay_id, conn.id, peer.id)
                self._relay_channels.append(relay_id)
                peers.append(cl.ProbePeer(peer.id, peer.name, peer.public_key, probe_id,
                                          [peer.serve_host, peer.serve_port]
                                          if direct_ok and peer.serve_host and peer.serve_port else None, relay_id))
                listen.append(cl.ProbeListen(f"probe-{self._round}-{peer.id}-{conn.id}", peer.public_key))
            if peers:
                conn.post(cl.ProbeLinks(peers, listen))

    def on_report(self, conn, message: cl.LinkReport) -> None:
        """A fellow's ``link_report``: its figures to each peer it measured (only peers of its pool are kept)."""
        online = self.serving.hub.online if self.serving.hub is not None else {}
        for link in message.links:
            peer = online.get(link.fellow_id)
            if peer is None or peer.id == conn.id or peer.pool_id != conn.pool_id:
                continue
            path = link.path if link.path in ("direct", "relay") else "relay"
            rtt, mbps = _number(link.rtt_ms), _number(link.mbps)
            before = self.links.get((conn.id, peer.id)) or {}
            # a failed probe, or a change of path, starts the window afresh
            recent = list(before.get("recent", [])) if before.get("path") == path and rtt is not None else []
            if rtt is not None:
                recent = [*recent, (rtt, mbps)][-WINDOW_ROUNDS:]
            rtts = [r for r, _ in recent]
            rates = [m for _, m in recent if m is not None]
            self.links[(conn.id, peer.id)] = {
                "path": path, "rtt_ms": min(rtts) if rtts else None, "mbps": max(rates) if rates else None,
                "last_rtt_ms": rtt, "rounds": len(recent), "recent": recent,
                "error": link.error[:200] if link.error else None,
                "note": link.note[:200] if link.note else None, "at": trio.current_time()}

    def hops(self) -> dict[tuple[int, int], Hop]:
        """What placement and the planner know of each pair of fellows: the hops of rings serving now, as their
        fellows report them (the path the ring really takes), else the latest probe's figures."""
        known = link_hops(self.links)
        for model in self.serving.models.values():
            n = len(model.stages)
            for i, hop_id in enumerate(model.hop_ids[:n]):
                stats = self.serving.hop_stats.get(hop_id) or {}
                rtt = stats.get("rtt_ms")
                if isinstance(rtt, (int, float)) and rtt > 0:
                    pair = (model.stages[i].plan.fellow_id, model.stages[(i + 1) % n].plan.fellow_id)
                    probed = known.get(pair) or known.get((pair[1], pair[0]))
                    known[pair] = Hop(float(rtt), True, stats.get("transport"), probed.bytes_per_s if probed else None)
        return known

    def view(self) -> dict:
        """The matrix for the admin page: the online fellows, and each measured pair between them."""
        online = self.serving.hub.online if self.serving.hub is not None else {}
        now = trio.current_time()
        fellows = [{"id": c.id, "name": c.name, "pool_id": c.pool_id} for c in sorted(online.values(),
                                                                                     key=lambda c: c.id)]
        hidden = ("at", "recent")
        links = [{"from_id": a, "to_id": b, "from": online[a].name, "to": online[b].name,
                  **{k: v for k, v in figures.items() if k not in hidden}, "age_s": round(now - figures["at"], 1)}
                 for (a, b), figures in sorted(self.links.items()) if a in online and b in online]
        return {"fellows": fellows, "links": links, "probe_every_s": PROBE_EVERY_S}


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
