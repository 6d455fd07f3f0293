"""The ring across home NATs, with real processes: a leader on the lab's internet, two `swarm join` fellows in home
networks behind the lab's NAT routers. Every case must give transformers' greedy reply token for token; which path
the hidden states took is read off the wire (tcpdump on the routers' WANs and the LAN) and from what the fellows
report in /api/v1/models/{id}/performance.

One lab (netlab.world: the leader on the internet, a home of every NAT kind) and one leader serve every case; each
case starts from Direct links off and nothing loaded, and swaps in the fellows it needs. A failing case's report holds
the last lines of every process's log. The NAT grid is printed in pytest's summary. Needs root; skips otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import netlab
from harness import install_model, wait_for

_reason = netlab.available()
if _reason:
    pytest.skip(_reason, allow_module_level=True)

pytestmark = [pytest.mark.lab, pytest.mark.e2e]

MODEL = "smollm2-135m-instruct"
PROMPT = "What is the capital of France?"
MAX_TOKENS = 24
LEADER_PORT = 8000
SERVE_PORT = 5559
DELAY_MS = netlab.WAN_DELAY_MS
EOS = 2
TRANSPORTS = ("direct", "tunnel", "relay")

# (case, NAT of the first fellow, NAT of the second, the two hosts, expected transport)
CASES = {
    "a": ("masquerade (same LAN)", "masquerade (same LAN)", ("a1", "a2"), "direct"),
    "b": ("masquerade", "masquerade", ("a1", "b1"), "relay"),
    "c": ("fully-random", "masquerade", ("r1", "b1"), "relay"),
    "d": ("udp-blocked", "masquerade", ("u1", "b1"), "relay"),
    "e": ("cgnat", "masquerade", ("c1", "b1"), "relay"),
}


class Results:
    """The NAT grid and the timings of the cases that ran, shown at the end of the run (pytest's summary)."""

    def __init__(self):
        self.grid: dict[tuple[str, str], str] = {}
        self.timings: dict[str, float] = {}
        self.lab: netlab.Lab | None = None

    def record(self, row: str, column: str, value: str) -> None:
        assert value.split(" ")[0] in TRANSPORTS, value  # every cell holds a transport the mesh knows
        self.grid[(row, column)] = value

    def text(self) -> str:
        return "\n".join([self.lab.describe() if self.lab else "", netlab.grid_text(self.grid),
                          "timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in self.timings.items())])


# Runs inside the leader's namespace: one process, JSON lines in (method, path, json, token), JSON lines out.
_API_PROXY = r"""
import json, sys
import httpx
client = httpx.Client(base_url=sys.argv[1], timeout=300)
print("ready", flush=True)
for line in sys.stdin:
    req = json.loads(line)
    headers = {"authorization": "Bearer " + req["token"]} if req.get("token") else {}
    try:
        r = client.request(req["method"], req["path"], json=req.get("json"), headers=headers)
        out = {"status": r.status_code, "text": r.text}
    except Exception as exc:
        out = {"status": 0, "text": repr(exc)}
    print(json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def reference(smollm_model_dir):
    from reference_model import load_reference_model
    from swarm.leader.chat.chat_format import encode_chat

    model = load_reference_model(smollm_model_dir, dtype=torch.float32)
    ids = encode_chat(smollm_model_dir, [{"role": "user", "content": PROMPT}], None)
    with torch.inference_mode():
        gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    want = gen[0, len(ids):].tolist()
    return want[: want.index(EOS) + 1] if EOS in want else want


class ApiProxy:
    """A process in the leader's namespace that makes the API calls of the test (one at a time each)."""

    def __init__(self, lab: netlab.Lab, stderr):
        self.lab = lab
        self.proc = lab.run(netlab.LEADER, [sys.executable, "-c", _API_PROXY, f"http://127.0.0.1:{LEADER_PORT}"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def call(self, method: str, path: str, body: dict | None, token: str | None,
             timeout: float = 180) -> tuple[int, object]:
        self.proc.stdin.write(json.dumps({"method": method, "path": path, "json": body, "token": token}) + "\n")
        self.proc.stdin.flush()
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                raise TimeoutError(f"{method} {path}: no answer within {timeout} s")
        out = json.loads(self.proc.stdout.readline())
        try:
            return out["status"], json.loads(out["text"])
        except ValueError:
            return out["status"], out["text"]

    def close(self) -> None:
        self.lab.stop(self.proc, timeout=5)
        for pipe in (self.proc.stdin, self.proc.stdout):
            pipe.close()


class Ring:
    """The lab, the leader process and whichever fellow processes the current case needs."""

    def __init__(self, lab: netlab.Lab, root: Path, model_dir: Path):
        self.lab, self.root, self.model_dir = lab, root, model_dir
        self.leader_dir = root / "leader"
        self.fellows: dict[str, subprocess.Popen] = {}  # host -> its `swarm join` process
        self.leader_url = f"http://{lab.address(netlab.LEADER)}:{LEADER_PORT}"
        self.leader = None
        self.leader_up = False  # once it answered: from then on, no answer at all is a failure of its own
        self.proxy = None
        self.token = None
        self.join_token = None
        self.logs: list = []

    # --- the leader and its API -----------------------------------------------------------------------------------

    def start_leader(self) -> None:
        install_model(self.leader_dir, self.model_dir)
        self.leader = self.lab.run(netlab.LEADER, [
            sys.executable, "-m", "swarm", "leader", "--host", "0.0.0.0", "--port", str(LEADER_PORT), "--data-dir",
            str(self.leader_dir)], stdout=self.log("leader"), stderr=subprocess.STDOUT)
        self.proxy = ApiProxy(self.lab, self.log("proxy"))

        def healthy():
            assert self.leader.poll() is None, f"the leader exited ({self.leader.returncode})\n{self.tail('leader')}"
            return self.api("GET", "/healthz", timeout=10)[0] == 200

        wait_for(healthy, 120, interval=0.2, message=lambda: self.tail("leader"))
        self.leader_up = True
        from swarm.demo import credentials

        self.token, self.join_token, _ = credentials(self.leader_dir, fellows=16)  # every case's fellows

    def api(self, method: str, path: str, body: dict | None = None, timeout: float = 180) -> tuple[int, object]:
        status, answer = self.proxy.call(method, path, body, self.token, timeout)
        if status == 0 and self.leader_up:  # the proxy got no HTTP answer at all (refused, reset, timed out)
            raise AssertionError(f"{method} {path}: no answer from the leader ({answer}); {self.leader_state()}")
        return status, answer

    def leader_state(self) -> str:
        """Whether the leader process still runs and what listens in its namespace: tells a leader that died (its
        exit code; its log is in the report) from one that runs but stopped serving, or a namespace gone."""
        code = self.leader.poll()
        if code is not None:
            return f"the leader process exited with code {code}"
        try:
            listening = self.lab.check(netlab.LEADER, ["ss", "-ltnu"], timeout=10).strip()
        except (netlab.NetlabError, OSError, subprocess.TimeoutExpired) as exc:
            listening = f"(could not list: {exc})"
        return f"the leader process (pid {self.leader.pid}) is still running; listening in its namespace:\n{listening}"

    def online(self) -> set[str]:
        status, body = self.api("GET", "/api/v1/fellows")
        assert status == 200, body
        return {f["name"] for f in body["fellows"] if f["state"] == "online"}

    def direct_links(self, enabled: bool) -> None:
        status, body = self.api("PUT", "/api/v1/settings/direct-links", {"enabled": enabled})
        assert status == 200 and body == {"enabled": enabled}, body

    def reset(self) -> None:
        """What every case starts from, whatever ran before it: Direct links off and the model not loaded (so the
        leader coordinates no punch for an earlier case's hops while that case's fellows are being stopped)."""
        self.direct_links(False)
        status, view = self.api("GET", f"/api/v1/models/{MODEL}")
        assert status == 200, view
        if view.get("status") != "not_loaded":
            self.unload()

    # --- fellows --------------------------------------------------------------------------------------------------

    def fellow_dir(self, host: str) -> Path:
        return self.root / "fellows" / host

    def seed_cache(self, host: str) -> None:
        """Give a fellow the model files in its content-addressed cache, as a fellow that served this model before
        holds them: the lab then moves only control and ring traffic (one case downloads for real)."""
        from swarm.store.manifest import load_manifest

        cache = self.fellow_dir(host) / "cache"
        for f in load_manifest(self.model_dir).files:
            dst = cache / f.sha256[:2] / f.sha256
            dst.parent.mkdir(parents=True, exist_ok=True)
            if not dst.exists():
                try:
                    os.link(self.model_dir / f.path, dst)
                except OSError:
                    shutil.copyfile(self.model_dir / f.path, dst)

    def forget_cache(self, host: str) -> None:
        """Stop the host's fellow and empty its cache: it downloads the model again."""
        if host in self.fellows:
            self.lab.stop(self.fellows.pop(host))
        shutil.rmtree(self.fellow_dir(host) / "cache", ignore_errors=True)

    def use(self, hosts: tuple[str, ...], seed: bool = True) -> None:
        """Exactly these hosts' fellows online (others stopped), with no model loaded."""
        status, view = self.api("GET", f"/api/v1/models/{MODEL}")
        if status == 200 and view.get("status") not in ("not_loaded", None):
            self.unload()
        for host in [h for h in self.fellows if h not in hosts or self.fellows[h].poll() is not None]:
            self.lab.stop(self.fellows.pop(host))  # not needed, or exited (an earlier case's failure): restarted
        for host in hosts:
            if host in self.fellows:
                continue
            if seed:
                self.seed_cache(host)
            env = {**os.environ, "SWARM_HEARTBEAT_S": "1", "SWARM_SERVE_PORT": str(SERVE_PORT), "SWARM_DEVICE": "cpu"}
            self.fellow_dir(host).mkdir(parents=True, exist_ok=True)
            self.fellows[host] = self.lab.run(
                host, [sys.executable, "-m", "swarm", "join", self.leader_url, "--token", self.join_token,
                       "--name", host, "--data-dir", str(self.fellow_dir(host))],
                env=env, stdout=self.log(host), stderr=subprocess.STDOUT)

        def all_online():
            for host, proc in self.fellows.items():
                assert proc.poll() is None, f"fellow {host} exited:\n{self.tail(host)}"
            return self.online() == set(hosts)

        wait_for(all_online, 120, interval=0.2, message=lambda: f"online: {self.online()}, wanted {hosts}")

    def load(self) -> dict:
        status, body = self.api("POST", f"/api/v1/models/{MODEL}/load", {"num_stages": 2, "quantization": "none"})
        assert status == 202, body

        def ready():
            _, view = self.api("GET", f"/api/v1/models/{MODEL}")
            assert view["status"] not in ("failed", "not_loaded"), view
            return view if view["status"] == "ready" else None

        return wait_for(ready, 180, interval=0.2, message=lambda: str(self.api("GET", f"/api/v1/models/{MODEL}")))

    def unload(self) -> None:
        status, body = self.api("POST", f"/api/v1/models/{MODEL}/unload")
        assert status == 200, body

    def chat(self) -> dict:
        body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
                "max_tokens": MAX_TOKENS, "return_token_ids": True}
        status, data = self.api("POST", "/v1/chat/completions", body)
        assert status == 200, data
        return data

    def hops(self, proxy: ApiProxy | None = None) -> list[dict]:
        """The ring's hops as the leader reports them (figures from the fellows' heartbeats, every second)."""
        status, perf = (proxy or self.proxy).call("GET", f"/api/v1/models/{MODEL}/performance", None, self.token)
        assert status == 200, perf
        return perf["hops"]

    def transports(self, proxy: ApiProxy | None = None) -> list[str | None]:
        return [h.get("transport") for h in self.hops(proxy)]

    def wait_transports(self, want: set[str] | None = None, timeout: float = 10) -> list[str]:
        """Wait until every hop reports a transport (all of them in ``want`` when given); those transports."""
        def reported():
            found = self.transports()
            return found if found and None not in found and (want is None or set(found) <= want) else None

        return wait_for(reported, timeout, interval=0.2, message=lambda: f"hops: {self.hops()}")

    # --- logs -----------------------------------------------------------------------------------------------------

    def log(self, name: str):
        f = open(self.root / f"{name}.log", "ab")
        self.logs.append(f)
        return f

    def log_files(self) -> dict[str, Path]:
        """Every process's log so far: the leader, the API proxy, each fellow that ever ran."""
        return {p.stem: p for p in sorted(self.root.glob("*.log"))}

    def log_size(self, name: str) -> int:
        path = self.root / f"{name}.log"
        return path.stat().st_size if path.exists() else 0

    def log_since(self, name: str, offset: int) -> str:
        with open(self.root / f"{name}.log", "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def tail(self, name: str, lines: int = 25) -> str:
        try:
            text = (self.root / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""
        return f"--- {name}.log\n" + "\n".join(text.splitlines()[-lines:])

    def close(self) -> None:
        for proc in self.fellows.values():
            self.lab.stop(proc, timeout=5)
        if self.proxy is not None:
            self.proxy.close()
        if self.leader is not None:
            self.lab.stop(self.leader, timeout=5)
        for f in self.logs:
            f.close()


@pytest.fixture(scope="module")
def results(session_summary):
    results = Results()
    yield results
    if results.grid:
        session_summary("the lab's NAT grid (tests/test_lab_ring.py)", results.text())


@pytest.fixture(scope="module")
def ring(module_tmp, smollm_model_dir, results):
    started = time.monotonic()
    # The leader on the internet; a home of every kind for the fellows (netlab.HOMES).
    with netlab.world(public=(netlab.LEADER,), delay_ms=DELAY_MS) as lab:
        results.lab = lab
        ring = Ring(lab, module_tmp("labring"), smollm_model_dir)
        try:
            ring.start_leader()
            results.timings["lab + leader"] = time.monotonic() - started
            yield ring
        finally:
            ring.close()


@pytest.fixture(autouse=True)
def fresh_ring(ring, process_logs):
    """Each case: its processes' logs in its report when it fails, and a ring with nothing left from earlier cases."""
    process_logs(ring.log_files)
    ring.reset()
    yield ring


def _wan_routers(lab: netlab.Lab, host: str) -> list[str]:
    """Every router between a host and the core: its home router, and the carrier's when behind a CGNAT."""
    out, node = [], lab.hosts[host].router
    while node != "core":
        out.append(node)
        node = lab.routers[node].upstream
    return out


def check_case(ring: Ring, results: Results, reference: list[int], case: str) -> dict:
    nat1, nat2, hosts, expected = CASES[case]
    lab = ring.lab
    started = time.monotonic()
    ring.use(hosts, seed=True)
    routers = sorted({r for h in hosts for r in _wan_routers(lab, h)})
    with contextlib.ExitStack() as captures:  # stopped however the case ends
        # Capture from before the load: a fellow opens its outgoing hop as soon as the whole ring is loaded.
        wan = {r: captures.enter_context(lab.capture(r, "wan", snaplen=256)) for r in routers}
        # Established flows only: a direct attempt to an unroutable private address is a lone SYN.
        lan = captures.enter_context(lab.capture(
            hosts[0], "eth0", f"tcp port {SERVE_PORT} and tcp[tcpflags] & tcp-ack != 0", snaplen=96))
        view = ring.load()
        assert sorted(s["fellow"] for s in view["stages"]) == sorted(hosts)
        data = ring.chat()

    choice = data["choices"][0]
    assert choice["token_ids"] == reference, f"case {case}: {choice}"
    assert choice["finish_reason"] == ("stop" if reference[-1] == EOS else "length")

    # Which path carried the hidden states: a relay dial is an HTTP upgrade "GET /relay/<hop>?role=dial" through a
    # router's WAN (plaintext HTTP to the lab's leader; its payload is Noise ciphertext); a direct link is a TCP
    # flow to the next stage's serving port, which only a LAN can carry here.
    # (A link probe may dial the relay too, on a channel named "probe-...": it carries no hidden state, and is not
    # counted.)
    relay_dials = {r: len(re.findall(rb"/relay/(?!probe-)[^?\s]*\?role=dial", cap.payload())) for r, cap in wan.items()}
    direct_on_wan = {r: cap.count(f"tcp port {SERVE_PORT} and tcp[tcpflags] & tcp-ack != 0") for r, cap in wan.items()}
    lan_bytes = lan.wire_bytes()
    wan_bytes = {r: cap.wire_bytes() for r, cap in wan.items()}
    inferred = "relay" if sum(relay_dials.values()) else ("direct" if lan_bytes else "?")
    reported = ring.wait_transports()  # the fellows' own word (heartbeats every second)
    evidence = dict(relay_dials=relay_dials, direct_on_wan=direct_on_wan, lan_bytes=lan_bytes, wan_bytes=wan_bytes,
                    reported=reported, stages=[s["fellow"] for s in view["stages"]])
    print(f"case {case} ({nat1} x {nat2}): {inferred}; {evidence}")

    assert inferred == expected, evidence
    assert not any(direct_on_wan.values()), evidence  # no fellow-to-fellow TCP flow ever crossed a NAT
    assert set(reported) == {expected}, evidence  # the fellows' word agrees with the wire
    if expected == "direct":
        # Both hops' hidden states went over the LAN: tens of KB there, while the WAN carried only the leader's
        # traffic (request in, token batches out, heartbeats) and no relay.
        assert lan_bytes > 20_000, evidence
        assert relay_dials == dict.fromkeys(routers, 0), evidence
    else:
        # Both hops dialled the relay: one dial from each fellow, through its own router(s).
        for host in hosts:
            assert relay_dials[lab.hosts[host].router] >= 1, evidence
        # No hidden state crossed the LAN. A few bytes may: the previous case's direct link between two fellows of
        # this LAN closing (FIN and ACK, ~66 bytes each) after this case's capture began.
        assert lan_bytes < 1_000, evidence
    for router in routers:
        assert lab.inbound_openings(router) == [], router
        # Text never leaves the leader (fellows deal in token ids), and what they exchange is Noise ciphertext.
        assert not wan[router].contains(PROMPT), router
        assert not wan[router].contains(choice["message"]["content"][:16]), router
    results.record(nat1, nat2, f"{inferred} ({'/'.join(sorted(set(reported)))})")
    results.timings[case] = time.monotonic() - started
    return evidence


def test_a_two_fellows_on_one_lan_talk_directly(ring, results, reference):
    check_case(ring, results, reference, "a")


def test_b_two_ordinary_nats_go_over_the_relay_and_open_no_port(ring, results, reference):
    ring.seed_cache("a1")
    ring.forget_cache("b1")  # b1 downloads its stage for real, through its NAT and the WAN delay
    ring.use(("a1", "b1"), seed=False)
    check_case(ring, results, reference, "b")
    lab = ring.lab
    for host in ("a1", "b1"):
        # The fellow does listen on its serving port (its own LAN reaches it)...
        assert lab.tcp_reachable(host, lab.address(host), SERVE_PORT)
        # ...but neither the internet nor the other home can open it: not at the router's public address (nothing
        # forwarded), not at the private one (unroutable outside).
        for outsider in (netlab.LEADER, "core"):
            assert not lab.tcp_reachable(outsider, lab.public_address(host), SERVE_PORT, timeout=1.0), host
        other = "b1" if host == "a1" else "a1"
        assert not lab.tcp_reachable(other, lab.address(host), SERVE_PORT, timeout=1.0), host


def test_c_fully_random_nat(ring, results, reference):
    check_case(ring, results, reference, "c")


def test_d_udp_blocked(ring, results, reference):
    check_case(ring, results, reference, "d")


def test_e_carrier_grade_nat(ring, results, reference):
    check_case(ring, results, reference, "e")
    lab = ring.lab
    assert not lab.tcp_reachable(netlab.LEADER, lab.public_address("c1"), SERVE_PORT, timeout=1.0)
    assert lab.inbound_openings("cgn") == []


# With Direct links on: (NAT of the first fellow, NAT of the second, hosts, transport both hops must end on).
TUNNEL_CASES = {
    "f": ("masquerade", "masquerade", ("a1", "b1"), "tunnel"),
    "g": ("cgnat", "masquerade", ("c1", "b1"), "tunnel"),
    "h": ("fully-random", "masquerade", ("r1", "b1"), "relay"),
    "i": ("udp-blocked", "masquerade", ("u1", "b1"), "relay"),
    "j": ("masquerade, open router", "masquerade, open router", ("p1", "q1"), "tunnel"),
}
# How long a hop may take to move to the tunnel: the ring opens on the relay, the leader gathers candidates
# (rendezvous ~2 s) and names a start 0.5 s ahead; punch + QUIC + Noise take well under a second at 20-40 ms RTT.
UPGRADE_WAIT_S = 25.0
# A punch that cannot work gives up after 8 s (after the rendezvous, ~2 s); the leader then logs the hop's outcome.
FAIL_WAIT_S = 20.0
# The leader's line for each attempt: "hop <id> (stage 0 -> 1) of <model>: tunnel" or ": failed: <why>".
_OUTCOME = re.compile(r"hop \S+ \(stage \d+ -> \d+\) of " + re.escape(MODEL) + r": (\w+)")


def check_tunnel_case(ring: Ring, results: Results, reference: list[int], case: str) -> None:
    nat1, nat2, hosts, expected = TUNNEL_CASES[case]
    lab = ring.lab
    started = time.monotonic()
    ring.use(hosts, seed=True)
    ring.direct_links(True)  # after `use`: no earlier model is loaded for the leader to punch for
    routers = sorted({r for h in hosts for r in _wan_routers(lab, h)})
    with contextlib.ExitStack() as captures:
        wan = {r: captures.enter_context(lab.capture(r, "wan", snaplen=256)) for r in routers}
        log_offset = ring.log_size("leader")
        ring.load()
        if expected == "tunnel":
            reported = ring.wait_transports({"tunnel"}, UPGRADE_WAIT_S)
        else:
            # Both hops' punches end (the leader logs each attempt's outcome); they stayed on the relay.
            def outcomes():
                found = _OUTCOME.findall(ring.log_since("leader", log_offset))
                return found if len(found) >= 2 else None

            found = wait_for(outcomes, FAIL_WAIT_S, interval=0.2, message=lambda: ring.tail("leader"))
            assert "tunnel" not in found, found
            reported = ring.wait_transports()
        data = ring.chat()
    evidence = {"reported": reported, "udp": {r: c.count("udp") for r, c in wan.items()}}
    print(f"case {case} ({nat1} x {nat2}, direct links on): {evidence}")
    assert set(reported) == {expected}, evidence
    choice = data["choices"][0]
    assert choice["token_ids"] == reference, f"case {case}: {choice}"
    if expected == "tunnel":
        # The hidden states crossed both NATs over UDP, and no router opened a port for it.
        assert all(n > 20 for n in evidence["udp"].values()), evidence
    for router in routers:
        assert lab.inbound_openings(router) == [], router
        assert not wan[router].contains(PROMPT), router
        assert not wan[router].contains(choice["message"]["content"][:16]), router
    results.record(nat1, nat2 + " +DL", expected)
    results.timings[case] = time.monotonic() - started


def test_f_two_ordinary_nats_with_direct_links_punch_a_tunnel(ring, results, reference):
    check_tunnel_case(ring, results, reference, "f")


def test_g_carrier_grade_nat_with_direct_links_punches_a_tunnel(ring, results, reference):
    check_tunnel_case(ring, results, reference, "g")


def test_h_fully_random_nat_stays_on_the_relay(ring, results, reference):
    check_tunnel_case(ring, results, reference, "h")


def test_i_udp_blocked_stays_on_the_relay(ring, results, reference):
    check_tunnel_case(ring, results, reference, "i")


def test_j_routers_that_answer_strangers_still_punch_with_a_coordinated_low_ttl_start(ring, results, reference):
    check_tunnel_case(ring, results, reference, "j")


def test_k_a_hop_moves_from_relay_to_tunnel_in_the_middle_of_a_long_reply(ring, results, smollm_model_dir):
    """Direct links switched on while a long reply streams over the relay: the hop moves to the tunnel between two
    tokens and the reply is still exactly generate's."""
    from reference_model import load_reference_model
    from swarm.leader.chat.chat_format import encode_chat

    long_prompt, n = "Write a long story about a lighthouse keeper.", 160
    model = load_reference_model(smollm_model_dir, dtype=torch.float32)
    ids = encode_chat(smollm_model_dir, [{"role": "user", "content": long_prompt}], None)
    with torch.inference_mode():
        want = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
    want = want[: want.index(EOS) + 1] if EOS in want else want

    ring.use(("a1", "b1"), seed=True)
    ring.load()
    assert ring.wait_transports() == ["relay", "relay"]
    sent_before = ring.hops()[0]["bytes_sent"]
    # A second API proxy: the first one is busy with the long reply.
    proxy = ApiProxy(ring.lab, ring.log("proxy-2"))
    result = {}

    def long_reply():
        body = {"model": MODEL, "messages": [{"role": "user", "content": long_prompt}], "temperature": 0,
                "max_tokens": n, "return_token_ids": True}
        result["reply"] = ring.api("POST", "/v1/chat/completions", body, timeout=300)

    worker = threading.Thread(target=long_reply)
    started = time.monotonic()
    worker.start()
    try:
        # The reply is under way on the relay: its first hop has sent hidden states (a heartbeat tells).
        wait_for(lambda: ring.hops(proxy)[0]["bytes_sent"] > sent_before or not worker.is_alive(), 30,
                 interval=0.2, message="the long reply sent nothing")
        assert worker.is_alive(), "the reply ended before Direct links were switched on"
        assert proxy.call("PUT", "/api/v1/settings/direct-links", {"enabled": True}, ring.token) == (
            200, {"enabled": True})
        moved = wait_for(lambda: (ring.transports(proxy) == ["tunnel", "tunnel"] and "tunnel")
                         or (not worker.is_alive() and "reply over"), 300, interval=0.3)
        moved_at = time.monotonic() - started if moved == "tunnel" else None
        worker.join()
        finished_at = time.monotonic() - started
        status, data = result["reply"]
        assert status == 200, data
        assert data["choices"][0]["token_ids"] == want
        print(f"case k: relay -> tunnel {moved_at} s into a {finished_at:.1f} s reply of {len(want)} tokens")
        assert moved_at is not None and moved_at < finished_at, (moved_at, finished_at)
        assert ring.transports() == ["tunnel", "tunnel"]
        results.record("masquerade", "masquerade +DL mid-reply", "relay -> tunnel")
    finally:
        worker.join(timeout=300)
        proxy.close()
