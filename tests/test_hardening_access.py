"""Attacks on a running leader (issue 32: a review against a leader with two fellows): a stranger's websocket frame,
reloads that end other users' replies, forged hot-cover claims, MCP arguments used as paths, malformed input that
used to be a 500, and sign-in and token limits. Each test attacks the way the finding describes."""

from __future__ import annotations

import base64
import os
import socket

import pytest
import trio

from harness import running_swarm, wait_until

pytestmark = pytest.mark.e2e


# --- Medium 1: a websocket frame that announces a terabyte ------------------------------------------------------------


async def _upgrade(url: str, path: str) -> trio.SocketStream:
    """A raw TCP connection to the leader, upgraded to a websocket on ``path`` (a stranger's: no credential)."""
    host, port = url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    key = base64.b64encode(os.urandom(16)).decode()
    await stream.send_all((f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
                          .encode())
    answer = b""
    with trio.fail_after(5):
        while b"\r\n\r\n" not in answer:
            answer += await stream.receive_some(4096)
    assert answer.startswith(b"HTTP/1.1 101"), answer
    return stream


async def test_a_stranger_announcing_a_huge_websocket_frame_is_cut_off_at_the_limit(tmp_path):
    """One frame header announcing 2^40 bytes, then zeros: the leader answered 1009 but went on buffering what came
    (1 GB before the 10 s hello deadline). Now the connection ends at the limit."""
    async with running_swarm(tmp_path, [], fellows=0) as swarm:
        stream = await _upgrade(swarm.url, "/fellow/link")
        stream.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)  # what we sent ~ what the leader took
        # FIN + binary, masked, 64-bit length 2^40, mask key 0 (the zeros stay zeros)
        await stream.send_all(bytes([0x82, 0x80 | 127]) + (1 << 40).to_bytes(8, "big") + b"\0" * 4)
        chunk, sent, cut = b"\0" * 65536, 0, False
        start = trio.current_time()
        with trio.move_on_after(5):
            try:
                while sent < 256 << 20:
                    await stream.send_all(chunk)
                    sent += len(chunk)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                cut = True
        took = trio.current_time() - start
        assert cut, f"the leader took {sent >> 20} MiB of one frame in {took:.1f} s and kept the connection"
        assert took < 2.0, f"the connection ended only after {took:.1f} s"
        assert sent < 4 << 20, f"the leader accepted {sent >> 20} MiB before ending the connection"
        assert (await swarm.http.get("/healthz")).status_code == 200


# --- Medium 2: a reload that ends other users' replies ----------------------------------------------------------------


@pytest.fixture(scope="module")
def scripted_dir(module_tmp):
    from scripted import imported

    return imported(module_tmp("scripted"), "qwen3-access", {"assistant\n": ["The", " answer", " is", " 4."]})


@pytest.fixture
def gate(monkeypatch):
    """Stages compute only while the gate is open: a reply in flight stays in flight."""
    from scripted import hold_compute

    opened = hold_compute(monkeypatch)
    yield opened
    opened.set()


def _user(swarm, name: str) -> dict:
    """A user who is not an admin, member of the default pool, and their API token as a header."""
    store = swarm.leader.store
    user = store.create_user(name, f"{name}'s long password")
    store.add_pool_member(store.list_pools()[0].id, user.id)
    return {"authorization": f"Bearer {store.create_api_token(user.id, name)[0]}"}


async def test_a_user_cannot_end_another_users_reply_by_loading_the_model_again(tmp_path, scripted_dir, gate):
    """`POST /models/M/load` at another quantization (the MCP tool models_load is the same route) unloaded the model
    and ended the admin's reply in flight, with a 202 to a user who may not unload it."""
    name = scripted_dir.name
    with trio.fail_after(120):
        async with running_swarm(tmp_path, [scripted_dir], fellows=2) as swarm:
            await swarm.load(name, 2)
            bob = _user(swarm, "bob")
            book = swarm.leader.serving.book
            reply = {}

            async def admin_chat():
                body = {"model": name, "messages": [{"role": "user", "content": "2+2?"}], "temperature": 0,
                        "max_tokens": 8}
                reply["response"] = await swarm.http.post("/v1/chat/completions", json=body, timeout=60)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(admin_chat)
                await wait_until(lambda: len(book.of_model(name)) == 1, 20)  # on the ring, held there
                running = book.of_model(name)[0]
                response = await swarm.http.post(f"/api/v1/models/{name}/load", headers=bob,
                                                 json={"quantization": "int8"})
                assert response.status_code == 403, response.text
                message = response.json()["error"]["message"]
                assert "1 request of other users" in message and "admin" in message, message
                is_error, text = await _tool(swarm, "models_load", {"model": name, "quantization": "nf4"}, bob)
                assert is_error and "other users" in text and "HTTP 403" in text, text
                assert not running.ended, "bob's load ended the admin's reply"
                assert swarm.leader.serving.models[name].quantization == "none"
                # a load that changes nothing is still anyone's
                response = await swarm.http.post(f"/api/v1/models/{name}/load", headers=bob, json={})
                assert response.status_code == 202, response.text
                gate.set()
            assert reply["response"].status_code == 200, reply["response"].text
            assert reply["response"].json()["choices"][0]["message"]["content"] == "The answer is 4."
            # nobody else's reply in the way: bob may load it again as he likes
            response = await swarm.http.post(f"/api/v1/models/{name}/load", headers=bob, json={"quantization": "int8"})
            assert response.status_code == 202, response.text


