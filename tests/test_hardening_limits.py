"""Attacks on a running leader's limits (issue 32): conversations longer than the model's served context, bodies and
prompts sized by the pool's KV budget instead of the model, and the replies of a request whose client has left.

One leader and one fellow serve the whole module (tests/web_helpers.BackgroundSwarm: its own trio loop on a thread),
with two of tests/scripted.py's tiny models, whose KV cache is so small that the pool's budget is millions of tokens:
the very case where limits that followed the budget let everything through. ``short`` has its own context of 512
tokens; ``long`` claims 8,192, so the leader's cap (SWARM_SERVE_CONTEXT_TOKENS, set to 4,096 here) is its served
context.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from harness import wait_for
from scripted import build
from swarm.store.importer import import_model
from web_helpers import BackgroundSwarm

pytestmark = pytest.mark.e2e

SCRIPT = ["One", " two", " three"]
WORDS = "hello world "


@pytest.fixture(scope="module")
def model_dirs(module_tmp) -> dict:
    root = module_tmp("limits")
    out = {}
    for name, own_context in (("short", 512), ("long", 8192)):
        source = build(root / f"src-{name}", {"assistant\n": SCRIPT})
        config = json.loads((source / "config.json").read_text())
        config["max_position_embeddings"] = own_context
        (source / "config.json").write_text(json.dumps(config))
        import_model(str(source), root / "models", name)
        out[name] = root / "models" / name
    return out


@pytest.fixture(scope="module")
def bg(module_tmp, model_dirs):
    swarm = BackgroundSwarm(module_tmp("limits-swarm"), list(model_dirs.values()), fellows=1,
                            leader_env={"SWARM_SERVE_CONTEXT_TOKENS": "4096"}).start()
    try:
        for name in model_dirs:
            swarm.call(swarm.swarm.load, name, 1)
        book = swarm.swarm.leader.serving.book
        swarm.ended = []  # every request that ends, in order (the serving history records them as well)
        record = book.on_end

        def on_end(request):
            swarm.ended.append(request)
            record(request)

        book.on_end = on_end
        yield swarm
    finally:
        swarm.stop()


def client(bg, **timeouts) -> httpx.Client:
    timeout = httpx.Timeout(timeouts.pop("read", 60), connect=10, **timeouts)
    return httpx.Client(base_url=bg.swarm.url, headers={"authorization": f"Bearer {bg.swarm.token}"}, timeout=timeout)


def words(model_dir, tokens: int) -> str:
    """A text of about ``tokens`` tokens of the model's tokenizer."""
    from swarm.leader.chat.chat_format import load_tokenizer

    per = len(load_tokenizer(str(model_dir)).encode(WORDS * 100, add_special_tokens=False)) / 100
    return WORDS * int(tokens / per)


