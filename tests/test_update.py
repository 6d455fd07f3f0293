"""`swarm update` end to end: a leader on a newer build of swarm (a copy of this source with the version and the wire
protocol bumped) and a fellow on the current one, installed from a wheel into a virtual environment of its own.

The fellow enrols and shows as outdated; a load that needs it is refused naming it; `swarm update` on its machine
makes it fetch the leader's wheel, check its sha256, pip install it and re-exec (same process id, same identity);
it comes back on the leader's version and the load succeeds. Then `swarm update` with no fellow running installs
the wheel itself."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import httpx
import pytest

from fleet import _stop, _tail, free_port
from harness import install_model, wait_for
from swarm import __version__, wire
from swarm.leader.fleet.updates import build_from_source, repack_installed, source_root

pytestmark = pytest.mark.e2e

NEWER = f"{__version__}.post1"


def _newer_source(dest: Path) -> Path:
    """A copy of this checkout with the version and the wire protocol bumped: "the next release"."""
    root = source_root()
    shutil.copytree(root / "swarm", dest / "swarm", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy2(root / "pyproject.toml", dest / "pyproject.toml")
    init = dest / "swarm" / "__init__.py"
    init.write_text(re.sub(r'__version__ = "[^"]+"', f'__version__ = "{NEWER}"', init.read_text()))
    wire_py = dest / "swarm" / "wire.py"
    wire_py.write_text(re.sub(r"^PROTOCOL_VERSION = \d+", f"PROTOCOL_VERSION = {wire.PROTOCOL_VERSION + 1}",
                              wire_py.read_text(), flags=re.M))
    return dest


def _fellow_venv(tmp: Path, wheel: Path) -> Path:
    """A venv with the current swarm installed from ``wheel``; its other dependencies (torch...) are this
    environment's, seen through links (no swarm among them), so nothing is downloaded or installed twice."""
    venv = tmp / "fellow-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    deps = tmp / "deps"
    deps.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.lower().startswith(("swarm", "__editable__", "_swarm")) and entry.suffix != ".pth":
            (deps / entry.name).symlink_to(entry)
    (site / "deps.pth").write_text(f"{deps}\n")
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], check=True,
                   cwd=tmp)
    return python


def _run_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "SWARM_SERVE_PORT": "0", "SWARM_HEARTBEAT_S": "1", "OMP_NUM_THREADS": "1"}


