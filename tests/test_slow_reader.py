"""Finding 2 of issue 10, attacked: a client that stops reading a long stream must not wedge the model for everyone.

It used to fill the request's event channel, block the leader's loop on the fellow link, and fail every user's
requests on that model until a restart. Now the leader keeps a request's tokens in the request (bounded by its
max_tokens) and readers never block the fellow link: the stalled stream runs to its end while other chats complete,
and unloading still works.
"""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import pytest
import trio

from harness import running_swarm

pytestmark = pytest.mark.e2e


async def test_a_client_that_stops_reading_its_stream_does_not_wedge_the_model(tmp_path, smollm_model_dir):
    name = smollm_model_dir.name
    with trio.fail_after(300):
        async with running_swarm(tmp_path, [smollm_model_dir], fellows=2) as swarm:
            await swarm.load(name, 2)
            url = urlsplit(swarm.url)
            sock = trio.socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # a tiny window: the stream backs up
            await sock.connect((url.hostname, url.port))
            stalled = trio.SocketStream(sock)
            body = json.dumps({"model": name, "stream": True, "max_tokens": 600, "temperature": 0,
                               "messages": [{"role": "user", "content": "Count from 1 to 500, one per line."}]})
            await stalled.send_all((
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {swarm.token}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
            # ...and never reads. Another user's chats still complete, one after another:
            for question in ("Say hello.", "Name a colour.", "Name a fruit."):
                with trio.fail_after(120):
                    data = await swarm.chat(name, [{"role": "user", "content": question}], max_tokens=12)
                assert data["choices"][0]["message"]["content"]
            # the model can still be unloaded (it used to hang)
            with trio.fail_after(30):
                response = await swarm.http.post(f"/api/v1/models/{name}/unload")
            assert response.status_code == 200, response.text
            await stalled.aclose()
