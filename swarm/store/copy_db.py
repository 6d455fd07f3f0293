"""`swarm admin migrate-db --to postgresql://...`: copy a SQLite leader's whole store into an empty PostgreSQL
database.

The target's schema is made by the store's own migrations (``Store(url)``), then every table is copied in the order
the migrations created them (a table's foreign keys name earlier tables), row by row through PostgreSQL's COPY, all
in one transaction on each side: the SQLite file is locked against writes meanwhile (stop the leader first), and a
copy that fails leaves the target as empty as it was. Identity sequences then go on where SQLite's AUTOINCREMENT
stood (no id is handed out twice), and each table's row count is checked before the commit.
"""

from __future__ import annotations

from pathlib import Path

from swarm.errors import StoreError
from swarm.store import dialect
from swarm.store.db import Store


def copy_to_postgres(sqlite_path: Path, url: str) -> dict[str, int]:
    """Copy the SQLite store at ``sqlite_path`` into the empty PostgreSQL database at ``url``; rows per table."""
    if not Path(sqlite_path).is_file():
        raise StoreError(f"there is no SQLite leader database at {sqlite_path}; pass the leader's --data-dir (the "
                         "folder holding leader.db).")
    source = Store(sqlite_path)  # brings an older file up to this swarm's schema first, as the leader would
    try:
        target = Store(url)
        try:
            return _copy(source, target)
        finally:
            target.close()
    finally:
        source.close()


def _copy(source: Store, target: Store) -> dict[str, int]:
    assert target._pg is not None, "the target must be a PostgreSQL store"
    counts: dict[str, int] = {}
    with source._tx() as src, target._tx() as dst:
        tables = [name for (name,) in src.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\' "
            "AND name != 'schema_version' ORDER BY rowid")]
        held = {t: dst.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in tables}
        if any(held.values()):
            what = ", ".join(f"{n} in {t}" for t, n in held.items() if n)
            raise StoreError(f"the PostgreSQL database {target.where} already holds leader data ({what}); "
                             "migrate-db copies into an empty database only, and changed nothing. Create a new "
                             "database (e.g. createdb swarm) and pass its URL, or drop this one's tables.")
        assert isinstance(dst, dialect.Connection)  # the target is a PostgreSQL store
        raw = dst.raw
        for table in tables:
            columns = [row[1] for row in src.execute(f"PRAGMA table_info({table})")]
            names = ", ".join(columns)
            with raw.cursor().copy(f"COPY {table} ({names}) FROM STDIN") as copy:
                for row in src.execute(f"SELECT {names} FROM {table}"):
                    copy.write_row(tuple(row))
            counts[table] = src.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
            copied = raw.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
            if copied != counts[table]:
                raise StoreError(f"copying {table} gave {copied} rows of {counts[table]}; nothing was committed.")
        # SQLite's AUTOINCREMENT never hands out an id again, a deleted row's included: neither does the copy
        used = dict(src.execute("SELECT name, seq FROM sqlite_sequence").fetchall())
        for table, column in target._pg.schema.identities:
            raw.execute(f"SELECT setval(pg_get_serial_sequence('{table}', '{column}'), "
                        f"greatest(coalesce(max({column}), 0), %s) + 1, false) FROM {table}", (used.get(table, 0),))
    return counts
