"""The leader's REST API under /api/v1: models (load, unload, files), requests, chats, fellows and join tokens
(sign-in and API tokens: swarm.leader.api.accounts_api)."""

from __future__ import annotations

import dataclasses
import logging

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse

from swarm import __version__
from swarm.errors import AuthError, BadRequest, Forbidden, PlacementError, PoolNotFound
from swarm.kv_kinds import check_kv_kind
from swarm.leader.api.auth import current_admin, current_fellow, current_user
from swarm.leader.api.http_errors import api_error, json_body, problem
from swarm.leader.fleet.files import file_response
from swarm.leader.planning.placement import MIN_CONTEXT
from swarm.leader.planning.planner import plan_model
from swarm.leader.serving.models import ModelStatus
from swarm.leader.serving.performance import parse_range, performance_view
from swarm.quantization import check_kind
from swarm.store.fleet import DEFAULT_POOL, JOIN_TOKEN_TTL_S, JOIN_TOKEN_USES, check_join_token_limits
from swarm.wire import PROTOCOL_VERSION

log = logging.getLogger(__name__)


def as_dict(obj) -> dict:
    data = dataclasses.asdict(obj)
    data.pop("public_key", None)
    return data


def handles_errors(fn):
    """Every /api/v1 route answers an error in one shape (swarm.leader.api.http_errors), whatever raised it."""

    async def wrapper(self, request: Request):
        try:
            return await fn(self, request)
        except Exception as exc:  # the API boundary: any failure is answered as /api/v1's error
            return api_error(exc)

    wrapper.__name__ = fn.__name__
    return wrapper


def _chat_fields(body: dict) -> dict:
    """A chat's fields, each of its type (a number as a title used to be a 500); BadRequest naming the wrong one."""
    for key, kind, what in (("title", str, "a string"), ("model", str, "a string"), ("messages", list, "a list")):
        if body.get(key) is not None and not isinstance(body[key], kind):
            raise BadRequest(f"a chat's {key} must be {what}.", f"invalid_{key}")
    return body


