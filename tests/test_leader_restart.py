"""A leader killed with SIGKILL and started again: the model it was serving is ready again with nobody loading it
(its fellows rejoin still holding their stages and are adopted), and accounts, tokens, saved chats and the serving
history are intact."""

from __future__ import annotations

import sqlite3

import httpx
import pytest

from fleet import Pool, logs
from harness import wait_for

pytestmark = pytest.mark.e2e

PROMPT = [{"role": "user", "content": "Name three colours."}]


def served_rows(data_dir) -> list[tuple]:
    """(outcome, reply tokens) of every request in the leader's serving history, oldest first."""
    with sqlite3.connect(f"file:{data_dir / 'leader.db'}?mode=ro", uri=True) as db:
        try:
            return db.execute("SELECT outcome, reply_tokens FROM serving_history ORDER BY ended_at").fetchall()
        except sqlite3.OperationalError:  # not created yet
            return []


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
        # the reply is in the serving history's table within a few seconds (written in batches, off its path)
        wait_for(lambda: served_rows(leader.data_dir), 30, message=leader.log)

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
        # the history survived: the longer ranges roll it up from the database, and the live 15 minutes read it back
        for range_ in ("15m", "1h", "7d"):
            perf = http.get(f"/api/v1/models/{name}/performance", params={"range": range_}).json()
            assert perf["last_15m"]["replies"] >= 1 and perf["speed"]["tokens"] >= len(before), (range_, perf)
            assert sum(p["replies"] for p in perf["series"]) >= 1, (range_, perf["series"])
        assert served_rows(leader.data_dir)[0] == ("done", len(before))
        assert all("unloaded" not in f.log(400) for f in fellows), logs(fellows)
        after = http.post("/v1/chat/completions", json=body).json()["choices"][0]["token_ids"]
        assert after == before
        assert http.get(f"/api/v1/chats/{chat['id']}").json()["title"] == "colours"
    finally:
        pool.stop()