# --- Low-medium 3: a forged hot-cover claim ---------------------------------------------------------------------------


async def _enrol(nursery, swarm, stages: list) -> tuple[object, dict]:
    """A new fellow of the pool (a fresh key, a join token) whose hello says it holds ``stages``."""
    import trio_websocket

    from swarm import wire
    from swarm.fellow import hardware
    from swarm.mesh.websocket import WebSocketFrameTransport, ws_url
    from swarm.tunnel.channel import NoiseChannel
    from swarm.tunnel.join_token import parse_join_token
    from swarm.tunnel.keys import generate_private_key

    ws = await trio_websocket.connect_websocket_url(nursery, ws_url(swarm.url, "/fellow/link"),
                                                     max_message_size=1 << 20)
    channel = await NoiseChannel.connect(WebSocketFrameTransport(ws), generate_private_key(), swarm.leader.public)
    await channel.send(wire.encode({"t": "hello", "name": "mallory", "version": "x", "stages": stages,
                                    "hardware": hardware.probe().to_wire(),
                                    "join_token": parse_join_token(swarm.join_token())[1]}))
    return channel, wire.decode(await channel.receive())


async def test_a_fellow_cannot_claim_a_hot_cover_it_was_not_given(tmp_path, scripted_dir):
    """A hello claiming {index: 0, cover: true} for the current load made its sender stage 0's cover: its node
    credential then downloaded stage 0's files (200/206), and a failover would have moved stage 0 onto it."""
    name = scripted_dir.name
    with trio.fail_after(120):
        async with running_swarm(tmp_path, [scripted_dir], fellows=2) as swarm, trio.open_nursery() as nursery:
            await swarm.load(name, 2)
            model = swarm.leader.serving.models[name]
            claims = [{"model": name, "load_id": model.load_id, "index": i, "cover": True} for i in (0, 1)]
            _, welcome = await _enrol(nursery, swarm, claims)
            assert welcome["t"] == "welcome", welcome
            assert name not in welcome["stages"], "the leader told the claimant to keep a cover it never gave"
            await trio.sleep(0.5)  # adoption runs once the welcome is out
            assert [s.cover for s in model.stages] == [None, None]
            files = sorted(model.files_for(model.stages[0].plan.fellow_id)
                           - model.files_for(model.stages[1].plan.fellow_id))
            assert files, "stage 0 has no files of its own to try"
            for path in files:
                response = await swarm.http.get(f"/api/v1/models/{name}/files/{path}",
                                                headers={"authorization": f"Bearer {welcome['credential']}",
                                                         "range": "bytes=0-15"})
                assert response.status_code == 403, (path, response.status_code)
            nursery.cancel_scope.cancel()


