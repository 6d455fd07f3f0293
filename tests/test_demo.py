"""`swarm demo` as a user runs it: real leader and fellow processes, and the official openai package streaming."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from harness import wait_for

pytestmark = pytest.mark.e2e


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _running(marker: str) -> list[int]:
    """Pids of the processes whose command line names ``marker`` (the demo's data dir), this one excepted."""
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split() if int(pid) != os.getpid()]


@pytest.fixture
def demo(tmp_path, smollm_model_dir, process_logs):
    data = tmp_path / "demo"
    (data / "leader" / "models").mkdir(parents=True)
    # Reuse this session's import of the built-in model, as a second `swarm demo` run would.
    os.symlink(smollm_model_dir, data / "leader" / "models" / smollm_model_dir.name)
    # What the demo prints, then the logs it writes for the processes it starts (data/leader.log, fellow-N.log).
    out = tmp_path / "demo.out"
    process_logs("demo (stdout)", out)
    process_logs(lambda: {p.stem: p for p in sorted(data.glob("*.log"))})
    port = _free_port()
    with open(out, "wb") as stdout:
        proc = subprocess.Popen(
            [sys.executable, "-m", "swarm", "demo", "--port", str(port), "--stages", "2", "--no-browser",
             "--data-dir", str(data)],
            stdout=stdout, stderr=subprocess.STDOUT,
        )

    def printed():
        text = out.read_text(errors="replace")
        lines = dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)
        assert "API token" in lines or proc.poll() is None, f"the demo exited ({proc.returncode}):\n{text}"
        return lines if "API token" in lines else None

    try:
        lines = wait_for(printed, 240, interval=0.2, message=lambda: out.read_text(errors="replace"))
        yield proc, lines, port, str(data)
    finally:
        # The demo stops its leader and fellows on SIGTERM; whatever is left after that (a demo that hung, or was
        # killed half-way) is ended here by pid, so no process of this test outlives it.
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in _running(str(data)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_openai_package_streams_from_the_demo(demo):
    from openai import OpenAI

    proc, lines, port, data = demo
    assert lines["API base"] == f"http://127.0.0.1:{port}/v1"
    assert lines["Chat"].startswith(f"http://127.0.0.1:{port}/auth/link?token=")
    client = OpenAI(base_url=lines["API base"], api_key=lines["API token"])
    assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct"]

    stream = client.chat.completions.create(
        model="smollm2-135m-instruct",
        # the demo loads the built-in model at gguf, its file's Q4_1 blocks against 8-bit activations (as llama.cpp):
        # asked bare, it answers in French and never names Paris, as int4-fast does; float32 says "Paris"
        messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        temperature=0,
        max_tokens=40,
        stream=True,
    )
    text, finish, usage, chunks = "", None, None, 0
    for chunk in stream:
        chunks += 1
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    assert "Paris" in text
    assert finish == "stop"
    assert chunks > 3  # streamed, not one burst
    assert usage is not None and usage.prompt_tokens > 10
    assert 0 < usage.completion_tokens < 40

    capped = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": "Tell me a long story about a dragon."}],
        temperature=0, max_tokens=5,
    )
    assert capped.choices[0].finish_reason == "length"
    assert capped.usage.completion_tokens == 5

    from openai import AuthenticationError, NotFoundError

    with pytest.raises(AuthenticationError):
        OpenAI(base_url=lines["API base"], api_key="swt_wrong").models.list()
    with pytest.raises(NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])

    # The CLI unloads and loads over the same leader; a request in between gets a clear 503 (auto-load off: on, the
    # request would load the model again).
    import httpx
    from openai import InternalServerError

    env = {**os.environ, "SWARM_LEADER": f"http://127.0.0.1:{port}", "SWARM_TOKEN": lines["API token"]}
    switched = httpx.put(f"http://127.0.0.1:{port}/api/v1/settings/models", json={"auto_load": False},
                         headers={"authorization": f"Bearer {lines['API token']}"}, timeout=30)
    assert switched.status_code == 200 and switched.json()["auto_load"] is False, switched.text
    out = subprocess.run([sys.executable, "-m", "swarm", "model-unload", "smollm2-135m-instruct"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    with pytest.raises(InternalServerError) as err:
        client.chat.completions.create(model="smollm2-135m-instruct", messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 503 and "not loaded" in str(err.value)
    out = subprocess.run([sys.executable, "-m", "swarm", "model-load", "smollm2-135m-instruct", "--num-stages", "2"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Stage 0: fellow-" in out.stdout and "Stage 1: fellow-" in out.stdout and "is ready" in out.stdout
    question = "What is the capital of France? Answer in one sentence."
    again = client.chat.completions.create(model="smollm2-135m-instruct", temperature=0, max_tokens=12,
                                           messages=[{"role": "user", "content": question}])
    assert "Paris" in again.choices[0].message.content

    # The Direct links switch from the command line (an admin token: the demo's is one).
    for args, shown in (([], "off"), (["on"], "on"), ([], "on"), (["off"], "off")):
        out = subprocess.run([sys.executable, "-m", "swarm", "admin", "direct-links", *args], env=env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.strip() == f"Direct links: {shown}", out.stderr

    # SIGTERM stops every process the demo started.
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    wait_for(lambda: _running(data) == [], 15, interval=0.2, message=lambda: f"still running: {_running(data)}")
