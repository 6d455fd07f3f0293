"""The leader's store: identity, secrets stored hashed, private chats with their limits, settings. Each test that
takes ``store`` or ``db_path`` runs twice: on SQLite and on PostgreSQL (``store_location``, tests/conftest.py)."""

from __future__ import annotations

import time
from pathlib import Path

import argon2
import pytest
import trio

from swarm.errors import AuthError, BadRequest, StoreError
from swarm.store.chats import DEFAULT_TITLE, TITLE_CHARS, default_title
from swarm.store.db import MIGRATIONS, ChatLimitReached, ChatTooLarge, Store

# argon2's minimum cost: the tests check behaviour, not the KDF's strength.
CHEAP = argon2.PasswordHasher(time_cost=1, memory_cost=8, parallelism=1)


@pytest.fixture
def db_path(store_location: Path | str) -> Path | str:
    """The store's place: a SQLite file, or a postgresql:// URL of a new database."""
    return store_location


@pytest.fixture
def store(db_path: Path):
    s = Store(db_path, password_hasher=CHEAP)
    yield s
    s.close()


def _db_bytes(path: Path | str) -> bytes:
    """Everything the database holds: the SQLite files' bytes, or every PostgreSQL row as text."""
    if isinstance(path, Path):
        return b"".join(p.read_bytes() for p in path.parent.glob(path.name + "*"))
    import psycopg

    with psycopg.connect(path) as conn:
        tables = [t for (t,) in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")]
        return "\n".join(str(row) for t in tables for row in conn.execute(f"SELECT * FROM {t}")).encode()


# --- schema ---------------------------------------------------------------------------------------------------------


def test_schema_version_and_reopen(db_path: Path) -> None:
    with Store(db_path, password_hasher=CHEAP) as s:
        assert s.schema_version() == len(MIGRATIONS)
        s.create_user("ada", "pw")
    with Store(db_path, password_hasher=CHEAP) as s:
        assert s.schema_version() == len(MIGRATIONS)
        assert [u.name for u in s.list_users()] == ["ada"]
        if not isinstance(db_path, Path):
            return
        mode = s._one("PRAGMA journal_mode")[0]
        assert mode == "wal"
        assert s._one("PRAGMA foreign_keys")[0] == 1


def test_newer_schema_is_refused(db_path: Path) -> None:
    with Store(db_path, password_hasher=CHEAP) as s, s._tx() as db:
        db.execute("UPDATE schema_version SET version = 999")
    with pytest.raises(StoreError, match="newer than this swarm"):
        Store(db_path, password_hasher=CHEAP)


# --- users ----------------------------------------------------------------------------------------------------------


def test_users_and_passwords(store: Store) -> None:
    admin = store.create_user("root", "s3cret", is_admin=True)
    bob = store.create_user("bob", "hunter2")
    assert admin.is_admin and not bob.is_admin
    assert store.verify_password("bob", "hunter2") == bob
    assert store.get_user(bob.id) == bob
    assert store.get_user_by_name("BOB") == bob  # names are case-insensitive
    assert [u.name for u in store.list_users()] == ["root", "bob"]
    with pytest.raises(StoreError, match="already exists"):
        store.create_user("Bob", "x")
    with pytest.raises(StoreError, match="password"):
        store.create_user("eve", "")


def test_wrong_password_does_not_reveal_names(store: Store) -> None:
    store.create_user("bob", "hunter2")
    with pytest.raises(AuthError) as wrong_pw:
        store.verify_password("bob", "nope")
    with pytest.raises(AuthError) as no_user:
        store.verify_password("nobody", "nope")
    assert str(wrong_pw.value) == str(no_user.value)


def test_password_is_rehashed_when_parameters_change(db_path: Path) -> None:
    with Store(db_path, password_hasher=CHEAP) as s:
        s.create_user("bob", "hunter2")
        old = s._one("SELECT password_hash FROM users")[0]
    stronger = argon2.PasswordHasher(time_cost=2, memory_cost=16, parallelism=1)
    with Store(db_path, password_hasher=stronger) as s:
        s.verify_password("bob", "hunter2")
        new = s._one("SELECT password_hash FROM users")[0]
        assert new != old and "t=2" in new
        s.verify_password("bob", "hunter2")  # still signs in with the new hash
        assert b"hunter2" not in _db_bytes(db_path)


def test_delete_user_deletes_their_things(store: Store) -> None:
    bob = store.create_user("bob", "pw")
    chat = store.create_chat(bob.id, messages=[{"role": "user", "content": "hi"}])
    token, _ = store.create_session(bob.id)
    plaintext, _ = store.create_api_token(bob.id, "laptop")
    link = store.create_login_link(bob.id)
    assert store.delete_user(bob.id)
    assert store.get_user(bob.id) is None
    assert store.get_chat(bob.id, chat.id) is None
    assert store.session_user(token) is None
    assert store.api_token_user(plaintext) is None
    assert store.use_login_link(link) is None
    assert not store.delete_user(bob.id)


# --- sessions, API tokens, login links ------------------------------------------------------------------------------


def test_sessions(store: Store) -> None:
    bob = store.create_user("bob", "pw")
    token, csrf = store.create_session(bob.id)
    assert store.session_user(token) == (bob, csrf)
    assert store.session_user("not-a-token") is None
    store.delete_session(token)
    assert store.session_user(token) is None
    expired, _ = store.create_session(bob.id, ttl_s=-1)
    assert store.session_user(expired) is None


def test_api_tokens_are_stored_hashed(store: Store, db_path: Path) -> None:
    bob = store.create_user("bob", "pw")
    alice = store.create_user("alice", "pw")
    plaintext, record = store.create_api_token(bob.id, "laptop")
    assert plaintext.startswith("swt_") and len(plaintext) == 4 + 32
    assert record.prefix == plaintext[:8] and record.name == "laptop" and record.last_used_at is None
    assert store.api_token_user(plaintext) == bob
    assert store.list_api_tokens(bob.id)[0].last_used_at is not None
    assert store.api_token_user(plaintext + "x") is None
    session, _ = store.create_session(bob.id)
    join = store.create_join_token(store.ensure_default_pool(bob.id).id)
    _, credential = store.enrol_fellow("gpu-1", b"k" * 32, store.list_pools()[0].id)
    link = store.create_login_link(bob.id)
    raw = _db_bytes(db_path)
    for secret in (plaintext, session, join, credential, link):
        assert secret.encode() not in raw
    assert not store.delete_api_token(alice.id, record.id)  # not hers
    assert store.delete_api_token(bob.id, record.id)
    assert store.api_token_user(plaintext) is None
    assert store.list_api_tokens(bob.id) == []


def test_login_link_is_single_use(store: Store) -> None:
    bob = store.create_user("bob", "pw")
    link = store.create_login_link(bob.id)
    assert store.use_login_link(link) == bob
    assert store.use_login_link(link) is None
    assert store.use_login_link(store.create_login_link(bob.id, ttl_s=-1)) is None


# --- pools, join tokens, fellows, models ----------------------------------------------------------------------------


def test_admin_gets_default_pool(store: Store) -> None:
    admin = store.create_user("root", "pw", is_admin=True)
    (pool,) = store.list_pools()
    assert pool.name == "default" and pool.owner_user_id == admin.id
    assert store.ensure_default_pool(admin.id) == pool


def test_join_tokens(store: Store) -> None:
    admin = store.create_user("root", "pw", is_admin=True)
    pool = store.ensure_default_pool(admin.id)
    token = store.create_join_token(pool.id)
    assert token.startswith("swj_")
    assert store.check_join_token(token) == pool.id
    with pytest.raises(AuthError, match="does not know"):
        store.check_join_token("swj_unknown")
    (listed,) = store.list_join_tokens()
    assert listed.prefix == token[:8] and not listed.revoked
    assert listed.expires_at == pytest.approx(time.time() + 24 * 3600, abs=60)  # a day by default
    assert (listed.uses, listed.uses_left) == (1, 1)  # and one fellow
    assert store.revoke_join_token(listed.id)
    with pytest.raises(AuthError, match="revoked"):
        store.check_join_token(token)


def test_join_tokens_expire_and_are_used_up(store: Store, monkeypatch) -> None:
    """A leaked join token is worth little: by default one fellow joins with it, within 24 h."""
    admin = store.create_user("root", "pw", is_admin=True)
    pool = store.ensure_default_pool(admin.id)
    once, twice = store.create_join_token(pool.id), store.create_join_token(pool.id, uses=2, ttl_s=60)
    assert store.redeem_join_token(once) == pool.id
    with pytest.raises(AuthError, match="used already"):
        store.redeem_join_token(once)
    store.redeem_join_token(twice)
    store.redeem_join_token(twice)
    with pytest.raises(AuthError, match="used already"):
        store.redeem_join_token(twice)
    later = store.create_join_token(pool.id)
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 24 * 3600 + 1)
    with pytest.raises(AuthError, match="expired"):
        store.redeem_join_token(later)
    for bad in ({"uses": 0}, {"uses": True}, {"uses": 10**6}, {"ttl_s": -1}, {"ttl_s": float("nan")},
                {"ttl_s": 10 * 365 * 86400}):
        with pytest.raises(BadRequest):
            store.create_join_token(pool.id, **bad)


