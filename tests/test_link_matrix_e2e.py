"""Links are measured (issue 37): a leader and three fellows on loopback; soon after they join, each fellow measures
round-trip time and throughput to the two others over a direct link, as a ring hop would dial it, and the admin API
gives the matrix. A fellow whose serving port cannot be reached is reported as failing over to the relay."""

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

            # fellow-2's serving port closes: the others' next probe of it fails, and says so
            victim = swarm.fellows[2]
            conn = swarm.leader.hub.online[victim.fellow_id]
            conn.serve_port = 1  # nothing listens there
            before = {k: v["at"] for k, v in matrix.links.items()}
            matrix.probe_all()
            to_victim = [(a, victim.fellow_id) for a in ids if a != victim.fellow_id]
            await wait_until(lambda: all(matrix.links[p]["at"] > before[p] for p in to_victim), 30)
            for pair in to_victim:
                link = matrix.links[pair]
                assert link["path"] == "relay" and link["rtt_ms"] is None and "direct link failed" in link["error"]

            # only admins read it
            user = swarm.leader.store.create_user("bob", "a long enough password", False)
            token, _ = swarm.leader.store.create_api_token(user.id, "t")
            refused = await swarm.http.get("/api/v1/links", headers={"authorization": f"Bearer {token}"})
            assert refused.status_code == 403