def error_of(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    return error["message"]


def stream_error(response: httpx.Response) -> dict:
    """The error event a stream refused before its first token carries (the seed: context_length_exceeded in a
    stream), after checking that no reply text came with it."""
    events = [json.loads(line.removeprefix("data: ")) for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert events and "error" in events[0], response.text[:500]
    assert not any(e.get("choices") for e in events), "a refused conversation streamed a reply"
    return events[0]["error"]


# --- finding 1: the context limit is the model's served context, on every route ---------------------------------------


def test_a_conversation_longer_than_the_served_context_is_a_413_on_every_route(bg, model_dirs):
    """6,000 tokens of prompt and 512 of reply on a model served at 4,096 answered 200, plain and streamed (the check
    followed the pool's KV budget, millions of tokens here)."""
    text = words(model_dirs["long"], 6000)
    body = {"model": "long", "messages": [{"role": "user", "content": text}], "max_tokens": 512}
    with client(bg) as http:
        message = error_of(http.post("/v1/chat/completions", json=body), 413, "context_length_exceeded")
        assert "maximum context length" in message and "holds 4096" in message, message
        assert "SWARM_SERVE_CONTEXT_TOKENS" in message and "own is 8192" in message, message
        error = stream_error(http.post("/v1/chat/completions", json={**body, "stream": True}))
        assert error["code"] == "context_length_exceeded" and "maximum context length" in error["message"]
        completion = {"model": "long", "prompt": text, "max_tokens": 512}
        error_of(http.post("/v1/completions", json=completion), 413, "context_length_exceeded")
        error = stream_error(http.post("/v1/completions", json={**completion, "stream": True}))
        assert error["code"] == "context_length_exceeded"
        ids = {"model": "long", "prompt": [5] * 3700, "max_tokens": 512}  # token ids: 4,212 > 4,096
        error_of(http.post("/v1/completions", json=ids), 413, "context_length_exceeded")
        # the page's chat: the same route, signed in with a session and its CSRF token
        password = bg.swarm.leader.first_start.admin_password
        with httpx.Client(base_url=bg.swarm.url, timeout=60) as page:
            assert page.post("/api/v1/auth/login", json={"name": "admin", "password": password}).status_code == 200
            csrf = page.get("/api/v1/me").json()["csrf"]
            error = stream_error(page.post("/v1/chat/completions", json={**body, "stream": True},
                                           headers={"x-csrf-token": csrf}))
            assert error["code"] == "context_length_exceeded"
        # what fits the served context is answered
        fits = {"model": "long", "messages": [{"role": "user", "content": words(model_dirs["long"], 3000)}],
                "max_tokens": 8, "temperature": 0}
        response = http.post("/v1/chat/completions", json=fits)
        assert response.status_code == 200, response.text
    assert not bg.sync(lambda: bg.swarm.leader.serving.book.of_model("long")), "a refused conversation ran"


def test_a_model_with_a_shorter_context_than_the_cap_is_held_to_its_own(bg, model_dirs):
    """A model made for 512 tokens took a 600-token conversation (its positions past what it was trained for)."""
    with client(bg) as http:
        body = {"model": "short", "messages": [{"role": "user", "content": words(model_dirs["short"], 600)}],
                "max_tokens": 16}
        message = error_of(http.post("/v1/chat/completions", json=body), 413, "context_length_exceeded")
        assert "holds 512" in message and "the model's own context" in message, message
        # no max_tokens: the reply gets what the context leaves, and a prompt that leaves nothing is refused
        del body["max_tokens"]
        error_of(http.post("/v1/chat/completions", json=body), 413, "context_length_exceeded")


def test_the_mcp_chat_tool_refuses_a_conversation_longer_than_the_context(bg, model_dirs):
    from mcp import ClientSession

    from test_mcp import Mcp, mcp_session

    text = words(model_dirs["long"], 6000)

    async def ask():
        http, transport = mcp_session(bg.swarm.url, bg.swarm.token)
        async with http, transport as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            return await Mcp(session).call("chat", {"model": "long", "prompt": text, "max_tokens": 512})

    kind, message = bg.call(ask)
    assert kind == "error" and "maximum context length" in message and "413" in message, (kind, message)


# --- finding 2: body and prompt sizes follow the served context; big bodies are handled off the event loop -----------


def _leader_address(bg) -> tuple[str, int]:
    url = urlsplit(bg.swarm.url)
    return url.hostname, url.port


def test_a_body_over_the_served_context_limit_is_refused_before_it_is_read(bg):
    """The /v1 body limit came out at ~248 MB with a big KV budget. A prompt of 4,096 tokens is at most 2 MiB of JSON:
    a 3 MiB body is refused from its Content-Length, with no more than its first 64 KiB sent."""
    declared = 3 << 20
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: leader\r\nAuthorization: Bearer {bg.swarm.token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n").encode()
    with socket.create_connection(_leader_address(bg), timeout=5) as sock:
        sock.sendall(head + b'{"model": "long", "messages": [{"role": "user", "content": "' + b"x" * (64 << 10))
        started = time.monotonic()
        answer = b""
        try:
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
        except TimeoutError:
            pass
    assert answer.startswith(b"HTTP/1.1 413"), f"no 413 within 5 s of 64 KiB of a 3 MiB body: {answer[:200]!r}"
    assert b"body_too_large" in answer and time.monotonic() - started < 5


class HealthWatch:
    """/healthz asked every 50 ms from a thread of its own while a test does something else: the slowest answer."""

    def __init__(self, bg):
        self.url = bg.swarm.url
        self.worst = 0.0
        self.asked = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as http:
            while not self._stop.is_set():
                started = time.monotonic()
                assert http.get("/healthz").status_code == 200
                self.worst = max(self.worst, time.monotonic() - started)
                self.asked += 1
                self._stop.wait(0.05)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)


def test_an_oversized_prompt_under_the_body_limit_is_refused_while_the_leader_keeps_answering(bg):
    """A 40 MB prompt was checked against the pool's budget (164 MB by bytes), tokenised, and held the event loop for
    71 s. Under the body limit now, a prompt far longer than the context is a 413 context_length_exceeded within
    seconds -- text by its bytes before the tokenizer sees it, token ids by their count before they are decoded --
    and /healthz keeps answering meanwhile."""
    text = WORDS * 125_000  # 1.5 MB: ~250,000 tokens
    ids = [5] * 400_000  # ~1.2 MB of JSON
    with HealthWatch(bg) as health, client(bg, read=20) as http:
        started = time.monotonic()
        message = error_of(http.post("/v1/chat/completions", json={
            "model": "long", "messages": [{"role": "user", "content": text}], "max_tokens": 8}),
            413, "context_length_exceeded")
        assert "maximum context length" in message
        error_of(http.post("/v1/completions", json={"model": "long", "prompt": text, "max_tokens": 8}),
                 413, "context_length_exceeded")
        error_of(http.post("/v1/completions", json={"model": "long", "prompt": ids, "max_tokens": 8}),
                 413, "context_length_exceeded")
        took = time.monotonic() - started
    assert took < 10, f"three refusals took {took:.1f} s"
    assert health.asked and health.worst < 1.0, f"/healthz took up to {health.worst:.2f} s meanwhile"
    assert not bg.sync(lambda: bg.swarm.leader.serving.book.of_model("long")), "a refused prompt ran"


# --- finding 3: a request's replies end with its client, and a request may ask for only so many ----------------------


def _idle(bg, model: str) -> bool:
    book = bg.swarm.leader.serving.book
    return bg.sync(lambda: not book.of_model(model) and not book.queued(model))


LEAVE_CASES = {
    # two groups of 8: the second waits for the first while the stream has not started (15 ran for nobody)
    "completions-stream": ("/v1/completions", {"prompt": ["Count", "Count to ten"], "n": 8, "stream": True}, 16),
    "completions": ("/v1/completions", {"prompt": "Count", "n": 8}, 8),
    "chat-stream": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count"}], "n": 8,
                                             "stream": True}, 8),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count"}], "n": 8}, 8),
}


