"""Quotas and usage: the store's rows (SQLite and PostgreSQL), which limits apply to a request, the sliding windows
and when a refused user may send again (swarm.leader.serving.quotas), and the usage table (swarm.leader.api.usage_api).
The same through a real leader and fellow with the openai client is in tests/test_quotas_e2e.py."""

from __future__ import annotations

from pathlib import Path

import argon2
import pytest

from swarm import messages
from swarm.errors import BadRequest, QuotaExceeded
from swarm.leader.api.usage_api import as_csv, parse_usage_query, usage_table
from swarm.leader.serving.admission import Budget
from swarm.leader.serving.quotas import QuotaBook, parse_limits
from swarm.leader.serving.request import Request
from swarm.leader.serving.requests import RequestBook
from swarm.store.db import Store
from swarm.store.history import ServedRequest

CHEAP = argon2.PasswordHasher(time_cost=1, memory_cost=8, parallelism=1)
NOW = 1_700_000_000.0


class Clock:
    def __init__(self):
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def request(owner: int | None, prompt: int = 10, token_id: int | None = None, model: str = "m") -> Request:
    return Request(model=model, prompt=list(range(prompt)), max_tokens=8, sampling=messages.Sampling(), eos=[],
                   owner=owner, token_id=token_id)


def served(rid: str, ended: float, user: int | None, token: int | None, model: str = "m", prompt: int = 10,
           reply: int = 5, outcome: str = "done") -> ServedRequest:
    return ServedRequest(id=rid, model=model, started_at=ended - 2, ended_at=ended, outcome=outcome,
                         prompt_tokens=prompt, reply_tokens=reply, user_id=user, token_id=token)


def test_quota_rows_and_usage_are_kept_and_go_with_their_subject(store_location):  # SQLite and PostgreSQL
    store = Store(store_location, password_hasher=CHEAP)
    bob = store.create_user("bob", "bob's long password")
    _, token = store.create_api_token(bob.id, "laptop")
    assert store.api_token_user(_).token_id == token.id  # a request with a token knows which one
    pool = store.ensure_default_pool(None)
    store.set_quota("pool", pool.id, {"prompt_tokens_per_day": 1000})
    store.set_quota("user", bob.id, {"concurrent_requests": 2, "prompt_tokens_per_day": None})
    store.set_quota("token", token.id, {"completion_tokens_per_minute": 50})
    store.set_quota("user", bob.id, {"concurrent_requests": 3})  # replaces
    assert {(q.scope, q.subject_id): q.limits for q in store.quotas()} == {
        ("pool", pool.id): {"prompt_tokens_per_day": 1000}, ("user", bob.id): {"concurrent_requests": 3},
        ("token", token.id): {"completion_tokens_per_minute": 50}}
    assert store.api_token_names() == {token.id: f"laptop ({token.prefix}…)"}
    store.add_served_requests([served("a", NOW - 10, bob.id, token.id), served("b", NOW - 5, bob.id, None),
                               served("c", NOW - 1, None, None)])
    rows = store.usage_rows(NOW - 60)
    assert [(r.user_id, r.token_id, r.prompt_tokens) for r in rows] == [(bob.id, token.id, 10), (bob.id, None, 10),
                                                                       (None, None, 10)]
    assert len(store.usage_rows(NOW - 60, user_id=bob.id)) == 2
    store.delete_api_token(bob.id, token.id)  # a token's quota goes with it, and a user's with them
    assert ("token", token.id) not in {(q.scope, q.subject_id) for q in store.quotas()}
    store.delete_user(bob.id)
    assert [(q.scope, q.subject_id) for q in store.quotas()] == [("pool", pool.id)]
    store.set_quota("pool", pool.id, None)
    assert store.quotas() == []
    store.close()


def test_limits_are_checked_when_set():
    assert parse_limits({"concurrent_requests": 2, "prompt_tokens_per_day": None}) == {
        "concurrent_requests": 2, "prompt_tokens_per_day": None}
    for body, words in [({"tokens_per_hour": 5}, "unknown limit 'tokens_per_hour'"),
                        ({"concurrent_requests": -1}, "0 or more"), ({"concurrent_requests": True}, "whole number"),
                        ({"prompt_tokens_per_day": 2.5}, "whole number"), ([1], "JSON object")]:
        with pytest.raises(BadRequest, match=words):
            parse_limits(body)


def quota_book(tmp_path: Path, clock: Clock) -> tuple[QuotaBook, RequestBook, Store]:
    store = Store(tmp_path / "leader.db", password_hasher=CHEAP)
    book = RequestBook()
    book.resume("m", Budget(max_requests=8, tokens=100_000))
    quotas = QuotaBook(store, book, clock=clock)
    book.on_end = quotas.on_end
    quotas.load()
    return quotas, book, store


def finish(book: RequestBook, req: Request, tokens: int) -> None:
    book.on_tokens(messages.Tokens(req.model, [messages.TokenBatch(req.rid, list(range(tokens)), True, "length")]))


