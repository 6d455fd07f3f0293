"""Admin endpoints the browser's admin page needs: users, pools, the serving switches, and the page itself."""

from __future__ import annotations

import trio
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, RedirectResponse
from starlette.routing import Route

from swarm.errors import AuthError, BadRequest, Forbidden
from swarm.leader.api.auth import current_admin, current_user
from swarm.leader.api.http_errors import json_body, problem
from swarm.leader.api.rest import as_dict, handles_errors
from swarm.leader.api.signin import check_password_rule
from swarm.leader.fleet.direct_links import DIRECT_LINKS
from swarm.leader.serving.recovery import HOT_COVER


class AdminRoutes:
    def __init__(self, leader, web_dir):
        self.leader = leader
        self.store = leader.store
        self.web_dir = web_dir

    async def _admin(self, request: Request):
        return await current_admin(request, self.store)

    async def page(self, request: Request):
        try:
            await current_user(request, self.store)
        except AuthError:
            return RedirectResponse("/login?next=/admin", status_code=303)
        return FileResponse(self.web_dir / "admin.html")

    @handles_errors
    async def users(self, request: Request):
        await self._admin(request)
        if request.method == "POST":
            body = await json_body(request)
            name, is_admin = body.get("name"), body.get("is_admin", False)
            if not isinstance(name, str) or not name.strip() or len(name) > 64:
                raise BadRequest("a user needs a name: a string of 1 to 64 characters.", "invalid_name")
            if not isinstance(is_admin, bool):  # "false" is a string, and a truthy one
                raise BadRequest('is_admin must be true or false (JSON booleans).', "invalid_is_admin")
            password = check_password_rule(body.get("password"))
            user = await self.leader.hashing.run(self.store.create_user, name, password, is_admin)
            return JSONResponse({"user": as_dict(user)}, status_code=201)
        users = await trio.to_thread.run_sync(self.store.list_users)
        return JSONResponse({"users": [as_dict(u) for u in users]})

    @handles_errors
    async def user_password(self, request: Request):
        """An admin sets a user's password (`swarm admin password`); that user's browsers are signed out."""
        await self._admin(request)
        user_id = int(request.path_params["user_id"])
        password = check_password_rule((await json_body(request)).get("password"))
        if await trio.to_thread.run_sync(self.store.get_user, user_id) is None:
            return problem(404, f"there is no user {user_id}", "not_found")
        await self.leader.hashing.run(self.store.set_password, user_id, password)
        return JSONResponse({"changed": True})

    @handles_errors
    async def user_delete(self, request: Request):
        me = await self._admin(request)
        user_id = int(request.path_params["user_id"])
        if user_id == me.id:
            return problem(400, "you cannot delete your own account while signed in with it.", "bad_request")
        ok = await trio.to_thread.run_sync(self.store.delete_user, user_id)
        return JSONResponse({"deleted": ok}, status_code=200 if ok else 404)

    def _pool_view(self, pool, users: dict[int, str], admin: bool) -> dict:
        view = {**as_dict(pool), "owner": users.get(pool.owner_user_id), "path": self.leader.pool_path(pool),
                "models": [m.name for m in self.store.list_models({pool.id})]}
        if admin:
            view["members"] = [{"id": u.id, "name": u.name} for u in self.store.pool_members(pool.id)]
            view["fellows"] = [{"id": f.id, "name": f.name} for f in self.store.list_fellows()
                               if f.pool_id == pool.id]
        return view

    @handles_errors
    async def pools(self, request: Request):
        """GET: the caller's pools (an admin's: every pool, with its members and fellows); POST {"name"}: an admin
        creates a pool, owned by them."""
        user = await current_user(request, self.store)
        if request.method == "POST":
            if not user.is_admin:
                raise Forbidden("this needs an admin account.")
            name = (await json_body(request)).get("name")
            pool = await trio.to_thread.run_sync(self.store.create_pool, name, user.id)
            view = await trio.to_thread.run_sync(self._pool_view, pool, {user.id: user.name}, True)
            return JSONResponse({"pool": view}, status_code=201)

        def read():
            users = {u.id: u.name for u in self.store.list_users()}
            mine = self.store.visible_pool_ids(user)
            return [self._pool_view(p, users, user.is_admin) for p in self.store.list_pools()
                    if mine is None or p.id in mine]

        return JSONResponse({"pools": await trio.to_thread.run_sync(read)})

    @handles_errors
    async def pool_delete(self, request: Request):
        await self._admin(request)

        def delete():
            return self.store.delete_pool(self.store.pool_by_name(request.path_params["pool"]).id)

        pool = await trio.to_thread.run_sync(delete)
        return JSONResponse({"deleted": True, "pool": as_dict(pool)})

    @handles_errors
    async def pool_members(self, request: Request):
        """GET: a pool's members; POST {"user": name or id}: add one (they see its models from now on)."""
        await self._admin(request)
        name = request.path_params["pool"]
        body = await json_body(request) if request.method == "POST" else {}

        def change():
            pool = self.store.pool_by_name(name)
            if request.method == "POST":
                self.store.add_pool_member(pool.id, self._user(body.get("user")).id)
            return [as_dict(u) for u in self.store.pool_members(pool.id)]

        members = await trio.to_thread.run_sync(change)
        return JSONResponse({"pool": name, "members": members}, status_code=201 if request.method == "POST" else 200)

    @handles_errors
    async def pool_member_remove(self, request: Request):
        await self._admin(request)
        name = request.path_params["pool"]

        def change():
            pool = self.store.pool_by_name(name)
            user = self._user(request.path_params["user"])
            if not self.store.remove_pool_member(pool.id, user.id):
                raise BadRequest(f"{user.name} is not a member of pool {name!r}.", "not_a_member")
            return [as_dict(u) for u in self.store.pool_members(pool.id)]

        return JSONResponse({"pool": name, "members": await trio.to_thread.run_sync(change)})

    def _user(self, ref):
        """The user a request names, by id or by name (blocks); BadRequest naming what was asked."""
        user = None
        if isinstance(ref, int) and not isinstance(ref, bool):
            user = self.store.get_user(ref)
        elif isinstance(ref, str) and ref.strip():
            user = self.store.get_user_by_name(ref)
            if user is None and ref.isdigit():
                user = self.store.get_user(int(ref))
        if user is None:
            raise BadRequest(f"there is no user {ref!r}; `GET /api/v1/users` lists them.", "unknown_user")
        return user

    @handles_errors
    async def direct_links(self, request: Request):
        await self._admin(request)
        if request.method == "PUT":
            body = await json_body(request)
            if not isinstance(body.get("enabled"), bool):
                raise BadRequest('send {"enabled": true} or {"enabled": false}.', "invalid_enabled")
            await trio.to_thread.run_sync(self.store.set_setting, DIRECT_LINKS, body["enabled"])
            if body["enabled"]:
                await self.leader.direct_links.start_all()  # hops already serving look for a tunnel now
        enabled = await trio.to_thread.run_sync(self.store.get_setting, DIRECT_LINKS, False)
        return JSONResponse({"enabled": bool(enabled)})


    @handles_errors
    async def hot_cover(self, request: Request):
        await self._admin(request)
        if request.method == "PUT":
            body = await json_body(request)
            if not isinstance(body.get("enabled"), bool):
                raise BadRequest('send {"enabled": true} or {"enabled": false}.', "invalid_enabled")
            await trio.to_thread.run_sync(self.store.set_setting, HOT_COVER, body["enabled"])
            if body["enabled"]:
                await self.leader.serving.recovery.cover_all()
        enabled = self.leader.settings.serve_hot_cover or bool(
            await trio.to_thread.run_sync(self.store.get_setting, HOT_COVER, False))
        return JSONResponse({"enabled": enabled, "forced_by_env": self.leader.settings.serve_hot_cover})

    @handles_errors
    async def model_switches(self, request: Request):
        """GET: the auto-load and evict-idle switches (swarm.leader.planning.auto_load); PUT {"auto_load": bool,
        "evict_idle": bool}, either or both: set them."""
        await self._admin(request)
        auto_load = self.leader.serving.auto_load
        if request.method == "PUT":
            body = await json_body(request)
            changes = {k: body[k] for k in ("auto_load", "evict_idle") if k in body}
            if not changes or not all(isinstance(v, bool) for v in changes.values()):
                raise BadRequest('send {"auto_load": true or false} and/or {"evict_idle": true or false}.',
                                 "invalid_switch")
            return JSONResponse(await auto_load.set_switches(changes))
        return JSONResponse(await auto_load.switches())

    @handles_errors
    async def links(self, request: Request):
        """The measured links between each pool's fellows (swarm.leader.fleet.link_matrix): round-trip time and
        throughput of each ordered pair, over the path a ring hop would take."""
        await self._admin(request)
        return JSONResponse(self.leader.serving.link_matrix.view())

    @handles_errors
    async def rebalance(self, request: Request):
        """Live moves (swarm.leader.serving.rebalance): GET the moves of serving stages to idle fellows, or the
        re-layouts (another stage count or split), the planner predicts at least 1.3x faster, and why faster layouts
        are left out; POST {"model": name} applies the one proposed for that model."""
        await self._admin(request)
        rebalancer = self.leader.serving.rebalance
        proposals = rebalancer.proposals()
        if request.method == "GET":
            view = {"mode": self.leader.serving.settings.serve_rebalance, "proposals": [p.view() for p in proposals]}
            if rebalancer.left_out:  # faster layouts that cannot load beside a ring, where nothing is proposed
                view["left_out"] = rebalancer.left_out
            return JSONResponse(view)
        body = await json_body(request)
        chosen = [p for p in proposals if p.model == body.get("model")]
        if not chosen:
            raise BadRequest(f"no live move is proposed for {body.get('model')!r} now: GET /api/v1/rebalance lists "
                             "the proposals (none with SWARM_SERVE_REBALANCE=off).", "no_proposal")
        return JSONResponse({"done": await rebalancer.apply(chosen[0])})

    @handles_errors
    async def fellow_update(self, request: Request):
        await self._admin(request)
        body = await json_body(request)
        if not isinstance(body.get("standby"), bool):
            raise BadRequest('send {"standby": true} or {"standby": false}.', "invalid_standby")
        fellow_id = int(request.path_params["fellow_id"])
        row = await trio.to_thread.run_sync(self.store.set_fellow_standby, fellow_id, body["standby"])
        if row is None:
            return problem(404, f"there is no fellow {fellow_id}", "not_found")
        conn = self.leader.hub.online.get(fellow_id)
        if conn is not None:
            conn.standby = row.standby
        return JSONResponse({"fellow": as_dict(row)})

    @handles_errors
    async def fellow_drain(self, request: Request):
        """POST {"force": false}: the fellow hands its stages over and leaves, as `swarm leave` on it does (409
        drain_refused, saying why, when a stage has no taker and ``force`` is not set)."""
        await self._admin(request)
        body = await json_body(request) if await request.body() else {}
        force = body.get("force", False)
        if not isinstance(force, bool):
            raise BadRequest('send {"force": true} or {"force": false}.', "invalid_force")
        fellow_id = int(request.path_params["fellow_id"])
        if fellow_id not in self.leader.hub.online:
            return problem(404, f"fellow {fellow_id} is not online: there is nothing to drain", "not_found")
        done = await self.leader.serving.drains.drain(fellow_id, force=force, wait_s=self.leader.settings.leave_wait_s)
        return JSONResponse({"fellow_id": fellow_id, "message": done})


