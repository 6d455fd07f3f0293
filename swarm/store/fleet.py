"""The fleet: pools, join tokens, fellows (their public keys and node credentials) and the model catalogue."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import time
from typing import Any

from swarm.errors import AuthError, BadRequest
from swarm.store.core import StoreCore, new_secret, sha256_hex

DEFAULT_POOL = "default"

# A join token lets one fellow in, within a day, unless its admin asks for more (`swarm admin join-token --uses N
# --ttl T`): a token that leaks from a chat log or a screenshot is worth little. Upper bounds keep a typo from
# minting a token that is as good as permanent.
JOIN_TOKEN_TTL_S = 24 * 3600.0
JOIN_TOKEN_MAX_TTL_S = 365 * 24 * 3600.0
JOIN_TOKEN_USES = 1
JOIN_TOKEN_MAX_USES = 1000


@dataclasses.dataclass(frozen=True)
class Pool:
    id: int
    owner_user_id: int | None
    name: str
    created_at: float


@dataclasses.dataclass(frozen=True)
class JoinToken:
    id: int
    pool_id: int
    prefix: str
    created_at: float
    expires_at: float | None
    revoked: bool
    uses: int | None = None  # how many fellows it admits in all (None: a token from before use counts)
    uses_left: int | None = None


@dataclasses.dataclass(frozen=True)
class Fellow:
    id: int
    name: str
    public_key: bytes
    pool_id: int
    created_at: float
    last_seen_at: float | None
    standby: bool = False


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    pool_id: int
    manifest_json: str
    created_at: float

    @property
    def manifest(self) -> Any:
        return json.loads(self.manifest_json)


def check_join_token_limits(ttl_s: float, uses: int) -> None:
    """BadRequest unless a join token of ``uses`` uses that lives ``ttl_s`` seconds is one we mint."""
    if isinstance(uses, bool) or not isinstance(uses, int) or not 1 <= uses <= JOIN_TOKEN_MAX_USES:
        raise BadRequest(f"a join token admits 1 to {JOIN_TOKEN_MAX_USES} fellows; got {uses!r}.", "invalid_uses")
    if (isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not ttl_s == ttl_s
            or not 0 < ttl_s <= JOIN_TOKEN_MAX_TTL_S):
        raise BadRequest(f"a join token lives between 1 second and {JOIN_TOKEN_MAX_TTL_S / 86400:.0f} days; "
                         f"got {ttl_s!r} seconds.", "invalid_ttl")


class FleetMixin(StoreCore):
    # --- pools and join tokens ---------------------------------------------------------------------------------------

    @staticmethod
    def _pool(row: sqlite3.Row) -> Pool:
        return Pool(id=row["id"], owner_user_id=row["owner_user_id"], name=row["name"], created_at=row["created_at"])

    def ensure_default_pool(self, owner_id: int) -> Pool:
        """The pool named "default", created (owned by ``owner_id``) if there is none yet."""
        with self._tx() as db:
            row = db.execute("SELECT * FROM pools WHERE name = ? ORDER BY id LIMIT 1", (DEFAULT_POOL,)).fetchone()
            if row is None:
                cur = db.execute(
                    "INSERT INTO pools (owner_user_id, name, created_at) VALUES (?, ?, ?)",
                    (owner_id, DEFAULT_POOL, self._now()),
                )
                row = db.execute("SELECT * FROM pools WHERE id = ?", (cur.lastrowid,)).fetchone()
        return self._pool(row)

    def get_pool(self, pool_id: int) -> Pool | None:
        row = self._one("SELECT * FROM pools WHERE id = ?", (pool_id,))
        return self._pool(row) if row else None

    def list_pools(self) -> list[Pool]:
        return [self._pool(r) for r in self._all("SELECT * FROM pools ORDER BY id")]

    def create_join_token(self, pool_id: int, ttl_s: float = JOIN_TOKEN_TTL_S, uses: int = JOIN_TOKEN_USES) -> str:
        """A token that lets ``uses`` fellows join ``pool_id`` within ``ttl_s`` seconds (default: one, in 24 h)."""
        check_join_token_limits(ttl_s, uses)
        plaintext = new_secret("swj_")
        now = self._now()
        with self._tx() as db:
            db.execute(
                "INSERT INTO join_tokens (token_hash, prefix, pool_id, created_at, expires_at, uses, uses_left) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (sha256_hex(plaintext), plaintext[:8], pool_id, now, now + ttl_s, uses, uses),
            )
        return plaintext

    @staticmethod
    def _usable_join_token(row: sqlite3.Row | None) -> int:
        if row is None:
            raise AuthError("the leader does not know this join token; ask its admin for a current one.")
        if row["revoked"]:
            raise AuthError("this join token was revoked; ask the leader's admin for a new one.")
        if row["expires_at"] is not None and row["expires_at"] <= time.time():
            raise AuthError("this join token has expired; ask the leader's admin for a new one "
                            "(swarm admin join-token, or Admin > Join tokens).")
        if row["uses_left"] is not None and row["uses_left"] <= 0:
            raise AuthError("this join token was used already; ask the leader's admin for a new one "
                            "(swarm admin join-token --uses N lets N fellows join with one token).")
        return int(row["pool_id"])

    def check_join_token(self, plaintext: str) -> int:
        """The pool a join token admits to; AuthError when it is unknown, revoked, expired or used up."""
        return self._usable_join_token(
            self._one("SELECT * FROM join_tokens WHERE token_hash = ?", (sha256_hex(plaintext),)))

    def redeem_join_token(self, plaintext: str) -> int:
        """Like :meth:`check_join_token`, and takes one use of the token (atomically: two fellows racing for the
        last use get one welcome and one refusal)."""
        with self._tx() as db:
            row = db.execute("SELECT * FROM join_tokens WHERE token_hash = ?", (sha256_hex(plaintext),)).fetchone()
            pool_id = self._usable_join_token(row)
            if row["uses_left"] is not None:
                db.execute("UPDATE join_tokens SET uses_left = uses_left - 1 WHERE id = ?", (row["id"],))
        return pool_id

    def list_join_tokens(self) -> list[JoinToken]:
        return [
            JoinToken(
                id=r["id"],
                pool_id=r["pool_id"],
                prefix=r["prefix"],
                created_at=r["created_at"],
                expires_at=r["expires_at"],
                revoked=bool(r["revoked"]),
                uses=r["uses"],
                uses_left=r["uses_left"],
            )
            for r in self._all("SELECT * FROM join_tokens ORDER BY id")
        ]

    def revoke_join_token(self, token_id: int) -> bool:
        with self._tx() as db:
            return db.execute("UPDATE join_tokens SET revoked = 1 WHERE id = ?", (token_id,)).rowcount > 0

    # --- fellows -----------------------------------------------------------------------------------------------------

    @staticmethod
    def _fellow(row: sqlite3.Row) -> Fellow:
        return Fellow(
            id=row["id"],
            name=row["name"],
            public_key=bytes(row["public_key"]),
            pool_id=row["pool_id"],
            created_at=row["created_at"],
            last_seen_at=row["last_seen_at"],
            standby=bool(row["standby"]),
        )

    def enrol_fellow(self, name: str, public_key: bytes, pool_id: int, standby: bool = False) -> tuple[Fellow, str]:
        """(fellow, node credential plaintext). The same key again is the same fellow, with a new credential.
        ``standby`` (`swarm join --standby`) marks it a standby; joining without it keeps what an admin set."""
        credential = new_secret("swn_")
        digest = sha256_hex(credential)
        with self._tx() as db:
            row = db.execute("SELECT * FROM fellows WHERE public_key = ?", (bytes(public_key),)).fetchone()
            if row is not None:
                db.execute(
                    "UPDATE fellows SET node_credential_hash = ?, pool_id = ? WHERE id = ?",
                    (digest, pool_id, row["id"]),
                )
                fellow_id = row["id"]
            else:
                base = name.strip() or "fellow"
                unique, n = base, 1
                while db.execute("SELECT 1 FROM fellows WHERE name = ?", (unique,)).fetchone():
                    n += 1
                    unique = f"{base}-{n}"
                cur = db.execute(
                    "INSERT INTO fellows (name, public_key, pool_id, node_credential_hash, created_at) "
                    "VALUES (?, ?, ?, ?, ?)",
                    (unique, bytes(public_key), pool_id, digest, self._now()),
                )
                fellow_id = cur.lastrowid
            if standby:
                db.execute("UPDATE fellows SET standby = 1 WHERE id = ?", (fellow_id,))
            row = db.execute("SELECT * FROM fellows WHERE id = ?", (fellow_id,)).fetchone()
        return self._fellow(row), credential

    def fellow_by_key(self, public_key: bytes) -> Fellow | None:
        row = self._one("SELECT * FROM fellows WHERE public_key = ?", (bytes(public_key),))
        return self._fellow(row) if row else None

    def fellow_by_credential(self, plaintext: str) -> Fellow | None:
        row = self._one("SELECT * FROM fellows WHERE node_credential_hash = ?", (sha256_hex(plaintext),))
        return self._fellow(row) if row else None

    def list_fellows(self) -> list[Fellow]:
        return [self._fellow(r) for r in self._all("SELECT * FROM fellows ORDER BY id")]

    def touch_fellow(self, fellow_id: int) -> None:
        with self._tx() as db:
            db.execute("UPDATE fellows SET last_seen_at = ? WHERE id = ?", (self._now(), fellow_id))

    def set_fellow_standby(self, fellow_id: int, standby: bool) -> Fellow | None:
        with self._tx() as db:
            db.execute("UPDATE fellows SET standby = ? WHERE id = ?", (int(standby), fellow_id))
            row = db.execute("SELECT * FROM fellows WHERE id = ?", (fellow_id,)).fetchone()
        return self._fellow(row) if row else None

    def delete_fellow(self, fellow_id: int) -> bool:
        with self._tx() as db:
            return db.execute("DELETE FROM fellows WHERE id = ?", (fellow_id,)).rowcount > 0

    def remove_fellow(self, fellow_id: int) -> Fellow | None:
        """Forget a fellow and refuse its key from now on (its node credential goes with it); None if unknown.
        The machine can join again only with a new key (delete its key file) and a new join token."""
        with self._tx() as db:
            row = db.execute("SELECT * FROM fellows WHERE id = ?", (fellow_id,)).fetchone()
            if row is None:
                return None
            db.execute("INSERT OR REPLACE INTO removed_fellow_keys (public_key, name, removed_at) VALUES (?, ?, ?)",
                       (bytes(row["public_key"]), row["name"], self._now()))
            db.execute("DELETE FROM fellows WHERE id = ?", (fellow_id,))
        return self._fellow(row)

    def fellow_key_removed(self, public_key: bytes) -> bool:
        return self._one("SELECT 1 FROM removed_fellow_keys WHERE public_key = ?", (bytes(public_key),)) is not None

    # --- models ------------------------------------------------------------------------------------------------------

    @staticmethod
    def _model(row: sqlite3.Row) -> Model:
        return Model(
            name=row["name"], pool_id=row["pool_id"], manifest_json=row["manifest_json"], created_at=row["created_at"]
        )

    def upsert_model(self, name: str, pool_id: int, manifest_json: str | dict[str, Any]) -> Model:
        text = manifest_json if isinstance(manifest_json, str) else json.dumps(manifest_json)
        with self._tx() as db:
            db.execute(
                "INSERT INTO models (name, pool_id, manifest_json, created_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(name) DO UPDATE SET pool_id = excluded.pool_id, manifest_json = excluded.manifest_json",
                (name, pool_id, text, self._now()),
            )
            row = db.execute("SELECT * FROM models WHERE name = ?", (name,)).fetchone()
        return self._model(row)

    def get_model(self, name: str) -> Model | None:
        row = self._one("SELECT * FROM models WHERE name = ?", (name,))
        return self._model(row) if row else None

    def list_models(self) -> list[Model]:
        return [self._model(r) for r in self._all("SELECT * FROM models ORDER BY name")]

    def delete_model(self, name: str) -> bool:
        with self._tx() as db:
            return db.execute("DELETE FROM models WHERE name = ?", (name,)).rowcount > 0

    # --- what is serving (so a restarted leader adopts the stages its fellows still hold) ---------------------------

    def save_serving(self, model: str, load_id: str, plans: list[dict[str, Any]]) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO serving (model, load_id, plans_json, updated_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(model) DO UPDATE SET load_id = excluded.load_id, plans_json = excluded.plans_json, "
                "updated_at = excluded.updated_at",
                (model, load_id, json.dumps(plans), self._now()),
            )

    def list_serving(self) -> list[tuple[str, str, list[dict[str, Any]]]]:
        """(model, load id, stage plans) of every model that was serving."""
        return [(r["model"], r["load_id"], json.loads(r["plans_json"]))
                for r in self._all("SELECT * FROM serving ORDER BY model")]

    def delete_serving(self, model: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM serving WHERE model = ?", (model,))
