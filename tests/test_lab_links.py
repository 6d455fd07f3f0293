"""Link-aware placement in the network lab (issue 37): three `swarm join` fellows on the lab's internet, one of them
FAR_MS each way from the rest. The fellows calibrate and probe each other's links (swarm.fellow.link_probe); the
plan then leaves the far one out and says why, and a load that lets the leader choose the number of stages puts the
model on the two near ones. Needs root; skips otherwise.
"""

from __future__ import annotations

import os
import re

import pytest

import netlab
from harness import wait_for

_reason = netlab.available()
if _reason:
    pytest.skip(_reason, allow_module_level=True)

from test_lab_ring import MODEL, Ring  # noqa: E402 (after the skip: it needs the lab too)

pytestmark = [pytest.mark.lab, pytest.mark.e2e]

FAR_MS = 60.0  # each way between the far fellow and the internet: 120 ms round trip to every other host
NEAR, FAR = ("f1", "f2"), "f3"


@pytest.fixture(scope="module")
def ring(module_tmp, smollm_model_dir):
    saved = {k: os.environ.get(k) for k in ("SWARM_CALIBRATE", "SWARM_CALIBRATE_CPU_S")}
    # the fellows inherit these (conftest turns calibration off for the other tests): a speed for the planner
    os.environ.update(SWARM_CALIBRATE="1", SWARM_CALIBRATE_CPU_S="4")
    with netlab.lab(delay_ms=0) as lab:
        lab.add_public_host(netlab.LEADER)
        for host in NEAR:
            lab.add_public_host(host)
        lab.add_public_host(FAR, delay_ms=FAR_MS)
        ring = Ring(lab, module_tmp("lablinks"), smollm_model_dir)
        try:
            ring.start_leader()
            ring.use((*NEAR, FAR))
            yield ring
        finally:
            ring.close()
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def test_a_far_fellow_is_left_out_of_the_ring(ring, process_logs):
    process_logs(ring.log_files)

    def planned():
        status, plan = ring.api("GET", f"/api/v1/models/{MODEL}/plan")
        return plan if status == 200 and plan.get("left_out") else None  # calibrated, and the links probed

    plan = wait_for(planned, 150, interval=1, message=lambda: str(ring.api("GET", f"/api/v1/models/{MODEL}/plan")))
    assert sorted(s["fellow"] for s in plan["stages"]) == list(NEAR)
    (why,) = plan["left_out"]
    match = re.fullmatch(rf"{FAR} left out: (\d+) ms to f[12] \(a token takes (\d+) ms with it, (\d+) ms without\)",
                         why)
    assert match, why
    rtt, with_it, without = (int(g) for g in match.groups())
    assert 2 * FAR_MS <= rtt < 2 * FAR_MS + 40  # the probe saw the lab's delay line, both ways
    assert with_it - without >= 2 * FAR_MS - 10  # its two hops of the ring cost about a round trip a token
    assert why in plan["text"]
    links = ring.api("GET", "/api/v1/links")[1]["links"]
    assert any(link["from"] in NEAR and link["to"] == FAR and link["rtt_ms"] >= 2 * FAR_MS for link in links), links

    # A load that leaves the number of stages to the leader: the two near fellows, and the reply comes
    status, body = ring.api("POST", f"/api/v1/models/{MODEL}/load", {})
    assert status == 202, body

    def ready():
        _, view = ring.api("GET", f"/api/v1/models/{MODEL}")
        assert view["status"] not in ("failed", "not_loaded"), view
        return view if view["status"] == "ready" else None

    view = wait_for(ready, 180, interval=0.5, message=lambda: str(ring.api("GET", f"/api/v1/models/{MODEL}")))
    assert sorted(s["fellow"] for s in view["stages"]) == list(NEAR)
    status, data = ring.api("POST", "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0})
    assert status == 200 and data["usage"]["completion_tokens"] > 0, data
