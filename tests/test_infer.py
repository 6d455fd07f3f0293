"""`swarm infer` against a real leader process and two fellow processes serving the built-in model over 2 stages (the
demo's fleet): the reply streams to the terminal, then the speed line with the fellows' split; errors are one line
and exit status 1."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from fleet import Pool

pytestmark = pytest.mark.e2e

SPEED = re.compile(r"^[\d.]+ tokens/s · (\d+) tokens · [\d.]+ s to first token · "
                   r"stage 0 [\d.]+ ms/token · link [\d.]+ ms · stage 1 [\d.]+ ms$")


@pytest.fixture(scope="module")
def pool(module_tmp, smollm_model_dir):
    pool = Pool(module_tmp("infer"), smollm_model_dir)
    try:
        pool.load(2)
        yield pool
    finally:
        pool.stop()


def infer(pool, *args: str, token: str | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}
    return subprocess.run([sys.executable, "-m", "swarm", "infer", *args, "--leader", pool.leader.url,
                           "--token", token or pool.token], input=stdin, capture_output=True, text=True,
                          timeout=180, env=env, check=False)


def greedy(pool, messages: list[dict], max_tokens: int) -> tuple[str, int]:
    data = pool.http.post("/v1/chat/completions", json={"model": pool.name, "messages": messages,
                                                        "temperature": 0, "max_tokens": max_tokens}).json()
    return data["choices"][0]["message"]["content"], data["usage"]["completion_tokens"]


def test_the_reply_streams_then_the_speed_line(pool):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "swarm", "infer", pool.name,
                             "List the numbers from 1 to 80, separated by commas.", "--temperature", "0",
                             "--max-tokens", "64", "--leader", pool.leader.url, "--token", pool.token],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        first = proc.stdout.read(1)  # the reply's first character, as soon as it is printed
        first_at = time.monotonic()
        rest, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    ended = time.monotonic()
    assert proc.returncode == 0, err
    text = first + rest
    want, tokens = greedy(pool, [{"role": "user", "content": "List the numbers from 1 to 80, separated by commas."}],
                          64)
    assert text == want + "\n"
    # it streamed: the first words were on the terminal well before the 64th token came
    assert ended - first_at > 0.5, (first_at - started, ended - started)
    line = err.strip().splitlines()[-1]
    match = SPEED.match(line)
    assert match, line
    assert int(match.group(1)) == tokens == 64


def test_prompt_from_stdin_with_a_system_message_and_sampling_options(pool):
    system = "You answer in one short sentence."
    result = infer(pool, pool.name, "-", "--system", system, "--temperature", "0", "--top-p", "0.9", "--top-k", "5",
                   "--min-p", "0.01", "--max-tokens", "16", "--no-reasoning", stdin="What is the capital of France?")
    assert result.returncode == 0, result.stderr
    want, tokens = greedy(pool, [{"role": "system", "content": system},
                                 {"role": "user", "content": "What is the capital of France?"}], 16)
    assert result.stdout == want + "\n"
    assert "Paris" in result.stdout
    assert SPEED.match(result.stderr.strip().splitlines()[-1]), result.stderr


@pytest.mark.parametrize("case", ["unknown model", "bad token", "bad option", "empty prompt"])
def test_errors_are_one_line_and_status_1(pool, case):
    if case == "unknown model":
        result = infer(pool, "no-such-model", "Hello")
        assert result.stderr == (
            "error: The model 'no-such-model' does not exist or you do not have access to it: "
            "it is in none of your pools. GET /v1/models lists yours; an admin adds you to a pool with `swarm admin "
            "pool-member-add POOL USER`, or imports a model with `swarm model import`.\n")
    elif case == "bad token":
        result = infer(pool, pool.name, "Hello", token="swt_not-a-token")
        assert result.stderr.startswith("error: the leader refused the token:") and result.stderr.count("\n") == 1
    elif case == "bad option":
        result = infer(pool, pool.name, "Hello", "--temperature", "-3")
        assert result.stderr.startswith("error: ") and "temperature" in result.stderr
        assert result.stderr.count("\n") == 1
    else:
        result = infer(pool, pool.name, "-", stdin="  \n")
        assert result.stderr == "error: the prompt is empty: give it as the second argument, or pipe it in with - .\n"
    assert result.returncode == 1 and result.stdout == ""
    assert "Traceback" not in result.stderr
