"""The leader's store: users, sign-in, API tokens, pools, join tokens, fellows, models, settings, chats,
serving history -- in a SQLite file in the data dir, or on PostgreSQL when ``SWARM_DATABASE_URL`` says so.

``Store(path_or_url)`` opens (and migrates) the database (``leader_store(data_dir)`` the leader's own); its methods
block, so async code calls them through ``trio.to_thread.run_sync``. The tables' methods live beside their records:
``accounts`` (users, sessions, login links, API tokens), ``fleet`` (pools, join tokens, fellows, models), ``chats``,
``history`` (served requests), ``responses`` (the Responses API's stored responses);
``core`` holds the connection, the transactions and the migrations. Import everything from here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import argon2

from swarm.config import Settings
from swarm.store.accounts import LOGIN_LINK_TTL_S, SESSION_TTL_S, AccountsMixin, ApiToken, User
from swarm.store.chats import Chat, ChatLimitReached, ChatsMixin, ChatSummary, ChatTooLarge
from swarm.store.core import MAX_CHAT_BYTES, MAX_CHATS_PER_USER, MIGRATIONS
from swarm.store.fleet import DEFAULT_POOL, Fellow, FleetMixin, JoinToken, Model, Pool
from swarm.store.history import HistoryMixin, ServedRequest
from swarm.store.quotas import Quota, QuotasMixin, UsageRow
from swarm.store.responses import ResponsesMixin, StoredResponse

__all__ = [
    "DEFAULT_POOL",
    "LOGIN_LINK_TTL_S",
    "MAX_CHAT_BYTES",
    "MAX_CHATS_PER_USER",
    "MIGRATIONS",
    "SESSION_TTL_S",
    "ApiToken",
    "Chat",
    "ChatLimitReached",
    "ChatSummary",
    "ChatTooLarge",
    "Fellow",
    "JoinToken",
    "Model",
    "Pool",
    "Quota",
    "ServedRequest",
    "StoredResponse",
    "Store",
    "UsageRow",
    "User",
    "leader_store",
]


class Store(AccountsMixin, FleetMixin, ChatsMixin, HistoryMixin, QuotasMixin, ResponsesMixin):
    """The leader's database. Methods block; call them through ``trio.to_thread.run_sync`` from async code.

    ``password_hasher`` defaults to argon2-cffi's; ``max_chats_per_user`` and ``max_chat_bytes`` to the seed's
    1000 chats of 2 MB (tests set them small).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        password_hasher: argon2.PasswordHasher | None = None,
        max_chats_per_user: int = MAX_CHATS_PER_USER,
        max_chat_bytes: int = MAX_CHAT_BYTES,
    ) -> None:
        super().__init__(
            path,
            password_hasher=password_hasher,
            max_chats_per_user=max_chats_per_user,
            max_chat_bytes=max_chat_bytes,
        )

    def __enter__(self) -> Store:
        return self

    def create_user(self, name: str, password: str, is_admin: bool = False) -> User:
        """A new user; the first admin also gets the default pool."""
        user = super().create_user(name, password, is_admin)
        if is_admin and not self.list_pools():
            self.ensure_default_pool(user.id)
        return user

    # --- settings ----------------------------------------------------------------------------------------------------

    def get_setting(self, key: str, default: Any = None) -> Any:
        row = self._one("SELECT value_json FROM settings WHERE key = ?", (key,))
        return default if row is None else json.loads(row["value_json"])

    def set_setting(self, key: str, value: Any) -> None:
        text = json.dumps(value)
        with self._tx() as db:
            db.execute(
                "INSERT INTO settings (key, value_json) VALUES (?, ?) "
                "ON CONFLICT(key) DO UPDATE SET value_json = excluded.value_json",
                (key, text),
            )


def leader_store(data_dir: Path, settings: Settings | None = None, **options: Any) -> Store:
    """The leader's store: the PostgreSQL database of ``SWARM_DATABASE_URL`` when it is set, else ``leader.db`` in
    its data dir."""
    url = (settings or Settings.from_env()).database_url
    return Store(url or Path(data_dir) / "leader.db", **options)
