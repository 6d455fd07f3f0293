"""A fellow that leaves hands its stages over first: real `swarm leader` and `swarm join` processes, one fleet for
the module, a streamed reply running through the leaving fellow's stage.

- SIGTERM of the fellow's process, no hot cover: the standby loads the stage while the old one serves, the ring
  switches, the reply is the uninterrupted one and pauses only for the switch;
- `swarm leave` with a hot cover: the ring switches at once, the longest gap under 0.5 s;
- no fellow to take a stage: `swarm leave` and the admin API's Drain refuse, saying why; `--force` leaves with
  failover, and the stage is loaded again once a fellow joins.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from fleet import FellowProcess, Pool, logs
from harness import wait_for

pytestmark = pytest.mark.e2e

PROMPT = [{"role": "user", "content": "List the numbers from 1 to 80, separated by commas."}]  # no near-tie
TOKENS = 100
HOT_COVER_GAP_S = 0.5  # the promise for a drain with a hot cover


@pytest.fixture(scope="module")
def pool(module_tmp, smollm_model_dir):
    """A leader and three fellows, the model over fellow-0 and fellow-1, fellow-2 a standby."""
    pool = Pool(module_tmp("drain"), smollm_model_dir, count=3, fellow_env={"SWARM_CALIBRATE": "0"})
    try:
        ids = {f["name"]: f["id"] for f in pool.online()}
        assert pool.http.put(f"/api/v1/fellows/{ids['fellow-2']}", json={"standby": True}).status_code == 200
        began = time.monotonic()
        pool.load(2)
        print(f"loaded in {time.monotonic() - began:.1f} s")
        yield pool
    finally:
        pool.stop()


@pytest.fixture
def fleet(pool, process_logs):
    process_logs(pool.logs)
    return pool


@pytest.fixture(scope="module")
def uninterrupted(pool):
    """The reply with nobody leaving, and its longest gap between two chunks."""
    began = time.monotonic()
    text, arrivals = stream(pool)
    print(f"uninterrupted: {len(arrivals)} chunks in {time.monotonic() - began:.1f} s, longest gap "
          f"{longest_gap(arrivals):.2f} s")
    return text, longest_gap(arrivals)


def stream(pool: Pool, act=None, at: int = 15) -> tuple[str, list[float]]:
    """Stream the prompt's reply; after ``at`` chunks run ``act()`` (once). -> (text, each chunk's arrival time)."""
    body = {"model": pool.name, "messages": PROMPT, "temperature": 0, "max_tokens": TOKENS, "stream": True}
    text, arrivals = [], []
    with pool.http.stream("POST", "/v1/chat/completions", json=body, timeout=300) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            assert "error" not in data, data
            delta = data["choices"][0]["delta"].get("content")
            if delta:
                text.append(delta)
                arrivals.append(time.monotonic())
                if act is not None and len(arrivals) == at:
                    act()
    return "".join(text), arrivals


def longest_gap(arrivals: list[float], after: int = 1) -> float:
    return max(b - a for a, b in zip(arrivals[after - 1:], arrivals[after:]))


def stages(pool: Pool) -> list[dict]:
    return pool.http.get(f"/api/v1/models/{pool.name}").json()["stages"]


def by_name(pool: Pool, name: str) -> FellowProcess:
    return next(f for f in pool.fellows if f.name == name)


def leave(fellow: FellowProcess, *extra: str) -> subprocess.Popen:
    """`swarm leave` on ``fellow``'s machine (its data dir)."""
    return subprocess.Popen([sys.executable, "-m", "swarm", "leave", "--data-dir", str(fellow.data_dir), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=fellow.env)


def test_sigterm_hands_the_stage_to_the_standby_while_the_reply_streams(fleet, uninterrupted):
    want, baseline_gap = uninterrupted
    leaving = by_name(fleet, stages(fleet)[1]["fellow"])
    signalled = {}

    def sigterm():
        signalled["at"] = time.monotonic()
        leaving.proc.send_signal(signal.SIGTERM)

    text, arrivals = stream(fleet, sigterm)
    assert text == want  # no token lost, none repeated: the reply of an uninterrupted run
    assert leaving.proc.wait(60) == 0, leaving.log()
    assert "handed over stage 1" in leaving.log(), leaving.log()
    now = stages(fleet)
    assert now[1]["fellow"] == "fellow-2" and fleet.status() == "ready", now
    gap = longest_gap(arrivals)
    switched = float(wait_for(lambda: _switch_ms(fleet), 10, message=fleet.leader.log)) / 1000
    load_s = time.monotonic() - signalled["at"]  # an upper bound of the load; the switch came after it
    print(f"drain without hot cover: longest gap {gap:.2f} s (uninterrupted {baseline_gap:.2f} s), switch "
          f"{switched:.2f} s")
    # the old stage served while the new one loaded: the pause is the switch's, far below the load's seconds
    assert gap < max(1.0, 4 * baseline_gap), (gap, load_s)


def _switch_ms(pool: Pool) -> str | None:
    for line in reversed(pool.leader.log(200).splitlines()):
        if "switched stage" in line:
            return line.rsplit(" in ", 1)[1].split(" ms", 1)[0]
    return None


def test_swarm_leave_with_a_hot_cover_switches_at_once(fleet, uninterrupted):
    want, baseline_gap = uninterrupted
    standby = FellowProcess(fleet.leader.url, fleet.leader.join_token(1), fleet.fellows[0].data_dir.parent
                            / "fellow-3", "fellow-3", standby=True).start()
    fleet.fellows.append(standby)
    wait_for(lambda: any(f["name"] == "fellow-3" for f in fleet.online()), 120, message=lambda: standby.log())
    assert fleet.http.put("/api/v1/settings/hot-cover", json={"enabled": True}).status_code == 200
    covered = wait_for(lambda: next((s for s in stages(fleet) if s["cover_fellow_id"] is not None), None), 120,
                       message=lambda: logs(fleet.fellows))
    leaving = by_name(fleet, covered["fellow"])
    command = {}
    text, arrivals = stream(fleet, lambda: command.setdefault("proc", leave(leaving)))
    out, err = command["proc"].communicate(timeout=120)
    assert command["proc"].returncode == 0, err
    assert f"handed over stage {covered['index']}" in out and "(hot cover)" in out, out
    assert text == want
    assert leaving.proc.wait(60) == 0, leaving.log()
    assert stages(fleet)[covered["index"]]["fellow"] == "fellow-3"
    gap = longest_gap(arrivals)
    print(f"drain with hot cover: longest gap {gap:.2f} s (uninterrupted {baseline_gap:.2f} s)")
    assert gap < HOT_COVER_GAP_S


def test_with_nobody_to_take_a_stage_leave_refuses_and_force_fails_over(fleet):
    fleet.http.put("/api/v1/settings/hot-cover", json={"enabled": False})
    held = stages(fleet)
    leaving = by_name(fleet, held[0]["fellow"])
    refused = leave(leaving)
    _, err = refused.communicate(timeout=120)
    assert refused.returncode == 1
    assert f"no fellow can take stage 0 of {fleet.name}" in err and "--force" in err, err
    fellow_id = next(f["id"] for f in fleet.online() if f["name"] == leaving.name)
    response = fleet.http.post(f"/api/v1/fellows/{fellow_id}/drain", json={})
    assert response.status_code == 409 and response.json()["error"]["code"] == "drain_refused", response.text
    assert leaving.proc.poll() is None and fleet.status() == "ready"  # it stays, serving
    forced = leave(leaving, "--force")
    out, err = forced.communicate(timeout=120)
    assert forced.returncode == 0, err
    assert "fails over" in out, out
    assert leaving.proc.wait(60) == 0, leaving.log()
    wait_for(lambda: fleet.status() == "recovering", 30)
    joined = FellowProcess(fleet.leader.url, fleet.leader.join_token(1), fleet.fellows[0].data_dir.parent
                           / "fellow-4", "fellow-4").start()
    fleet.fellows.append(joined)
    wait_for(lambda: fleet.status() == "ready", 180, message=lambda: logs(fleet.fellows))
    assert stages(fleet)[0]["fellow"] == "fellow-4"
