"""The MCP tools at /mcp, driven by the official SDK's own client against a real leader and two fellows: the tools are
listed, chat gives generate's greedy reply, a saved chat is listed, renamed and deleted (and stays private to its
user), and a bad argument or a bad token is an error, not a crash."""

from __future__ import annotations

import json

import httpx2
import pytest
import torch
import trio
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

from exactness import reference
from harness import running_swarm

pytestmark = pytest.mark.e2e

QUESTION = "Name three colours."
TOOLS = {"models_list", "models_load", "models_unload", "models_performance", "models_plan", "chat", "chats_list",
         "chats_get", "chats_rename", "chats_delete"}
# A made-up speed for each fellow (they run with SWARM_CALIBRATE=0 here): 1 ms + 1e-7 ms/byte a decode step.
CALIBRATION = {"prefill_tokens": 256, "points": [{"weight_bytes": 1_000_000, "decode_ms": 1.1, "prefill_ms": 30},
                                                 {"weight_bytes": 10_000_000, "decode_ms": 2.0, "prefill_ms": 300}]}


class Mcp:
    def __init__(self, session: ClientSession):
        self.session = session

    async def call(self, name: str, arguments: dict | None = None):
        result = await self.session.call_tool(name, arguments or {})
        text = "".join(block.text for block in result.content if getattr(block, "text", None))
        if result.is_error:
            return "error", text
        return "ok", result.structured_content.get("result", result.structured_content) \
            if result.structured_content is not None else json.loads(text)


def mcp_session(url: str, token: str):
    """(http client, transport) for an MCP session as the holder of ``token``."""
    http = httpx2.AsyncClient(headers={"authorization": f"Bearer {token}"}, timeout=120)
    return http, streamable_http_client(f"{url}/mcp", http_client=http)


async def test_mcp_tools_reach_models_and_chats_as_the_api_does(tmp_path, smollm_model_dir):
    from reference_model import load_reference_model
    from swarm.leader.chat.chat_format import encode_chat, load_tokenizer

    name = smollm_model_dir.name
    model = load_reference_model(smollm_model_dir, dtype=torch.float32)
    want, _ = reference(model, encode_chat(smollm_model_dir, [{"role": "user", "content": QUESTION}], None), 24,
                        eos=[2])
    want_text = load_tokenizer(str(smollm_model_dir)).decode(want, skip_special_tokens=True)
    with trio.fail_after(300):
        async with running_swarm(tmp_path, [smollm_model_dir], fellows=2) as swarm:
            http, transport = mcp_session(swarm.url, swarm.token)
            async with http, transport as (read, write), ClientSession(read, write) as session:
                await session.initialize()
                tools = {t.name for t in (await session.list_tools()).tools}
                assert TOOLS <= tools, tools
                mcp = Mcp(session)
                kind, models = await mcp.call("models_list")
                assert kind == "ok" and [m["id"] for m in models] == [name]
                assert models[0]["status"] == "not_loaded"
                # the plan before loading: the plan route's answer, and its refusals in its words
                kind, text = await mcp.call("models_plan", {"model": name})
                assert kind == "error" and "not reported their speed yet" in text and "HTTP 409" in text
                for conn in swarm.leader.hub.online.values():
                    conn.calibration = CALIBRATION
                for query in ({"num_stages": 2}, {"num_stages": 1}, {}):
                    kind, planned = await mcp.call("models_plan", {"model": name, **query})
                    assert kind == "ok", planned
                    assert planned == (await swarm.http.get(f"/api/v1/models/{name}/plan", params=query)).json()
                    assert planned["num_stages"] == query.get("num_stages", 2) and planned["tokens_per_s"] > 0
                    assert planned["text"].startswith("about ")
                kind, text = await mcp.call("models_plan", {"model": name, "num_stages": 3})
                assert kind == "error" and "needs 3 fellows online" in text and "HTTP 409" in text
                kind, started = await mcp.call("models_load", {"model": name, "num_stages": 2, "quantization": "none"})
                assert kind == "ok", started
                await swarm.leader.serving.loader.wait_ready(name, 120)
                kind, reply = await mcp.call("chat", {"model": name, "prompt": QUESTION, "temperature": 0,
                                                      "max_tokens": 24})
                assert kind == "ok", reply
                assert reply["content"] == want_text and reply["usage"]["completion_tokens"] == len(want)
                kind, perf = await mcp.call("models_performance", {"model": name})
                assert kind == "ok" and perf["status"] == "ready" and len(perf["stages"]) == 2
                assert perf["range"] == "15m" and perf["last_15m"]["tokens"] == len(want)
                kind, perf = await mcp.call("models_performance", {"model": name, "range": "24h"})
                assert kind == "ok" and perf["step_s"] == 3600 and perf["speed"]["tokens"] == len(want)
                kind, text = await mcp.call("models_performance", {"model": name, "range": "2h"})
                assert kind == "error" and "15m, 1h, 6h, 24h, 7d" in text and "HTTP 400" in text
                # a bad argument: the API's own words, as a tool error
                kind, text = await mcp.call("chat", {"model": name, "prompt": "hi", "temperature": 5})
                assert kind == "error" and "temperature" in text and "HTTP 400" in text
                kind, text = await mcp.call("chat", {"model": name})
                assert kind == "error" and "either messages" in text
                kind, text = await mcp.call("models_load", {"model": "no-such-model"})
                assert kind == "error" and "404" in text
                kind, text = await mcp.call("models_load", {"model": name, "quantization": "int3"})
                assert kind == "error" and "none, int8, nf4, int4-fast" in text and "HTTP 400" in text

                # saved chats: the same ones the REST API shows, private to their user
                saved = (await swarm.http.post("/api/v1/chats", json={
                    "title": "colours", "model": name, "messages": [{"role": "user", "content": QUESTION}]})).json()
                kind, chats = await mcp.call("chats_list")
                assert kind == "ok" and [c["id"] for c in chats] == [saved["id"]]
                kind, one = await mcp.call("chats_get", {"chat_id": saved["id"]})
                assert kind == "ok" and one["messages"][0]["content"] == QUESTION
                kind, _ = await mcp.call("chats_rename", {"chat_id": saved["id"], "title": "three colours"})
                assert kind == "ok"
                assert (await swarm.http.get(f"/api/v1/chats/{saved['id']}")).json()["title"] == "three colours"
                kind, _ = await mcp.call("chats_delete", {"chat_id": saved["id"]})
                assert kind == "ok"
                assert (await swarm.http.get(f"/api/v1/chats/{saved['id']}")).status_code == 404
                kind, text = await mcp.call("chats_get", {"chat_id": saved["id"]})
                assert kind == "error" and "no such chat" in text

                kind, _ = await mcp.call("models_unload", {"model": name})
                assert kind == "ok" and swarm.leader.serving.status(name) == "not_loaded"

            # a bad token: refused before any tool runs, in words
            response = await swarm.http.post("/mcp", headers={"authorization": "Bearer swt_nope"},
                                             json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
            assert response.status_code == 401 and "API token" in response.json()["error"]["message"]
