"""The leader process: one trio process serving the web app, /v1 (Anthropic's /v1/messages too), /api/v1, Ollama's
/api, the fellow links and the relay."""

from __future__ import annotations

import dataclasses
import logging
import secrets
from pathlib import Path

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, RedirectResponse
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

from swarm.config import Settings
from swarm.errors import AuthError, ConfigError
from swarm.leader.api.accounts_api import AccountRoutes
from swarm.leader.api.admin_api import admin_routes
from swarm.leader.api.anthropic_api import ANTHROPIC_PATHS, AnthropicRoutes
from swarm.leader.api.auth import bearer, current_user
from swarm.leader.api.completions import CompletionRoutes
from swarm.leader.api.headers import SecurityHeaders
from swarm.leader.api.hypercorn_close import guard_close_race
from swarm.leader.api.limits import CHAT_BODY_MARGIN, DEFAULT_BODY, SIGN_IN_BODY, BodyLimit, chat_body_limit
from swarm.leader.api.mcp_tools import McpEndpoint
from swarm.leader.api.metrics import Metrics, MetricsRoute
from swarm.leader.api.ollama_api import OLLAMA_CHAT_PATHS, OLLAMA_PATHS, OllamaRoutes
from swarm.leader.api.openai_api import OpenAIRoutes
from swarm.leader.api.responses_api import RESPONSES_PATH, ResponsesRoutes
from swarm.leader.api.rest import ApiRoutes
from swarm.leader.api.signin import HashPool, SignInThrottle
from swarm.leader.api.usage_api import usage_routes
from swarm.leader.api.verify_api import verify_routes
from swarm.leader.api.ws_message_limit import close_on_oversize
from swarm.leader.fleet.direct_links import DirectLinkCoordinator
from swarm.leader.fleet.fellows import FellowHub
from swarm.leader.fleet.install import InstallRoutes
from swarm.leader.fleet.relay import RelayHub
from swarm.leader.fleet.updates import SelfWheel, UpdateRoutes
from swarm.leader.serving import timing
from swarm.leader.serving.history import ServingHistory
from swarm.leader.serving.quotas import QuotaBook
from swarm.leader.serving.serving import Serving
from swarm.mesh.rendezvous import serve_rendezvous
from swarm.store.db import Store, leader_store
from swarm.store.fleet import DEFAULT_POOL, JOIN_TOKEN_TTL_S, JOIN_TOKEN_USES
from swarm.tunnel.join_token import make_join_token
from swarm.tunnel.keys import fingerprint, load_or_create_identity
from swarm.tunnel.noise import MAX_FRAME
from swarm.tunnel.tls import cert_pin_of_file

log = logging.getLogger(__name__)

WEB_DIR = Path(__file__).resolve().parent.parent / "web"


@dataclasses.dataclass
class FirstStart:
    admin_name: str
    admin_password: str
    admin_token: str
    join_token: str


