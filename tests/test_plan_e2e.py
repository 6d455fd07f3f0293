"""The planner against a real leader process and two fellow processes holding the built-in model's catalogue entry:
each fellow times a decoder layer when it joins (cached for the machine), `GET /api/v1/models/{id}/plan` and `swarm
plan` tell the speed a load would have before anything is loaded, and the API's usual errors come for an unknown
model or a placement that cannot be made."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import httpx
import pytest

from fleet import Pool
from harness import wait_for
from swarm.fellow import calibration, calibration_cache, hardware

pytestmark = pytest.mark.e2e

SENTENCE = re.compile(r"^about [\d.]+ tokens/s, first token of a 1,000-token prompt in [\d.]+ s (over 2 stages|on "
                      r"fellow-\d); the slowest part is (stage \d on fellow-\d \(compute\)|the links between stages)")


@pytest.fixture(scope="module")
def pool(module_tmp, smollm_model_dir):
    old = os.environ.get("SWARM_CALIBRATE")
    os.environ["SWARM_CALIBRATE"] = "1"  # the fellows inherit it (conftest turns it off for the other tests)
    try:
        pool = Pool(module_tmp("plan"), smollm_model_dir)
    finally:
        os.environ["SWARM_CALIBRATE"] = old if old is not None else "0"
    try:
        yield pool
    finally:
        pool.stop()


def plan(pool, query: str = "", name: str | None = None):
    return pool.http.get(f"/api/v1/models/{name or pool.name}/plan{query}")


def swarm_plan(pool, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}
    return subprocess.run([sys.executable, "-m", "swarm", "plan", *args, "--leader", pool.leader.url, "--token",
                           pool.token], capture_output=True, text=True, timeout=120, env=env, check=False)


def test_plan_before_loading_route_and_cli(pool):
    first = plan(pool, "?num_stages=2")
    if first.status_code != 200:  # the fellows' calibration is still running: the error says so
        assert first.status_code == 409
        assert "has not reported its speed yet" in first.json()["error"]["message"] or \
            "have not reported their speed yet" in first.json()["error"]["message"]
    response = wait_for(lambda: (r := plan(pool, "?num_stages=2")).status_code == 200 and r, 90, interval=0.5)
    data = response.json()
    assert pool.status() == "not_loaded"
    assert data["num_stages"] == 2 and data["prompt_tokens"] == 1000
    assert sorted(s["fellow"] for s in data["stages"]) == ["fellow-0", "fellow-1"]  # in the order they enrolled
    assert data["stages"][0]["layers"][0] == 0 and data["stages"][1]["layers"][1] == 30  # SmolLM2's 30 layers
    assert all(s["decode_ms"] > 0 and s["prefill_ms"] > s["decode_ms"] for s in data["stages"])
    # 576 float32 numbers forward a token (CPU fellows); each link assumed, or measured by the fellows' probes
    # (swarm.leader.fleet.link_matrix, soon after they join): on loopback, a few ms at most
    assert [link["bytes_per_token"] for link in data["links"]] == [576 * 4, 64]
    assert all(link["rtt_ms"] < 50 if link["rtt_measured"] else link["rtt_ms"] == 2.0 for link in data["links"])
    total = sum(s["decode_ms"] for s in data["stages"]) + sum(link["ms_per_token"] for link in data["links"])
    assert data["tokens_per_s"] == pytest.approx(1000 / total)
    assert SENTENCE.match(data["text"]), data["text"]
    # the calibration is cached for this machine (both fellows run here), keyed by its hardware
    key = calibration.hardware_key("auto", hardware.probe().to_wire())
    cached = json.loads(calibration_cache.cache_file(key).read_text())
    assert cached["key"] == key and len(cached["calibration"]["points"]) == 2
    for point in cached["calibration"]["points"]:  # the layer, the pass's own costs, the embedding, the head
        assert all(point[k] > 0 for k in ("decode_ms", "prefill_ms", "pass_ms", "embed_ms", "head_bytes", "head_ms"))

    one = plan(pool, "?num_stages=1").json()
    assert one["num_stages"] == 1 and one["links"] == []
    # one fellow has no link to pay but all 30 layers: slower per token than its own stage of two. (Compared on the
    # same fellow's calibration: two fellows timed minutes apart on a shared VM can differ by more than 2x.)
    alone = one["stages"][0]
    assert alone["layers"] == [0, 30]
    its_stage = next(s for s in data["stages"] if s["fellow"] == alone["fellow"])
    assert alone["decode_ms"] > its_stage["decode_ms"]

    result = swarm_plan(pool, pool.name, "--num-stages", "2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith(f"{pool.name}: about ") and "over 2 stages" in lines[0]
    assert re.match(r"  stage 0: fellow-\d · L0-\d+ · [\d.]+ ms/token, prompt [\d.]+ s$", lines[1]), lines[1]
    assert re.match(r"  stage 1: fellow-\d · L\d+-29 · ", lines[2]), lines[2]
    assert re.match(r"  link 0 -> 1: [\d.]+ ms round trip \((assumed|measured)\), 2,304 bytes", lines[3]), lines[3]


def test_plan_errors_are_the_apis(pool):
    missing = plan(pool, name="no-such-model")
    assert missing.status_code == 404
    assert "'no-such-model'" in missing.json()["error"]["message"]  # the model route's own words name it
    too_many = plan(pool, "?num_stages=3")
    assert too_many.status_code == 409
    assert "needs 3 fellows online" in too_many.json()["error"]["message"]
    bad = plan(pool, "?num_stages=zero")
    assert bad.status_code == 400
    result = swarm_plan(pool, "no-such-model")
    assert result.returncode == 1
    assert result.stderr.strip().startswith("error: ") and "'no-such-model'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_restarted_leader_plans_as_soon_as_the_fellows_are_back(pool):
    """A fellow's hello carries its calibration: a leader that restarted plans the moment the fellows have rejoined,
    not a heartbeat later (between the two it answered 409 "has not reported its speed yet")."""
    wait_for(lambda: plan(pool, "?num_stages=2").status_code == 200, 90, interval=0.5)  # both calibrated
    pool.leader.stop()
    pool.leader.start()
    wait_for(lambda: _online(pool) == 2, 60, message=pool.leader.log)
    response = plan(pool, "?num_stages=2")
    assert response.status_code == 200, response.text


def _online(pool) -> int:
    try:
        return len(pool.online())
    except (httpx.HTTPError, ValueError, KeyError):
        return 0  # the leader is still starting