def test_a_removed_fellow_is_forgotten_and_its_key_refused(store: Store) -> None:
    pool = store.ensure_default_pool(store.create_user("root", "pw", is_admin=True).id)
    fellow, credential = store.enrol_fellow("gpu-1", b"k" * 32, pool.id)
    assert store.remove_fellow(fellow.id).name == "gpu-1"
    assert store.fellow_by_credential(credential) is None and store.fellow_by_key(b"k" * 32) is None
    assert store.fellow_key_removed(b"k" * 32) and not store.fellow_key_removed(b"j" * 32)
    assert store.remove_fellow(fellow.id) is None


def test_fellow_enrol_and_re_enrol(store: Store) -> None:
    pool = store.ensure_default_pool(store.create_user("root", "pw", is_admin=True).id)
    fellow, cred1 = store.enrol_fellow("gpu-1", b"\x01" * 32, pool.id)
    assert cred1.startswith("swn_") and fellow.name == "gpu-1" and fellow.public_key == b"\x01" * 32
    assert store.fellow_by_credential(cred1) == fellow
    assert store.fellow_by_key(b"\x01" * 32) == fellow

    again, cred2 = store.enrol_fellow("gpu-1", b"\x01" * 32, pool.id)
    assert again.id == fellow.id and cred2 != cred1
    assert store.fellow_by_credential(cred1) is None  # the old credential no longer works
    assert store.fellow_by_credential(cred2).id == fellow.id

    other, _ = store.enrol_fellow("gpu-1", b"\x02" * 32, pool.id)
    third, _ = store.enrol_fellow("gpu-1", b"\x03" * 32, pool.id)
    assert (other.name, third.name) == ("gpu-1-2", "gpu-1-3")
    assert [f.name for f in store.list_fellows()] == ["gpu-1", "gpu-1-2", "gpu-1-3"]

    assert fellow.last_seen_at is None
    store.touch_fellow(fellow.id)
    assert store.fellow_by_key(b"\x01" * 32).last_seen_at is not None