def test_a_cover_the_leader_gave_is_adopted_when_its_fellow_rejoins():
    """The honest case the check must keep: a standby the leader gave a cover rejoins holding it (after a blip, or
    a leader restart) and keeps it; another fellow's same claim is refused."""
    import types

    from swarm.leader.planning.placement import StagePlan
    from swarm.leader.serving.models import ModelServing, StageState
    from swarm.leader.serving.recovery import Recovery

    stages = [StageState(StagePlan(i, 10 + i, f"pc-{i}", i, i + 1, 0, 0), ready=True) for i in range(2)]
    stages[0].cover_given = 7  # the leader asked fellow 7 to cover stage 0; it went away (cover cleared)
    model = ModelServing("m", "load-1", stages, status="ready")
    serving = types.SimpleNamespace(models={"m": model}, _start=lambda *a: None)
    recovery = Recovery(serving)
    claim = [{"model": "m", "load_id": "load-1", "index": 0, "cover": True}]

    def fellow(fellow_id):
        return types.SimpleNamespace(id=fellow_id, name=f"fellow-{fellow_id}", compatible=True, pool_id=None)

    # no cover of its own
    assert recovery.keeps(fellow(8), claim) == [] and recovery.adoption.claim(fellow(8), claim) == []
    assert stages[0].cover is None
    assert recovery.keeps(fellow(7), claim) == ["m"] and recovery.adoption.claim(fellow(7), claim) == ["m"]
    assert (stages[0].cover, stages[0].cover_ready) == (7, True)
    assert recovery.keeps(fellow(11), claim) == []  # nor can stage 1's own fellow claim to cover stage 0


# --- Low 4: MCP tool arguments as paths, an idle event stream, an over-size body --------------------------------------


async def _tool(swarm, name: str, arguments: dict, auth: dict | None = None) -> tuple[bool, str]:
    """(is_error, text) of one MCP tool call, as any MCP client posts it (stateless: no session needed); as the
    admin unless ``auth`` says otherwise."""
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": name, "arguments": arguments}}
    response = await swarm.http.post("/mcp", json=body, headers={"accept": "application/json, text/event-stream",
                                                                 **(auth or {})})
    assert response.status_code == 200, response.text
    result = response.json()["result"]
    return result.get("isError", False), "".join(c.get("text", "") for c in result["content"])


async def test_mcp_tool_arguments_cannot_reach_other_routes(tmp_path):
    """With the admin's token, chats_delete {"chat_id": "../users/5"} deleted user 5 (the in-process call's URL was
    normalised to /api/v1/users/5), and chats_get("../../v1/models") answered the model list."""
    async with running_swarm(tmp_path, [], fellows=0) as swarm:
        store = swarm.leader.store
        victim = store.create_user("victim", "victim's long password")
        is_error, text = await _tool(swarm, "chats_delete", {"chat_id": f"../users/{victim.id}"})
        assert store.get_user(victim.id) is not None, "chats_delete deleted a user"
        assert is_error, text
        for chat_id in ("../../v1/models", "..", ".", "..%2F..%2Fv1%2Fmodels", f"..\\users\\{victim.id}"):
            is_error, text = await _tool(swarm, "chats_get", {"chat_id": chat_id})
            assert is_error and '"data"' not in text and "object" not in text, (chat_id, text)
        is_error, text = await _tool(swarm, "models_unload", {"model": f"../../users/{victim.id}"})
        assert is_error and store.get_user(victim.id) is not None
        # a real chat id still works
        chat = store.create_chat(store.get_user_by_name("admin").id, "kept", "", [])
        is_error, text = await _tool(swarm, "chats_get", {"chat_id": chat.id})
        assert not is_error and "kept" in text, text


async def test_get_mcp_is_a_405_and_an_over_size_chunked_body_a_413(tmp_path):
    """GET /mcp held an idle event stream open for ever; a chunked body over the limit was a 500."""
    async with running_swarm(tmp_path, [], fellows=0) as swarm:
        with trio.fail_after(5):
            response = await swarm.http.get("/mcp", headers={"accept": "text/event-stream"})
        assert response.status_code == 405 and "POST" in response.headers["allow"], response.text

        async def chunks():  # no Content-Length: counted as it arrives
            yield b'{"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"x": "'
            for _ in range(40):
                yield b"x" * 65536
            yield b'"}}'

        response = await swarm.http.post("/mcp", content=chunks(), headers={
            "accept": "application/json, text/event-stream", "content-type": "application/json"})
        assert response.status_code == 413, (response.status_code, response.text)
        assert "larger than" in response.json()["error"]["message"]


# --- Low 5: malformed input that was a 500 or a traceback -------------------------------------------------------------


def _leader_client(tmp_path):
    from starlette.testclient import TestClient

    from swarm.config import Settings
    from swarm.leader.app import Leader

    leader = Leader(tmp_path / "leader", Settings.from_env({}))
    return leader, TestClient(leader.app, backend="trio")


def _errors(caplog) -> list[str]:
    """What the leader logged as its own bug: errors and tracebacks."""
    return [r.getMessage() for r in caplog.records if r.levelno >= 40 or r.exc_info]