def test_swarm_update_brings_an_old_fellow_to_the_leaders_version(tmp_path, smollm_model_dir):
    own_venv_swarm = Path(sysconfig.get_paths()["purelib"]) / f"swarm-{__version__}.dist-info"
    before = own_venv_swarm.stat().st_mtime_ns if own_venv_swarm.exists() else None
    current_wheel = build_from_source(source_root(), tmp_path / "wheels")
    python = _fellow_venv(tmp_path, current_wheel)
    newer = _newer_source(tmp_path / "newer")

    leader_dir = tmp_path / "leader"
    model = install_model(leader_dir, smollm_model_dir)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out, log = open(tmp_path / "leader.out", "wb"), open(tmp_path / "leader.log", "wb")
    # run from the copy: `python -m` puts the working directory first on sys.path
    leader = subprocess.Popen([sys.executable, "-m", "swarm", "leader", "--host", "127.0.0.1", "--port", str(port),
                               "--data-dir", str(leader_dir)], cwd=newer, stdout=out, stderr=log,
                              env={**_run_env(), "PYTHONPATH": str(newer)}, start_new_session=True)
    fellow = None
    fellow_dir, fellow_log = tmp_path / "f2", tmp_path / "f2.log"

    def logs() -> str:
        return f"--- leader ---\n{_tail(tmp_path / 'leader.log', 40)}\n--- f2 ---\n{_tail(fellow_log, 40)}"

    try:
        def admin_token():
            text = (tmp_path / "leader.out").read_text()
            found = re.search(r"^Admin API token: (\S+)", text, re.M)
            return found.group(1) if found else None

        token = wait_for(admin_token, 60, message=logs)
        from swarm.demo import mint_join_token

        join = mint_join_token(leader_dir)
        with open(fellow_log, "ab") as flog:
            fellow = subprocess.Popen([str(python), "-m", "swarm", "join", url, "--token", join, "--name", "f2",
                                       "--data-dir", str(fellow_dir)], cwd=tmp_path, stdout=flog,
                                      stderr=subprocess.STDOUT, env=_run_env(), start_new_session=True)
        http = httpx.Client(base_url=url, headers={"authorization": f"Bearer {token}"}, timeout=60)

        def f2() -> dict | None:
            listing = http.get("/api/v1/fellows").json()
            return next((f for f in listing["fellows"] if f["name"] == "f2" and f["state"] == "online"), None)

        seen = wait_for(f2, 90, message=logs)
        listing = http.get("/api/v1/fellows").json()
        assert listing["leader"] == {"version": NEWER, "protocol": wire.PROTOCOL_VERSION + 1}
        assert (seen["version"], seen["protocol"], seen["outdated"]) == (__version__, wire.PROTOCOL_VERSION, True)

        refused = http.post(f"/api/v1/models/{model}/load", json={"num_stages": 1})
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["message"] == (
            f"f2 runs swarm {__version__} (protocol {wire.PROTOCOL_VERSION}); this leader needs protocol "
            f"{wire.PROTOCOL_VERSION + 1} — run swarm update on f2.")
        assert http.get(f"/api/v1/models/{model}").json()["status"] == "not_loaded"  # nothing started

        done = subprocess.run([str(python), "-m", "swarm", "update", "--data-dir", str(fellow_dir)], cwd=tmp_path,
                              capture_output=True, text=True, env=_run_env(), timeout=120, check=False)
        assert done.returncode == 0, done.stderr + logs()
        assert f"f2 is running: it installs swarm {NEWER} from the leader" in done.stdout

        updated = wait_for(lambda: (f := f2()) and f["version"] == NEWER and f, 120, message=logs)
        assert (updated["protocol"], updated["outdated"]) == (wire.PROTOCOL_VERSION + 1, False)
        assert updated["id"] == seen["id"] and updated["fingerprint"] == seen["fingerprint"]  # the same fellow
        assert fellow.poll() is None  # re-exec'd in place: the process we started still runs, now the new version
        script = "import swarm, swarm.wire as w; print(swarm.__version__, w.PROTOCOL_VERSION, swarm.__file__)"
        installed = subprocess.run([str(python), "-c", script], capture_output=True, text=True, env=_run_env(),
                                   cwd=tmp_path, check=True).stdout.split()
        assert installed[:2] == [NEWER, str(wire.PROTOCOL_VERSION + 1)]
        assert installed[2].startswith(str(python.parent.parent))

        loaded = http.post(f"/api/v1/models/{model}/load", json={"num_stages": 1})
        assert loaded.status_code == 202, loaded.text
        wait_for(lambda: http.get(f"/api/v1/models/{model}").json()["status"] == "ready", 120, message=logs)
        reply = http.post("/v1/chat/completions", json={"model": model, "max_tokens": 4, "temperature": 0,
                                                        "messages": [{"role": "user", "content": "Hi"}]})
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"], reply.text

        # With the fellow stopped, `swarm update` installs the wheel itself (--force: the versions match now).
        _stop(fellow)
        wait_for(lambda: f2() is None, 30, message=logs)
        same = subprocess.run([str(python), "-m", "swarm", "update", "--data-dir", str(fellow_dir)], cwd=tmp_path,
                              capture_output=True, text=True, env=_run_env(), timeout=120, check=False)
        assert same.returncode == 0 and f"f2 already runs swarm {NEWER}" in same.stdout, same.stderr
        forced = subprocess.run([str(python), "-m", "swarm", "update", "--force", "--data-dir", str(fellow_dir)],
                                cwd=tmp_path, capture_output=True, text=True, env=_run_env(), timeout=120,
                                check=False)
        assert forced.returncode == 0, forced.stderr
        assert f"Installed swarm {NEWER} (protocol {wire.PROTOCOL_VERSION + 1}). Start the fellow" in forced.stdout
    finally:
        _stop(fellow)
        _stop(leader)
        out.close()
        log.close()
    after = own_venv_swarm.stat().st_mtime_ns if own_venv_swarm.exists() else None
    assert after == before  # this environment's swarm was left alone