class Leader:
    def __init__(self, data_dir: Path, settings: Settings, *, tls_cert: Path | None = None,
                 tls_key: Path | None = None):
        self.data_dir = data_dir
        self.settings = settings
        if (tls_cert is None) != (tls_key is None):
            raise ConfigError("HTTPS needs both --tls-cert and --tls-key.")
        self.tls = (Path(tls_cert), Path(tls_key)) if tls_cert is not None and tls_key is not None else None
        try:
            # Join tokens pin this certificate: fellows trust it alone (swarm.tunnel.tls).
            self.cert_pin = cert_pin_of_file(self.tls[0]) if self.tls else None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the TLS certificate {tls_cert}: {exc}") from None
        data_dir.mkdir(parents=True, exist_ok=True)
        self.store = leader_store(data_dir, settings)
        self.private, self.public = load_or_create_identity(data_dir / "leader.key")
        self.models_root = data_dir / "models"
        self.relay = RelayHub()
        self.serving = Serving(self.store, settings, self.models_root, self.relay)
        # each record keeps its reply's swarm.timing, the fellows' split included, once their times came in
        self.metrics = Metrics(self)
        self.serving.verifier.metrics = self.metrics
        self.history = ServingHistory(self.store, settings.serving_history_days,
                                      timing=lambda request: timing.of_request(self.serving, request),
                                      on_settled=self.metrics.observe)
        self.quotas = QuotaBook(self.store, self.serving.book)
        self.serving.quotas = self.quotas

        def ended(request) -> None:  # RequestBook.on_end: each must not block and never raises
            self.history.record(request)
            self.quotas.on_end(request)

        self.serving.book.on_end = ended
        self.hub = FellowHub(self.store, self.private, self.serving)
        self.serving.hub = self.hub
        self.hub.updates = SelfWheel(data_dir / "updates")
        self.direct_links = DirectLinkCoordinator(self.store, self.serving)
        self.serving.direct_links = self.direct_links
        self.signin = SignInThrottle()
        self.hashing = HashPool()
        self.first_start = initialize(self.store, self.public, self.cert_pin)
        self.mcp = McpEndpoint(self)  # its tools call self.app in-process, once it exists
        self.app = SecurityHeaders(BodyLimit(self._build_app(), self.body_limit, flat_errors=OLLAMA_PATHS,
                                             anthropic_errors=ANTHROPIC_PATHS))

    def body_limit(self, path: str) -> int:
        """The largest request body ``path`` accepts (swarm.leader.api.limits)."""
        if path == "/api/v1/auth/login":
            return SIGN_IN_BODY
        if path in ("/v1/chat/completions", "/v1/completions", RESPONSES_PATH, *OLLAMA_CHAT_PATHS, *ANTHROPIC_PATHS):
            # no model serves a longer context than the longest loaded (never the pool's KV budget: issue 32)
            return chat_body_limit(self.serving.contexts.largest_context())
        if path.startswith("/api/v1/chats"):
            return 2 * self.store.max_chat_bytes + CHAT_BODY_MARGIN  # a whole chat, every character escaped
        return DEFAULT_BODY

    async def new_join_token(self, ttl_s: float = JOIN_TOKEN_TTL_S, uses: int = JOIN_TOKEN_USES,
                             pool: str = DEFAULT_POOL) -> str:
        """A join token that lets ``uses`` fellows into ``pool`` (PoolNotFound when there is none of that name)."""
        found = await trio.to_thread.run_sync(self.store.pool_by_name, pool)
        secret = await trio.to_thread.run_sync(self.store.create_join_token, found.id, ttl_s, uses)
        return make_join_token(self.public, secret, self.cert_pin)

    def pool_path(self, pool) -> str:
        """The chat page of ``pool``: /pools/{owner}/{pool}/inference (blocks: call it in a thread)."""
        owner = self.store.get_user(pool.owner_user_id) if pool.owner_user_id else None
        return f"/pools/{owner.name if owner else 'admin'}/{pool.name}/inference"

    async def home_path(self, user=None) -> str:
        """The page a user lands on: their only pool's, else every pool of theirs (/inference)."""
        def pick():
            pools = self.store.list_pools()
            if user is not None and not user.is_admin:
                mine = self.store.member_pool_ids(user.id)
                pools = [p for p in pools if p.id in mine]
            return self.pool_path(pools[0]) if len(pools) == 1 else "/inference"

        return await trio.to_thread.run_sync(pick)

    def _build_app(self) -> Starlette:
        api = ApiRoutes(self)
        accounts = AccountRoutes(self)
        oai = OpenAIRoutes(self)
        ollama = OllamaRoutes(oai)
        responses = ResponsesRoutes(oai)
        anthropic = AnthropicRoutes(oai)
        updates = UpdateRoutes(self)
        install = InstallRoutes(self)

        async def fellow_link(ws: WebSocket):
            await self.hub.handle(ws)

        async def relay(ws: WebSocket):
            hop_id = ws.path_params["hop_id"]
            role = ws.query_params.get("role", "")
            fellow = await trio.to_thread.run_sync(self.store.fellow_by_credential, bearer(ws) or "")
            if role not in ("dial", "listen") or fellow is None or not self.relay.may_join(hop_id, role, fellow.id):
                await ws.close(4403)
                return
            await ws.accept()
            await self.relay.join(ws, hop_id, role)

        async def health(request: Request):
            return JSONResponse({"ok": True, "leader_key": fingerprint(self.public)})

        async def page(request: Request):
            return FileResponse(WEB_DIR / "index.html")

        async def home(request: Request):
            try:
                user = await current_user(request, self.store)
            except AuthError:
                return RedirectResponse("/login", status_code=303)
            return RedirectResponse(await self.home_path(user), status_code=303)

        async def login_page(request: Request):
            return FileResponse(WEB_DIR / "login.html")

        routes = [
            Route("/healthz", health),
            Route("/metrics", MetricsRoute(self).get),
            Route("/install.sh", install.script),
            Route("/install.ps1", install.script),
            Route("/", home),
            Route("/login", login_page),
            Route("/pools/{owner}/{pool}/inference", page),
            Route("/inference", page),  # every pool of the user's ("All your pools")
            Route("/auth/link", accounts.login_link),
            Route("/mcp", self.mcp, methods=["GET", "POST", "DELETE"]),
            Route("/v1/models", oai.models),
            Route("/v1/chat/completions", oai.chat_completions, methods=["POST"]),
            Route("/v1/completions", CompletionRoutes(oai).completions, methods=["POST"]),
            # OpenAI's Responses API (swarm.leader.api.responses_api): the same requests as /v1, stored per user
            Route(RESPONSES_PATH, responses.create, methods=["POST"]),
            Route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"]),
            Route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"]),
            Route("/v1/responses/{response_id}/input_items", responses.input_items),
            # Anthropic's Messages API (swarm.leader.api.anthropic_api): the same requests, in Anthropic's shapes
            Route("/v1/messages", anthropic.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", anthropic.count_tokens, methods=["POST"]),
            # Ollama's API (swarm.leader.api.ollama_api): the same requests as /v1, in Ollama's shapes
            Route("/api/chat", ollama.chat, methods=["POST"]),
            Route("/api/generate", ollama.generate, methods=["POST"]),
            Route("/api/tags", ollama.tags),
            Route("/api/show", ollama.show, methods=["POST"]),
            Route("/api/ps", ollama.ps),
            Route("/api/version", ollama.version),
            Route("/api/v1/auth/login", accounts.login, methods=["POST"]),
            Route("/api/v1/auth/logout", accounts.logout, methods=["POST"]),
            Route("/api/v1/me", accounts.me),
            Route("/api/v1/me/password", accounts.password, methods=["POST"]),
            Route("/api/v1/tokens", accounts.tokens, methods=["GET", "POST"]),
            Route("/api/v1/tokens/{token_id:int}", accounts.token_delete, methods=["DELETE"]),
            Route("/api/v1/models", api.models),
            Route("/api/v1/models/{model_id}", api.model),
            Route("/api/v1/models/{model_id}/load", api.model_load, methods=["POST"]),
            Route("/api/v1/models/{model_id}/performance", api.model_performance),
            Route("/api/v1/models/{model_id}/plan", api.model_plan),
            Route("/api/v1/models/{model_id}/unload", api.model_unload, methods=["POST"]),
            Route("/api/v1/models/{model_id}/files/{path:path}", api.model_file, methods=["GET", "HEAD"]),
            Route("/api/v1/requests/{rid}/cancel", api.request_cancel, methods=["POST"]),
            Route("/api/v1/chats", api.chats, methods=["GET", "POST"]),
            Route("/api/v1/chats/{chat_id}", api.chat, methods=["GET", "PATCH", "DELETE"]),
            Route("/api/v1/fellows", api.fellows),
            Route("/api/v1/fellows/update", updates.update_fellows, methods=["POST"]),
            Route("/api/v1/update/{file}", updates.wheel, methods=["GET", "HEAD"]),
            Route("/api/v1/join-tokens", api.join_tokens, methods=["GET", "POST"]),
            Route("/api/v1/join-tokens/{token_id:int}", api.join_token_revoke, methods=["DELETE"]),
            Route("/api/v1/fellows/{fellow_id:int}", api.fellow_remove, methods=["DELETE"]),
            *admin_routes(self, WEB_DIR),
            *usage_routes(self),
            *verify_routes(self),
            WebSocketRoute("/fellow/link", fellow_link),
            WebSocketRoute("/relay/{hop_id}", relay),
            Mount("/static", StaticFiles(directory=WEB_DIR / "static", check_dir=False), name="static"),
        ]
        return Starlette(routes=routes)

    async def serve(self, host: str, port: int, *, shutdown_trigger=None, task_status=trio.TASK_STATUS_IGNORED):
        """Serve HTTP on host:port and the UDP rendezvous (on SWARM_RENDEZVOUS_PORT, by default the same number)."""
        guard_close_race()
        close_on_oversize()  # a websocket message over the limit ends its connection: nothing more is buffered
        config = HypercornConfig()
        config.bind = [f"{host}:{port}"]
        config.accesslog = None
        config.errorlog = logging.getLogger("hypercorn.error")
        # Both websocket routes (fellow link, relay) carry one Noise frame per message: at most 64 KiB.
        config.websocket_max_message_size = 2 * MAX_FRAME
        if self.tls is not None:
            config.certfile, config.keyfile = str(self.tls[0]), str(self.tls[1])
        config.keep_alive_timeout = 75
        async with self.mcp.run(), trio.open_nursery() as nursery:
            self.serving.nursery = nursery
            nursery.start_soon(self.serving.link_matrix.run)  # measures the links between fellows now and then
            nursery.start_soon(self.serving.rebalance.run)  # live moves with SWARM_SERVE_REBALANCE=auto
            await self.serving.recovery.restore()  # before any fellow rejoins: models that were serving
            await trio.to_thread.run_sync(self.serving.verifier.load)  # the admin's spot-check fraction
            await trio.to_thread.run_sync(self.quotas.load)  # the quotas, and the last day's usage they count
            await nursery.start(self.history.run)  # writes finished requests off the request path, prunes old ones

            async def http(task_status):
                # a Starlette-typed ASGI app: hypercorn's ASGIFramework spells the same protocol in TypedDicts
                await serve(self.app, config, shutdown_trigger=shutdown_trigger,  # type: ignore[arg-type]
                            task_status=task_status)
                nursery.cancel_scope.cancel()  # HTTP has shut down gracefully: stop the rest

            urls = await nursery.start(http)
            bound_port = int(urls[0].rsplit(":", 1)[1])
            udp_port = self.settings.rendezvous_port if self.settings.rendezvous_port is not None else bound_port
            try:
                _, self.direct_links.rendezvous_port = await nursery.start(
                    lambda task_status: serve_rendezvous(host, udp_port, self.direct_links.allow,
                                                         task_status=task_status))
            except OSError as exc:
                log.warning("no UDP rendezvous on port %s (%s): direct links will use the relay", udp_port, exc)
            task_status.started(urls)


def initialize(store: Store, leader_public: bytes, cert_pin: bytes | None = None) -> FirstStart | None:
    """On the first start: the admin account, its API token, the default pool and a join token. Else None."""
    if store.list_users():
        return None
    password = secrets.token_urlsafe(12)
    admin = store.create_user("admin", password, is_admin=True)
    pool = store.ensure_default_pool(admin.id)
    token, _ = store.create_api_token(admin.id, "admin")
    join = make_join_token(leader_public, store.create_join_token(pool.id), cert_pin)
    return FirstStart("admin", password, token, join)
