"""Pools in the store: several per leader, members, models by pool (the same name in two), join tokens naming their
pool, and the migration that puts everything an existing leader had into the default pool. Each test runs on SQLite
and on PostgreSQL (``store_location``, tests/conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

import argon2
import pytest

from swarm.errors import BadRequest, ModelNotFound, PoolNotFound
from swarm.store import core
from swarm.store.db import Store
from swarm.store.fleet import model_id

CHEAP = argon2.PasswordHasher(time_cost=1, memory_cost=8, parallelism=1)
MANIFEST = {"num_layers": 2, "files": []}


@pytest.fixture
def store(store_location: Path | str):
    s = Store(store_location, password_hasher=CHEAP)
    yield s
    s.close()


def test_migration_puts_everything_in_the_default_pool(store_location: Path | str, monkeypatch) -> None:
    """A leader from before pools (schema 4) keeps every user, fellow, model and join token, all in the default
    pool, and every user is a member of it."""
    monkeypatch.setattr(core, "MIGRATIONS", core.MIGRATIONS[:4])
    with Store(store_location, password_hasher=CHEAP) as old:
        assert old.schema_version() == 4
        with old._tx() as db:
            for name, admin in (("root", 1), ("ada", 0), ("bob", 0)):
                db.execute("INSERT INTO users (name, password_hash, is_admin, created_at) VALUES (?, ?, ?, ?)",
                           (name, "x", admin, 1.0))
            root = db.execute("SELECT id FROM users WHERE name = ?", ("root",)).fetchone()["id"]
            db.execute("INSERT INTO pools (owner_user_id, name, created_at) VALUES (?, ?, ?)", (root, "default", 1.0))
            pool = db.execute("SELECT id FROM pools WHERE name = ?", ("default",)).fetchone()["id"]
            db.execute("INSERT INTO fellows (name, public_key, pool_id, node_credential_hash, created_at) "
                       "VALUES (?, ?, ?, ?, ?)", ("pc-1", b"k" * 32, pool, "h1", 1.0))
            db.execute("INSERT INTO models (name, pool_id, manifest_json, created_at) VALUES (?, ?, ?, ?)",
                       ("smol", pool, json.dumps(MANIFEST), 1.0))
            db.execute("INSERT INTO join_tokens (token_hash, prefix, pool_id, created_at, expires_at, uses, uses_left)"
                       " VALUES (?, ?, ?, ?, ?, ?, ?)", ("t1", "swj_abcd", pool, 1.0, 9e9, 1, 1))
    monkeypatch.undo()
    with Store(store_location, password_hasher=CHEAP) as new:
        assert new.schema_version() == len(core.MIGRATIONS)
        (default,) = new.list_pools()
        assert default.name == "default"
        assert [u.name for u in new.pool_members(default.id)] == ["root", "ada", "bob"]
        assert [(f.name, f.pool_id) for f in new.list_fellows()] == [("pc-1", default.id)]
        assert [(m.name, m.pool_id) for m in new.list_models()] == [("smol", default.id)]
        assert [(t.prefix, t.pool_id) for t in new.list_join_tokens()] == [("swj_abcd", default.id)]
        ada = new.get_user_by_name("ada")
        assert new.resolve_model("smol", new.visible_pool_ids(ada)).name == "smol"  # ada still sees it


def test_pools_are_created_named_and_deleted_when_empty(store: Store) -> None:
    admin = store.create_user("root", "pw", is_admin=True)
    lab = store.create_pool("lab", admin.id)
    assert [p.name for p in store.list_pools()] == ["default", "lab"]
    assert store.pool_by_name("lab") == lab
    with pytest.raises(BadRequest, match="already exists"):
        store.create_pool("lab", admin.id)
    for bad in ("", "a b", "@lab", "x" * 65, "lab/2"):
        with pytest.raises(BadRequest, match="cannot be a pool name"):
            store.create_pool(bad, admin.id)
    with pytest.raises(PoolNotFound, match="no pool 'nope' on this leader \\(pools: default, lab\\)"):
        store.pool_by_name("nope")
    with pytest.raises(BadRequest, match="default pool cannot be deleted"):
        store.delete_pool(store.pool_by_name("default").id)
    fellow, _ = store.enrol_fellow("pc-1", b"k" * 32, lab.id)
    store.upsert_model(model_id("smol", "lab"), lab.id, MANIFEST)
    with pytest.raises(BadRequest, match="still has 1 fellow and 1 model"):
        store.delete_pool(lab.id)
    store.delete_fellow(fellow.id)
    store.delete_model("smol@lab")
    token = store.create_join_token(lab.id)
    assert store.delete_pool(lab.id).name == "lab"
    assert [p.name for p in store.list_pools()] == ["default"]
    assert store.list_join_tokens() == []  # its join tokens went with it
    with pytest.raises(Exception, match="does not know"):
        store.check_join_token(token)


def test_join_token_names_its_pool_and_the_fellow_enrols_there(store: Store) -> None:
    admin = store.create_user("root", "pw", is_admin=True)
    lab = store.create_pool("lab", admin.id)
    token = store.create_join_token(lab.id)
    assert store.redeem_join_token(token) == lab.id
    fellow, _ = store.enrol_fellow("pc-lab", b"l" * 32, lab.id)
    assert store.fellow_by_key(b"l" * 32).pool_id == lab.id == fellow.pool_id


def test_members_see_only_their_pools_models(store: Store) -> None:
    """The same model name in two pools is two models (smol and smol@lab); a member resolves the bare name to their
    pool's, a model of a pool they are not in reads as one that does not exist, and an admin sees every pool."""
    admin = store.create_user("root", "pw", is_admin=True)
    default = store.pool_by_name("default")
    lab = store.create_pool("lab", admin.id)
    family = store.create_user("mum", "pw")  # a new user starts in the default pool
    scientist = store.create_user("curie", "pw")
    assert store.member_pool_ids(family.id) == {default.id}
    assert store.remove_pool_member(default.id, scientist.id)
    assert store.add_pool_member(lab.id, scientist.id)
    assert not store.add_pool_member(lab.id, scientist.id)  # already a member
    assert [u.name for u in store.pool_members(lab.id)] == ["curie"]

    store.upsert_model("smol", default.id, MANIFEST)
    store.upsert_model(model_id("smol", "lab"), lab.id, MANIFEST)
    store.upsert_model(model_id("labonly", "lab"), lab.id, MANIFEST)
    assert [m.name for m in store.list_models()] == ["labonly@lab", "smol", "smol@lab"]

    mine = store.visible_pool_ids(scientist)
    assert [m.name for m in store.list_models(mine)] == ["labonly@lab", "smol@lab"]
    assert store.resolve_model("smol", mine).name == "smol@lab"  # the bare name, in their one pool
    assert store.resolve_model("labonly", mine).name == "labonly@lab"
    assert store.resolve_model("smol@lab", mine).base_name == "smol"
    with pytest.raises(ModelNotFound, match="The model 'smol@lab' does not exist or you do not have access to it"):
        store.resolve_model("smol@lab", store.visible_pool_ids(family))
    assert store.resolve_model("smol", store.visible_pool_ids(family)).name == "smol"

    assert store.visible_pool_ids(admin) is None  # an admin sees every pool: the id wins over the bare name
    assert store.resolve_model("smol", None).name == "smol"
    kids = store.create_pool("kids", admin.id)
    store.upsert_model(model_id("smol", "kids"), kids.id, MANIFEST)
    store.add_pool_member(kids.id, scientist.id)
    with pytest.raises(BadRequest, match="in several of your pools: name one of smol@kids, smol@lab"):
        store.resolve_model("smol", store.visible_pool_ids(scientist))
    assert store.resolve_model("smol@kids", store.visible_pool_ids(scientist)).pool_id == kids.id
    store.add_pool_member(lab.id, family.id)
    assert store.remove_pool_member(lab.id, family.id)
    store.delete_user(scientist.id)
    assert store.pool_members(lab.id) == []