def test_which_limits_apply_and_when_a_refused_user_may_send_again(tmp_path: Path):
    clock = Clock()
    quotas, book, store = quota_book(tmp_path, clock)
    pool = 1
    quotas.set("pool", pool, {"prompt_tokens_per_minute": 100})
    # the pool's default applies to users without their own row, not to a request with no user
    quotas.check(request(7, prompt=100), pool)
    with pytest.raises(QuotaExceeded, match="more than the 100 prompt tokens per minute"):
        quotas.check(request(7, prompt=101), pool)  # can never pass: no Retry-After
    quotas.check(request(None, prompt=500), pool)

    first = request(7, prompt=60)
    book.submit(first)  # running: its prompt counts already
    with pytest.raises(QuotaExceeded) as info:
        quotas.check(request(7, prompt=50), pool)
    assert "you have used 60 of the 100 prompt tokens per minute" in str(info.value)
    assert "this pool (its default for each user)" in str(info.value)
    finish(book, first, 3)  # ended at NOW: its 60 tokens leave the window at NOW + 60
    clock.now += 20
    later = request(7, prompt=30)
    book.submit(later)
    finish(book, later, 3)
    clock.now += 10
    with pytest.raises(QuotaExceeded) as info:
        quotas.check(request(7, prompt=50), pool)
    assert info.value.retry_after == 30  # the first request's 60 leave in 30 s: then 30 + 50 fit
    assert "in 30 s" in str(info.value)
    clock.now += 30
    quotas.check(request(7, prompt=50), pool)

    # a user's own row replaces the pool's (all nulls: no limits); a token's row adds to it
    quotas.set("user", 7, {"prompt_tokens_per_minute": None})
    quotas.check(request(7, prompt=500), pool)
    quotas.set("token", 3, {"completion_tokens_per_day": 5, "concurrent_requests": 1})
    quotas.check(request(7, prompt=500, token_id=3), pool)
    tokened = request(7, token_id=3)
    book.submit(tokened)
    with pytest.raises(QuotaExceeded, match="this API token allows 1 request at once"):
        quotas.check(request(7, token_id=3), pool)
    quotas.check(request(7, token_id=None), pool)  # the same user without that token is not held by it
    finish(book, tokened, 6)
    clock.now += 3600
    with pytest.raises(QuotaExceeded) as info:
        quotas.check(request(7, token_id=3), pool)
    assert "6 of the 5 completion tokens per day" in str(info.value)
    assert info.value.retry_after == 86400 - 3600
    assert "(in 23 h 0 min)" in str(info.value)

    # a group of choices counts whole against requests-at-once
    quotas.set("user", 8, {"concurrent_requests": 3})
    with pytest.raises(QuotaExceeded, match="allows 3 requests at once"):
        quotas.check(request(8), pool, count=4)
    quotas.check(request(8), pool, count=3)
    store.close()


def test_a_restarted_leader_counts_the_last_days_usage(tmp_path: Path):
    clock = Clock()
    quotas, _, store = quota_book(tmp_path, clock)
    quotas.set("user", 7, {"completion_tokens_per_day": 100})
    store.add_served_requests([served("old", NOW - 90_000, 7, None, reply=500),
                               served("new", NOW - 600, 7, None, reply=100)])
    again = QuotaBook(store, RequestBook(), clock=clock)
    again.load()
    with pytest.raises(QuotaExceeded) as info:
        again.check(request(7), 1)
    assert info.value.retry_after == 86400 - 600
    store.close()


def test_usage_is_summed_per_period_and_group():
    hour = 3600
    base = NOW // hour * hour
    rows = [served("a", base + 10, 1, 5), served("b", base + 20, 1, None, prompt=4, reply=2),
            served("c", base + 30, 2, None, model="n", outcome="failed"), served("d", base + hour + 1, 1, 5)]
    table = usage_table(rows, hour, ("user", "model"), {1: "ann", 2: "bob"}, {5: "laptop (swt_abc…)"})
    assert [(r["period_start"] - base, r["user"], r["model"], r["requests"], r["failed"], r["prompt_tokens"],
             r["completion_tokens"]) for r in table] == [
        (0, "ann", "m", 2, 0, 14, 7), (0, "bob", "n", 1, 1, 10, 5), (hour, "ann", "m", 1, 0, 10, 5)]
    by_token = usage_table(rows, 86400, ("token",), {}, {5: "laptop (swt_abc…)"})
    assert {r["token"]: r["requests"] for r in by_token} == {"laptop (swt_abc…)": 2, None: 2}
    text = as_csv(table, ("user", "model"))
    assert text.splitlines()[0] == "period,user_id,user,model,requests,failed,prompt_tokens,completion_tokens"
    assert text.splitlines()[1].endswith(",1,ann,m,2,0,14,7")
    assert parse_usage_query({}, 7) == (86400, 3600, ("user", "model"))
    assert parse_usage_query({"range": "7d", "by": "token"}, 7) == (7 * 86400, 86400, ("token",))
    for query, words in [({"range": "8d"}, "keeps 7 days"), ({"range": "soon"}, "hours or days"),
                         ({"step": "week"}, "step 'week'"), ({"by": "fellow"}, "group by any of")]:
        with pytest.raises(BadRequest, match=words):
            parse_usage_query(query, 7)
