"""The command line as users meet it: first-start secrets printed once, clear refusals, no stack traces."""

from __future__ import annotations

import socket
import subprocess
import sys

import httpx
import pytest

from harness import wait_for


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_leader(data_dir, port, out) -> subprocess.Popen:
    """`swarm leader` with its stdout (what a user reads) in the file ``out`` and its log (stderr) in ``out``.log."""
    with open(out, "wb") as stdout, open(f"{out}.log", "wb") as stderr:
        return subprocess.Popen([sys.executable, "-m", "swarm", "leader", "--host", "127.0.0.1", "--port", str(port),
                                 "--data-dir", str(data_dir)], stdout=stdout, stderr=stderr)


def _lines(proc: subprocess.Popen, out, count: int) -> list[str]:
    """The first ``count`` lines the leader printed, once it has printed them."""
    def printed():
        lines = out.read_text().splitlines()
        assert len(lines) >= count or proc.poll() is None, f"the leader exited ({proc.returncode}): {lines}"
        return lines[:count] if len(lines) >= count else None

    return wait_for(printed, 60, message=lambda: f"printed: {out.read_text()!r}")


def _answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.e2e
def test_leader_prints_its_secrets_on_the_first_start_only(tmp_path, process_logs):
    port = _free_port()
    first, again = tmp_path / "first.out", tmp_path / "again.out"
    for out in (first, again):
        process_logs(f"leader {out.stem} (stdout)", out)
        process_logs(f"leader {out.stem} (stderr)", f"{out}.log")
    proc = _start_leader(tmp_path / "leader", port, first)
    try:
        lines = _lines(proc, first, 4)
        assert lines[0] == f"Leader: http://127.0.0.1:{port}"
        assert lines[1].startswith("Admin password: ") and len(lines[1]) > 25
        assert lines[2].startswith("Admin API token: swt_")
        assert lines[3].startswith("Join token: swj1.")
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0
    proc = _start_leader(tmp_path / "leader", port, again)
    try:
        assert _lines(proc, again, 1) == [f"Leader: http://127.0.0.1:{port}"]
        # Serving requests: it is past the point where a first start prints its secrets.
        wait_for(lambda: _answers(port), 30, message="the leader does not answer /healthz")
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    rest = again.read_text()
    assert "Admin" not in rest and "Join token" not in rest


def _swarm(*args, env=None):
    import os

    return subprocess.run([sys.executable, "-m", "swarm", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


@pytest.mark.e2e
def test_import_refuses_an_architecture_it_cannot_slice(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(tmp_path / "gpt2")
    result = _swarm("model", "import", str(tmp_path / "gpt2"), "--data-dir", str(tmp_path / "leader"))
    assert result.returncode == 1
    assert "gpt2" in result.stderr and "qwen3" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "leader" / "models" / "gpt2").exists()


@pytest.mark.e2e
def test_import_a_transformers_folder_and_list_it_in_the_catalogue(tmp_path):
    from conftest import build_tiny_source
    from swarm.store.db import Store

    source = build_tiny_source(tmp_path / "src", "qwen3")
    result = _swarm("model", "import", str(source), "--name", "tiny-qwen3", "--data-dir", str(tmp_path / "leader"))
    assert result.returncode == 0, result.stderr
    assert "Imported tiny-qwen3: qwen3, 5 layers" in result.stdout
    assert "import:" in result.stderr  # the progress bar
    store = Store(tmp_path / "leader" / "leader.db")
    assert [m.name for m in store.list_models()] == ["tiny-qwen3"]
    again = _swarm("model", "import", str(source), "--name", "tiny-qwen3", "--data-dir", str(tmp_path / "leader"))
    assert again.returncode == 1 and "--replace" in again.stderr


def test_cli_commands_that_need_a_leader_say_how_to_name_one():
    result = _swarm("model-load", "x", env={"SWARM_LEADER": "", "SWARM_TOKEN": ""})
    assert result.returncode == 1
    assert "SWARM_LEADER" in result.stderr and "Traceback" not in result.stderr
    result = _swarm("model-load", "x", "--leader", f"http://127.0.0.1:{_free_port()}", "--token", "t")
    assert result.returncode == 1 and "cannot reach the leader" in result.stderr


@pytest.mark.e2e
def test_admin_cli_mints_lists_and_revokes_join_tokens_and_sets_a_password(tmp_path, process_logs):
    port = _free_port()
    out = tmp_path / "leader.out"
    process_logs("leader (stdout)", out)
    process_logs("leader (stderr)", f"{out}.log")
    proc = _start_leader(tmp_path / "leader", port, out)
    try:
        lines = _lines(proc, out, 4)
        token = lines[2].split(": ", 1)[1]
        wait_for(lambda: _answers(port), 30, message="the leader does not answer /healthz")
        env = {"SWARM_LEADER": f"http://127.0.0.1:{port}", "SWARM_TOKEN": token}
        minted = _swarm("admin", "join-token", "--uses", "3", "--ttl", "2h", env=env)
        assert minted.returncode == 0, minted.stderr
        assert minted.stdout.startswith("swj1.") and "lets 3 fellows join within 2 h" in minted.stderr
        listed = _swarm("admin", "join-tokens", env=env)
        assert listed.returncode == 0 and "3 of 3 uses left" in listed.stdout, listed.stdout
        newest = max(int(line.split()[0]) for line in listed.stdout.splitlines())
        revoked = _swarm("admin", "revoke-join-token", str(newest), env=env)
        assert revoked.returncode == 0 and "revoked" in _swarm("admin", "join-tokens", env=env).stdout
        bad = _swarm("admin", "join-token", "--ttl", "soon", env=env)
        assert bad.returncode != 0 and "not a duration" in bad.stderr
        import os

        changed = subprocess.run([sys.executable, "-m", "swarm", "admin", "password", "--user", "admin"],
                                 input="a new password\n", capture_output=True, text=True, timeout=120,
                                 env={**os.environ, **env})
        assert changed.returncode == 0, changed.stderr
        login = httpx.post(f"http://127.0.0.1:{port}/api/v1/auth/login",
                           json={"name": "admin", "password": "a new password"}, timeout=30)
        assert login.status_code == 200
        short = subprocess.run([sys.executable, "-m", "swarm", "admin", "password"], input="b\n",
                               capture_output=True, text=True, timeout=120, env={**os.environ, **env})
        assert short.returncode == 1 and "at least 8 characters" in short.stderr
        assert "Traceback" not in short.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=20)
