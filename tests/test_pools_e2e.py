"""One leader serves a family's pool and a lab's pool apart, end to end: a `swarm leader` process, one `swarm join`
fellow process in each pool (joined with a join token of that pool), the built-in model imported into both pools under
the same name. Pools, join tokens and memberships are made with the `swarm admin` CLI. A load in one pool never
places a stage (nor a failover) on the other pool's fellow, and a member of one pool neither sees nor chats with the
other pool's model (REST, /v1/models, /v1/chat/completions, MCP models_list)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
import trio

from fleet import FellowProcess, LeaderProcess, free_port, logs
from harness import wait_for
from swarm.store.db import Store
from swarm.store.fleet import model_id
from swarm.store.manifest import load_manifest

pytestmark = pytest.mark.e2e

PASSWORD = "correct horse battery"


def test_two_pools_on_one_leader_serve_apart(tmp_path, smollm_model_dir, process_logs):
    leader_dir = tmp_path / "leader"
    # a failover that finds nobody in the model's pool gives up after 3 s (the lab's idle fellow must not take it)
    leader = LeaderProcess(leader_dir, free_port(), env={"SWARM_SERVE_FAILOVER_WAIT_S": "3"}).start()
    fellows: list[FellowProcess] = []
    process_logs(lambda: {"leader": leader.log_path, **{f.name: f.log_path for f in fellows}})
    try:
        token = wait_for(lambda: leader.printed("Admin API token:"), 60, message=leader.log)
        admin = httpx.Client(base_url=leader.url, headers={"authorization": f"Bearer {token}"}, timeout=120)

        def cli(*args: str) -> str:
            done = subprocess.run([sys.executable, "-m", "swarm", "admin", *args, "--leader", leader.url,
                                   "--token", token], capture_output=True, text=True, timeout=60, check=False,
                                  env={**os.environ, "SWARM_LEADER": "", "SWARM_TOKEN": ""})
            assert done.returncode == 0, done.stderr
            return done.stdout

        assert "Created pool family (/pools/admin/family/inference)" in cli("pool-create", "family")
        cli("pool-create", "lab")
        # the built-in model in both pools, under the same name (as `swarm model import --pool P` lists it)
        manifest = load_manifest(smollm_model_dir).to_json()
        (leader_dir / "models").mkdir(parents=True, exist_ok=True)
        with Store(leader_dir / "leader.db") as store:
            for pool in ("family", "lab"):
                (leader_dir / "models" / model_id("smol", pool)).symlink_to(smollm_model_dir)
                store.upsert_model(model_id("smol", pool), store.pool_by_name(pool).id, manifest)

        for pool in ("family", "lab"):
            join = cli("join-token", "--pool", pool).strip()
            fellows.append(FellowProcess(leader.url, join, tmp_path / f"pc-{pool}", f"pc-{pool}",
                                         env={"SWARM_CALIBRATE": "0"}).start())

        def online() -> dict[str, dict]:
            return {f["name"]: f for f in admin.get("/api/v1/fellows").json()["fellows"] if f["state"] == "online"}

        wait_for(lambda: len(online()) == 2, 120, message=lambda: logs(fellows))
        assert {name: f["pool"] for name, f in online().items()} == {"pc-family": "family", "pc-lab": "lab"}

        # users: mum in the family's pool, curie in the lab's (both start in the default pool: taken out of it)
        users = {}
        for name, pool in (("mum", "family"), ("curie", "lab")):
            response = admin.post("/api/v1/users", json={"name": name, "password": PASSWORD})
            assert response.status_code == 201, response.text
            assert name in cli("pool-member-add", pool, name)
            cli("pool-member-remove", "default", name)
            with Store(leader_dir / "leader.db") as store:
                plaintext, _ = store.create_api_token(store.get_user_by_name(name).id, "test")
            users[name] = httpx.Client(base_url=leader.url, headers={"authorization": f"Bearer {plaintext}"},
                                       timeout=120)
        listing = cli("pools")
        assert "family" in listing and "members: mum; fellows: pc-family; models: smol@family" in listing

        # a load in the family's pool has one fellow to place on: never the lab's
        lab_fellow = online()["pc-lab"]["id"]
        refused = admin.post("/api/v1/models/smol@family/load", json={"num_stages": 2})
        assert refused.status_code == 409 and "needs 2 fellows online in the pool" in refused.json()["error"]["message"]
        refused = admin.post("/api/v1/models/smol@family/load", json={"fellow_id": lab_fellow})
        assert refused.status_code == 409 and "in another pool" in refused.json()["error"]["message"], refused.text
        for pool in ("family", "lab"):
            assert admin.post(f"/api/v1/models/smol@{pool}/load", json={}).status_code == 202
        for pool in ("family", "lab"):
            wait_for(lambda pool=pool: admin.get(f"/api/v1/models/smol@{pool}").json()["status"] == "ready", 180,
                     message=lambda: logs(fellows))
            view = admin.get(f"/api/v1/models/smol@{pool}").json()
            assert [s["fellow"] for s in view["stages"]] == [f"pc-{pool}"]
            assert (view["name"], view["pool"]) == ("smol", pool)

        # each member sees their pool's model only, and chats with it by its plain name
        for name, mine, other in (("mum", "family", "lab"), ("curie", "lab", "family")):
            http = users[name]
            assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [f"smol@{mine}"]
            assert [m["id"] for m in http.get("/api/v1/models").json()["models"]] == [f"smol@{mine}"]
            reply = http.post("/v1/chat/completions", json={
                "model": "smol", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8,
                "temperature": 0})
            assert reply.status_code == 200, reply.text
            assert reply.json()["model"] == f"smol@{mine}" and reply.json()["usage"]["completion_tokens"] > 0
            refused = http.post("/v1/chat/completions", json={
                "model": f"smol@{other}", "messages": [{"role": "user", "content": "hi"}]})
            assert refused.status_code == 404
            assert refused.json()["error"]["code"] == "model_not_found"
            assert refused.json()["error"]["message"].startswith(
                f"The model 'smol@{other}' does not exist or you do not have access to it")
            assert http.get(f"/api/v1/models/smol@{other}").status_code == 404
            assert http.post(f"/api/v1/models/smol@{other}/load", json={}).status_code == 404
            assert http.get("/api/v1/models", params={"pool": other}).status_code == 404
        assert sorted(m["id"] for m in admin.get("/v1/models").json()["data"]) == ["smol@family", "smol@lab"]
        assert _mcp_models(leader.url, users["curie"].headers["authorization"]) == ["smol@lab"]

        # the family's fellow dies; the lab's, now idle, would be the obvious replacement -- but it is not in the
        # model's pool, so the failover finds nobody and gives up
        assert admin.post("/api/v1/models/smol@lab/unload").status_code == 200
        fellows[0].kill()
        wait_for(lambda: admin.get("/api/v1/models/smol@family").json()["status"] == "not_loaded", 60,
                 message=lambda: logs(fellows))
        assert online()["pc-lab"]["stages"] == []
    finally:
        for fellow in fellows:
            fellow.stop()
        leader.stop()


def _mcp_models(url: str, authorization: str) -> list[str]:
    """The ids MCP's models_list gives the holder of ``authorization``."""
    import httpx2
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    async def main():
        http = httpx2.AsyncClient(headers={"authorization": authorization}, timeout=60)
        async with http, streamable_http_client(f"{url}/mcp", http_client=http) as (read, write, *_), \
                ClientSession(read, write) as session:
            await session.initialize()
            result = await session.call_tool("models_list", {})
            assert not result.is_error, result
            text = "".join(block.text for block in result.content if getattr(block, "text", None))
            data = result.structured_content.get("result") if result.structured_content else json.loads(text)
            return [m["id"] for m in data]

    return trio.run(main)
