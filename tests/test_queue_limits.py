"""What a client sees when the pool is full, through the real API: a full queue is a 429 with Retry-After in the
OpenAI error shape, a request that waits too long to start is a 503 that says why (never a hang), and a client that
goes away while its request waits takes it out of the queue.

The ring is held still for these tests (its stages' compute waits on a gate), so that "busy" is certain rather than
a matter of timing; the pool runs one request at a time."""

from __future__ import annotations

import json

import pytest
import trio

from harness import running_swarm, wait_until
from scripted import hold_compute, imported
from swarm.leader.serving.admission import Budget
from swarm.leader.serving.models import ModelServing

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def scripted_dir(module_tmp):
    return imported(module_tmp("scripted"), "qwen3-queue", {"assistant\n": ["The", " answer", " is", " 4."]})


@pytest.fixture
def gate(monkeypatch):
    """Stages compute only while the gate is open."""
    opened = hold_compute(monkeypatch)
    monkeypatch.setattr(ModelServing, "budget", lambda self, settings: Budget(max_requests=1, tokens=4096))
    yield opened
    opened.set()


async def _chat(swarm, name: str, out: dict, stream: bool = False) -> None:
    body = {"model": name, "messages": QUESTION, "temperature": 0, "max_tokens": 4, "stream": stream}
    response = await swarm.http.post("/v1/chat/completions", json=body, timeout=60)
    out["status"], out["headers"], out["text"] = response.status_code, response.headers, response.text


async def test_a_full_queue_is_a_429_and_a_long_wait_a_503(tmp_path, scripted_dir, gate):
    name = scripted_dir.name
    env = {"SWARM_SERVE_QUEUE_LIMIT": "1", "SWARM_SERVE_QUEUE_TIMEOUT_S": "3"}
    with trio.fail_after(120):
        async with running_swarm(tmp_path, [scripted_dir], fellows=2, leader_env=env) as swarm:
            await swarm.load(name, 2)
            book = swarm.leader.serving.book
            first, second, third = {}, {}, {}
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_chat, swarm, name, first)  # runs (and is held on the ring)
                await wait_until(lambda: len(book.of_model(name)) == 1, 20)
                nursery.start_soon(_chat, swarm, name, second, True)  # waits: the pool runs one at a time
                await wait_until(lambda: book.queued(name) == 1, 20)
                # the queue is full: refused at once, with when to come back
                await _chat(swarm, name, third)
                assert third["status"] == 429, third["text"]
                error = json.loads(third["text"])["error"]
                assert error["type"] == "rate_limit_error" and error["code"] == "pool_busy"
                assert f"the pool serving {name} is busy: its queue is full, with 1 request waiting" in error["message"]
                assert "SWARM_SERVE_QUEUE_LIMIT" in error["message"]
                assert 1 <= int(third["headers"]["retry-after"]) <= 300
                # the waiting one gives up after SWARM_SERVE_QUEUE_TIMEOUT_S: a real 503, even for a stream
                await wait_until(lambda: "status" in second, timeout=20)
                assert second["status"] == 503, second["text"]
                error = json.loads(second["text"])["error"]
                assert error["code"] == "queue_timeout" and error["type"] == "server_error"
                assert error["message"].startswith(f"this request waited 3 s for room on the pool serving {name} "
                                                   "and did not start (SWARM_SERVE_QUEUE_TIMEOUT_S), with 1 other "
                                                   "request running or waiting")
                assert book.queued(name) == 0
                gate.set()  # the ring moves again: the first request is answered in full
            assert first["status"] == 200, first["text"]
            assert json.loads(first["text"])["choices"][0]["message"]["content"] == "The answer is 4."


async def test_a_client_that_goes_away_leaves_the_queue(tmp_path, scripted_dir, gate):
    name = scripted_dir.name
    with trio.fail_after(120):
        async with running_swarm(tmp_path, [scripted_dir], fellows=2) as swarm:
            await swarm.load(name, 2)
            book = swarm.leader.serving.book
            first, gone = {}, {}
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_chat, swarm, name, first)
                await wait_until(lambda: len(book.of_model(name)) == 1, 20)
                scope = trio.CancelScope()
                nursery.start_soon(_leave, scope, swarm, name, gone)
                await wait_until(lambda: book.queued(name) == 1, 20)
                scope.cancel()  # the client closes its connection without a word
                await wait_until(lambda: book.queued(name) == 0, timeout=10)
                gate.set()
            assert first["status"] == 200 and "status" not in gone
            # nothing is left on the stages once the reply is done
            await wait_until(lambda: all(f.stages[name].held() == {"requests": 0, "caches": 0}
                                         for f in swarm.fellows), timeout=10)


async def _leave(scope: trio.CancelScope, swarm, name: str, out: dict) -> None:
    with scope:
        await _chat(swarm, name, out, stream=True)
