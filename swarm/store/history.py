"""Serving history: one row per finished request (done, failed or cancelled) with its tokens, timings and the
fellows' time split, kept ``SWARM_SERVING_HISTORY_DAYS`` days. The leader writes rows in batches off the request
path (swarm.leader.serving.history) and rolls its longer performance ranges up from them
(swarm.leader.serving.performance).

Mixed into :class:`swarm.store.db.Store`; ``StoreCore`` provides the connection and the transactions.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from swarm.store.core import StoreCore


@dataclasses.dataclass(frozen=True)
class ServedRequest:
    """One finished request. Times are wall-clock seconds (time.time()); durations are milliseconds, None when the
    request never got that far (no first token: no ttft and no tokens/s)."""

    id: str
    model: str
    started_at: float  # when the leader took the request (its queue wait starts here)
    ended_at: float
    outcome: str  # done | failed | cancelled
    prompt_tokens: int = 0
    reply_tokens: int = 0
    ttft_ms: float | None = None  # from leaving the queue to the first token
    tokens_per_s: float | None = None  # steady rate after the first token
    queue_ms: float | None = None
    user_id: int | None = None
    error: str | None = None
    token_id: int | None = None  # the API token it came with; None: the page (a session) or the CLI's admin token
    timing: dict[str, Any] | None = None  # the reply's swarm.timing as the leader had it (the fellows' split)

    @property
    def decode_s(self) -> float:
        """Seconds spent after the first token (0 for a reply of one token or none)."""
        if not self.tokens_per_s or self.reply_tokens < 2:
            return 0.0
        return (self.reply_tokens - 1) / self.tokens_per_s


_COLUMNS = ("id", "model", "user_id", "token_id", "started_at", "ended_at", "outcome", "prompt_tokens", "reply_tokens",
            "ttft_ms", "tokens_per_s", "queue_ms", "error", "timing_json")


class HistoryMixin(StoreCore):
    def add_served_requests(self, records: list[ServedRequest]) -> None:
        """Keep ``records`` (one transaction for the batch); a record whose id is kept already replaces it."""
        rows = [(r.id, r.model, r.user_id, r.token_id, r.started_at, r.ended_at, r.outcome, r.prompt_tokens,
                 r.reply_tokens, r.ttft_ms, r.tokens_per_s, r.queue_ms, r.error,
                 json.dumps(r.timing, separators=(",", ":")) if r.timing is not None else None) for r in records]
        if not rows:
            return
        with self._tx() as db:
            db.executemany(f"INSERT OR REPLACE INTO serving_history ({', '.join(_COLUMNS)}) "
                           f"VALUES ({', '.join('?' * len(_COLUMNS))})", rows)

    def served_requests(self, model: str | None, since: float, until: float | None = None,
                        timing: bool = True) -> list[ServedRequest]:
        """The requests of ``model`` (None: of every model) that ended at ``since`` or later (and before ``until``),
        oldest first; without their timing maps when ``timing`` is False (a week of them reads several times
        faster and takes a fraction of the memory)."""
        columns = _COLUMNS if timing else _COLUMNS[:-1]
        sql = f"SELECT {', '.join(columns)} FROM serving_history WHERE ended_at >= ?"
        args: tuple = (since,)
        if model is not None:
            sql, args = sql + " AND model = ?", (*args, model)
        if until is not None:
            sql, args = sql + " AND ended_at < ?", (*args, until)
        return [_record(row) for row in self._all(sql + " ORDER BY ended_at", args)]

    def prune_served_requests(self, before: float) -> int:
        """Forget the requests that ended before ``before``; how many went."""
        with self._tx() as db:
            return db.execute("DELETE FROM serving_history WHERE ended_at < ?", (before,)).rowcount


def _record(row) -> ServedRequest:
    values = {name: row[name] for name in _COLUMNS if name != "timing_json"}
    try:
        timing = json.loads(row["timing_json"]) if "timing_json" in row.keys() and row["timing_json"] else None
    except ValueError:
        timing = None
    return ServedRequest(**values, timing=timing if isinstance(timing, dict) else None)
