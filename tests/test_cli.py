"""The command line as users meet it: first-start secrets printed once, clear refusals, no stack traces."""

from __future__ import annotations

import socket
import subprocess
import sys
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _leader_lines(data_dir, port, count) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen([sys.executable, "-m", "swarm", "leader", "--host", "127.0.0.1", "--port", str(port),
                             "--data-dir", str(data_dir)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines = [proc.stdout.readline().rstrip("\n") for _ in range(count)]
    return proc, lines


def test_leader_prints_its_secrets_on_the_first_start_only(tmp_path):
    port = _free_port()
    proc, lines = _leader_lines(tmp_path, port, 4)
    try:
        assert lines[0] == f"Leader: http://127.0.0.1:{port}"
        assert lines[1].startswith("Admin password: ") and len(lines[1]) > 25
        assert lines[2].startswith("Admin API token: swt_")
        assert lines[3].startswith("Join token: swj1.")
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0
    proc, lines = _leader_lines(tmp_path, port, 1)
    try:
        assert lines == [f"Leader: http://127.0.0.1:{port}"]
        time.sleep(0.5)
    finally:
        proc.terminate()
        rest = proc.communicate(timeout=20)[0]
    assert "Admin" not in rest and "Join token" not in rest


def _swarm(*args, env=None):
    import os

    return subprocess.run([sys.executable, "-m", "swarm", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_import_refuses_an_architecture_it_cannot_slice(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(tmp_path / "gpt2")
    result = _swarm("model", "import", str(tmp_path / "gpt2"), "--data-dir", str(tmp_path / "leader"))
    assert result.returncode == 1
    assert "gpt2" in result.stderr and "qwen3" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "leader" / "models" / "gpt2").exists()


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