def admin_routes(leader, web_dir) -> list[Route]:
    admin = AdminRoutes(leader, web_dir)
    return [
        Route("/admin", admin.page),
        Route("/api/v1/users", admin.users, methods=["GET", "POST"]),
        Route("/api/v1/users/{user_id:int}", admin.user_delete, methods=["DELETE"]),
        Route("/api/v1/users/{user_id:int}/password", admin.user_password, methods=["PUT"]),
        Route("/api/v1/pools", admin.pools, methods=["GET", "POST"]),
        Route("/api/v1/pools/{pool}", admin.pool_delete, methods=["DELETE"]),
        Route("/api/v1/pools/{pool}/members", admin.pool_members, methods=["GET", "POST"]),
        Route("/api/v1/pools/{pool}/members/{user}", admin.pool_member_remove, methods=["DELETE"]),
        Route("/api/v1/settings/direct-links", admin.direct_links, methods=["GET", "PUT"]),
        Route("/api/v1/settings/hot-cover", admin.hot_cover, methods=["GET", "PUT"]),
        Route("/api/v1/settings/models", admin.model_switches, methods=["GET", "PUT"]),
        Route("/api/v1/links", admin.links, methods=["GET"]),
        Route("/api/v1/rebalance", admin.rebalance, methods=["GET", "POST"]),
        Route("/api/v1/fellows/{fellow_id:int}", admin.fellow_update, methods=["PUT"]),
        Route("/api/v1/fellows/{fellow_id:int}/drain", admin.fellow_drain, methods=["POST"]),
    ]