def test_an_installed_swarm_is_packed_again_into_a_wheel_pip_installs(tmp_path):
    """A leader installed from a wheel (no checkout) serves its installed files as a wheel."""
    from importlib.metadata import distributions

    wheel = build_from_source(source_root(), tmp_path / "built")
    first = tmp_path / "first"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(first),
                    str(wheel)], check=True)
    dist = next(d for d in distributions(path=[str(first)]) if d.metadata["Name"] == "swarm")
    repacked = repack_installed(dist, tmp_path / "repacked")
    assert repacked.name == wheel.name
    second = tmp_path / "second"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(second),
                    str(repacked)], check=True)

    def tree(root: Path) -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
                if p.is_file() and "__pycache__" not in p.parts and p.parent.name.endswith(".dist-info") is False}

    assert tree(second) == tree(first)  # every file of the package, byte for byte
    assert "swarm/web/admin.html" in tree(second)
    assert (second / "bin" / "swarm").exists()  # pip made the launcher anew from entry_points.txt


async def test_admins_ask_outdated_fellows_to_update_and_the_wheel_needs_a_node_credential(tmp_path, smollm_model_dir):
    """In one process: the leader's view of a fellow on an older protocol (its link is real, its protocol number
    set back as an older build would send it), the refusals that name it, the admin's update order, the route."""
    import hashlib

    from harness import running_swarm, wait_until

    async with running_swarm(tmp_path, [smollm_model_dir], fellows=1) as s:
        model = smollm_model_dir.name
        conn = next(iter(s.leader.hub.online.values()))
        conn.protocol = wire.PROTOCOL_VERSION - 1
        listing = (await s.http.get("/api/v1/fellows")).json()
        assert listing["leader"] == {"version": __version__, "protocol": wire.PROTOCOL_VERSION}
        assert [(f["name"], f["protocol"], f["outdated"]) for f in listing["fellows"]] == \
            [("fellow-0", wire.PROTOCOL_VERSION - 1, True)]
        checks = listing["fellows"][0]["checks"]  # the early checks against the catalogue
        assert [m["model"] for m in checks["models"]] == [model] and model in checks["text"]
        assert checks["disk_free_bytes"] > 0 and checks["memory_free_bytes"] > 0
        why = (f"fellow-0 runs swarm {__version__} (protocol {wire.PROTOCOL_VERSION - 1}); this leader needs "
               f"protocol {wire.PROTOCOL_VERSION} — run swarm update on fellow-0.")
        for body in ({}, {"num_stages": 1}, {"fellow_id": conn.id}):
            refused = await s.http.post(f"/api/v1/models/{model}/load", json=body)
            assert (refused.status_code, refused.json()["error"]["message"]) == (409, why), body
        assert model not in s.leader.serving.models

        ordered = await s.http.post("/api/v1/fellows/update", json={})
        assert ordered.status_code == 200, ordered.text
        assert (ordered.json()["updating"], ordered.json()["manual"]) == (["fellow-0"], [])
        fellow = s.fellows[0]
        await wait_until(lambda: fellow.updater.downloaded is not None, 120)
        offer = await s.leader.hub.updates.offer()
        assert hashlib.sha256(fellow.updater.downloaded.read_bytes()).hexdigest() == offer["sha256"]
        assert fellow.updater.downloaded.stat().st_size == offer["size"]

        anonymous = await s.http.get(offer["path"], headers={"authorization": ""})
        assert anonymous.status_code == 401
        node = {"authorization": f"Bearer {fellow.credential}"}
        assert (await s.http.get(offer["path"], headers={"authorization": f"Bearer {s.token}"})).status_code == 401
        assert (await s.http.get("/api/v1/update/swarm-0.0.1-py3-none-any.whl", headers=node)).status_code == 404
        served = await s.http.get(offer["path"], headers=node)
        assert served.status_code == 200 and hashlib.sha256(served.content).hexdigest() == offer["sha256"]
