"""GET /metrics (swarm.leader.api.metrics): a real leader and two fellows, a few chats, then the scrape parsed with
prometheus_client's own parser -- the figures must agree with what the replies said they used -- and the Grafana
dashboard in deploy/ must only ask for metrics the leader exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from harness import running_swarm, wait_until
from scripted import build
from swarm.store.importer import import_model

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "swarm-leader.json"
METRICS_TOKEN = "scrape-me-0123456789"


@pytest.fixture(scope="module")
def model_dir(module_tmp):
    root = module_tmp("metrics")
    build(root / "src", {"assistant\n": ["Counted ", "and ", "measured."]})
    import_model(str(root / "src"), root / "models", "counted")
    return root / "models" / "counted"


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, from the Prometheus text format."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(found: dict, name: str, **labels) -> float:
    return found[(name, tuple(sorted(labels.items())))]


async def test_the_leaders_metrics_count_what_the_replies_used(tmp_path, model_dir):
    name = model_dir.name
    with trio.fail_after(200):
        async with running_swarm(tmp_path, [model_dir], fellows=2,
                                 leader_env={"SWARM_METRICS_TOKEN": METRICS_TOKEN}) as swarm:
            # who may scrape: an admin or the metrics token; not a user, not nobody
            assert (await swarm.http.get("/metrics", headers={"authorization": ""})).status_code == 401
            store = swarm.leader.store
            bob = await trio.to_thread.run_sync(store.create_user, "bob", "bob's long password")
            bob_token, _ = await trio.to_thread.run_sync(store.create_api_token, bob.id, "bob")
            refused = await swarm.http.get("/metrics", headers={"authorization": f"Bearer {bob_token}"})
            assert refused.status_code == 403 and "SWARM_METRICS_TOKEN" in refused.json()["error"]["message"]
            wrong = await swarm.http.get("/metrics", headers={"authorization": "Bearer scrape-me-wrong"})
            assert wrong.status_code == 401

            await swarm.load(name, 2)
            replies = [await swarm.chat(name, [{"role": "user", "content": f"Count {i}"}]) for i in range(3)]
            assert all(r["choices"][0]["message"]["content"] == "Counted and measured." for r in replies)

            async def scrape() -> dict:
                response = await swarm.http.get("/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"})
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/plain; version=")
                return samples(response.text)

            found: dict = {}

            async def settled() -> bool:
                nonlocal found
                found = await scrape()
                return found.get(("swarm_requests_total", (("model", name), ("outcome", "done")))) == 3

            # records settle a few seconds after the reply, with the stages' times
            await wait_until(settled, 20, interval=0.5)
            assert value(found, "swarm_prompt_tokens_total", model=name) == sum(
                r["usage"]["prompt_tokens"] for r in replies)
            assert value(found, "swarm_reply_tokens_total", model=name) == sum(
                r["usage"]["completion_tokens"] for r in replies)
            assert value(found, "swarm_time_to_first_token_seconds_count", model=name) == 3
            assert value(found, "swarm_queue_wait_seconds_count", model=name) == 3
            assert value(found, "swarm_time_per_token_seconds_count", model=name) == 3
            ttft_sum = value(found, "swarm_time_to_first_token_seconds_sum", model=name)
            reported = sum(r["swarm"]["timing"]["ttft_ms"] for r in replies) / 1000
            assert ttft_sum == pytest.approx(reported, rel=1e-3, abs=1e-3)
            # each stage's compute and each hop, as the fellows measured them
            for stage in ("0", "1"):
                assert value(found, "swarm_stage_compute_seconds_per_token_count", model=name, stage=stage) == 3
            hops = {labels for (sample, labels) in found if sample == "swarm_link_seconds_per_token_count"}
            assert {dict(h)["hop"] for h in hops} == {"0->1", "1->0"}
            # what is, read live
            assert value(found, "swarm_fellows", state="serving") == 2
            assert value(found, "swarm_fellows", state="idle") == 0
            assert value(found, "swarm_model_status", model=name, status="ready") == 1
            assert value(found, "swarm_model_stages", model=name) == 2
            assert value(found, "swarm_requests_waiting", model=name) == 0
            assert value(found, "swarm_requests_running", model=name) == 0
            assert value(found, "swarm_kv_tokens_used", model=name) == 0
            assert value(found, "swarm_kv_tokens_capacity", model=name) > 0

            # an admin's own token scrapes too; the dashboard asks only for what is exported
            response = await swarm.http.get("/metrics")
            assert response.status_code == 200
            exported = {family.name for family in text_string_to_metric_families(response.text)}
            exported |= {s for (s, _) in samples(response.text)}
            dashboard = json.loads(DASHBOARD.read_text())
            asked = {name for panel in dashboard["panels"] for target in panel["targets"]
                     for name in re.findall(r"\bswarm_[a-z_]+", target["expr"])}
            assert asked and asked <= exported, asked - exported
            assert len(dashboard["panels"]) >= 8
