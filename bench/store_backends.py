"""The leader's store on SQLite and on PostgreSQL, and the road not taken: the same queries through SQLAlchemy Core.

    .venv/bin/python bench/store_backends.py [--url postgresql://...] [--rounds 5] [--n 300]

Without --url a throwaway PostgreSQL server is started (tests/pg_server.py: Debian's postgresql package; as root it
runs as the postgres user). Each round times, per backend, in turn (so a shared machine's swings fall on all alike):
a read by key (``get_user_by_name``), a write transaction (``create_chat``: a count and an insert under the write
lock), a list (``list_chats`` of 50 chats; the writes go to another user) and a batch of 100 served requests
(``add_served_requests``). The SQLAlchemy rows run the same SQL on the same PostgreSQL database through SQLAlchemy 2
Core (``text()`` statements, its connection pool, the psycopg 3 driver) -- what choosing it over psycopg with
swarm.store.dialect would cost per call before any rewrite (pip install sqlalchemy for those rows; they are left out
without it). Prints the median microseconds per call of each operation and backend.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import argon2

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from swarm.store.db import Store
from swarm.store.history import ServedRequest

CHEAP = argon2.PasswordHasher(time_cost=1, memory_cost=8, parallelism=1)


def _timed(fn, n: int) -> float:
    start = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - start) / n * 1e6


def store_ops(store: Store, user_id: int, writer_id: int, tag: str):
    batch = [0]

    def add_batch(i: int) -> None:
        batch[0] += 1
        now = time.time()
        store.add_served_requests([ServedRequest(id=f"{tag}-{batch[0]}-{k}", model="m", started_at=now, ended_at=now,
                                                 outcome="done", reply_tokens=10, timing={"stage_ms": [1.0]})
                                   for k in range(100)])

    return {
        "read by key": lambda i: store.get_user_by_name("bench"),
        "write tx": lambda i: store.create_chat(writer_id, title=f"t{i}", messages=[]),
        "list 50": lambda i: store.list_chats(user_id),
        "batch of 100": add_batch,
    }


def sqlalchemy_ops(url: str, user_id: int, writer_id: int, tag: str):
    import json

    import sqlalchemy as sa

    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1), pool_size=8)
    by_name = sa.text("SELECT * FROM users WHERE name = :name")
    count = sa.text("SELECT count(*) FROM chats WHERE user_id = :u")
    lock = sa.text("SELECT pg_advisory_xact_lock(:k)")
    insert = sa.text("INSERT INTO chats (id, user_id, title, model, messages_json, message_count, created_at, "
                     "updated_at) VALUES (:id, :u, :t, '', '[]', 0, :now, :now)")
    listing = sa.text("SELECT id, title, model, message_count, created_at, updated_at FROM chats WHERE user_id = :u "
                      "ORDER BY updated_at DESC, ctid DESC")
    served = sa.text("INSERT INTO serving_history (id, model, started_at, ended_at, outcome, reply_tokens, "
                     "timing_json) VALUES (:id, 'm', :now, :now, 'done', 10, :timing) ON CONFLICT (id) DO UPDATE "
                     "SET ended_at = EXCLUDED.ended_at")
    batch = [0]

    def read(i: int) -> None:
        with engine.connect() as conn:
            conn.execute(by_name, {"name": "bench"}).mappings().first()

    def write(i: int) -> None:
        with engine.begin() as conn:
            conn.execute(lock, {"k": 0x5357_4152_4D00})
            conn.execute(count, {"u": writer_id}).scalar()
            conn.execute(insert, {"id": f"{tag}{i}-{time.time_ns()}", "u": writer_id, "t": f"t{i}", "now": time.time()})

    def listed(i: int) -> None:
        with engine.connect() as conn:
            conn.execute(listing, {"u": user_id}).mappings().all()

    def add_batch(i: int) -> None:
        batch[0] += 1
        now = time.time()
        with engine.begin() as conn:
            conn.execute(served, [{"id": f"{tag}-{batch[0]}-{k}", "now": now, "timing": json.dumps({"stage_ms": [1.0]})}
                                  for k in range(100)])

    return {"read by key": read, "write tx": write, "list 50": listed, "batch of 100": add_batch}, engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="an empty PostgreSQL database (default: a throwaway server)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--n", type=int, default=300, help="calls per operation per round")
    args = parser.parse_args()
    server = None
    url = args.url
    if url is None:
        from pg_server import PostgresServer

        server = PostgresServer()
        url = server.new_database()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            big = 10**7  # the writes' chats go to a writer with no limit; the list reads the reader's 50
            stores = {"SQLite": Store(Path(tmp) / "leader.db", password_hasher=CHEAP, max_chats_per_user=big),
                      "PostgreSQL (psycopg + dialect)": Store(url, password_hasher=CHEAP, max_chats_per_user=big)}
            backends = {}
            users, writers = {}, {}
            for name, store in stores.items():
                users[name] = store.create_user("bench", "pw").id
                writers[name] = store.create_user("writer", "pw").id
                for i in range(50):
                    store.create_chat(users[name], title=f"seed {i}", messages=[])
                backends[name] = store_ops(store, users[name], writers[name], name[:3])
            engine = None
            try:
                pg = "PostgreSQL (psycopg + dialect)"
                ops, engine = sqlalchemy_ops(url, users[pg], writers[pg], "sa")
                backends["PostgreSQL (SQLAlchemy Core)"] = ops
            except ImportError:
                print("(SQLAlchemy is not installed: its rows are left out; pip install sqlalchemy)")
            times: dict[tuple[str, str], list[float]] = {}
            for _ in range(args.rounds):
                for op in ("read by key", "write tx", "list 50", "batch of 100"):
                    for name, ops in backends.items():  # in turn
                        n = args.n if op != "batch of 100" else max(1, args.n // 30)
                        times.setdefault((op, name), []).append(_timed(ops[op], n))
            print(f"median microseconds per call, {args.rounds} rounds of {args.n} calls (batches: {args.n // 30})")
            print(f"{'operation':14} " + " ".join(f"{name:>32}" for name in backends))
            for op in ("read by key", "write tx", "list 50", "batch of 100"):
                print(f"{op:14} " + " ".join(f"{statistics.median(times[(op, name)]):>32.0f}" for name in backends))
            for store in stores.values():
                store.close()
            if engine is not None:
                engine.dispose()
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