def test_models(store: Store) -> None:
    pool = store.ensure_default_pool(store.create_user("root", "pw", is_admin=True).id)
    store.upsert_model("tiny", pool.id, '{"layers": 2}')
    store.upsert_model("tiny", pool.id, {"layers": 3})
    store.upsert_model("alpha", pool.id, {"layers": 1})
    assert store.get_model("tiny").manifest == {"layers": 3}
    assert [m.name for m in store.list_models()] == ["alpha", "tiny"]
    assert store.delete_model("tiny") and store.get_model("tiny") is None
    assert not store.delete_model("tiny")


def test_settings(store: Store) -> None:
    assert store.get_setting("theme", "dark") == "dark"
    store.set_setting("theme", "light")
    store.set_setting("limits", {"a": [1, 2]})
    assert store.get_setting("theme") == "light"
    assert store.get_setting("limits") == {"a": [1, 2]}
    store.set_setting("theme", None)
    assert store.get_setting("theme", "dark") is None


# --- chats ----------------------------------------------------------------------------------------------------------


def test_chats_are_private_admins_included(store: Store) -> None:
    admin = store.create_user("root", "pw", is_admin=True)
    bob = store.create_user("bob", "pw")
    chat = store.create_chat(bob.id, None, "tiny", [{"role": "user", "content": "secret plans"}])
    assert store.get_chat(bob.id, chat.id) == chat
    assert store.get_chat(admin.id, chat.id) is None
    assert store.list_chats(admin.id) == []
    assert store.update_chat(admin.id, chat.id, title="mine now") is None
    assert not store.delete_chat(admin.id, chat.id)
    assert store.get_chat(bob.id, chat.id).title == "secret plans"


