"""Quotas and usage over HTTP (swarm.leader.serving.quotas, swarm.store.quotas).

- ``GET /api/v1/quotas`` (admins): every quota row, with the names of its pool, user or token.
- ``PUT /api/v1/quotas/{scope}/{ref}`` (admins), scope ``pool`` (a pool's name: its users' default), ``user`` (a
  name or id) or ``token`` (an API token's id); the body is the limits (swarm.leader.serving.quotas.LIMITS, null: none).
  ``DELETE`` the same path removes the row.
- ``GET /api/v1/usage?range=24h&step=hour&by=user,model[&user=NAME][&format=csv]``: requests and tokens per
  period, grouped by any of user, token and model; an admin sees everyone's, any other user their own. Read from
  the serving history, so it reaches back SWARM_SERVING_HISTORY_DAYS days.
"""

from __future__ import annotations

import csv
import io
import re
import time

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from swarm.errors import BadRequest, Forbidden
from swarm.leader.api.auth import current_admin, current_user
from swarm.leader.api.http_errors import json_body
from swarm.leader.api.rest import handles_errors
from swarm.leader.serving.quotas import LIMITS, parse_limits

STEPS = {"hour": 3600, "day": 86400}
GROUPS = ("user", "token", "model")
_RANGE = re.compile(r"^(\d{1,4})(h|d)$")


def parse_usage_query(query, keep_days: float) -> tuple[float, int, tuple[str, ...]]:
    """(seconds back, step in seconds, group-by columns) of a usage query; BadRequest naming what is wrong."""
    text = query.get("range", "24h")
    match = _RANGE.match(text)
    if not match or int(match[1]) < 1:
        raise BadRequest(f"range {text!r} is not a number of hours or days such as 24h or 7d.", "invalid_range")
    span = int(match[1]) * (3600 if match[2] == "h" else 86400)
    if span > keep_days * 86400 + 1:
        raise BadRequest(f"range {text} reaches past the serving history, which keeps {keep_days:g} days "
                         "(SWARM_SERVING_HISTORY_DAYS).", "invalid_range")
    step = query.get("step", "hour" if span <= 2 * 86400 else "day")
    if step not in STEPS:
        raise BadRequest(f"step {step!r} is not one of {', '.join(STEPS)}.", "invalid_step")
    by = tuple(g.strip() for g in query.get("by", "user,model").split(",") if g.strip())
    if not by or any(g not in GROUPS for g in by):
        raise BadRequest(f"by {query.get('by')!r}: group by any of {', '.join(GROUPS)}, comma separated.",
                         "invalid_by")
    return span, STEPS[step], by


