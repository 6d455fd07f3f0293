"""Quotas (limits per pool, user and API token) and usage (what the serving history says each used).

A quota row holds limits by name (swarm.leader.serving.quotas.LIMITS); a limit left out or null is no limit. A pool's
row is the default of its users; a user's row replaces it for that user (all nulls: no limits at all); a token's row
limits that token on top of its user's. Usage is read from the serving history (kept SWARM_SERVING_HISTORY_DAYS days),
so it needs no bookkeeping of its own and goes when the history does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from swarm.store.core import StoreCore

SCOPES = ("pool", "user", "token")


@dataclass(frozen=True)
class Quota:
    scope: str  # pool | user | token
    subject_id: int
    limits: dict[str, int | None]
    updated_at: float


@dataclass(frozen=True)
class UsageRow:
    """What the requests that ended in one period used, per user, token and model."""

    ended_at: float
    user_id: int | None
    token_id: int | None
    model: str
    prompt_tokens: int
    reply_tokens: int
    outcome: str


class QuotasMixin(StoreCore):
    def set_quota(self, scope: str, subject_id: int, limits: dict[str, int | None] | None) -> Quota | None:
        """Keep ``limits`` for ``scope``/``subject_id`` (replacing what was there); None removes the row."""
        if scope not in SCOPES:
            raise ValueError(f"a quota's scope is one of {', '.join(SCOPES)}, not {scope!r}")
        with self._tx() as db:
            if limits is None:
                db.execute("DELETE FROM quotas WHERE scope = ? AND subject_id = ?", (scope, subject_id))
                return None
            now = self._now()
            db.execute("INSERT OR REPLACE INTO quotas (scope, subject_id, limits_json, updated_at) VALUES (?, ?, ?, ?)",
                       (scope, subject_id, json.dumps(limits, sort_keys=True), now))
        return Quota(scope, subject_id, dict(limits), now)

    def quotas(self) -> list[Quota]:
        rows = self._all("SELECT * FROM quotas ORDER BY scope, subject_id")
        return [_quota(r) for r in rows]

    def quota(self, scope: str, subject_id: int) -> Quota | None:
        row = self._one("SELECT * FROM quotas WHERE scope = ? AND subject_id = ?", (scope, subject_id))
        return _quota(row) if row else None

    def api_token_names(self) -> dict[int, str]:
        """Every API token's id -> its name and the start of its text, as Settings > API shows them."""
        return {r["id"]: f"{r['name']} ({r['prefix']}…)" for r in self._all("SELECT id, name, prefix FROM api_tokens")}

    def usage_rows(self, since: float, until: float | None = None, user_id: int | None = None) -> list[UsageRow]:
        """The finished requests' usage from ``since`` (to ``until``), oldest first; one user's with ``user_id``."""
        sql = ("SELECT ended_at, user_id, token_id, model, prompt_tokens, reply_tokens, outcome FROM serving_history "
               "WHERE ended_at >= ?")
        args: tuple = (since,)
        if until is not None:
            sql, args = sql + " AND ended_at < ?", (*args, until)
        if user_id is not None:
            sql, args = sql + " AND user_id = ?", (*args, user_id)
        return [UsageRow(r["ended_at"], r["user_id"], r["token_id"], r["model"], r["prompt_tokens"],
                         r["reply_tokens"], r["outcome"]) for r in self._all(sql + " ORDER BY ended_at", args)]


def _quota(row) -> Quota:
    return Quota(row["scope"], row["subject_id"], json.loads(row["limits_json"]), row["updated_at"])