def test_chat_titles(store: Store) -> None:
    bob = store.create_user("bob", "pw")
    long = "word " * 40
    messages = [{"role": "system", "content": "be nice"}, {"role": "user", "content": long}]
    chat = store.create_chat(bob.id, messages=messages)
    assert len(chat.title) <= TITLE_CHARS + 1 and chat.title.endswith("…") and chat.title.startswith("word word")
    parts = [{"role": "user", "content": [{"type": "text", "text": "look\n at   this"}]}]
    assert default_title(parts) == "look at this"
    empty = store.create_chat(bob.id)
    assert empty.title == DEFAULT_TITLE and empty.messages == []
    named = store.update_chat(bob.id, empty.id, messages=[{"role": "user", "content": "Hello there"}])
    assert named.title == "Hello there"
    assert store.update_chat(bob.id, empty.id, title="  Greetings  ").title == "Greetings"
    assert store.update_chat(bob.id, empty.id, messages=[{"role": "user", "content": "other"}]).title == "Greetings"
    assert store.update_chat(bob.id, empty.id, title="").title == "other"


def test_chat_list_order_and_search(store: Store) -> None:
    bob = store.create_user("bob", "pw")
    a = store.create_chat(bob.id, "Recipe for Crème brûlée", "qwen3-8b", [])
    b = store.create_chat(bob.id, "Tax return", "smollm2-135m-instruct", [])
    c = store.create_chat(bob.id, "Poem", "Qwen3-8B", [{"role": "user", "content": "x"}])
    assert [s.id for s in store.list_chats(bob.id)] == [c.id, b.id, a.id]
    two = [{"role": "user", "content": "more"}, {"role": "assistant", "content": "ok"}]
    store.update_chat(bob.id, a.id, messages=two)
    summaries = store.list_chats(bob.id)
    assert [s.id for s in summaries] == [a.id, c.id, b.id]
    assert summaries[0].message_count == 2 and summaries[0].model == "qwen3-8b"
    assert [s.id for s in store.list_chats(bob.id, query="QWEN3")] == [a.id, c.id]
    assert [s.id for s in store.list_chats(bob.id, query="BRÛLÉE")] == [a.id]
    assert [s.id for s in store.list_chats(bob.id, query="tax")] == [b.id]
    assert store.list_chats(bob.id, query="%") == []  # no LIKE wildcards
    assert store.update_chat(bob.id, b.id, model="tiny").model == "tiny"
    assert store.delete_chat(bob.id, b.id)
    assert store.get_chat(bob.id, b.id) is None
    assert [s.id for s in store.list_chats(bob.id)] == [a.id, c.id]


def test_chat_count_limit(db_path: Path) -> None:
    with Store(db_path, password_hasher=CHEAP, max_chats_per_user=3) as s:
        bob, alice = s.create_user("bob", "pw"), s.create_user("alice", "pw")
        chats = [s.create_chat(bob.id, messages=[]) for _ in range(3)]
        with pytest.raises(ChatLimitReached, match="delete some chats") as exc:
            s.create_chat(bob.id)
        assert "3" in str(exc.value) and isinstance(exc.value, StoreError)
        s.create_chat(alice.id)  # the limit is per user
        s.delete_chat(bob.id, chats[0].id)
        s.create_chat(bob.id)


def test_default_chat_count_limit_is_1000(db_path: Path) -> None:
    with Store(db_path, password_hasher=CHEAP) as s:
        bob = s.create_user("bob", "pw")
        now = time.time()
        with s._tx() as db:  # 1000 rows in one transaction: a few milliseconds
            db.executemany(
                "INSERT INTO chats (id, user_id, title, model, messages_json, created_at, updated_at) "
                "VALUES (?, ?, 't', '', '[]', ?, ?)",
                [(f"c{i}", bob.id, now, now) for i in range(1000)],
            )
        with pytest.raises(ChatLimitReached, match="1000"):
            s.create_chat(bob.id)


