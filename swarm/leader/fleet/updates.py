"""The leader's own version of swarm as a wheel, for its fellows' `swarm update`.

A fellow on another version asks for it over its control link; the leader announces the wheel's sha256 there (the
link is Noise-encrypted and pinned to the leader's key, so the hash cannot be forged on the way) and serves the file
on an HTTP route that takes the fellow's node credential, as model files are served. No other internet is needed.

Where the wheel comes from:
  - a source checkout (``swarm/`` next to a ``pyproject.toml``: an editable install, or PYTHONPATH): the package is
    copied to a scratch folder and built there with `pip wheel --no-deps` (setuptools from this environment when it
    has it, so no index is asked), once per state of the sources -- a digest of every file's path, size and mtime;
  - an installed wheel: its installed files, as the distribution's RECORD lists them, are packed again into a wheel
    (the launcher scripts and the installer's own files left out: pip makes them anew on the fellow).
Either is cached under the leader's data dir, so it is built once.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import logging
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import trio

import swarm
from swarm import __version__, wire
from swarm.errors import AuthError, BadRequest, Forbidden, UpdateError

log = logging.getLogger(__name__)

BUILD_TIMEOUT_S = 300.0  # measured here: 7 s for `pip wheel` of this repo without build isolation
WHEEL_NAME = re.compile(r"^swarm-[A-Za-z0-9_.+!]+-py3-none-any\.whl$")
# Written by the installer on the machine it installs to; a repacked wheel must not carry them.
_INSTALLER_FILES = {"INSTALLER", "REQUESTED", "direct_url.json", "RECORD"}


def source_root(package_file: str | None = None) -> Path | None:
    """The source checkout this swarm runs from (the folder with pyproject.toml), or None when it is installed."""
    root = Path(package_file or swarm.__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file() and (root / "swarm" / "__init__.py").is_file():
        return root
    return None


def source_digest(root: Path) -> str:
    """Changes whenever a file of the package (or pyproject.toml) does: names the cached wheel of a checkout."""
    digest = hashlib.sha256()
    files = [root / "pyproject.toml", *sorted((root / "swarm").rglob("*"))]
    for path in files:
        if "__pycache__" in path.parts or path.suffix == ".pyc" or not path.is_file():
            continue
        st = path.stat()
        digest.update(f"{path.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def build_from_source(root: Path, out_dir: Path) -> Path:
    """`pip wheel --no-deps` of the checkout at ``root``, built in a scratch copy (setuptools writes build/ and
    *.egg-info next to what it builds, which does not belong in someone's checkout)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="swarm-wheel-") as scratch:
        src = Path(scratch) / "src"
        shutil.copytree(root / "swarm", src / "swarm", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        for name in ("pyproject.toml", "README.md", "LICENSE"):
            if (root / name).is_file():
                shutil.copy2(root / name, src / name)
        built = Path(scratch) / "out"
        base = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-q", "-w",
                str(built)]
        # First with this environment's setuptools and no index (offline); else pip fetches the build backend.
        attempts = [[*base, "--no-build-isolation", "--no-index", str(src)], [*base, str(src)]]
        errors = []
        for args in attempts:
            done = subprocess.run(args, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
            wheels = sorted(built.glob("swarm-*.whl"))
            if done.returncode == 0 and wheels:
                target = out_dir / wheels[0].name
                shutil.move(wheels[0], target)
                return target
            errors.append((done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"])
        raise UpdateError(
            f"the leader could not build a wheel of its own swarm from {root}: {errors[-1][0]}. Install setuptools "
            f"in the leader's environment ({sys.executable} -m pip install setuptools) and try again.")


def repack_installed(dist, out_dir: Path) -> Path:
    """A wheel of the installed distribution ``dist`` (importlib.metadata) from the files its RECORD lists."""
    out_dir.mkdir(parents=True, exist_ok=True)
    version = dist.version
    target = out_dir / f"swarm-{version}-py3-none-any.whl"
    partial = target.with_suffix(".part")
    record = []
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as whl:
        info_dir = None
        for entry in dist.files or []:
            path = str(entry)
            parts = entry.parts
            if path.startswith("..") or "__pycache__" in parts or path.endswith(".pyc"):
                continue  # launcher scripts outside site-packages, and byte code
            if parts[0].endswith(".dist-info"):
                info_dir = parts[0]
                if parts[-1] in _INSTALLER_FILES:
                    continue
            data = Path(dist.locate_file(entry)).read_bytes()
            whl.writestr(path, data)
            record.append((path, _record_hash(data), str(len(data))))
        if info_dir is None:
            raise UpdateError(f"the installed swarm {version} lists no .dist-info folder; reinstall it on the leader.")
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerows([*record, (f"{info_dir}/RECORD", "", "")])
        whl.writestr(f"{info_dir}/RECORD", buffer.getvalue())
    partial.replace(target)
    return target


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def own_wheel(cache_dir: Path) -> Path:
    """The wheel of the swarm this process runs, built (or packed) once and kept under ``cache_dir``."""
    root = source_root()
    if root is not None:
        folder = cache_dir / f"{__version__}-src-{source_digest(root)}"
    else:
        folder = cache_dir / f"{__version__}-installed"
    found = sorted(folder.glob("swarm-*.whl")) if folder.is_dir() else []
    if found:
        return found[0]
    if root is not None:
        log.info("building a wheel of swarm %s from %s for fellows to update to", __version__, root)
        return build_from_source(root, folder)
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution("swarm")
    except PackageNotFoundError:
        raise UpdateError("the leader's swarm is neither a source checkout nor an installed package; install it "
                          "with pip so that fellows can update to it.") from None
    return repack_installed(dist, folder)


class SelfWheel:
    """The leader's wheel and the offer that announces it (version, protocol, file name, sha256, size)."""

    def __init__(self, cache_dir: Path):
        self.cache_dir = cache_dir
        self._offer: dict | None = None
        self._path: Path | None = None
        self._lock = trio.Lock()

    async def offer(self) -> dict:
        async with self._lock:
            if self._offer is None:
                path = await trio.to_thread.run_sync(own_wheel, self.cache_dir)
                sha256 = await trio.to_thread.run_sync(file_sha256, path)
                self._path = path
                self._offer = {"version": __version__, "protocol": wire.PROTOCOL_VERSION, "file": path.name,
                               "sha256": sha256, "size": path.stat().st_size,
                               "path": f"/api/v1/update/{path.name}"}
                log.info("fellows update to %s (sha256 %s…)", path.name, sha256[:12])
            return dict(self._offer)

    def path_of(self, name: str) -> tuple[Path, str] | None:
        """(path, sha256) of the wheel called ``name`` once announced; None for any other name."""
        if self._offer is None or self._path is None or name != self._offer["file"]:
            return None
        return self._path, self._offer["sha256"]


class UpdateRoutes:
    """GET /api/v1/update/{file}: the wheel, for a fellow's node credential (or a join token: the install script).
    POST /api/v1/fellows/update (admins): ask every outdated fellow online (or those named in ``fellow_ids``) to update
    itself."""

    def __init__(self, leader):
        self.leader = leader

    async def wheel(self, request):
        from swarm.leader.api.http_errors import api_error, problem
        from swarm.leader.fleet.files import file_response
        from swarm.leader.fleet.install import wheel_reader

        try:
            await wheel_reader(request, self.leader.store)  # a fellow, or a PC running the install script
        except AuthError as exc:
            return api_error(exc)
        found = self.leader.hub.updates.path_of(request.path_params["file"])
        if found is None:
            return problem(404, "the leader offers no such file; run `swarm update` again for the current one.",
                           "not_found")
        path, sha256 = found
        return file_response(path, request, sha256)

    async def update_fellows(self, request):
        from starlette.responses import JSONResponse

        from swarm.leader.api.auth import current_user
        from swarm.leader.api.http_errors import api_error, json_body

        try:
            user = await current_user(request, self.leader.store)
            if not user.is_admin:
                raise Forbidden("this needs an admin account.")
            body = await json_body(request) if await request.body() else {}  # too deep a JSON is a 400 there
            ids = body.get("fellow_ids")
            if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, int) for i in ids)):
                raise BadRequest("fellow_ids must be a list of fellow ids.", "invalid_fellow_ids")
            conns = [c for c in self.leader.hub.online.values() if (c.id in ids if ids is not None else c.outdated)]
            updating, manual = [], []
            for conn in sorted(conns, key=lambda c: c.id):
                if conn.updates:
                    await self.leader.hub.ask_update(conn)
                    updating.append(conn.name)
                else:
                    manual.append({"name": conn.name, "message": (
                        f"{conn.name} runs swarm {conn.version}, which cannot update itself: on {conn.name}, install "
                        f"the leader's version (swarm {__version__}) by hand or with the install command, then start "
                        "`swarm join` again.")})
            return JSONResponse({"version": __version__, "protocol": wire.PROTOCOL_VERSION, "updating": updating,
                                 "manual": manual})
        except Exception as exc:  # noqa: BLE001 - one error shape, as every /api/v1 route answers (http_errors)
            return api_error(exc)