async def test_a_strangers_hello_with_a_bignum_name_is_refused_without_a_traceback(tmp_path, caplog):
    """A pre-enrolment hello whose name is a 60 kB CBOR bignum: str() of it raised ValueError (the int-to-string
    limit), a traceback in the leader's log per stranger, and no answer."""
    import trio_websocket

    from swarm import wire
    from swarm.fellow import hardware
    from swarm.mesh.websocket import WebSocketFrameTransport, ws_url
    from swarm.tunnel.channel import NoiseChannel
    from swarm.tunnel.join_token import parse_join_token
    from swarm.tunnel.keys import generate_private_key

    async with running_swarm(tmp_path, [], fellows=0) as swarm, trio.open_nursery() as nursery:
        hello = {"t": "hello", "name": 1 << (8 * 60_000), "version": 1 << (8 * 1000),
                 "hardware": hardware.probe().to_wire(), "stages": []}
        for expected in ("name must be a string", None):
            ws = await trio_websocket.connect_websocket_url(nursery, ws_url(swarm.url, "/fellow/link"),
                                                             max_message_size=1 << 20)
            channel = await NoiseChannel.connect(WebSocketFrameTransport(ws), generate_private_key(),
                                                 swarm.leader.public)
            await channel.send(wire.encode(hello))
            with trio.fail_after(5):
                reply = wire.decode(await channel.receive())
            if expected is None:
                assert reply["t"] == "welcome", reply
                assert swarm.leader.hub.online[reply["fellow_id"]].version == "?"
                break
            assert reply["t"] == "refused" and expected in reply["message"], reply
            # a fellow with a join token whose version is a bignum: enrolled, its version unknown
            hello.update(name="mallory", join_token=parse_join_token(swarm.join_token())[1])
        assert _errors(caplog) == []
        nursery.cancel_scope.cancel()


def test_a_json_schema_with_a_huge_bound_is_a_400():
    from swarm.errors import BadRequest
    from swarm.leader.api.openai_params import parse_chat_body

    for bound in (-10**300, 10**300, 2**64):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer", "minimum": bound}}}}
        with pytest.raises(BadRequest) as refused:
            parse_chat_body(body, 4096)
        assert "JSON schema" in str(refused.value)


def test_deeply_nested_chats_and_update_bodies_are_a_400(tmp_path, caplog):
    """A chat whose content nests 950 lists was stored, then every read of it was a 500 (RecursionError); a deeply
    nested body on /api/v1/fellows/update was a 500."""
    leader, client = _leader_client(tmp_path)
    auth = {"authorization": f"Bearer {leader.first_start.admin_token}", "content-type": "application/json"}
    with client:
        deep = '{"messages": [{"role": "user", "content": ' + "[" * 950 + "]" * 950 + "}]}"
        response = client.post("/api/v1/chats", content=deep, headers=auth)
        assert response.status_code == 400, response.text
        assert "levels deep" in response.json()["error"]["message"]
        listed = client.get("/api/v1/chats", headers=auth).json()["chats"]
        assert listed == [], "the chat was stored anyway"
        fine = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
        assert client.post("/api/v1/chats", json={"messages": fine}, headers=auth).status_code == 201
        response = client.post("/api/v1/fellows/update", content='{"a":' * 5000, headers=auth)
        assert response.status_code == 400, response.text
    assert _errors(caplog) == []


async def test_a_client_leaving_mid_body_is_not_logged_as_a_bug(tmp_path, caplog):
    import logging

    caplog.set_level(logging.INFO)
    async with running_swarm(tmp_path, [], fellows=0) as swarm:
        host, port = swarm.url.removeprefix("http://").split(":")
        stream = await trio.open_tcp_stream(host, int(port))
        await stream.send_all((f"POST /api/v1/chats HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {swarm.token}"
                               "\r\nContent-Type: application/json\r\nContent-Length: 10000\r\n\r\n{\"title\": ")
                              .encode())
        await trio.sleep(0.3)  # the route is reading the body
        await stream.aclose()
        await wait_until(lambda: any("went away" in r.getMessage() for r in caplog.records), 5,
                         message=lambda: str(_errors(caplog)))
        assert _errors(caplog) == []


# --- Low 6: sign-out, lock-outs, token counts -------------------------------------------------------------------------


