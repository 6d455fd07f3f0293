"""The store's plumbing: the connection, transactions, schema migrations -- on SQLite or PostgreSQL.

SQLite (the default, nothing to set up): one file in the leader's data dir. The leader calls the store from
``trio.to_thread.run_sync``, so several worker threads may call at once: one connection opened with
``check_same_thread=False`` and an ``RLock`` around every use keeps that safe, and SQLite's own locking (``BEGIN
IMMEDIATE``, a busy timeout) covers a second process such as ``swarm`` CLI admin commands.

PostgreSQL (``SWARM_DATABASE_URL=postgresql://...``, for a leader that outgrows one file): a pool of connections
(psycopg_pool) that the worker threads borrow from, and a write transaction that first takes one advisory lock, so
writers go one at a time as under ``BEGIN IMMEDIATE`` while readers never wait. The SQL stays SQLite's, written once:
``swarm.store.dialect`` translates each statement (placeholders, id columns, BLOB, upserts), so one list of
MIGRATIONS is the one schema and history of both. Design choice, measured (bench/store_backends.py,
bench/HISTORY.md): psycopg 3 with that thin layer rather than SQLAlchemy Core and Alembic -- the store is ~100
hand-written statements with ``?``; SQLAlchemy would have meant rewriting each as expressions or ``text()`` with
named parameters and keeping a second, Alembic, migration history beside the SQLite one, for a driver (psycopg)
that is the same underneath. Each call's overhead is in the bench.

The schema grows by appending to ``MIGRATIONS`` (SQLite SQL; the store's tests run it on both); never edit an entry
that has shipped.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import argon2

from swarm.errors import StoreError
from swarm.store import dialect

log = logging.getLogger(__name__)

# The seed (Saved chats): "A user can keep up to 1000 chats of up to 2 MB each".
MAX_CHATS_PER_USER = 1000
MAX_CHAT_BYTES = 2_000_000

# Version n is reached by running MIGRATIONS[n - 1]. Append only.
MIGRATIONS: list[str] = [
    """
    CREATE TABLE users (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        name TEXT NOT NULL UNIQUE COLLATE NOCASE,
        password_hash TEXT NOT NULL,
        is_admin INTEGER NOT NULL DEFAULT 0,
        created_at REAL NOT NULL
    );
    CREATE TABLE sessions (
        id TEXT PRIMARY KEY,
        user_id INTEGER NOT NULL REFERENCES users(id) ON DELETE CASCADE,
        csrf TEXT NOT NULL,
        created_at REAL NOT NULL,
        expires_at REAL NOT NULL
    );
    CREATE INDEX sessions_user ON sessions(user_id);
    CREATE TABLE api_tokens (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        user_id INTEGER NOT NULL REFERENCES users(id) ON DELETE CASCADE,
        name TEXT NOT NULL,
        token_hash TEXT NOT NULL UNIQUE,
        prefix TEXT NOT NULL,
        created_at REAL NOT NULL,
        last_used_at REAL
    );
    CREATE INDEX api_tokens_user ON api_tokens(user_id);
    CREATE TABLE login_links (
        token_hash TEXT PRIMARY KEY,
        user_id INTEGER NOT NULL REFERENCES users(id) ON DELETE CASCADE,
        expires_at REAL NOT NULL
    );
    CREATE TABLE pools (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        owner_user_id INTEGER REFERENCES users(id) ON DELETE SET NULL,
        name TEXT NOT NULL,
        created_at REAL NOT NULL
    );
    CREATE TABLE join_tokens (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        token_hash TEXT NOT NULL UNIQUE,
        prefix TEXT NOT NULL,
        pool_id INTEGER NOT NULL REFERENCES pools(id) ON DELETE CASCADE,
        created_at REAL NOT NULL,
        expires_at REAL,
        revoked INTEGER NOT NULL DEFAULT 0
    );
    CREATE TABLE fellows (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        name TEXT NOT NULL UNIQUE,
        public_key BLOB NOT NULL UNIQUE,
        pool_id INTEGER NOT NULL REFERENCES pools(id) ON DELETE CASCADE,
        node_credential_hash TEXT NOT NULL UNIQUE,
        created_at REAL NOT NULL,
        last_seen_at REAL
    );
    CREATE TABLE models (
        name TEXT PRIMARY KEY,
        pool_id INTEGER NOT NULL REFERENCES pools(id) ON DELETE CASCADE,
        manifest_json TEXT NOT NULL,
        created_at REAL NOT NULL
    );
    CREATE TABLE chats (
        id TEXT PRIMARY KEY,
        user_id INTEGER NOT NULL REFERENCES users(id) ON DELETE CASCADE,
        title TEXT NOT NULL,
        model TEXT NOT NULL DEFAULT '',
        messages_json TEXT NOT NULL,
        message_count INTEGER NOT NULL DEFAULT 0,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE INDEX chats_user_updated ON chats(user_id, updated_at);
    CREATE TABLE settings (
        key TEXT PRIMARY KEY,
        value_json TEXT NOT NULL
    );
    """,
    """
    ALTER TABLE fellows ADD COLUMN standby INTEGER NOT NULL DEFAULT 0;
    CREATE TABLE serving (
        model TEXT PRIMARY KEY,
        load_id TEXT NOT NULL,
        plans_json TEXT NOT NULL,
        updated_at REAL NOT NULL
    );
    """,
    # Join tokens expire and are used up (issue 10): uses_left NULL is a token from before, good until it expires --
    # which old never-expiring tokens now do, 24 h after this upgrade. A removed fellow's key stays refused.
    """
    ALTER TABLE join_tokens ADD COLUMN uses INTEGER;
    ALTER TABLE join_tokens ADD COLUMN uses_left INTEGER;
    UPDATE join_tokens SET expires_at = CAST(strftime('%s', 'now') AS REAL) + 86400 WHERE expires_at IS NULL;
    CREATE TABLE removed_fellow_keys (
        public_key BLOB PRIMARY KEY,
        name TEXT NOT NULL,
        removed_at REAL NOT NULL
    );
    """,
    # Serving history (issue 12): every finished request, kept SWARM_SERVING_HISTORY_DAYS days (swarm.store.history).
    """
    CREATE TABLE serving_history (
        id TEXT PRIMARY KEY,
        model TEXT NOT NULL,
        user_id INTEGER,
        started_at REAL NOT NULL,
        ended_at REAL NOT NULL,
        outcome TEXT NOT NULL,
        prompt_tokens INTEGER NOT NULL DEFAULT 0,
        reply_tokens INTEGER NOT NULL DEFAULT 0,
        ttft_ms REAL,
        tokens_per_s REAL,
        queue_ms REAL,
        error TEXT,
        timing_json TEXT
    );
    CREATE INDEX serving_history_model_ended ON serving_history(model, ended_at);
    CREATE INDEX serving_history_ended ON serving_history(ended_at);
    """,
    # Pools (issue 14): a leader hosts several, named uniquely; users are members of pools. Everything that was there
    # before -- every user, fellow, model and join token -- is in the default pool.
    """
    CREATE UNIQUE INDEX pools_name ON pools(name);
    CREATE TABLE pool_members (
        pool_id INTEGER NOT NULL REFERENCES pools(id) ON DELETE CASCADE,
        user_id INTEGER NOT NULL REFERENCES users(id) ON DELETE CASCADE,
        added_at REAL NOT NULL,
        PRIMARY KEY (pool_id, user_id)
    );
    CREATE INDEX pool_members_user ON pool_members(user_id);
    INSERT INTO pool_members (pool_id, user_id, added_at)
        SELECT pools.id, users.id, users.created_at FROM pools, users WHERE pools.name = 'default';
    UPDATE fellows SET pool_id = (SELECT id FROM pools WHERE name = 'default')
        WHERE EXISTS (SELECT 1 FROM pools WHERE name = 'default');
    UPDATE models SET pool_id = (SELECT id FROM pools WHERE name = 'default')
        WHERE EXISTS (SELECT 1 FROM pools WHERE name = 'default');
    UPDATE join_tokens SET pool_id = (SELECT id FROM pools WHERE name = 'default')
        WHERE EXISTS (SELECT 1 FROM pools WHERE name = 'default');
    """,
    # Quotas and usage (issue 39): limits per pool (its users' default), per user and per API token; the serving
    # history says which token each request came with, so usage reads per user, token and model.
    """
    CREATE TABLE quotas (
        scope TEXT NOT NULL,
        subject_id INTEGER NOT NULL,
        limits_json TEXT NOT NULL,
        updated_at REAL NOT NULL,
        PRIMARY KEY (scope, subject_id)
    );
    ALTER TABLE serving_history ADD COLUMN token_id INTEGER;
    CREATE INDEX serving_history_user_ended ON serving_history(user_id, ended_at);
    """,
    # Stored responses of the Responses API (issue 38, swarm.store.responses): each belongs to one user, as chats do.
    """
    CREATE TABLE responses (
        id TEXT PRIMARY KEY,
        user_id INTEGER NOT NULL REFERENCES users(id) ON DELETE CASCADE,
        model TEXT NOT NULL,
        response_json TEXT NOT NULL,
        input_json TEXT NOT NULL,
        messages_json TEXT NOT NULL,
        created_at REAL NOT NULL
    );
    CREATE INDEX responses_user_created ON responses(user_id, created_at);
    """,
]


def _private_file(path: Path) -> None:
    """Create the database file readable by its owner only (0600), or make an existing one so: it holds password
    hashes, token hashes and every user's chats. SQLite gives its -wal and -shm files the database file's mode."""
    if path.exists():
        os.chmod(path, 0o600)
    else:
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    for extra in (path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        if extra.exists():
            os.chmod(extra, 0o600)


def sha256_hex(text: str) -> str:
    """How every secret is kept: its sha256, so a copy of the database file signs nobody in."""
    return hashlib.sha256(text.encode()).hexdigest()


def new_secret(prefix: str) -> str:
    """A token shown once: ``prefix`` and 24 random bytes as 32 urlsafe characters (192 bits)."""
    return prefix + secrets.token_urlsafe(24)


class StoreCore:
    """The connection and its transactions; the tables' methods live in the mixins that make up ``Store``."""

    def __init__(
        self,
        path: str | Path,  # the SQLite file, or a postgresql:// URL
        *,
        password_hasher: argon2.PasswordHasher | None = None,
        max_chats_per_user: int = MAX_CHATS_PER_USER,
        max_chat_bytes: int = MAX_CHAT_BYTES,
    ) -> None:
        self.max_chats_per_user = max_chats_per_user
        self.max_chat_bytes = max_chat_bytes
        self._hasher = password_hasher or argon2.PasswordHasher()
        self._dummy_hash: str | None = None
        self._lock = threading.RLock()
        self._last_now = 0.0
        self._pg: dialect.Postgres | None = None
        if dialect.is_postgres_url(path):
            self.path = None
            self._pg = dialect.Postgres(str(path))
            self.where = self._pg.where
            self._error: type[Exception] = self._pg.Error
            self._migrate()
            return
        self.path = Path(path)
        self.where = str(self.path)
        self._error = sqlite3.Error
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _private_file(self.path)
            self._conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10.0)
            self._conn.row_factory = sqlite3.Row
            self._conn.create_function("swarm_fold", 1, lambda s: (s or "").casefold(), deterministic=True)
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA foreign_keys=ON")
            self._conn.execute("PRAGMA synchronous=NORMAL")  # safe with WAL; a power cut loses the last commit at most
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(f"cannot open the leader's database {self.path}: {exc}; check the data dir.") from exc
        self._migrate()

    # --- plumbing ----------------------------------------------------------------------------------------------------

    def close(self) -> None:
        if self._pg is not None:
            self._pg.close()
            return
        with self._lock:
            self._conn.close()

    def __enter__(self) -> StoreCore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; rolled back when the block raises. On PostgreSQL the connection it gives takes the
        same SQL (swarm.store.dialect translates it), and the block's ``_one``/``_all`` read inside it."""
        if self._pg is not None:
            with self._pg_errors(), self._pg.transaction() as conn:
                yield conn
            return
        with self._lock:
            # These messages can reach an HTTP client: they name no path (the log does), so a user of the API
            # learns nothing about the leader's disk.
            try:
                self._conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                log.error("the database %s is not writable: %s", self.path, exc)
                raise StoreError("the leader's database is not writable; its admin should check the leader's "
                                 "log and disk.") from exc
            try:
                yield self._conn
            except sqlite3.Error as exc:
                self._conn.execute("ROLLBACK")
                log.error("the database %s refused a change: %s", self.path, exc)
                raise StoreError("the leader's database refused this change; its admin can find why in the "
                                 "leader's log.") from exc
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            else:
                self._conn.execute("COMMIT")

    @contextlib.contextmanager
    def _pg_errors(self) -> Iterator[None]:
        """PostgreSQL's errors as the StoreError an API client may read: no host or password in it (the log has
        the server's words)."""
        assert self._pg is not None
        try:
            yield
        except self._pg.Error as exc:
            log.error("the database %s refused a change: %s", self.where, exc)
            raise StoreError("the leader's database refused this change or could not be reached; its admin can "
                             "find why in the leader's log.") from exc

    def _one(self, sql: str, args: tuple[Any, ...] = ()) -> sqlite3.Row | None:
        if self._pg is not None:
            with self._pg_errors():
                return self._pg.read(sql, args, many=False)
        with self._lock:
            return self._conn.execute(sql, args).fetchone()

    def _all(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        if self._pg is not None:
            with self._pg_errors():
                return self._pg.read(sql, args, many=True)
        with self._lock:
            return self._conn.execute(sql, args).fetchall()

    def _now(self) -> float:
        # Strictly increasing, so "most recent first" never ties within one leader process.
        with self._lock:
            self._last_now = max(time.time(), self._last_now + 1e-6)
            return self._last_now

    def schema_version(self) -> int:
        row = self._one("SELECT version FROM schema_version")
        return int(row["version"]) if row else 0

    def _migrate(self) -> None:
        with self._tx() as db:
            if self._pg is not None:
                for statement in dialect.PRELUDE:
                    db.execute(statement)
            db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = db.execute("SELECT version FROM schema_version").fetchone()
            if row is None:
                db.execute("INSERT INTO schema_version (version) VALUES (0)")
                version = 0
            else:
                version = int(row["version"])
            if version > len(MIGRATIONS):
                raise StoreError(
                    f"the database {self.where} has schema version {version}, newer than this swarm "
                    f"({len(MIGRATIONS)}); update swarm or use another data dir."
                )
            for number in range(version, len(MIGRATIONS)):
                # executescript would COMMIT our transaction; run the statements one by one instead (so a migration
                # must not hold a ';' inside a statement, e.g. a trigger body).
                for statement in MIGRATIONS[number].split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.execute("UPDATE schema_version SET version = ?", (number + 1,))
            if self._pg is not None:
                assert isinstance(db, dialect.Connection)  # a PostgreSQL store's transaction
                self._pg.schema.refresh(db.raw)
