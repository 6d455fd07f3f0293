"""A throwaway PostgreSQL server for the store's tests: initdb into a temporary folder, pg_ctl start on a free port of
127.0.0.1, a fresh database per test, pg_ctl stop at the end.

The binaries are Debian's (``apt-get install postgresql``, which scripts/bootstrap test does) under
/usr/lib/postgresql/<version>/bin. PostgreSQL refuses to run as root: as root the server runs as the ``postgres``
user the package creates. Without the binaries the PostgreSQL variants of the tests are skipped, saying so.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path


def find_bin_dir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    def __init__(self) -> None:
        bin_dir = find_bin_dir()
        if bin_dir is None:
            raise FileNotFoundError("PostgreSQL's initdb is not installed (apt-get install postgresql)")
        self.bin = bin_dir
        self.user: str | None = None
        if os.geteuid() == 0:
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                raise FileNotFoundError("running as root and there is no postgres user to run the server as") from None
            self.user = "postgres"
        # in /tmp as root: the postgres user must reach it (a root TMPDIR such as /root/tmp it could not)
        self.dir = Path(tempfile.mkdtemp(prefix="swarm-pg-", dir="/tmp" if self.user else None))
        if self.user:
            shutil.chown(self.dir, self.user)
        self.port = _free_port()
        self._names = itertools.count(1)
        data = self.dir / "data"
        self._run("initdb", "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--locale=C.UTF-8",
                  "--no-sync")
        # Throwaway data: no fsync; its socket in the temp folder (not /var/run/postgresql).
        options = (f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.dir} -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        self._run("pg_ctl", "-D", str(data), "-o", options, "-l", str(self.dir / "log"), "-w", "-t", "60", "start")
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        command = [str(self.bin / tool), *args]
        if self.user:
            command = ["runuser", "-u", self.user, "--", *command]
        result = subprocess.run(command, capture_output=True, text=True, cwd=self.dir, check=False)
        if result.returncode != 0:
            log = (self.dir / "log").read_text() if (self.dir / "log").exists() else ""
            raise RuntimeError(f"{tool} failed: {result.stdout}{result.stderr}{log}")

    def new_database(self) -> str:
        """The URL of a new, empty database."""
        import psycopg

        name = f"swarm_test_{os.getpid()}_{next(self._names)}"
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name} TEMPLATE template0")
        return f"postgresql://postgres@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.dir / "data"), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