def test_import_into_a_pool(tmp_path) -> None:
    """`swarm model import SOURCE --name m --pool lab` writes models/m@lab and lists it in the lab's pool, beside an m
    of the default pool; an unknown pool, or an '@' in the name, is refused before anything is read."""
    from conftest import build_tiny_source
    from swarm.errors import ImportFailed
    from swarm.model_import import import_into_leader

    leader = tmp_path / "leader"
    source = build_tiny_source(tmp_path / "src", "llama")
    with pytest.raises(PoolNotFound, match="no pool 'lab'"):
        import_into_leader(str(source), leader, "m", pool="lab")
    with Store(leader / "leader.db", password_hasher=CHEAP) as store:
        admin = store.create_user("root", "pw", is_admin=True)
        lab = store.create_pool("lab", admin.id)
    with pytest.raises(ImportFailed, match="'m@x' cannot be a model name"):
        import_into_leader(str(source), leader, "m@x", pool="lab")
    assert import_into_leader(str(source), leader, "m", pool="lab").name == "m@lab"
    import_into_leader(str(source), leader, "m")
    assert sorted(p.name for p in (leader / "models").iterdir()) == ["m", "m@lab"]
    with Store(leader / "leader.db", password_hasher=CHEAP) as store:
        assert [(m.name, m.pool_id == lab.id) for m in store.list_models()] == [("m", False), ("m@lab", True)]
