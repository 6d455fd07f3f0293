"""The fleet: pools, join tokens, fellows (their public keys and node credentials) and the model catalogue.

A leader hosts several pools. A fellow serves only the pool its join token named; a model is imported into one pool
and loads over that pool's fellows. A model's id -- the OpenAI ``model`` field, the key of everything the leader
keeps about it -- is its name in the default pool and ``NAME@POOL`` in any other, so the same name may be in two
pools and a leader with one pool never sees an ``@``. The API also takes a bare NAME when just one of the caller's
pools has a model of that name (:meth:`FleetMixin.resolve_model`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sqlite3
import time
from typing import Any

from swarm.errors import AuthError, BadRequest, ModelNotFound, PoolNotFound
from swarm.store.core import StoreCore, new_secret, sha256_hex

DEFAULT_POOL = "default"
POOL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

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

    @property
    def base_name(self) -> str:
        """The name it was imported as, without its pool: ``qwen`` of ``qwen@lab``."""
        return self.name.split("@", 1)[0]


def model_id(name: str, pool: str) -> str:
    """A model's id: its name in the default pool, NAME@POOL in any other."""
    return name if pool == DEFAULT_POOL else f"{name}@{pool}"


def check_pool_name(name: str) -> str:
    if not isinstance(name, str) or not POOL_NAME_RE.match(name):
        raise BadRequest(f"{name!r} cannot be a pool name: use letters, digits, '.', '_' and '-' (up to 64), "
                         "starting with a letter or digit, e.g. family or lab-2.", "invalid_pool_name")
    return name


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

    def ensure_default_pool(self, owner_id: int | None) -> Pool:
        """The pool named "default", created (owned by ``owner_id``, or by no one) if there is none yet."""
        with self._tx() as db:
            row = db.execute("SELECT * FROM pools WHERE name = ? ORDER BY id LIMIT 1", (DEFAULT_POOL,)).fetchone()
            if row is None:
                cur = db.execute(
                    "INSERT INTO pools (owner_user_id, name, created_at) VALUES (?, ?, ?)",
                    (owner_id, DEFAULT_POOL, self._now()),
                )
                row = db.execute("SELECT * FROM pools WHERE id = ?", (cur.lastrowid,)).fetchone()
                # everyone there is (the first admin, usually) is in it, as every user was before pools
                db.execute("INSERT INTO pool_members (pool_id, user_id, added_at) SELECT ?, id, ? FROM users",
                           (row["id"], self._now()))
        return self._pool(row)

    def get_pool(self, pool_id: int) -> Pool | None:
        row = self._one("SELECT * FROM pools WHERE id = ?", (pool_id,))
        return self._pool(row) if row else None

    def list_pools(self) -> list[Pool]:
        return [self._pool(r) for r in self._all("SELECT * FROM pools ORDER BY id")]

    def pool_by_name(self, name: str) -> Pool:
        """The pool called ``name``; PoolNotFound naming the pools there are."""
        row = self._one("SELECT * FROM pools WHERE name = ?", (name,))
        if row is None:
            known = ", ".join(p.name for p in self.list_pools()) or "none"
            raise PoolNotFound(f"there is no pool {name!r} on this leader (pools: {known}); an admin creates one "
                               "with `swarm admin pool-create NAME` or on the admin page.")
        return self._pool(row)

    def create_pool(self, name: str, owner_id: int | None) -> Pool:
        """A new, empty pool; BadRequest when the name is not one or is taken."""
        check_pool_name(name)
        with self._tx() as db:
            if db.execute("SELECT 1 FROM pools WHERE name = ?", (name,)).fetchone():
                raise BadRequest(f"a pool named {name!r} already exists; pick another name.", "pool_exists")
            cur = db.execute("INSERT INTO pools (owner_user_id, name, created_at) VALUES (?, ?, ?)",
                             (owner_id, name, self._now()))
            row = db.execute("SELECT * FROM pools WHERE id = ?", (cur.lastrowid,)).fetchone()
        return self._pool(row)

    def delete_pool(self, pool_id: int) -> Pool:
        """Delete an empty pool with its join tokens and memberships. The default pool stays, and a pool that still
        has fellows or models is refused (BadRequest saying what is left): nothing goes by accident."""
        with self._tx() as db:
            row = db.execute("SELECT * FROM pools WHERE id = ?", (pool_id,)).fetchone()
            if row is None:
                raise PoolNotFound(f"there is no pool {pool_id} on this leader.")
            if row["name"] == DEFAULT_POOL:
                raise BadRequest("the default pool cannot be deleted.", "default_pool")
            fellows = db.execute("SELECT COUNT(*) AS n FROM fellows WHERE pool_id = ?", (pool_id,)).fetchone()["n"]
            models = db.execute("SELECT COUNT(*) AS n FROM models WHERE pool_id = ?", (pool_id,)).fetchone()["n"]
            if fellows or models:
                raise BadRequest(
                    f"pool {row['name']!r} still has {fellows} fellow{'s' if fellows != 1 else ''} and {models} "
                    f"model{'s' if models != 1 else ''}; remove them first (swarm admin remove-fellow ID; "
                    "a model goes with its folder under the data dir).", "pool_not_empty")
            db.execute("DELETE FROM quotas WHERE scope = 'pool' AND subject_id = ?", (pool_id,))
            db.execute("DELETE FROM pools WHERE id = ?", (pool_id,))
        return self._pool(row)

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

    def list_models(self, pool_ids: set[int] | None = None) -> list[Model]:
        """The catalogue, or the models of ``pool_ids``."""
        models = [self._model(r) for r in self._all("SELECT * FROM models ORDER BY name")]
        return models if pool_ids is None else [m for m in models if m.pool_id in pool_ids]

    def resolve_model(self, name: str, pool_ids: set[int] | None) -> Model:
        """The model ``name`` names among the pools ``pool_ids`` (None: every pool): its id, or a bare name that
        only one of those pools has. ModelNotFound in the OpenAI API's words otherwise (a model of a pool the caller
        is not in reads as one that does not exist); BadRequest when the bare name is in several of them."""
        if isinstance(name, str):
            row = self._one("SELECT * FROM models WHERE name = ?", (name,))
            if row is not None and (pool_ids is None or row["pool_id"] in pool_ids):
                return self._model(row)
            same = [m for m in self.list_models(pool_ids) if m.base_name == name]
            if len(same) == 1:
                return same[0]
            if same:
                raise BadRequest(f"model {name!r} is in several of your pools: name one of "
                                 f"{', '.join(m.name for m in same)}.", "ambiguous_model")
        raise ModelNotFound(f"The model {name!r} does not exist or you do not have access to it: it is in none of "
                            "your pools. GET /v1/models lists yours; an admin adds you to a pool with "
                            "`swarm admin pool-member-add POOL USER`, or imports a model with `swarm model import`.")

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
