"""The leader's store on PostgreSQL: `swarm admin migrate-db` copies a SQLite leader over with nothing lost, refuses
a target that holds data, and the leader opens its store there when SWARM_DATABASE_URL is set. Each test needs the
throwaway server of tests/conftest.py (``postgres_server``)."""

from __future__ import annotations

import sqlite3
import sys
import time
from pathlib import Path

import argon2
import psycopg
import pytest

from swarm import cli
from swarm.config import Settings
from swarm.errors import ConfigError
from swarm.store.db import Store, leader_store
from swarm.store.dialect import translate
from swarm.store.history import ServedRequest

CHEAP = argon2.PasswordHasher(time_cost=1, memory_cost=8, parallelism=1)

# The tables the SQLite leader below fills; every table, these and any other, must arrive with all its rows.
FILLED = ("users", "sessions", "api_tokens", "login_links", "pools", "join_tokens", "fellows", "models", "chats",
          "settings", "serving", "removed_fellow_keys", "serving_history")


def _fill(store: Store) -> None:
    """A leader that has lived a little: a row or more in every table."""
    admin = store.create_user("root", "admin-pw", is_admin=True)
    bob = store.create_user("Bob", "bob-pw")
    store.create_session(bob.id)
    store.create_api_token(admin.id, "laptop")
    store.create_login_link(admin.id)
    pool = store.ensure_default_pool(admin.id)
    store.create_join_token(pool.id, uses=3)
    store.enrol_fellow("pc-1", b"\x00\x01key-one\xff" * 3, pool.id)
    store.enrol_fellow("pc-2", b"\x02key-two", pool.id, standby=True)
    gone, _ = store.enrol_fellow("pc-3", b"\x03key-three", pool.id)
    store.remove_fellow(gone.id)
    store.upsert_model("tiny", pool.id, {"name": "tiny", "layers": 4})
    store.create_chat(bob.id, messages=[{"role": "user", "content": "crème brûlée ✓ 100%?"}], model="tiny")
    store.create_chat(admin.id, title="second")
    store.set_setting("direct_links", True)
    store.save_serving("tiny", "load-1", [{"fellow": "pc-1", "layers": [0, 4]}])
    now = time.time()
    store.add_served_requests([
        ServedRequest(id=f"r{i}", model="tiny", started_at=now - 10 + i, ended_at=now - 9 + i, outcome="done",
                      prompt_tokens=12, reply_tokens=30, ttft_ms=41.5, tokens_per_s=22.25, queue_ms=0.5,
                      user_id=bob.id, timing={"stages": [1.5, 2.5]} if i else None)
        for i in range(5)
    ])


def _rows(conn, table: str, columns: list[str]) -> list[tuple]:
    rows = [tuple(bytes(v) if isinstance(v, memoryview) else v for v in r)
            for r in conn.execute(f"SELECT {', '.join(columns)} FROM {table}").fetchall()]
    return sorted(rows, key=repr)


def test_migrate_db_copies_every_row_and_refuses_a_full_target(tmp_path: Path, postgres_server, capsys) -> None:
    data_dir = tmp_path / "leader"
    with Store(data_dir / "leader.db", password_hasher=CHEAP) as store:
        _fill(store)
    url = postgres_server.new_database()

    assert cli.main(["admin", "migrate-db", "--to", url, "--data-dir", str(data_dir)]) == 0
    out = capsys.readouterr().out
    assert "2 users" in out and "5 serving_history" in out and f"SWARM_DATABASE_URL={url}" in out

    lite = sqlite3.connect(data_dir / "leader.db")
    tables = [t for (t,) in lite.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                         "AND name NOT LIKE 'sqlite_%' ORDER BY name")]
    assert set(FILLED) <= set(tables)
    with psycopg.connect(url) as pg:
        for table in tables:
            columns = [c[1] for c in lite.execute(f"PRAGMA table_info({table})")]
            expected, copied = _rows(lite, table, columns), _rows(pg, table, columns)
            assert copied == expected, table  # counts and every value, blobs and floats included
            assert expected or table not in FILLED, f"the test leader has no {table}"

    # the leader's own view of it on PostgreSQL; new ids follow the copied ones (the sequences were reset)
    with Store(url, password_hasher=CHEAP) as store:
        assert store.verify_password("bob", "bob-pw").name == "Bob"
        assert [f.name for f in store.list_fellows()] == ["pc-1", "pc-2"]
        assert store.fellow_by_key(b"\x00\x01key-one\xff" * 3).name == "pc-1"
        assert store.fellow_key_removed(b"\x03key-three")
        assert store.list_fellows()[1].standby
        assert store.get_setting("direct_links") is True
        assert [c.title for c in store.list_chats(store.get_user_by_name("bob").id, query="BRÛLÉE")] == \
            ["crème brûlée ✓ 100%?"]
        assert store.create_user("carol", "pw").id == 3
        fellow, _ = store.enrol_fellow("pc-4", b"\x04", store.list_pools()[0].id)
        assert fellow.id == 4

    # a second copy into the now full database changes nothing and says why
    assert cli.main(["admin", "migrate-db", "--to", url, "--data-dir", str(data_dir)]) == 1
    err = capsys.readouterr().err
    assert "already holds leader data (3 in users" in err and "empty database only" in err
    with Store(url, password_hasher=CHEAP) as store:
        assert len(store.list_users()) == 3


