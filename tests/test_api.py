"""The leader's HTTP API without fellows: authentication, OpenAI-shaped errors, chats' privacy and limits."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from swarm.config import Settings
from swarm.leader.app import Leader


@pytest.fixture
def leader(tmp_path, tiny_model_dirs):
    leader = Leader(tmp_path / "leader", Settings.from_env({}))
    from harness import install_model

    install_model(tmp_path / "leader", tiny_model_dirs["qwen3"])
    return leader


@pytest.fixture
def client(leader):
    with TestClient(leader.app, backend="trio") as c:
        yield c


def _auth(token):
    return {"authorization": f"Bearer {token}"}


def check_error(response, status, code=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if code:
        assert error["code"] == code
    return error["message"]


def test_openai_routes_refuse_without_a_valid_token(client):
    check_error(client.get("/v1/models"), 401, "invalid_api_key")
    check_error(client.post("/v1/chat/completions", json={}, headers=_auth("swt_nope")), 401)


def test_chat_completions_errors_are_openai_shaped(client, leader):
    token = leader.first_start.admin_token
    check_error(client.post("/v1/chat/completions", content=b"{not json", headers=_auth(token)), 400, "invalid_json")
    check_error(client.post("/v1/chat/completions", json={"messages": []}, headers=_auth(token)), 400, "missing_model")
    message = check_error(client.post("/v1/chat/completions", headers=_auth(token),
                                 json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
                     404, "model_not_found")
    assert "nope" in message
    message = check_error(client.post("/v1/chat/completions", headers=_auth(token),
                                 json={"model": "qwen3", "messages": [{"role": "user", "content": "hi"}]}),
                     503, "model_not_loaded")
    # auto-load (on by default) tried to load it for the request: no fellow is online to take it
    assert "qwen3 is not loaded, and loading it for this request failed" in message and "no fellow" in message
    models = client.get("/v1/models", headers=_auth(token)).json()
    assert [(m["id"], m["status"]) for m in models["data"]] == [("qwen3", "not_loaded")]


def test_loading_without_fellows_says_what_is_needed(client, leader):
    token = leader.first_start.admin_token
    message = check_error(client.post("/api/v1/models/qwen3/load", json={"num_stages": 2}, headers=_auth(token)), 409)
    assert "needs 2 fellows online" in message and "swarm join" in message


def test_chats_are_private_and_limited(client, leader, tmp_path):
    store = leader.store
    admin_token = leader.first_start.admin_token
    alice = store.create_user("alice", "alice-password-1")
    alice_token, _ = store.create_api_token(alice.id, "t")
    created = client.post("/api/v1/chats", headers=_auth(alice_token),
                          json={"model": "qwen3", "messages": [{"role": "user", "content": "Plan my week"}]})
    assert created.status_code == 201
    chat_id = created.json()["id"]
    assert created.json()["title"] == "Plan my week"
    # Nobody else reads it, admins included.
    check_error(client.get(f"/api/v1/chats/{chat_id}", headers=_auth(admin_token)), 404)
    check_error(client.delete(f"/api/v1/chats/{chat_id}", headers=_auth(admin_token)), 404)
    assert client.get("/api/v1/chats", headers=_auth(admin_token)).json() == {"chats": []}
    # A chat over 2 MB is refused with the limit named, and the stored one is unchanged.
    big = [{"role": "user", "content": "x" * 2_100_000}]
    message = check_error(client.patch(f"/api/v1/chats/{chat_id}", headers=_auth(alice_token), json={"messages": big}),
                     413)
    assert "2.0 MB" in message and "not saved" in message
    assert client.get(f"/api/v1/chats/{chat_id}", headers=_auth(alice_token)).json()["messages"][0]["content"] == \
        "Plan my week"


def test_browser_sessions_need_the_csrf_token(client, leader):
    response = client.post("/api/v1/auth/login", json={"name": "admin", "password": leader.first_start.admin_password})
    assert response.status_code == 200
    me = client.get("/api/v1/me").json()
    assert me["user"]["name"] == "admin" and me["csrf"]
    check_error(client.post("/api/v1/chats", json={"messages": []}), 401)
    ok = client.post("/api/v1/chats", json={"messages": []}, headers={"x-csrf-token": me["csrf"]})
    assert ok.status_code == 201
    check_error(client.post("/api/v1/auth/login", json={"name": "admin", "password": "wrong"}), 401)


def test_model_files_need_a_node_credential(client, leader):
    admin = _auth(leader.first_start.admin_token)
    check_error(client.get("/api/v1/models/qwen3/files/config.json", headers=admin), 401)


def test_our_own_bugs_are_500s_that_say_so_never_400s(client, leader, monkeypatch, caplog):
    """A KeyError or TypeError inside a route is a bug in swarm: a 500 with a log line, in each API's error shape."""
    token = leader.first_start.admin_token

    def broken(*args, **kwargs):
        raise KeyError("tokenizer_class")

    monkeypatch.setattr(leader.serving, "status", lambda name: "ready")
    monkeypatch.setattr("swarm.leader.api.openai_api.encode_chat", broken)
    response = client.post("/v1/chat/completions", headers=_auth(token),
                           json={"model": "qwen3", "messages": [{"role": "user", "content": "hi"}]})
    message = check_error(response, 500, "internal_error")
    assert "bug in swarm" in message and "KeyError" in message
    assert response.json()["error"]["type"] == "server_error"
    assert any("unexpected error" in r.message for r in caplog.records)

    monkeypatch.setattr(leader.serving, "models_on_fellow", lambda fellow_id: 1 / 0)
    monkeypatch.setattr(leader.store, "list_models", lambda: (_ for _ in ()).throw(TypeError("bad row")))
    response = client.get("/api/v1/models", headers=_auth(token))
    assert response.status_code == 500 and response.json()["error"]["code"] == "internal_error"