class ApiRoutes:
    def __init__(self, leader):
        self.leader = leader
        self.store = leader.store

    async def _admin(self, request: Request):
        return await current_admin(request, self.store)

    async def _json(self, request: Request) -> dict:
        return await json_body(request)

    # --- models ---------------------------------------------------------------------------------------------------

    def _model_view(self, row, pools: dict[int, str] | None = None) -> dict:
        manifest = row.manifest
        serving = self.leader.serving.models.get(row.name)
        view = {
            "id": row.name,
            "name": row.base_name,
            "pool": (pools or {}).get(row.pool_id) or self._pool_name(row.pool_id),
            "architecture": manifest.get("architecture"),
            "num_layers": manifest.get("num_layers"),
            "dtype": manifest.get("dtype"),
            "storage": manifest.get("storage") or "",  # "gguf": the GGUF's tensors as the file has them
            "total_bytes": manifest.get("total_bytes"),
            "status": self.leader.serving.status(row.name),
            # Every file of the manifest is on the leader (imports are atomic); a model missing a shard is listed
            # but cannot be picked.
            "complete": all((self.leader.models_root / row.name / f["path"]).exists() for f in manifest["files"]),
        }
        if serving is not None:
            view.update(serving.describe())
        return view

    def _pool_name(self, pool_id: int) -> str | None:
        pool = self.store.get_pool(pool_id)
        return pool.name if pool else None

    @handles_errors
    async def models(self, request: Request):
        """The models of the caller's pools (an admin's: every pool's), or of the one ``?pool=NAME`` names."""
        user = await current_user(request, self.store)
        asked = request.query_params.get("pool")

        def read():
            visible = self.store.visible_pool_ids(user)
            names = {p.id: p.name for p in self.store.list_pools()}
            pool_ids = visible
            if asked:
                pool = self.store.pool_by_name(asked)
                if visible is not None and pool.id not in visible:
                    raise PoolNotFound(f"you are not a member of pool {asked!r}; ask an admin to add you "
                                       f"(swarm admin pool-member-add {asked} {user.name}).")
                pool_ids = {pool.id}
            return self.store.list_models(pool_ids), names

        rows, names = await trio.to_thread.run_sync(read)
        return JSONResponse({"models": [self._model_view(r, names) for r in rows]})

    async def _model_row(self, name: str, user):
        """The model ``name`` names among ``user``'s pools (swarm.store.fleet: its id, or a bare name only one of
        them has); ModelNotFound for one outside them, as for one that does not exist."""
        return await trio.to_thread.run_sync(
            lambda: self.store.resolve_model(name, self.store.visible_pool_ids(user)))

    @handles_errors
    async def model(self, request: Request):
        user = await current_user(request, self.store)
        row = await self._model_row(request.path_params["model_id"], user)
        return JSONResponse(await trio.to_thread.run_sync(self._model_view, row))

    @handles_errors
    async def model_performance(self, request: Request):
        user = await current_user(request, self.store)
        range_ = parse_range(request.query_params.get("range"))
        name = (await self._model_row(request.path_params["model_id"], user)).name
        return JSONResponse(await performance_view(self.leader, name, range_))

    @handles_errors
    async def model_plan(self, request: Request):
        """What a load would give on the pool now: decode tokens/s, time to first token, the bottleneck."""
        user = await current_user(request, self.store)
        name = (await self._model_row(request.path_params["model_id"], user)).name
        raw = request.query_params.get("num_stages")
        num_stages = None
        if raw is not None:
            if not raw.isdigit() or int(raw) < 1:
                raise BadRequest("num_stages must be a positive integer.", "invalid_num_stages")
            num_stages = int(raw)
        return JSONResponse(await plan_model(self.leader.serving, name, num_stages))

    @handles_errors
    async def model_load(self, request: Request):
        user = await current_user(request, self.store)
        name = (await self._model_row(request.path_params["model_id"], user)).name
        body = await self._json(request) if await request.body() else {}
        num_stages, fellow_id = body.get("num_stages"), body.get("fellow_id")
        context_tokens = body.get("context_tokens")
        for key, value in (("num_stages", num_stages), ("fellow_id", fellow_id), ("context_tokens", context_tokens)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise BadRequest(f"{key} must be a positive integer.", f"invalid_{key}")
        if context_tokens is not None and context_tokens < MIN_CONTEXT:
            raise BadRequest(f"context_tokens is {context_tokens}; a model serves at least {MIN_CONTEXT} tokens. Ask "
                             "for more, or leave it out for the model's own context.", "invalid_context_tokens")
        kv_cache = check_kv_kind(body["kv_cache"]) if body.get("kv_cache") is not None else None
        if fellow_id is not None and num_stages is None:
            num_stages = 1
        quantization = body.get("quantization")
        if quantization is not None:
            quantization = check_kind(quantization)
        # A load of a model that serves already at another quantization (or in another shape while it recovers)
        # unloads it first: like an unload, it needs an admin while it would end other users' replies.
        if self.leader.serving.loader.restarts(name, num_stages, fellow_id, quantization, context_tokens, kv_cache):
            self._may_end_replies(user, name, "loading it again as asked would end them. Load it as it serves now, "
                                              "try again when they finish, or ask an admin to load it again.")
        serving = await self.leader.serving.loader.load(name, num_stages, fellow_id, quantization, context_tokens,
                                                        kv_cache)
        if serving.status == ModelStatus.FAILED:
            raise PlacementError(serving.error or "the load failed")
        row = await self._model_row(name, user)
        return JSONResponse(await trio.to_thread.run_sync(self._model_view, row), status_code=202)

    @handles_errors
    async def model_unload(self, request: Request):
        user = await current_user(request, self.store)
        name = (await self._model_row(request.path_params["model_id"], user)).name
        self._may_end_replies(user, name, "try again when they finish, or ask an admin to unload it now.")
        await self.leader.serving.loader.unload(name)
        return JSONResponse({"id": name, "status": "not_loaded"})

    def _may_end_replies(self, user, name: str, what_to_do: str) -> None:
        """The rule (README, "Who may do what"): anyone signed in may load a model and unload one nobody else is
        using; ending another user's reply -- an unload, or a load that starts the model over -- needs an admin.
        Forbidden, saying how many requests are in the way, otherwise."""
        if user.is_admin:
            return
        book = self.leader.serving.book
        others = [r for r in [*book.of_model(name), *book.waiting.get(name, [])] if not r.ended and r.owner != user.id]
        if others:
            raise Forbidden(f"{name} is answering {len(others)} request{'s' if len(others) != 1 else ''} of other "
                            f"users; {what_to_do}")

    async def model_file(self, request: Request):
        try:
            fellow = await current_fellow(request, self.store)
        except AuthError as exc:
            return problem(401, str(exc), "unauthorized")
        name, path = request.path_params["model_id"], request.path_params["path"]
        row = await trio.to_thread.run_sync(self.store.get_model, name)
        entry = next((f for f in (row.manifest["files"] if row else []) if f["path"] == path), None)
        if entry is None:  # only files the manifest names: no path tricks
            return problem(404, f"model {name} has no file {path}", "not_found")
        if not self.leader.serving.may_fetch(fellow.id, name, path):
            # A fellow gets the files of the stages placed on it, nothing else: a fellow that is compromised or
            # merely enrolled cannot walk off with a model it does not serve.
            return problem(403, f"fellow {fellow.name} serves no stage of {name} that needs {path}", "forbidden")
        return file_response(self.leader.models_root / name / path, request, sha256=entry["sha256"])

    @handles_errors
    async def request_cancel(self, request: Request):
        user = await current_user(request, self.store)
        ring_request = self.leader.serving.find(request.path_params["rid"])
        if ring_request is None or ring_request.owner != user.id:
            # Only one's own requests; someone else's looks like one that has ended, so ids reveal nothing.
            return JSONResponse({"cancelled": False})
        self.leader.serving.cancel(ring_request)
        return JSONResponse({"cancelled": True})

    # --- chats ----------------------------------------------------------------------------------------------------

    @handles_errors
    async def chats(self, request: Request):
        user = await current_user(request, self.store)
        if request.method == "POST":
            body = _chat_fields(await self._json(request))
            chat = await trio.to_thread.run_sync(
                lambda: self.store.create_chat(user.id, body.get("title"), body.get("model"),
                                               body.get("messages") or []))
            return JSONResponse(as_dict(chat), status_code=201)
        query = request.query_params.get("q")
        chats = await trio.to_thread.run_sync(self.store.list_chats, user.id, query)
        return JSONResponse({"chats": [as_dict(c) for c in chats]})

    @handles_errors
    async def chat(self, request: Request):
        user = await current_user(request, self.store)
        chat_id = request.path_params["chat_id"]
        if request.method == "DELETE":
            ok = await trio.to_thread.run_sync(self.store.delete_chat, user.id, chat_id)
            if not ok:
                return problem(404, "no such chat", "not_found")
            return JSONResponse({"deleted": True})
        if request.method == "PATCH":
            body = _chat_fields(await self._json(request))
            chat = await trio.to_thread.run_sync(
                lambda: self.store.update_chat(user.id, chat_id, title=body.get("title"),
                                               messages=body.get("messages"), model=body.get("model")))
        else:
            chat = await trio.to_thread.run_sync(self.store.get_chat, user.id, chat_id)
        if chat is None:
            return problem(404, "no such chat", "not_found")
        return JSONResponse(as_dict(chat))

    # --- admin ----------------------------------------------------------------------------------------------------

    @handles_errors
    async def fellows(self, request: Request):
        await self._admin(request)
        rows = await trio.to_thread.run_sync(self.store.list_fellows)
        pools = {p.id: p.name for p in await trio.to_thread.run_sync(self.store.list_pools)}
        online = self.leader.hub.online
        checks = await self.leader.hub.checks(list(online.values()))  # what each can hold (early checks)
        out = []
        for row in rows:
            view = online[row.id].summary() if row.id in online else {**as_dict(row), "state": "offline"}
            view["stages"] = self.leader.serving.models_on_fellow(row.id)
            view["pool"] = pools.get(row.pool_id)
            view["checks"] = checks.get(row.id)
            out.append(view)
        return JSONResponse({"fellows": out, "leader": {"version": __version__, "protocol": PROTOCOL_VERSION}})

    @handles_errors
    async def join_tokens(self, request: Request):
        await self._admin(request)
        if request.method == "POST":
            body = await self._json(request) if await request.body() else {}
            ttl_s, uses = body.get("ttl_s", JOIN_TOKEN_TTL_S), body.get("uses", JOIN_TOKEN_USES)
            pool = body.get("pool", DEFAULT_POOL)
            if not isinstance(pool, str):
                raise BadRequest("pool must be a pool's name, e.g. \"default\".", "invalid_pool")
            check_join_token_limits(ttl_s, uses)
            token = await self.leader.new_join_token(ttl_s, uses, pool)
            return JSONResponse({"token": token, "uses": uses, "ttl_s": ttl_s, "pool": pool}, status_code=201)

        def read():
            names = {p.id: p.name for p in self.store.list_pools()}
            return [{**as_dict(t), "pool": names.get(t.pool_id)} for t in self.store.list_join_tokens()]

        return JSONResponse({"join_tokens": await trio.to_thread.run_sync(read)})

    @handles_errors
    async def join_token_revoke(self, request: Request):
        await self._admin(request)
        token_id = int(request.path_params["token_id"])
        if not await trio.to_thread.run_sync(self.store.revoke_join_token, token_id):
            return problem(404, f"there is no join token {token_id}", "not_found")
        return JSONResponse({"revoked": True})

    @handles_errors
    async def fellow_remove(self, request: Request):
        """Forget a fellow: its key and node credential are refused from now on, its link ends, its stages fail
        over."""
        await self._admin(request)
        fellow_id = int(request.path_params["fellow_id"])
        removed = await trio.to_thread.run_sync(self.store.remove_fellow, fellow_id)
        if removed is None:
            return problem(404, f"there is no fellow {fellow_id}", "not_found")
        await self.leader.hub.disconnect(fellow_id)
        log.info("removed fellow %s (%s)", removed.name, fellow_id)
        return JSONResponse({"removed": True, "fellow": as_dict(removed)})