def test_migrate_db_without_a_sqlite_leader_says_where_it_looked(tmp_path: Path, postgres_server, capsys) -> None:
    url = postgres_server.new_database()
    assert cli.main(["admin", "migrate-db", "--to", url, "--data-dir", str(tmp_path / "nothing")]) == 1
    assert "no SQLite leader database at" in capsys.readouterr().err
    assert cli.main(["admin", "migrate-db", "--to", "mysql://x/y", "--data-dir", str(tmp_path)]) == 1
    assert "not a postgresql:// URL" in capsys.readouterr().err


def test_the_leader_store_follows_swarm_database_url(tmp_path: Path, postgres_server) -> None:
    url = postgres_server.new_database()
    with leader_store(tmp_path, Settings.from_env({"SWARM_DATABASE_URL": url})) as store:
        store.create_user("root", "pw", is_admin=True)
        assert store.where == url and store.path is None
    assert not (tmp_path / "leader.db").exists()
    with leader_store(tmp_path, Settings.from_env({})) as store:  # unset: the SQLite file in the data dir
        assert store.list_users() == []
    assert (tmp_path / "leader.db").is_file()
    with pytest.raises(ConfigError, match="must be a postgresql:// URL"):
        Settings.from_env({"SWARM_DATABASE_URL": "mysql://db-host/swarm"})


def test_an_unreachable_database_is_a_clear_error(postgres_server) -> None:
    from swarm.errors import StoreError

    wrong = postgres_server.url.rsplit("/", 1)[0] + "/no_such_db"
    with pytest.raises(StoreError, match=r"cannot open the leader's PostgreSQL database .*no_such_db.*"
                                         r"does not exist.*check SWARM_DATABASE_URL"):
        Store(wrong)


def test_translation_of_the_stores_sqlite_sql() -> None:
    keys = (("removed_fellow_keys", ("public_key",)),)
    identities = (("users", "id"),)
    assert translate("SELECT * FROM users WHERE name = ? AND x LIKE '%?'", keys, identities) == \
        ("SELECT * FROM users WHERE name = %s AND x ILIKE '%%?'", False)
    assert translate("INSERT INTO users (name) VALUES (?)", keys, identities) == \
        ("INSERT INTO users (name) VALUES (%s) RETURNING id", True)
    assert translate("INSERT OR REPLACE INTO removed_fellow_keys (public_key, name) VALUES (?, ?)", keys,
                     identities)[0] == ("INSERT INTO removed_fellow_keys (public_key, name) VALUES (%s, %s) "
                                        "ON CONFLICT (public_key) DO UPDATE SET name = EXCLUDED.name")
    assert translate("INSERT OR IGNORE INTO t (a) VALUES (?)")[0] == \
        "INSERT INTO t (a) VALUES (%s) ON CONFLICT DO NOTHING"
    ddl = translate("CREATE TABLE u (id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL UNIQUE COLLATE NOCASE, "
                    "k BLOB, at REAL, n INTEGER)")[0]
    assert ddl == ("CREATE TABLE u (id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, "
                   "name TEXT COLLATE swarm_nocase NOT NULL UNIQUE, k BYTEA, at DOUBLE PRECISION, n BIGINT)")


@pytest.mark.e2e
async def test_a_leader_on_postgresql_enrols_fellows_loads_and_answers(tmp_path: Path, postgres_server,
                                                                       smollm_model_dir, monkeypatch) -> None:
    from harness import running_swarm

    url = postgres_server.new_database()
    monkeypatch.setenv("SWARM_DATABASE_URL", url)  # swarm model import (the harness's install) follows it too
    async with running_swarm(tmp_path, [smollm_model_dir], fellows=2, leader_env={"SWARM_DATABASE_URL": url}) as swarm:
        model = smollm_model_dir.name
        view = await swarm.load(model, num_stages=2)
        assert [s["fellow"] for s in view["stages"]] == ["fellow-0", "fellow-1"]
        reply = await swarm.chat(model, [{"role": "user", "content": "hello"}], max_tokens=5)
        assert reply["usage"]["completion_tokens"] >= 1
    assert not (tmp_path / "leader" / "leader.db").exists()
    with psycopg.connect(url) as pg:
        assert [n for (n,) in pg.execute("SELECT name FROM fellows ORDER BY id")] == ["fellow-0", "fellow-1"]
        assert [m for (m,) in pg.execute("SELECT name FROM models")] == [model]
        assert [m for (m,) in pg.execute("SELECT model FROM serving")] == [model]
        assert pg.execute("SELECT count(*) FROM users WHERE is_admin = 1").fetchone()[0] == 1


def test_without_the_driver_the_leader_says_what_to_install(monkeypatch) -> None:
    """psycopg is imported only when SWARM_DATABASE_URL is set; a leader without it says how to get it."""
    from swarm.errors import StoreError

    monkeypatch.setitem(sys.modules, "psycopg", None)  # as if not installed: its import raises ImportError
    with pytest.raises(StoreError, match=r"pip install 'psycopg\[binary\]' psycopg_pool"):
        Store("postgresql://swarm@127.0.0.1:1/swarm")