def usage_table(rows, step: int, by: tuple[str, ...], users: dict, tokens: dict) -> list[dict]:
    """Rows of the serving history summed per period (aligned to UTC hours or days) and group."""
    totals: dict[tuple, dict] = {}
    for row in rows:
        period = int(row.ended_at // step * step)
        key = (period, *(getattr(row, f"{g}_id") if g != "model" else row.model for g in by))
        entry = totals.get(key)
        if entry is None:
            entry = {"period_start": period, "period": _iso(period)}
            for g in by:
                if g == "user":
                    entry["user_id"], entry["user"] = row.user_id, users.get(row.user_id)
                elif g == "token":
                    entry["token_id"], entry["token"] = row.token_id, tokens.get(row.token_id)
                else:
                    entry["model"] = row.model
            entry.update(requests=0, failed=0, prompt_tokens=0, completion_tokens=0)
            totals[key] = entry
        entry["requests"] += 1
        entry["failed"] += row.outcome == "failed"
        entry["prompt_tokens"] += row.prompt_tokens
        entry["completion_tokens"] += row.reply_tokens
    return sorted(totals.values(), key=lambda e: (e["period_start"], *(str(e.get(g) or "") for g in by)))


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def as_csv(rows: list[dict], by: tuple[str, ...]) -> str:
    columns = ["period", *[c for g in by for c in ((f"{g}_id", g) if g != "model" else ("model",))],
               "requests", "failed", "prompt_tokens", "completion_tokens"]
    out = io.StringIO()
    writer = csv.DictWriter(out, columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


class UsageRoutes:
    def __init__(self, leader):
        self.leader = leader
        self.store = leader.store

    async def _admin(self, request: Request):
        return await current_admin(
            request, self.store, "quotas are set by admins; ask one, or see your own usage at GET /api/v1/usage.")

    @handles_errors
    async def quotas(self, request: Request):
        await self._admin(request)
        return JSONResponse({"quotas": await trio.to_thread.run_sync(self._named_rows), "limits": list(LIMITS)})

    def _named_rows(self) -> list[dict]:
        pools = {p.id: p.name for p in self.store.list_pools()}
        users = {u.id: u.name for u in self.store.list_users()}
        tokens = self.store.api_token_names()
        out = []
        for q in self.store.quotas():
            name = {"pool": pools, "user": users}.get(q.scope, tokens).get(q.subject_id)
            out.append({"scope": q.scope, "id": q.subject_id, "name": name, "limits": q.limits,
                        "updated_at": q.updated_at})
        return out

    @handles_errors
    async def quota(self, request: Request):
        await self._admin(request)
        scope, ref = request.path_params["scope"], request.path_params["ref"]
        limits = parse_limits(await json_body(request)) if request.method == "PUT" else None

        def change() -> int:
            subject = self._subject(scope, ref)
            self.leader.quotas.set(scope, subject, limits)
            return subject

        subject = await trio.to_thread.run_sync(change)
        if limits is None:
            return JSONResponse({"deleted": True, "scope": scope, "id": subject})
        return JSONResponse({"scope": scope, "id": subject, "limits": limits})

    def _subject(self, scope: str, ref: str) -> int:
        """The id a quota path names (blocks); BadRequest saying how to find the right one."""
        if scope == "pool":
            return self.store.pool_by_name(ref).id
        if scope == "user":
            user = self.store.get_user_by_name(ref) or (self.store.get_user(int(ref)) if ref.isdigit() else None)
            if user is None:
                raise BadRequest(f"there is no user {ref!r}; `GET /api/v1/users` lists them.", "unknown_user")
            return user.id
        if scope == "token":
            if not ref.isdigit() or int(ref) not in self.store.api_token_names():
                raise BadRequest(f"there is no API token {ref!r}: give its id (GET /api/v1/usage?by=token lists the "
                                 "ones in use; each user's Settings > API lists theirs).", "unknown_token")
            return int(ref)
        raise BadRequest(f"a quota is for a pool, a user or a token, not {scope!r}: "
                         "PUT /api/v1/quotas/{pool|user|token}/{name or id}.", "invalid_scope")

    @handles_errors
    async def usage(self, request: Request):
        user = await current_user(request, self.store)
        span, step, by = parse_usage_query(request.query_params, self.leader.settings.serving_history_days)
        asked = request.query_params.get("user")
        now = time.time()
        since = (now - span) // step * step  # whole periods

        def read():
            only = user.id
            if user.is_admin:
                only = None
                if asked:
                    found = self.store.get_user_by_name(asked) or (
                        self.store.get_user(int(asked)) if asked.isdigit() else None)
                    if found is None:
                        raise BadRequest(f"there is no user {asked!r}; `GET /api/v1/users` lists them.",
                                         "unknown_user")
                    only = found.id
            elif asked and asked not in (user.name, str(user.id)):
                raise Forbidden("only admins see other users' usage.")
            rows = self.store.usage_rows(since, user_id=only)
            users = {u.id: u.name for u in self.store.list_users()} if user.is_admin else {user.id: user.name}
            tokens = self.store.api_token_names()
            return usage_table(rows, step, by, users, tokens)

        table = await trio.to_thread.run_sync(read)
        if request.query_params.get("format") == "csv":
            return Response(as_csv(table, by), media_type="text/csv; charset=utf-8",
                            headers={"content-disposition": 'attachment; filename="swarm-usage.csv"'})
        return JSONResponse({"since": since, "step": "hour" if step == 3600 else "day", "by": list(by),
                             "rows": table})


def usage_routes(leader) -> list[Route]:
    routes = UsageRoutes(leader)
    return [
        Route("/api/v1/quotas", routes.quotas),
        Route("/api/v1/quotas/{scope}/{ref}", routes.quota, methods=["PUT", "DELETE"]),
        Route("/api/v1/usage", routes.usage),
    ]
