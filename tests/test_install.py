"""One command adds a PC: the leader's install scripts, filled in and refused as they should be, and the Linux script
run end to end against a real leader: it installs swarm from the leader into a fresh virtual environment, runs the
early checks (the PC joins), writes the systemd user unit, and the unit's command starts a fellow that comes online.

This machine cannot reach PyTorch's own index, so the fresh environment sees this one's packages (swarm left out)
through a .pth file: the script finds PyTorch importable and pip finds swarm's dependencies satisfied; everything of
swarm itself comes from the leader."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import trio

from swarm import __version__
from swarm.leader.fleet.install import SCRIPTS, fill

VALUES = {"LEADER_URL": "http://10.0.0.5:8000", "JOIN_TOKEN": "swj1.abc.def", "WHEEL_FILE": "swarm-1-py3-none-any.whl",
          "WHEEL_SHA256": "ab" * 32}


def test_the_scripts_are_filled_in_whole_and_parse():
    for name in ("install.sh", "install.ps1"):
        text = fill((SCRIPTS / name).read_text(), VALUES)
        assert "@@" not in text
        for value in VALUES.values():
            assert f"'{value}'" in text  # single-quoted: nothing in it is expanded by the shell
    script = fill((SCRIPTS / "install.sh").read_text(), VALUES)
    assert subprocess.run(["sh", "-n"], input=script, text=True, check=False).returncode == 0
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (scripts/bootstrap installs it)")
    linted = subprocess.run(["shellcheck", "-s", "sh", "-"], input=script, text=True, capture_output=True, check=False)
    assert linted.returncode == 0, linted.stdout


@pytest.mark.e2e
async def test_the_linux_script_installs_swarm_from_the_leader_and_joins(tmp_path, smollm_model_dir):
    from harness import running_swarm, wait_until

    async with running_swarm(tmp_path, [smollm_model_dir], fellows=0) as s:
        missing = await s.http.get("/install.sh")
        done = await trio.run_process(["sh"], stdin=missing.content, capture_stdout=True, capture_stderr=True,
                                      check=False)
        assert done.returncode == 1 and b"needs a join token" in done.stderr
        bad = await s.http.get("/install.sh", params={"token": "swj1.nope.nope"})
        assert "error: " in bad.text and "exit 1" in bad.text
        ps1 = await s.http.get("/install.ps1", params={"token": s.join_token()})
        assert f"$LeaderUrl = '{s.url}'" in ps1.text

        token = s.join_token()
        served = await s.http.get("/install.sh", params={"token": token})
        assert served.status_code == 200 and f"LEADER_URL='{s.url}'" in served.text
        offer = await s.leader.hub.updates.offer()
        assert f"WHEEL_SHA256='{offer['sha256']}'" in served.text
        assert s.leader.store.list_fellows() == []  # serving the script took no use of the token

        home = tmp_path / "home"
        swarm_home = home / ".local" / "share" / "swarm"
        _venv_with_this_environments_packages(swarm_home / "venv")
        env = {**{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XDG_DATA_HOME", "XDG_CONFIG_HOME")},
               "HOME": str(home), "SWARM_NAME": "pc-1", "SWARM_PYTHON": sys.executable, "SWARM_SERVE_PORT": "0",
               "OMP_NUM_THREADS": "1"}
        ran = await trio.run_process(["sh"], stdin=served.content, capture_stdout=True, capture_stderr=True,
                                     check=False, env=env, cwd=tmp_path)
        out = ran.stdout.decode() + ran.stderr.decode()
        assert ran.returncode == 0, out
        assert f"Joined {s.url} as pc-1. What this PC can hold: " in out and smollm_model_dir.name in out
        assert [f.name for f in s.leader.store.list_fellows()] == ["pc-1"]

        python = swarm_home / "venv" / "bin" / "python"
        installed = subprocess.run([str(python), "-c", "import swarm; print(swarm.__version__, swarm.__file__)"],
                                   capture_output=True, text=True, cwd=tmp_path, check=True).stdout.split()
        assert installed[0] == __version__ and installed[1].startswith(str(swarm_home / "venv"))
        wheel_path, _ = s.leader.hub.updates.path_of(offer["file"])
        with zipfile.ZipFile(wheel_path) as wheel:  # installed from the leader's wheel: the same bytes
            for member in ("swarm/__init__.py", "swarm/leader/fleet/install.py", "swarm/web/install/install.sh"):
                assert (Path(installed[1]).parent.parent / member).read_bytes() == wheel.read(member)

        unit = (home / ".config" / "systemd" / "user" / "swarm-fellow.service").read_text()
        command = re.search(r"^ExecStart=(.+)$", unit, re.M).group(1)
        assert command == f'"{swarm_home}/venv/bin/swarm" join {s.url} --data-dir "{swarm_home}/fellow"'
        if "no systemd user session here" in out:  # a container: start it as the unit would
            args = [a.strip('"') for a in command.split(" ")]
            proc = await trio.lowlevel.open_process(args, env=env, cwd=tmp_path,
                                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                await wait_until(lambda: any(c.name == "pc-1" for c in s.leader.hub.online.values()), 90)
                conn = next(c for c in s.leader.hub.online.values() if c.name == "pc-1")
                assert conn.version == __version__ and conn.compatible and not conn.outdated
            finally:
                proc.terminate()
                await proc.wait()


def _venv_with_this_environments_packages(venv: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c",
                                "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    deps = venv.parent / "deps"
    deps.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.lower().startswith(("swarm", "__editable__", "_swarm")) and entry.suffix != ".pth":
            (deps / entry.name).symlink_to(entry)
    (site / "deps.pth").write_text(f"{deps}\n")