def test_chat_size_limit(db_path: Path) -> None:
    with Store(db_path, password_hasher=CHEAP, max_chat_bytes=500) as s:
        bob = s.create_user("bob", "pw")
        chat = s.create_chat(bob.id, messages=[{"role": "user", "content": "short"}])
        big = [{"role": "user", "content": "é" * 300}]  # 600 bytes in UTF-8
        with pytest.raises(ChatTooLarge, match="start a new chat"):
            s.create_chat(bob.id, messages=big)
        with pytest.raises(ChatTooLarge, match="500 bytes"):
            s.update_chat(bob.id, chat.id, messages=big)
        assert s.get_chat(bob.id, chat.id).messages == [{"role": "user", "content": "short"}]
    with Store(db_path, password_hasher=CHEAP) as s:  # the default is 2 MB
        bob = s.get_user_by_name("bob")
        with pytest.raises(ChatTooLarge, match="2.0 MB"):
            s.create_chat(bob.id, messages=[{"role": "user", "content": "x" * 2_000_001}])


async def test_store_from_worker_threads(store: Store) -> None:
    bob = store.create_user("bob", "pw")
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(trio.to_thread.run_sync, store.create_chat, bob.id, f"chat {i}", "m", [])
                nursery.start_soon(trio.to_thread.run_sync, store.list_chats, bob.id)
    assert len(store.list_chats(bob.id)) == 20


async def test_concurrent_writers_go_one_at_a_time(db_path) -> None:
    """The chat limit is a count, then an insert: 20 threads racing for 5 places get exactly 5 (SQLite's BEGIN
    IMMEDIATE, PostgreSQL's write lock)."""
    with Store(db_path, password_hasher=CHEAP, max_chats_per_user=5) as s:
        bob = s.create_user("bob", "pw")
        outcomes: list[str] = []

        def create() -> None:
            try:
                s.create_chat(bob.id, messages=[])
                outcomes.append("saved")
            except ChatLimitReached:
                outcomes.append("refused")

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for _ in range(20):
                    nursery.start_soon(trio.to_thread.run_sync, create)
        assert sorted(outcomes) == ["refused"] * 15 + ["saved"] * 5
        assert len(s.list_chats(bob.id)) == 5


def test_the_database_file_is_private_and_errors_do_not_name_it(tmp_path) -> None:
    import stat

    path = tmp_path / "data" / "leader.db"
    store = Store(path)
    store.create_user("root", "pw", is_admin=True)  # writes: the WAL exists now
    for file in (path, path.with_name("leader.db-wal")):
        assert stat.S_IMODE(file.stat().st_mode) == 0o600, file
    with pytest.raises(StoreError) as caught:
        with store._tx() as db:
            db.execute("INSERT INTO no_such_table VALUES (1)")
    assert str(tmp_path) not in str(caught.value) and "leader.db" not in str(caught.value)
    store.close()
    path.chmod(0o644)  # a database from before: made private when opened
    Store(path).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


# --- stored responses (the Responses API) ---------------------------------------------------------------------------


def test_stored_responses_belong_to_their_user_and_the_oldest_go(db_path: Path) -> None:
    with Store(db_path, password_hasher=CHEAP, max_chats_per_user=2) as s:
        ada, bob = s.create_user("ada", "pw"), s.create_user("bob", "pw")
        conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
        for n in range(3):
            s.save_response(ada.id, f"resp_{n}", "m", {"id": f"resp_{n}", "n": n}, [{"id": "msg_1"}], conversation)
        assert s.get_response(ada.id, "resp_0") is None  # past the 2 one user keeps: the oldest went
        kept = s.get_response(ada.id, "resp_2")
        assert kept is not None and kept.response == {"id": "resp_2", "n": 2} and kept.messages == conversation
        assert kept.input_items == [{"id": "msg_1"}] and kept.model == "m"
        assert s.get_response(bob.id, "resp_2") is None and not s.delete_response(bob.id, "resp_2")
        assert s.delete_response(ada.id, "resp_2") and s.get_response(ada.id, "resp_2") is None
        assert s.get_response(ada.id, "resp_1") is not None
        with pytest.raises(ChatTooLarge):
            s.save_response(ada.id, "resp_big", "m", {}, [], [{"role": "user", "content": "a" * 3_000_000}])