def test_a_template_that_refuses_the_messages_is_the_clients_400(client, leader, monkeypatch):
    from jinja2 import TemplateError

    token = leader.first_start.admin_token

    def refuse(*args, **kwargs):
        raise TemplateError("Conversation roles must alternate user/assistant/user/assistant/...")

    monkeypatch.setattr(leader.serving, "status", lambda name: "ready")
    monkeypatch.setattr("swarm.leader.api.openai_api.encode_chat", refuse)
    message = check_error(client.post("/v1/chat/completions", headers=_auth(token),
                                 json={"model": "qwen3", "messages": [{"role": "user", "content": "hi"}]}),
                     400, "invalid_messages")
    assert "alternate" in message


def test_admins_mark_fellows_standby_and_see_it(client, leader):
    token = leader.first_start.admin_token
    pool = leader.store.list_pools()[0]
    fellow, _ = leader.store.enrol_fellow("gpu-box", b"k" * 32, pool.id)
    listed = client.get("/api/v1/fellows", headers=_auth(token)).json()["fellows"]
    assert [(f["name"], f["standby"]) for f in listed] == [("gpu-box", False)]
    response = client.put(f"/api/v1/fellows/{fellow.id}", json={"standby": True}, headers=_auth(token))
    assert response.status_code == 200 and response.json()["fellow"]["standby"] is True
    assert client.get("/api/v1/fellows", headers=_auth(token)).json()["fellows"][0]["standby"] is True
    check_error(client.put(f"/api/v1/fellows/{fellow.id}", json={"standby": "yes"}, headers=_auth(token)), 400)
    check_error(client.put("/api/v1/fellows/999", json={"standby": True}, headers=_auth(token)), 404)
    # a fellow that joins with --standby is one; joining again without it keeps what the admin set
    again, _ = leader.store.enrol_fellow("gpu-box", b"k" * 32, pool.id, standby=False)
    assert again.standby is True
    spare, _ = leader.store.enrol_fellow("spare", b"s" * 32, pool.id, standby=True)
    assert spare.standby is True
    hot = client.put("/api/v1/settings/hot-cover", json={"enabled": True}, headers=_auth(token))
    assert hot.status_code == 200 and hot.json()["enabled"] is True
    assert client.get("/api/v1/settings/hot-cover", headers=_auth(token)).json()["enabled"] is True


def test_a_conversation_longer_than_the_pool_is_a_413_and_an_event_in_a_stream(client, leader, monkeypatch):
    from swarm.errors import ContextTooLong
    from swarm.leader.serving.requests import too_long

    token = leader.first_start.admin_token

    async def refuse(request):
        raise ContextTooLong(too_long(4312, 3800, 512, 4096))

    monkeypatch.setattr(leader.serving, "status", lambda name: "ready")
    monkeypatch.setattr(leader.serving.intake, "submit", refuse)
    # (within the model's own context of 256, which the leader checks first: the refusal is the pool's)
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    message = check_error(client.post("/v1/chat/completions", json=body, headers=_auth(token)), 413,
                     "context_length_exceeded")
    assert message.startswith("this conversation needs 4312 tokens (3800 in the prompt and up to 512 in the reply); "
                              "the pool serving this model holds 4096.")
    assert "maximum context length" in message
    streamed = client.post("/v1/chat/completions", json={**body, "stream": True}, headers=_auth(token))
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    event = json.loads(streamed.text.split("\n")[0].removeprefix("data: "))
    assert event["error"]["code"] == "context_length_exceeded" and "4312 tokens" in event["error"]["message"]
    over = client.post("/v1/chat/completions", json={**body, "max_tokens": 5000}, headers=_auth(token))
    assert "at most 4096 tokens" in check_error(over, 400, "invalid_max_tokens")


def test_completions_route_answers_in_the_openai_shape(client, leader):
    token = leader.first_start.admin_token
    check_error(client.post("/v1/completions", json={"model": "qwen3", "prompt": "hi"}), 401)
    message = check_error(client.post("/v1/completions", headers=_auth(token),
                                      json={"model": "qwen3", "prompt": "hi", "suffix": "end"}),
                          400, "unsupported_parameter")
    assert "'suffix'" in message
    check_error(client.post("/v1/completions", headers=_auth(token), json={"model": "qwen3", "prompt": "hi"}), 503,
           "model_not_loaded")
    message = check_error(client.post("/v1/chat/completions", headers=_auth(token),
                                 json={"model": "qwen3", "messages": [{"role": "user", "content": "hi"}],
                                       "response_format": {"type": "json_schema",
                                                           "json_schema": {"name": "x", "schema": {"type": "nope"}}}}),
                     400, "invalid_response_format")
    assert "'response_format'" in message and "nope" in message
