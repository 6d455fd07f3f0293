"""A real leader and real fellows inside one trio test: hypercorn on 127.0.0.1 port 0, TCP and websockets on
loopback, the same classes the `swarm leader` and `swarm join` processes run."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import trio

from swarm.config import Settings
from swarm.fellow import Fellow
from swarm.leader.app import Leader
from swarm.model_import import register
from swarm.store.manifest import load_manifest
from swarm.tunnel.join_token import make_join_token


def _timed_out(condition: Callable, timeout: float, message: str | Callable[[], str]) -> AssertionError:
    name = getattr(condition, "__name__", "<lambda>")
    what = "the condition" if name == "<lambda>" else name
    try:
        detail = message() if callable(message) else message
    except Exception as exc:  # noqa: BLE001 - the timeout is the failure to report, not this
        detail = f"(could not describe the state: {exc!r})"
    return AssertionError(f"{what} did not hold within {timeout:g} s" + (f": {detail}" if detail else ""))


async def wait_until(condition: Callable, timeout: float, *, interval: float = 0.05,
                     message: str | Callable[[], str] = "") -> object:
    """Poll ``condition()`` (a plain or async callable) every ``interval`` s until it returns something true, and
    return that; fail with ``message`` (a string, or a callable giving one: the state worth seeing) after
    ``timeout`` s. For state that changes without an event to wait on: real sockets, other processes."""
    deadline = trio.current_time() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if trio.current_time() >= deadline:
            raise _timed_out(condition, timeout, message)
        await trio.sleep(interval)


def wait_for(condition: Callable[[], object], timeout: float, *, interval: float = 0.05,
             message: str | Callable[[], str] = "") -> object:
    """``wait_until`` for synchronous tests: real processes, network namespaces. ``condition`` may raise (e.g. an
    AssertionError when a process it waits on has exited) to fail at once."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _timed_out(condition, timeout, message)
        time.sleep(interval)


@dataclasses.dataclass
class Swarm:
    leader: Leader
    url: str
    token: str
    fellows: list[Fellow]
    http: httpx.AsyncClient

    def join_token(self, uses: int = 1) -> str:
        """A fresh join token that admits ``uses`` more fellows."""
        pool = self.leader.store.list_pools()[0]
        return make_join_token(self.leader.public, self.leader.store.create_join_token(pool.id, uses=uses),
                               self.leader.cert_pin)

    async def load(self, model: str, num_stages: int, timeout: float = 120, quantization: str | None = "none") -> dict:
        """Load ``model`` over ``num_stages`` at ``quantization``: none by default, the float32 weights the exactness
        tests compare with transformers' reference (a GGUF model's own default is gguf); None: the model's default."""
        body: dict = {"num_stages": num_stages}
        if quantization is not None:
            body["quantization"] = quantization
        response = await self.http.post(f"/api/v1/models/{model}/load", json=body)
        assert response.status_code == 202, response.text
        await self.leader.serving.loader.wait_ready(model, timeout)
        return (await self.http.get(f"/api/v1/models/{model}")).json()

    def stage(self, model: str, index: int):
        """The fellow's LoadedStage that runs stage ``index`` of ``model``."""
        return next(f.stages[model] for f in self.fellows
                    if model in f.stages and f.stages[model].driver.index == index)

    async def greedy(self, model: str, prompt: list[int], max_tokens: int, timeout: float = 60) -> list[int]:
        """The greedy reply to token ids ``prompt``, submitted through the leader's intake (no chat template, no end
        token): its ids once done. Fails on an error or on ``timeout`` seconds without a batch."""
        return (await self.greedy_done(model, prompt, max_tokens, timeout))[0]

    async def greedy_done(self, model: str, prompt: list[int], max_tokens: int,
                          timeout: float = 60) -> tuple[list[int], object]:
        """As :meth:`greedy`, with what the reader's "done" carried."""
        from swarm.leader.serving.request import Reader, Request
        from swarm.messages import Sampling

        request = Request(model=model, prompt=prompt, max_tokens=max_tokens, sampling=Sampling(), eos=[])
        await self.leader.serving.intake.submit(request)
        reader = Reader(request)
        while True:
            kind, value = await reader.next(timeout)
            assert kind != "error", value
            if kind == "done":
                return request.tokens, value

    async def chat(self, model: str, messages: list[dict], **extra) -> dict:
        body = {"model": model, "messages": messages, "temperature": 0, "return_token_ids": True, **extra}
        response = await self.http.post("/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()


def install_model(leader_dir: Path, model_dir: Path) -> str:
    """Make an imported model part of a leader's catalogue without copying its files."""
    (leader_dir / "models").mkdir(parents=True, exist_ok=True)
    link = leader_dir / "models" / model_dir.name
    if not link.exists():
        os.symlink(model_dir, link)
    register(leader_dir, load_manifest(model_dir))
    return model_dir.name


@contextlib.asynccontextmanager
async def running_swarm(tmp: Path, model_dirs: list[Path], fellows: int = 2, leader_env: dict | None = None,
                        fellow_env: dict | None = None, leader_tls: tuple[Path, Path] | None = None):
    """``leader_tls`` (certificate, key): the leader serves HTTPS, and the join tokens pin its certificate."""
    leader_settings = Settings.from_env({"SWARM_SERVE_PORT": "0", **(leader_env or {})})
    fellow_settings = Settings.from_env({"SWARM_SERVE_PORT": "0", "SWARM_HEARTBEAT_S": "1", "SWARM_CALIBRATE": "0",
                                         **(fellow_env or {})})
    leader = Leader(tmp / "leader", leader_settings, tls_cert=leader_tls[0] if leader_tls else None,
                    tls_key=leader_tls[1] if leader_tls else None)
    for model_dir in model_dirs:
        install_model(tmp / "leader", model_dir)
    first = leader.first_start
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(lambda task_status: leader.serve("127.0.0.1", 0, shutdown_trigger=stop.wait,
                                                                     task_status=task_status))
        url = urls[0]
        members = []
        pool = leader.store.list_pools()[0]
        join = make_join_token(leader.public, leader.store.create_join_token(pool.id, uses=max(fellows, 1)),
                               leader.cert_pin)
        for i in range(fellows):
            fellow = Fellow(leader_url=url, data_dir=tmp / f"fellow-{i}", settings=fellow_settings,
                            name=f"fellow-{i}", join_token=join)
            await nursery.start(fellow.run)
            await fellow.connected.wait()  # one at a time: fellow-i enrols as the i-th fellow, so stage i is on it
            members.append(fellow)
        verify = True
        if leader_tls:
            import ssl

            verify = ssl.create_default_context(cafile=str(leader_tls[0]))
            verify.check_hostname = False
        async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {first.admin_token}"},
                                     timeout=60, verify=verify) as http:
            try:
                yield Swarm(leader, url, first.admin_token, members, http)
            finally:
                stop.set()
                nursery.cancel_scope.cancel()