def test_logout_needs_the_pages_csrf_token(tmp_path):
    """Any site could sign the leader's users out: a cross-site form POST to /api/v1/auth/logout carries the cookie,
    and logout asked for nothing else."""
    leader, client = _leader_client(tmp_path)
    with client:
        signed_in = client.post("/api/v1/auth/login", json={"name": "admin",
                                                            "password": leader.first_start.admin_password})
        assert signed_in.status_code == 200
        csrf = client.get("/api/v1/me").json()["csrf"]
        response = client.post("/api/v1/auth/logout", content=b"", headers={"content-type": "text/plain"})
        assert response.status_code == 401 and "CSRF" in response.json()["error"]["message"], response.text
        assert client.get("/api/v1/me").status_code == 200, "another site's form signed the user out"
        response = client.post("/api/v1/auth/logout", json={}, headers={"x-csrf-token": csrf})
        assert response.status_code == 200
        assert client.get("/api/v1/me").status_code == 401
        # an expired or unknown session just goes: nothing to protect
        client.cookies.set("swarm_session", "gone")
        assert client.post("/api/v1/auth/logout").status_code == 200


def test_a_stranger_cannot_keep_an_account_locked_out_from_its_owners_address(tmp_path):
    """Failing one sign-in every few minutes from anywhere kept the account waiting (5 free failures per account,
    then up to 300 s): its owner could not sign in at all. Now the stranger's own pair waits; the owner's address
    does not."""
    from starlette.testclient import TestClient

    from swarm.config import Settings
    from swarm.leader.app import Leader

    leader = Leader(tmp_path / "leader", Settings.from_env({}))
    owner = TestClient(leader.app, backend="trio", client=("192.0.2.10", 50000))
    stranger = TestClient(leader.app, backend="trio", client=("198.51.100.7", 50000))
    right = {"name": "admin", "password": leader.first_start.admin_password}
    wrong = {"name": "admin", "password": "a wrong guess"}
    with owner, stranger:
        assert owner.post("/api/v1/auth/login", json=right).status_code == 200  # the owner's usual address
        statuses = [stranger.post("/api/v1/auth/login", json=wrong).status_code for _ in range(8)]
        assert statuses[:5] == [401] * 5 and 429 in statuses[5:], statuses  # the stranger is held
        assert owner.post("/api/v1/auth/login", json=right).status_code == 200, "the owner was locked out"


def test_the_throttle_still_bounds_guesses_from_many_addresses():
    from swarm.errors import TooManyAttempts
    from swarm.leader.api.signin import FREE_FAILURES, FREE_FAILURES_PER_ACCOUNT, SignInThrottle

    now = [0.0]
    throttle = SignInThrottle(clock=lambda: now[0])
    throttle.succeeded("alice", "10.0.0.1")  # the owner's address
    for i in range(FREE_FAILURES_PER_ACCOUNT):  # a botnet: few failures per address, many in all
        throttle.failed("alice", f"10.1.{i // FREE_FAILURES}.{i % FREE_FAILURES}")
    with pytest.raises(TooManyAttempts):
        throttle.check("alice", "10.2.0.1")  # a new address waits
    throttle.check("alice", "10.0.0.1")  # the owner's does not


def test_api_tokens_per_user_are_limited(tmp_path, monkeypatch):
    """Tokens per user were unlimited: a user (or a stolen session) could fill the database with them."""
    from starlette.testclient import TestClient

    from swarm.config import Settings
    from swarm.leader.app import Leader

    monkeypatch.setenv("SWARM_API_TOKENS_PER_USER", "3")
    leader = Leader(tmp_path / "leader", Settings.from_env())
    assert leader.settings.api_tokens_per_user == 3 and Settings.from_env({}).api_tokens_per_user == 100
    auth = {"authorization": f"Bearer {leader.first_start.admin_token}"}  # the admin holds 1 already
    with TestClient(leader.app, backend="trio") as client:
        made = [client.post("/api/v1/tokens", json={"name": f"t{i}"}, headers=auth) for i in range(2)]
        assert [r.status_code for r in made] == [201, 201]
        refused = client.post("/api/v1/tokens", json={"name": "one too many"}, headers=auth)
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert error["code"] == "token_limit_reached"
        assert "3 API tokens" in error["message"] and "SWARM_API_TOKENS_PER_USER" in error["message"]
        assert len(client.get("/api/v1/tokens", headers=auth).json()["tokens"]) == 3
        client.delete(f"/api/v1/tokens/{made[0].json()['id']}", headers=auth)
        assert client.post("/api/v1/tokens", json={"name": "room again"}, headers=auth).status_code == 201
