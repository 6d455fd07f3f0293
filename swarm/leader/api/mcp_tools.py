"""The leader's MCP tools (toolset ``serving``), for agents: list, load and unload models, see how one performs, chat,
and read, rename and delete saved chats.

Streamable HTTP at ``/mcp`` (the official ``mcp`` SDK, stateless, JSON responses), authenticated with an API token as
a Bearer header. Each tool is a call to the leader's own REST or OpenAI route made in-process with the caller's
token, so a tool reaches the same models and chats under the same rules as the API (chats private to the token's
user, the same validation and the same error words); a refusal comes back as a tool error, never a crash.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any
from urllib.parse import quote

import httpx
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse

from swarm.errors import AuthError, BodyTooLarge
from swarm.leader.api.auth import current_user
from swarm.leader.api.http_errors import api_error

log = logging.getLogger(__name__)

# the caller's bearer token, for the in-process calls a tool makes
_token: contextvars.ContextVar[str] = contextvars.ContextVar("mcp_token")

INSTRUCTIONS = (
    "swarm serves large language models split over several PCs. models_list shows the catalogue and what is loaded; "
    "models_load puts a model on the pool's fellows (it answers once the load has started; poll models_list for "
    "ready); models_plan tells how fast a model would run before loading it; chat sends messages to a loaded model "
    "and returns its reply; chats_* reach your saved chats."
)


class McpEndpoint:
    """The ASGI app behind ``/mcp``: checks the API token, then hands the request to the SDK's transport."""

    def __init__(self, leader):
        self.leader = leader
        self.server = build_server(leader)
        self.transport = self.server.streamable_http_app(streamable_http_path="/mcp", stateless_http=True,
                                                         json_response=True)

    def run(self):
        """The SDK's session manager: entered for as long as the leader serves."""
        return self.server.session_manager.run()

    async def __call__(self, scope, receive, send) -> None:
        from starlette.requests import Request

        request = Request(scope, receive)
        if request.method == "GET":
            # A GET would open the stream of server-initiated messages; this server sends none (stateless, JSON
            # answers), and the SDK held such a stream open, idle, for ever. The MCP spec (streamable HTTP) lets a
            # server answer 405 instead.
            response = JSONResponse({"error": {"message": "GET /mcp opens no event stream on this leader: send "
                                                          "JSON-RPC requests with POST.", "type": "method_not_allowed",
                                               "code": "method_not_allowed"}}, status_code=405,
                                    headers={"allow": "POST, DELETE"})
            await response(scope, receive, send)
            return
        try:
            await current_user(request, self.leader.store)
        except AuthError as exc:
            response = JSONResponse({"error": {"message": f"{exc} The MCP tools take an API token as a Bearer "
                                                          "header (Settings -> API tokens, or swarm admin token).",
                                               "type": "unauthorized", "code": "unauthorized"}}, status_code=401,
                                    headers={"www-authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        try:
            # Read here, not in the SDK: a chunked body over the route's limit raises BodyTooLarge
            # (swarm.leader.api.limits), which the SDK answered as a 500.
            body = await request.body()
        except BodyTooLarge as exc:
            await api_error(exc)(scope, receive, send)
            return
        except ClientDisconnect:
            log.info("an MCP client went away while sending its request")
            return
        token = _token.set(request.headers.get("authorization", "").removeprefix("Bearer ").strip())
        try:
            await self.transport(scope, _replay(body, receive), send)
        finally:
            _token.reset(token)


def _replay(body: bytes, receive):
    """An ASGI receive that gives ``body`` (already read) first, then whatever ``receive`` has (a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed


def segment(value: Any, what: str) -> str:
    """``value`` as one path segment of a route, percent-encoded; ToolError for what cannot be one. Used as it came,
    "../users/5" as a chat id reached another route (chats_delete with it deleted a user). No id has a "/" (chat ids
    are URL-safe tokens, model ids folder names), and the leader's routes see "%2F" decoded, so one is refused."""
    if not isinstance(value, str) or value in ("", ".", "..") or "/" in value or "\\" in value:
        raise ToolError(f"{value!r} is not a {what}; {what}s are listed by "
                        f"{'chats_list' if what == 'chat id' else 'models_list'}.")
    return quote(value, safe="")


def build_server(leader) -> MCPServer:
    server = MCPServer("swarm", instructions=INSTRUCTIONS)

    async def call(method: str, path: str, body: dict | None = None, params: dict | None = None) -> Any:
        """The leader's own route, in-process, as the caller; its refusal as a tool error in its own words."""
        transport = httpx.ASGITransport(app=leader.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://leader",
                                     headers={"authorization": f"Bearer {_token.get()}"}, timeout=None) as http:
            response = await http.request(method, path, json=body, params=params)
        try:
            data = response.json()
        except ValueError:
            data = {"error": {"message": response.text}}
        if response.status_code >= 400:
            error = data.get("error") if isinstance(data, dict) else None
            message = error.get("message") if isinstance(error, dict) else response.text
            raise ToolError(f"{message} (HTTP {response.status_code})")
        return data

    @server.tool(description="The models of your pools (an admin's: every pool's), each with its id (its name, or "
                             "NAME@POOL outside the default pool), its pool, its status (not_loaded, loading, ready, "
                             "recovering, failed) and where its stages run.")
    async def models_list() -> list[dict]:
        return (await call("GET", "/api/v1/models"))["models"]

    @server.tool(description="Load a model on the pool. num_stages splits it over that many fellows (1: one PC, "
                             "with fellow_id to choose which); by default the leader places it. quantization "
                             "(none, int8, nf4, int4-fast, gguf) holds the weights at 8 or 4 bits, or gguf: on a "
                             "GGUF model's own quantized blocks (its default); context_tokens caps "
                             "the conversation length served (default: the model's own); kv_cache (auto, f32, f16, "
                             "q8) holds keys and values at that width, q8 at about half of f16. Returns at once; "
                             "the model is ready when models_list says so.")
    async def models_load(model: str, num_stages: int | None = None, fellow_id: int | None = None,
                          quantization: str | None = None, context_tokens: int | None = None,
                          kv_cache: str | None = None) -> dict:
        body = {k: v for k, v in (("num_stages", num_stages), ("fellow_id", fellow_id),
                                  ("quantization", quantization), ("context_tokens", context_tokens),
                                  ("kv_cache", kv_cache)) if v is not None}
        return await call("POST", f"/api/v1/models/{segment(model, 'model id')}/load", body)

    @server.tool(description="Unload a model from every fellow serving it.")
    async def models_unload(model: str) -> dict:
        return await call("POST", f"/api/v1/models/{segment(model, 'model id')}/unload")

    @server.tool(description="How a model performs over a range (15m live, or 1h, 6h, 24h, 7d from the serving "
                             "history): tokens/s now or the median per reply, median time to first token, tokens "
                             "generated, a tokens/s series; each stage's fellow, layers and GPUs (load, memory, "
                             "power, temperature; CPU and RAM without one); each hop (transport, bytes per token, "
                             "bytes/s, round trip); where each token's time goes and a bottleneck sentence; and the "
                             "last 15 minutes' replies, failures, tokens/s and first-token times at p50 and p95.")
    async def models_performance(model: str, range: str = "15m") -> dict:  # `range`: the API's name
        return await call("GET", f"/api/v1/models/{segment(model, 'model id')}/performance", params={"range": range})

    @server.tool(description="Before loading: how fast a model would run on the pool now -- decode tokens/s, the "
                             "time to first token of a 1,000-token prompt, per stage its fellow, layers and ms per "
                             "token, per hop its round trip (measured or assumed), the bottleneck and a sentence. "
                             "num_stages: over that many fellows (by default as a load would place it).")
    async def models_plan(model: str, num_stages: int | None = None) -> dict:
        params = {"num_stages": num_stages} if num_stages is not None else None
        return await call("GET", f"/api/v1/models/{segment(model, 'model id')}/plan", params=params)

    @server.tool(description="Send a chat to a loaded model and return its reply. Give messages (a list of "
                             "{role, content}) or a prompt (one user message). temperature 0 is greedy; unset "
                             "sampling is the model's own. reasoning false asks a reasoning model not to think first.")
    async def chat(model: str, messages: list[dict] | None = None, prompt: str | None = None,
                   temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                   min_p: float | None = None, max_tokens: int | None = None,
                   reasoning: bool | None = None) -> dict:
        if (messages is None) == (prompt is None):
            raise ToolError("give either messages (a list of {role, content}) or a prompt, not both and not neither.")
        body: dict = {"model": model, "messages": messages if messages is not None else
                      [{"role": "user", "content": prompt}]}
        for key, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("min_p", min_p),
                           ("max_tokens", max_tokens)):
            if value is not None:
                body[key] = value
        if reasoning is not None:
            body["chat_template_kwargs"] = {"enable_thinking": reasoning}
        data = await call("POST", "/v1/chat/completions", body)
        choice = data["choices"][0]
        reply = {"content": choice["message"].get("content") or "", "finish_reason": choice["finish_reason"],
                 "usage": data["usage"]}
        if choice["message"].get("reasoning_content"):
            reply["reasoning"] = choice["message"]["reasoning_content"]
        return reply

    @server.tool(description="Your saved chats, newest first: id, title, model and when each was last changed.")
    async def chats_list() -> list[dict]:
        return (await call("GET", "/api/v1/chats"))["chats"]

    @server.tool(description="One of your saved chats, with its messages.")
    async def chats_get(chat_id: str) -> dict:
        return await call("GET", f"/api/v1/chats/{segment(chat_id, 'chat id')}")

    @server.tool(description="Give one of your saved chats a new title.")
    async def chats_rename(chat_id: str, title: str) -> dict:
        return await call("PATCH", f"/api/v1/chats/{segment(chat_id, 'chat id')}", {"title": title})

    @server.tool(description="Delete one of your saved chats for good.")
    async def chats_delete(chat_id: str) -> dict:
        await call("DELETE", f"/api/v1/chats/{segment(chat_id, 'chat id')}")
        return {"deleted": chat_id}

    return server


