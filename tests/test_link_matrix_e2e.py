"""Links are measured (issue 37): a leader and three fellows on loopback; soon after they join, each fellow measures
round-trip time and throughput to the two others over a direct link, as a ring hop would dial it, and the admin API
gives the matrix. A fellow whose serving port cannot be reached is measured over the leader's relay, the path its ring
hops would take then, at a cost of a few KB a pair."""

from __future__ import annotations

import pytest
import trio

from harness import running_swarm, wait_until

pytestmark = pytest.mark.e2e


async def test_fellows_measure_their_links_and_the_admin_api_gives_the_matrix(tmp_path):
    with trio.fail_after(120):
        async with running_swarm(tmp_path, [], fellows=3) as swarm:
            matrix = swarm.leader.serving.link_matrix
            ids = sorted(swarm.leader.hub.online)
            pairs = {(a, b) for a in ids for b in ids if a != b}
            await wait_until(lambda: set(matrix.links) >= pairs, 30, message=lambda: matrix.links)

            view = (await swarm.http.get("/api/v1/links")).json()
            assert [f["id"] for f in view["fellows"]] == ids
            assert {(link["from_id"], link["to_id"]) for link in view["links"]} == pairs
            for link in view["links"]:
                assert link["path"] == "direct" and link["error"] is None, link
                assert 0 < link["rtt_ms"] < 1000 and link["mbps"] > 0, link

            # fellow-2's serving port closes: the others' next probe of it goes over the relay, measured, and says
            # why; fellow-2's own probes still go direct
            victim = swarm.fellows[2]
            conn = swarm.leader.hub.online[victim.fellow_id]
            conn.serve_port = 1  # nothing listens there
            before = {k: v["at"] for k, v in matrix.links.items()}
            relayed_before = swarm.leader.relay.bytes_forwarded
            matrix.probe_all()
            await wait_until(lambda: all(matrix.links[p]["at"] > before[p] for p in pairs), 30)
            to_victim = [(a, victim.fellow_id) for a in ids if a != victim.fellow_id]
            for pair in pairs:
                link = matrix.links[pair]
                if pair in to_victim:
                    assert link["path"] == "relay" and link["error"] is None, link
                    assert "direct link failed" in link["note"] and 0 < link["rtt_ms"] < 1000 and link["mbps"] > 0
                else:
                    assert link["path"] == "direct" and link["note"] is None, link
            # the two relayed probes cost a few KB each through the leader (payloads, Noise and framing)
            relayed = swarm.leader.relay.bytes_forwarded - relayed_before
            assert 2 * 2 * 4288 <= relayed < 2 * 12_000, relayed

            # only admins read it
            user = swarm.leader.store.create_user("bob", "a long enough password", False)
            token, _ = swarm.leader.store.create_api_token(user.id, "t")
            refused = await swarm.http.get("/api/v1/links", headers={"authorization": f"Bearer {token}"})
            assert refused.status_code == 403
