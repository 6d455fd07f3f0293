"""A fellow survives its leader restarting: it reconnects with backoff and is online again, same identity."""

from __future__ import annotations

import pytest
import trio

from harness import wait_until
from swarm.config import Settings
from swarm.fellow import Fellow
from swarm.leader.app import Leader

pytestmark = pytest.mark.e2e  # a real leader and a real fellow over loopback


async def _serve(leader: Leader, port: int, stop: trio.Event, task_status=trio.TASK_STATUS_IGNORED):
    await leader.serve("127.0.0.1", port, shutdown_trigger=stop.wait, task_status=task_status)


def _leader(tmp_path) -> tuple[Leader, Settings, str]:
    """A leader on its first start (port 0, heartbeats every 0.5 s), its settings and its printed join token."""
    settings = Settings.from_env({"SWARM_SERVE_PORT": "0", "SWARM_HEARTBEAT_S": "0.5"})
    leader = Leader(tmp_path / "leader", settings)
    return leader, settings, leader.first_start.join_token


async def test_fellow_rejoins_a_restarted_leader(tmp_path):
    leader, settings, join = _leader(tmp_path)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            stop = trio.Event()
            urls = await nursery.start(_serve, leader, 0, stop)
            port = int(urls[0].rsplit(":", 1)[1])
            fellow = Fellow(leader_url=urls[0], data_dir=tmp_path / "fellow", settings=settings, name="pc-1",
                            join_token=join)
            nursery.start_soon(fellow.run)
            await fellow.connected.wait()
            first_id = fellow.fellow_id
            assert [c.name for c in leader.hub.online.values()] == ["pc-1"]

            stop.set()  # the leader goes away...
            await wait_until(lambda: not fellow.connected.is_set(), 10, message="the fellow did not notice")

            again = Leader(tmp_path / "leader", settings)  # ...and comes back on the same port and data dir
            assert again.first_start is None  # later starts print the URL only
            stop2 = trio.Event()
            await nursery.start(_serve, again, port, stop2)
            await fellow.connected.wait()
            assert fellow.fellow_id == first_id  # the same fellow, known by its key: no join token needed
            assert [c.name for c in again.hub.online.values()] == ["pc-1"]
            stop2.set()
            nursery.cancel_scope.cancel()


async def test_nothing_reaches_a_fellow_before_its_welcome(tmp_path):
    """Once a fellow is online any task may post to it (a ring's link, an unlink); its welcome must still be the first
    message it reads. A leader whose enrolment awaited (the early checks) after putting the fellow online let another
    task's message go first, and the fellow dropped the link and rejoined over and over."""
    leader, settings, join = _leader(tmp_path)
    checks = leader.hub.checks

    async def slow_checks(conns):  # a slow catalogue read: the window in which other tasks run
        await trio.sleep(0.5)
        return await checks(conns)

    leader.hub.checks = slow_checks
    posted = []

    async def post_as_soon_as_online():  # another task with something to tell every online fellow
        while True:
            for conn in list(leader.hub.online.values()):
                if conn.id not in posted:
                    conn.post({"t": "alive"})
                    posted.append(conn.id)
            await trio.sleep(0.01)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            stop = trio.Event()
            urls = await nursery.start(_serve, leader, 0, stop)
            nursery.start_soon(post_as_soon_as_online)
            fellow = Fellow(leader_url=urls[0], data_dir=tmp_path / "fellow", settings=settings, name="pc-1",
                            join_token=join)
            nursery.start_soon(fellow.run)
            await fellow.connected.wait()
            await wait_until(lambda: posted, 5, message="the other task never saw the fellow online")
            await trio.sleep(1.5)  # three heartbeats: still the same link
            assert fellow.connected.is_set()
            assert [c.name for c in leader.hub.online.values()] == ["pc-1"]
            assert len(posted) == 1  # it never had to join again
            stop.set()
            nursery.cancel_scope.cancel()


async def test_a_stall_of_the_process_itself_does_not_drop_the_link(tmp_path):
    """A process whose own loop is held longer than the silence limit (a full collection over a big heap, swap) must
    not blame the other side: what it sent meanwhile waits unread. Both ends used to give the link up (the leader
    'went silent for 4 s', the fellow 'the leader went silent'), and the fellow rejoined -- a load in flight was
    lost."""
    import time

    leader, settings, join = _leader(tmp_path)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            stop = trio.Event()
            urls = await nursery.start(_serve, leader, 0, stop)
            fellow = Fellow(leader_url=urls[0], data_dir=tmp_path / "fellow", settings=settings, name="pc-1",
                            join_token=join)
            nursery.start_soon(fellow.run)
            await fellow.connected.wait()
            await trio.sleep(1.5)
            [conn] = leader.hub.online.values()
            time.sleep(6)  # the one loop both run in is held: neither side reads or writes (SILENT_S is 4 s)
            await trio.sleep(4)  # every watch has looked again
            assert fellow.connected.is_set()
            assert list(leader.hub.online.values()) == [conn]  # the same link: nobody was dropped or rejoined
            stop.set()
            nursery.cancel_scope.cancel()