@pytest.mark.parametrize("case", list(LEAVE_CASES))
def test_a_client_that_leaves_cancels_every_reply_of_its_request(bg, case):
    """Long sampled replies (ignore_eos, up to 4,000 tokens each: seconds of work even on a fast machine); the client
    waits half a second, then closes its connection. Every reply of the request ends as cancelled within seconds,
    the model's queue and slots are free again, and the next request is answered at once."""
    path, extra, replies = LEAVE_CASES[case]
    assert _idle(bg, "long")
    bg.sync(bg.ended.clear)
    body = {"model": "long", "max_tokens": 4000, "ignore_eos": True, "temperature": 1.0, **extra}
    with client(bg, read=0.5) as http:
        try:
            with http.stream("POST", path, json=body) as response:
                assert response.status_code == 200
                next(response.iter_lines())  # the stream started: leave in the middle of it
        except httpx.ReadTimeout:
            pass  # no answer yet: leave while it is still waiting or generating
    wait_for(lambda: _idle(bg, "long"), 5, message=lambda: f"still running: "
             f"{bg.sync(lambda: [(r.id, len(r.tokens)) for r in bg.swarm.leader.serving.book.of_model('long')])}")
    finished = bg.sync(lambda: [(r.finish_reason, len(r.tokens)) for r in bg.ended])
    assert len(finished) == replies and all(reason == "cancelled" for reason, _ in finished), finished
    started = time.monotonic()
    with client(bg) as http:
        response = http.post("/v1/chat/completions", json={"model": "long", "max_tokens": 4, "temperature": 0,
                                                           "messages": [{"role": "user", "content": "Count"}]})
    assert response.status_code == 200 and time.monotonic() - started < 5, response.text


def test_one_request_may_ask_for_a_bounded_number_of_replies(bg):
    """Prompts x n had no bound but 32 x 8 (256 requests on the ring from one call); past SWARM_SERVE_REQUEST_REPLIES
    (64) the request is a 400 saying how to split it."""
    with client(bg) as http:
        body = {"model": "short", "prompt": ["Count"] * 9, "n": 8, "max_tokens": 1}
        message = error_of(http.post("/v1/completions", json=body), 400, "too_many_replies")
        assert "72 replies" in message and "at most 64" in message and "SWARM_SERVE_REQUEST_REPLIES" in message
    assert _idle(bg, "short")


def test_the_request_replies_setting_is_checked():
    from swarm.config import Settings
    from swarm.errors import BadRequest, ConfigError
    from swarm.leader.api.limits import check_replies

    assert Settings.from_env({}).serve_request_replies == 64
    assert Settings.from_env({"SWARM_SERVE_REQUEST_REPLIES": "8"}).serve_request_replies == 8
    with pytest.raises(ConfigError, match="SWARM_SERVE_REQUEST_REPLIES"):
        Settings.from_env({"SWARM_SERVE_REQUEST_REPLIES": "0"})
    check_replies(8, 8, 64)
    with pytest.raises(BadRequest, match="65 replies"):
        check_replies(13, 5, 64)
