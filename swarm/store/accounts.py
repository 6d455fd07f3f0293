"""Accounts: users and their passwords, browser sessions, single-use login links, API tokens.

Passwords are hashed with argon2id (argon2-cffi's RFC 9106 low-memory profile: 64 MiB, 3 passes) and rehashed at the
next sign-in when those parameters change. Session tokens, login links and API tokens are kept as sha256 only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import sqlite3
import time

import argon2

from swarm.errors import AuthError, StoreError
from swarm.store.core import StoreCore, new_secret, sha256_hex

SESSION_TTL_S = 30 * 24 * 3600.0  # a browser stays signed in for 30 days


class TokenLimitReached(StoreError):
    """The user already keeps as many API tokens as one user may (SWARM_API_TOKENS_PER_USER)."""
LOGIN_LINK_TTL_S = 600.0  # long enough to open swarm demo's printed Chat: URL, short enough not to linger


@dataclasses.dataclass(frozen=True)
class User:
    id: int
    name: str
    is_admin: bool
    created_at: float
    # the API token a request came with (swarm.store api_token_user); None: a session. Not part of who the user is.
    token_id: int | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass(frozen=True)
class ApiToken:
    id: int
    user_id: int
    name: str
    prefix: str  # the first characters of the plaintext, to tell tokens apart in a list
    created_at: float
    last_used_at: float | None


class AccountsMixin(StoreCore):
    # --- users -------------------------------------------------------------------------------------------------------

    @staticmethod
    def _user(row: sqlite3.Row) -> User:
        return User(id=row["id"], name=row["name"], is_admin=bool(row["is_admin"]), created_at=row["created_at"])

    def create_user(self, name: str, password: str, is_admin: bool = False) -> User:
        name = name.strip()
        if not name:
            raise StoreError("a user needs a name.")
        if not password:
            raise StoreError(f"user {name!r} needs a password that is not empty.")
        password_hash = self._hasher.hash(password)
        with self._tx() as db:
            if db.execute("SELECT 1 FROM users WHERE name = ?", (name,)).fetchone():
                raise StoreError(f"a user named {name!r} already exists; pick another name.")
            cur = db.execute(
                "INSERT INTO users (name, password_hash, is_admin, created_at) VALUES (?, ?, ?, ?)",
                (name, password_hash, int(is_admin), self._now()),
            )
            user_id = cur.lastrowid
            assert user_id is not None  # the row just inserted
            # A new user is a member of the default pool (as every user was before pools); an admin can take them
            # out of it and into others.
            db.execute("INSERT INTO pool_members (pool_id, user_id, added_at) SELECT id, ?, ? FROM pools "
                       "WHERE name = 'default'", (user_id, self._now()))
        user = self.get_user(user_id)
        assert user is not None
        return user

    def verify_password(self, name: str, password: str) -> User:
        """The user with that name and password; AuthError otherwise, the same whether or not the name exists."""
        refused = AuthError("wrong user name or password; check both and try again.")
        row = self._one("SELECT * FROM users WHERE name = ?", (name.strip(),))
        if row is None:
            # Spend the same time as a real check, so timing does not tell which names exist.
            if self._dummy_hash is None:
                self._dummy_hash = self._hasher.hash(secrets.token_urlsafe(16))
            with contextlib.suppress(argon2.exceptions.VerificationError):
                self._hasher.verify(self._dummy_hash, password)
            raise refused
        try:
            self._hasher.verify(row["password_hash"], password)
        except (argon2.exceptions.VerificationError, argon2.exceptions.InvalidHashError):
            raise refused from None
        if self._hasher.check_needs_rehash(row["password_hash"]):
            with self._tx() as db:
                db.execute("UPDATE users SET password_hash = ? WHERE id = ?", (self._hasher.hash(password), row["id"]))
        return self._user(row)

    def set_password(self, user_id: int, password: str) -> None:
        if not password:
            raise StoreError("the new password is empty; pick one that is not.")
        password_hash = self._hasher.hash(password)
        with self._tx() as db:
            db.execute("UPDATE users SET password_hash = ? WHERE id = ?", (password_hash, user_id))
            db.execute("DELETE FROM sessions WHERE user_id = ?", (user_id,))

    def get_user(self, user_id: int) -> User | None:
        row = self._one("SELECT * FROM users WHERE id = ?", (user_id,))
        return self._user(row) if row else None

    def get_user_by_name(self, name: str) -> User | None:
        row = self._one("SELECT * FROM users WHERE name = ?", (name.strip(),))
        return self._user(row) if row else None

    def list_users(self) -> list[User]:
        return [self._user(r) for r in self._all("SELECT * FROM users ORDER BY id")]

    def delete_user(self, user_id: int) -> bool:
        """Delete a user with their chats, API tokens, sessions and login links (foreign keys cascade)."""
        with self._tx() as db:
            tokens = [r["id"] for r in db.execute("SELECT id FROM api_tokens WHERE user_id = ?", (user_id,))]
            for token_id in tokens:  # their quotas go with them (quotas has no foreign keys: its subjects vary)
                db.execute("DELETE FROM quotas WHERE scope = 'token' AND subject_id = ?", (token_id,))
            db.execute("DELETE FROM quotas WHERE scope = 'user' AND subject_id = ?", (user_id,))
            return db.execute("DELETE FROM users WHERE id = ?", (user_id,)).rowcount > 0

    # --- browser sessions and login links ----------------------------------------------------------------------------

    def create_session(self, user_id: int, ttl_s: float = SESSION_TTL_S) -> tuple[str, str]:
        """A new sign-in: (session token for the HttpOnly cookie, CSRF token for the page)."""
        token, csrf = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
        now = self._now()
        with self._tx() as db:
            db.execute("DELETE FROM sessions WHERE expires_at <= ?", (now,))
            db.execute(
                "INSERT INTO sessions (id, user_id, csrf, created_at, expires_at) VALUES (?, ?, ?, ?, ?)",
                (sha256_hex(token), user_id, csrf, now, now + ttl_s),
            )
        return token, csrf

    def session_user(self, session_token: str) -> tuple[User, str] | None:
        """(user, csrf token) for a live session; None when unknown or expired."""
        row = self._one(
            "SELECT users.*, sessions.csrf, sessions.expires_at AS expires_at FROM sessions "
            "JOIN users ON users.id = sessions.user_id WHERE sessions.id = ?",
            (sha256_hex(session_token),),
        )
        if row is None:
            return None
        if row["expires_at"] <= time.time():
            self.delete_session(session_token)
            return None
        return self._user(row), row["csrf"]

    def delete_session(self, session_token: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM sessions WHERE id = ?", (sha256_hex(session_token),))

    def create_login_link(self, user_id: int, ttl_s: float = LOGIN_LINK_TTL_S) -> str:
        """A single-use token that signs ``user_id`` in (``swarm demo``'s Chat: URL)."""
        token = new_secret("swl_")
        now = self._now()
        with self._tx() as db:
            db.execute("DELETE FROM login_links WHERE expires_at <= ?", (now,))
            db.execute(
                "INSERT INTO login_links (token_hash, user_id, expires_at) VALUES (?, ?, ?)",
                (sha256_hex(token), user_id, now + ttl_s),
            )
        return token

    def use_login_link(self, token: str) -> User | None:
        """The link's user, once; None when the link is unknown, used or expired."""
        with self._tx() as db:
            row = db.execute("SELECT * FROM login_links WHERE token_hash = ?", (sha256_hex(token),)).fetchone()
            if row is None:
                return None
            db.execute("DELETE FROM login_links WHERE token_hash = ?", (sha256_hex(token),))
            if row["expires_at"] <= time.time():
                return None
            user_id = row["user_id"]
        return self.get_user(user_id)

    # --- API tokens --------------------------------------------------------------------------------------------------

    @staticmethod
    def _api_token(row: sqlite3.Row) -> ApiToken:
        return ApiToken(
            id=row["id"],
            user_id=row["user_id"],
            name=row["name"],
            prefix=row["prefix"],
            created_at=row["created_at"],
            last_used_at=row["last_used_at"],
        )

    def create_api_token(self, user_id: int, name: str, limit: int | None = None) -> tuple[str, ApiToken]:
        """(plaintext, record). The plaintext is shown once; only its sha256 is kept. ``limit``: how many tokens the
        user may keep (TokenLimitReached past it); None for no limit (the admin's own, on the command line)."""
        plaintext = new_secret("swt_")
        with self._tx() as db:
            if limit is not None:
                (count,) = db.execute("SELECT count(*) FROM api_tokens WHERE user_id = ?", (user_id,)).fetchone()
                if count >= limit:
                    raise TokenLimitReached(
                        f"you already keep {count} API tokens, the most one user can keep ({limit}, "
                        "SWARM_API_TOKENS_PER_USER on the leader); delete tokens you no longer use under Settings > "
                        "API (or DELETE /api/v1/tokens/{id}), then create this one.")
            cur = db.execute(
                "INSERT INTO api_tokens (user_id, name, token_hash, prefix, created_at) VALUES (?, ?, ?, ?, ?)",
                (user_id, name.strip() or "token", sha256_hex(plaintext), plaintext[:8], self._now()),
            )
            row = db.execute("SELECT * FROM api_tokens WHERE id = ?", (cur.lastrowid,)).fetchone()
        return plaintext, self._api_token(row)

    def api_token_user(self, plaintext: str) -> User | None:
        """The token's user, with ``token_id`` set to the token's id (quotas and usage count per token too)."""
        digest = sha256_hex(plaintext)
        with self._tx() as db:
            row = db.execute(
                "SELECT users.*, api_tokens.id AS api_token_id FROM api_tokens "
                "JOIN users ON users.id = api_tokens.user_id WHERE api_tokens.token_hash = ?",
                (digest,),
            ).fetchone()
            if row is None:
                return None
            db.execute("UPDATE api_tokens SET last_used_at = ? WHERE token_hash = ?", (self._now(), digest))
        return dataclasses.replace(self._user(row), token_id=row["api_token_id"])

    def list_api_tokens(self, user_id: int) -> list[ApiToken]:
        rows = self._all("SELECT * FROM api_tokens WHERE user_id = ? ORDER BY id", (user_id,))
        return [self._api_token(r) for r in rows]

    def delete_api_token(self, user_id: int, token_id: int) -> bool:
        with self._tx() as db:
            cur = db.execute("DELETE FROM api_tokens WHERE id = ? AND user_id = ?", (token_id, user_id))
            if cur.rowcount > 0:
                db.execute("DELETE FROM quotas WHERE scope = 'token' AND subject_id = ?", (token_id,))
            return cur.rowcount > 0

    # --- pool membership ---------------------------------------------------------------------------------------------

    def add_pool_member(self, pool_id: int, user_id: int) -> bool:
        """Make ``user_id`` a member of ``pool_id``; False when they already were."""
        with self._tx() as db:
            if db.execute("SELECT 1 FROM pool_members WHERE pool_id = ? AND user_id = ?",
                          (pool_id, user_id)).fetchone():
                return False
            db.execute("INSERT INTO pool_members (pool_id, user_id, added_at) VALUES (?, ?, ?)",
                       (pool_id, user_id, self._now()))
        return True

    def remove_pool_member(self, pool_id: int, user_id: int) -> bool:
        with self._tx() as db:
            return db.execute("DELETE FROM pool_members WHERE pool_id = ? AND user_id = ?",
                              (pool_id, user_id)).rowcount > 0

    def pool_members(self, pool_id: int) -> list[User]:
        rows = self._all("SELECT users.* FROM pool_members JOIN users ON users.id = pool_members.user_id "
                         "WHERE pool_members.pool_id = ? ORDER BY users.id", (pool_id,))
        return [self._user(r) for r in rows]

    def member_pool_ids(self, user_id: int) -> set[int]:
        """The pools ``user_id`` is a member of."""
        return {int(r["pool_id"]) for r in self._all("SELECT pool_id FROM pool_members WHERE user_id = ?",
                                                     (user_id,))}

    def visible_pool_ids(self, user: User) -> set[int] | None:
        """The pools whose models ``user`` sees: their own, or every pool (None) for an admin."""
        return None if user.is_admin else self.member_pool_ids(user.id)
