"""A leader killed with SIGKILL and started again: the model it was serving is ready again with nobody loading it
(its fellows rejoin still holding their stages and are adopted), and accounts, tokens and saved chats are intact."""

from __future__ import annotations

import httpx
import pytest

from fleet import Pool, logs
from harness import wait_for

pytestmark = pytest.mark.e2e

PROMPT = [{"role": "user", "content": "Name three colours."}]


def test_a_killed_leader_comes_back_serving_what_it_served(tmp_path, smollm_model_dir, process_logs):
    pool = Pool(tmp_path, smollm_model_dir)
    process_logs(pool.logs)
    leader, fellows, http, name = pool.leader, pool.fellows, pool.http, pool.name
    try:
        pool.load(2)
        body = {"model": name, "messages": PROMPT, "temperature": 0, "max_tokens": 24, "return_token_ids": True}
        before = http.post("/v1/chat/completions", json=body).json()["choices"][0]["token_ids"]
        chat = http.post("/api/v1/chats", json={"title": "colours", "model": name,
                                                "messages": [{"role": "user", "content": "hi"}]}).json()
        placed = [s["fellow"] for s in http.get(f"/api/v1/models/{name}").json()["stages"]]

        # a client streaming when the leader dies gets a clean end of its stream, never a hang
        with pytest.raises(httpx.HTTPError):
            with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True, "max_tokens": 2000},
                             timeout=30) as stream:
                for n, _ in enumerate(stream.iter_lines()):
                    if n == 5:
                        leader.kill()
        leader.start()
        status = wait_for(lambda: pool.status() == "ready" and "ready", 90,
                          message=lambda: f"{leader.log()}\n{logs(fellows)}")
        assert status == "ready"
        view = http.get(f"/api/v1/models/{name}").json()
        assert [s["fellow"] for s in view["stages"]] == placed  # adopted where they were, not reloaded elsewhere
        assert all("unloaded" not in f.log(400) for f in fellows), logs(fellows)
        after = http.post("/v1/chat/completions", json=body).json()["choices"][0]["token_ids"]
        assert after == before
        assert http.get(f"/api/v1/chats/{chat['id']}").json()["title"] == "colours"
    finally:
        pool.stop()
