"""Quotas: how much of a pool one user, or one API token, may use.

Limits (each optional): prompt and completion tokens per minute and per day, counted apart, and requests at once.
Which apply to a request (swarm.store.quotas keeps the rows):

- its user's own row, else its model's pool's row (the pool's default for its users); a user row with no limits in
  it frees that user of the pool's default;
- and, when it came with an API token that has a row, that token's limits too.

Windows slide: "per minute" is the last 60 s, "per day" the last 24 h. What counts: every finished request in the
window (the ledger here, read back from the serving history when the leader starts) and every request still
waiting or running (its prompt, and the tokens it has had so far). A request over a limit is refused before it
queues: 429 with Retry-After, saying which limit, what was used and when the user can send again. A prompt larger
than a per-minute or per-day prompt limit can never pass: that refusal has no Retry-After and says so.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from swarm.errors import BadRequest, QuotaExceeded

log = logging.getLogger(__name__)

MINUTE, DAY = 60.0, 86400.0
# name -> (window in seconds, what it counts)
TOKEN_LIMITS = {
    "prompt_tokens_per_minute": (MINUTE, "prompt"),
    "completion_tokens_per_minute": (MINUTE, "completion"),
    "prompt_tokens_per_day": (DAY, "prompt"),
    "completion_tokens_per_day": (DAY, "completion"),
}
CONCURRENT = "concurrent_requests"
LIMITS = (*TOKEN_LIMITS, CONCURRENT)
BUSY_RETRY_S = 5  # over the requests-at-once limit, or the window's tokens all held by running requests


def parse_limits(body: Any) -> dict[str, int | None]:
    """The limits of a PUT body: a JSON object of LIMITS names to a whole number >= 0 or null (no limit)."""
    if not isinstance(body, dict):
        raise BadRequest(f"send a JSON object of limits: {', '.join(LIMITS)} (each a whole number, or null for none).",
                         "invalid_quota")
    unknown = sorted(set(body) - set(LIMITS))
    if unknown:
        raise BadRequest(f"unknown limit {unknown[0]!r}; the limits are {', '.join(LIMITS)}.", "invalid_quota")
    out: dict[str, int | None] = {}
    for name, value in body.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise BadRequest(f"{name} must be a whole number of 0 or more, or null for no limit.", "invalid_quota")
        out[name] = value
    return out


@dataclasses.dataclass(frozen=True)
class Spent:
    """One finished request in the ledger."""

    at: float
    owner: int | None  # the user, as Request.owner
    token_id: int | None
    prompt: int
    completion: int


class QuotaBook:
    """The quota rows (cached; the admin routes update both) and the last day of usage, per user and token."""

    def __init__(self, store, book, clock: Callable[[], float] = time.time):
        self.store = store
        self.book = book  # swarm.leader.serving.requests.RequestBook: what is waiting and running
        self.clock = clock
        self.rows: dict[tuple[str, int], dict[str, int | None]] = {}
        self.ledger: collections.deque[Spent] = collections.deque()

    def load(self) -> None:
        """Read the quota rows and the last day's usage (blocking: from a worker thread, at start)."""
        self.rows = {(q.scope, q.subject_id): q.limits for q in self.store.quotas()}
        since = self.clock() - DAY
        self.ledger = collections.deque(Spent(r.ended_at, r.user_id, r.token_id, r.prompt_tokens, r.reply_tokens)
                                        for r in self.store.usage_rows(since))

    def set(self, scope: str, subject_id: int, limits: dict[str, int | None] | None) -> None:
        """Blocking: keep a row (None removes it) in the store and here."""
        self.store.set_quota(scope, subject_id, limits)
        if limits is None:
            self.rows.pop((scope, subject_id), None)
        else:
            self.rows[(scope, subject_id)] = dict(limits)

    def on_end(self, request) -> None:
        """A request ended (RequestBook.on_end): its tokens count from now. Never raises into the book."""
        try:
            self.ledger.append(Spent(self.clock(), request.owner, getattr(request, "token_id", None),
                                     len(request.prompt), len(request.tokens)))
            self._forget_old()
        except Exception:  # a bug here must not cost the reply
            log.exception("could not count request %s against its quotas", getattr(request, "id", "?"))

    def _forget_old(self) -> None:
        horizon = self.clock() - DAY
        while self.ledger and self.ledger[0].at < horizon:
            self.ledger.popleft()

    # --- the check --------------------------------------------------------------------------------------------------

    def limits_for(self, user_id: int | None, token_id: int | None, pool_id: int | None) -> list[tuple[str, dict]]:
        """(whose, limits) that apply: the user's (or the pool's default), and the token's."""
        out = []
        own = self.rows.get(("user", user_id)) if user_id is not None else None
        if own is not None:
            out.append(("your account", own))
        elif pool_id is not None and ("pool", pool_id) in self.rows and user_id is not None:
            out.append(("this pool (its default for each user)", self.rows[("pool", pool_id)]))
        if token_id is not None and ("token", token_id) in self.rows:
            out.append(("this API token", self.rows[("token", token_id)]))
        return out

    def check(self, request, pool_id: int | None, count: int = 1) -> None:
        """Raise QuotaExceeded when ``request`` (with ``count`` requests of its kind: the choices of one API
        request) would pass a limit."""
        if count <= 0:
            return
        user_id, token_id = request.owner, getattr(request, "token_id", None)
        for whose, limits in self.limits_for(user_id, token_id, pool_id):
            # (both a Request and a Spent have owner and token_id)
            mine = (lambda r: r.token_id == token_id) if whose == "this API token" else \
                (lambda r: r.owner == user_id)
            held = [r for r in self._in_flight() if mine(r)]
            limit = limits.get(CONCURRENT)
            if limit is not None and len(held) + count > limit:
                raise QuotaExceeded(
                    f"{whose} allows {limit} request{'s' if limit != 1 else ''} at once ({CONCURRENT}), and you "
                    f"have {len(held)} waiting or running. Send this one again when one ends.", BUSY_RETRY_S)
            for name, (window, kind) in TOKEN_LIMITS.items():
                limit = limits.get(name)
                if limit is None:
                    continue
                need = len(request.prompt) * count if kind == "prompt" else 1
                self._check_window(whose, name, limit, window, kind, need,
                                   (s for s in self.ledger if mine(s)), held)

    def _in_flight(self) -> list:
        book = self.book
        waiting = (r for queue in book.waiting.values() for r in queue)
        return [r for r in [*book.by_rid.values(), *waiting] if not r.ended]

    def _check_window(self, whose: str, name: str, limit: int, window: float, kind: str, need: int,
                      spent: Iterable[Spent], held: list) -> None:
        now = self.clock()
        recent = [(s.at, s.prompt if kind == "prompt" else s.completion) for s in spent if s.at > now - window]
        holding = sum(len(r.prompt) if kind == "prompt" else len(r.tokens) for r in held)
        used = holding + sum(n for _, n in recent)
        if used + need <= limit:
            return
        what = f"{limit:,} {kind} tokens per {'minute' if window == MINUTE else 'day'} ({name})"
        if need > limit and kind == "completion":  # a limit of 0: no replies at all
            raise QuotaExceeded(f"{whose} allows no replies ({name} is 0); ask an admin to raise the limit.", None)
        if need > limit:
            raise QuotaExceeded(
                f"this prompt alone is {need:,} tokens, more than the {what} {whose} allows, so it cannot be sent "
                f"at any time. Shorten the conversation, or ask an admin to raise the limit.", None)
        freed, retry_at = used, None
        for at, n in recent:  # oldest first: the window lets go of them in this order
            freed -= n
            if freed + need <= limit:
                retry_at = at + window
                break
        wait = max(1, round(retry_at - now)) if retry_at is not None else BUSY_RETRY_S
        when = time.strftime("%H:%M:%S UTC", time.gmtime(now + wait))
        raise QuotaExceeded(
            f"you have used {used:,} of the {what} {whose} allows. You can send again at {when} (in "
            f"{_duration(wait)}); an admin can raise the limit.", wait)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 90:
        return f"{seconds} s"
    minutes = round(seconds / 60)
    if minutes < 90:
        return f"{minutes} min"
    return f"{minutes // 60} h {minutes % 60} min"
