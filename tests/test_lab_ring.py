"""The ring across home NATs, with real processes: a leader on the lab's internet, two `swarm join` fellows in home
networks behind the lab's NAT routers. Every case must give transformers' greedy reply token for token; which path
the hidden states took is read off the wire (tcpdump on the routers' WANs and the LAN) and, where the fellows
report it, from /api/v1/models/{id}/performance.

One lab and one leader serve every case; each case swaps in the fellows it needs. Needs root; skips otherwise.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import netlab

_reason = netlab.available()
if _reason:
    pytest.skip(_reason, allow_module_level=True)

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
PROMPT = "What is the capital of France?"
MAX_TOKENS = 24
LEADER_PORT = 8000
SERVE_PORT = 5559
DELAY_MS = 10.0
EOS = 2

# (case, NAT of the first fellow, NAT of the second, the two hosts, expected transport)
CASES = {
    "a": ("masquerade (same LAN)", "masquerade (same LAN)", ("a1", "a2"), "direct"),
    "b": ("masquerade", "masquerade", ("a1", "b1"), "relay"),
    "c": ("fully-random", "masquerade", ("r1", "b1"), "relay"),
    "d": ("udp-blocked", "masquerade", ("u1", "b1"), "relay"),
    "e": ("cgnat", "masquerade", ("c1", "b1"), "relay"),
}
GRID: dict[tuple[str, str], str] = {}
TIMINGS: dict[str, float] = {}

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
    from swarm.leader.chat_format import encode_chat
    from swarm.stage.reference import load_reference_model

    model = load_reference_model(smollm_model_dir, dtype=torch.float32)
    ids = encode_chat(smollm_model_dir, [{"role": "user", "content": PROMPT}], None)
    with torch.inference_mode():
        gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    want = gen[0, len(ids):].tolist()
    return want[: want.index(EOS) + 1] if EOS in want else want


class Ring:
    """The lab, the leader process and whichever fellow processes the current case needs."""

    def __init__(self, lab: netlab.Lab, root: Path, model_dir: Path):
        self.lab, self.root, self.model_dir = lab, root, model_dir
        self.leader_dir = root / "leader"
        self.fellows: dict[str, object] = {}  # host -> Popen
        self.leader_url = f"http://{lab.address('leader')}:{LEADER_PORT}"
        self.token = None
        self.join_token = None
        self.logs: list = []

    # --- the leader and its API -----------------------------------------------------------------------------------

    def start_leader(self) -> None:
        from harness import install_model

        install_model(self.leader_dir, self.model_dir)
        self.leader = self.lab.run("leader", [sys.executable, "-m", "swarm", "leader", "--host", "0.0.0.0", "--port",
                                              str(LEADER_PORT), "--data-dir", str(self.leader_dir)],
                                   stdout=self.log("leader"), stderr=subprocess.STDOUT)
        self.proxy = self.lab.run("leader", [sys.executable, "-c", _API_PROXY, f"http://127.0.0.1:{LEADER_PORT}"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.log("proxy"), text=True)
        assert self.proxy.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 120
        while self.api("GET", "/healthz", timeout=10)[0] != 200:
            assert self.leader.poll() is None, self.tail("leader")
            assert time.monotonic() < deadline, self.tail("leader")
            time.sleep(0.3)
        from swarm.demo import _credentials

        self.token, self.join_token, _ = _credentials(self.leader_dir)

    def api(self, method: str, path: str, body: dict | None = None, timeout: float = 180) -> tuple[int, object]:
        self.proxy.stdin.write(json.dumps({"method": method, "path": path, "json": body, "token": self.token}) + "\n")
        self.proxy.stdin.flush()
        with selectors.DefaultSelector() as sel:
            sel.register(self.proxy.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                raise TimeoutError(f"{method} {path}: no answer within {timeout} s")
        out = json.loads(self.proxy.stdout.readline())
        try:
            return out["status"], json.loads(out["text"])
        except ValueError:
            return out["status"], out["text"]

    def online(self) -> set[str]:
        status, body = self.api("GET", "/api/v1/fellows")
        assert status == 200, body
        return {f["name"] for f in body["fellows"] if f["state"] == "online"}

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

    def use(self, hosts: tuple[str, ...], seed: bool = True) -> None:
        """Exactly these hosts' fellows online (others stopped), with no model loaded."""
        status, view = self.api("GET", f"/api/v1/models/{MODEL}")
        if status == 200 and view.get("status") not in ("not_loaded", None):
            self.unload()
        for host in [h for h in self.fellows if h not in hosts]:
            self.lab.stop(self.fellows.pop(host))
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
        deadline = time.monotonic() + 120
        while self.online() != set(hosts):
            for host, proc in self.fellows.items():
                assert proc.poll() is None, f"fellow {host} exited:\n{self.tail(host)}"
            assert time.monotonic() < deadline, f"online: {self.online()}, wanted {hosts}\n" + self.tails()
            time.sleep(0.3)

    def load(self) -> dict:
        status, body = self.api("POST", f"/api/v1/models/{MODEL}/load", {"num_stages": 2})
        assert status == 202, body
        deadline = time.monotonic() + 180
        while True:
            status, view = self.api("GET", f"/api/v1/models/{MODEL}")
            if view["status"] == "ready":
                return view
            assert view["status"] not in ("failed", "not_loaded"), f"{view}\n{self.tails()}"
            assert time.monotonic() < deadline, f"{view}\n{self.tails()}"
            time.sleep(0.3)

    def unload(self) -> None:
        status, body = self.api("POST", f"/api/v1/models/{MODEL}/unload")
        assert status == 200, body

    def chat(self) -> dict:
        body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
                "max_tokens": MAX_TOKENS, "return_token_ids": True}
        status, data = self.api("POST", "/v1/chat/completions", body)
        assert status == 200, f"{data}\n{self.tails()}"
        return data

    def reported_transports(self, wait_s: float = 4.0) -> list[str | None]:
        """The transports the fellows report per hop (heartbeats every second); Nones where nothing is reported."""
        deadline = time.monotonic() + wait_s
        while True:
            status, perf = self.api("GET", f"/api/v1/models/{MODEL}/performance")
            hops = perf.get("hops", []) if status == 200 and isinstance(perf, dict) else []
            found = [h.get("transport") for h in hops]
            if (found and None not in found) or time.monotonic() > deadline:
                return found
            time.sleep(0.5)

    # --- logs -----------------------------------------------------------------------------------------------------

    def log(self, name: str):
        f = open(self.root / f"{name}.log", "ab")
        self.logs.append(f)
        return f

    def tail(self, name: str, lines: int = 25) -> str:
        try:
            text = (self.root / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""
        return f"--- {name}.log\n" + "\n".join(text.splitlines()[-lines:])

    def tails(self) -> str:
        return "\n".join(self.tail(n) for n in ["leader", *self.fellows])

    def close(self) -> None:
        for proc in self.fellows.values():
            self.lab.stop(proc, timeout=5)
        for name in ("proxy", "leader"):
            proc = getattr(self, name, None)
            if proc is not None:
                self.lab.stop(proc, timeout=5)
        for f in self.logs:
            f.close()


@pytest.fixture(scope="module")
def ring(tmp_path_factory, smollm_model_dir):
    started = time.monotonic()
    with netlab.lab(delay_ms=DELAY_MS) as lab:
        lab.add_public_host("leader")
        lab.add_router("nat-a", "masquerade")
        lab.add_host("a1", "nat-a")
        lab.add_host("a2", "nat-a")
        lab.add_router("nat-b", "masquerade")
        lab.add_host("b1", "nat-b")
        lab.add_router("nat-r", "masquerade fully-random")
        lab.add_host("r1", "nat-r")
        lab.add_router("nat-u", "udp-blocked")
        lab.add_host("u1", "nat-u")
        lab.add_router("cgn", "cgnat")
        lab.add_router("nat-c", "masquerade", upstream="cgn")
        lab.add_host("c1", "nat-c")
        # Routers that answer unsolicited packets to themselves (no input filter): the setting where an early punch
        # packet makes a Linux masquerade NAT change port, unless the first probes die before reaching it.
        lab.add_router("nat-p", "masquerade", input_filter=False)
        lab.add_host("p1", "nat-p")
        lab.add_router("nat-q", "masquerade", input_filter=False)
        lab.add_host("q1", "nat-q")
        ring = Ring(lab, tmp_path_factory.mktemp("labring"), smollm_model_dir)
        try:
            ring.start_leader()
            TIMINGS["lab + leader"] = time.monotonic() - started
            yield ring
        finally:
            ring.close()


def _wan_routers(lab: netlab.Lab, host: str) -> list[str]:
    """Every router between a host and the core: its home router, and the carrier's when behind a CGNAT."""
    out, node = [], lab.hosts[host].router
    while node != "core":
        out.append(node)
        node = lab.routers[node].upstream
    return out


def _run_case(ring: Ring, reference: list[int], case: str) -> dict:
    nat1, nat2, hosts, expected = CASES[case]
    lab = ring.lab
    started = time.monotonic()
    ring.use(hosts, seed=True)
    routers = sorted({r for h in hosts for r in _wan_routers(lab, h)})
    # Capture from before the load: a fellow opens its outgoing hop as soon as the whole ring is loaded.
    wan = {r: lab.capture(r, "wan", snaplen=256) for r in routers}
    # Established flows only: a direct attempt to an unroutable private address is a lone SYN.
    lan = lab.capture(hosts[0], "eth0", f"tcp port {SERVE_PORT} and tcp[tcpflags] & tcp-ack != 0", snaplen=96)
    view = ring.load()
    assert sorted(s["fellow"] for s in view["stages"]) == sorted(hosts)
    data = ring.chat()
    for cap in [*wan.values(), lan]:
        cap.stop()

    choice = data["choices"][0]
    assert choice["token_ids"] == reference, f"case {case}: {choice}"
    assert choice["finish_reason"] == ("stop" if reference[-1] == EOS else "length")

    # Which path carried the hidden states: a relay dial is an HTTP upgrade "GET /relay/<hop>?role=dial" through a
    # router's WAN (plaintext HTTP to the lab's leader; its payload is Noise ciphertext); a direct link is a TCP
    # flow to the next stage's serving port, which only a LAN can carry here.
    relay_dials = {r: cap.payload().count(b"role=dial") for r, cap in wan.items()}
    direct_on_wan = {r: cap.count(f"tcp port {SERVE_PORT} and tcp[tcpflags] & tcp-ack != 0") for r, cap in wan.items()}
    lan_bytes = lan.wire_bytes()
    wan_bytes = {r: cap.wire_bytes() for r, cap in wan.items()}
    inferred = "relay" if sum(relay_dials.values()) else ("direct" if lan_bytes else "?")
    reported = ring.reported_transports()
    evidence = dict(relay_dials=relay_dials, direct_on_wan=direct_on_wan, lan_bytes=lan_bytes, wan_bytes=wan_bytes,
                    reported=reported, stages=[s["fellow"] for s in view["stages"]])
    print(f"case {case} ({nat1} x {nat2}): {inferred}; {evidence}")

    assert inferred == expected, evidence
    assert not any(direct_on_wan.values()), evidence  # no fellow-to-fellow TCP flow ever crossed a NAT
    if any(reported):  # the fellows' own word, where they give it, agrees with the wire
        assert set(reported) == {expected}, evidence
    if expected == "direct":
        # Both hops' hidden states went over the LAN: tens of KB there, while the WAN carried only the leader's
        # traffic (request in, token batches out, heartbeats) and no relay.
        assert lan_bytes > 20_000, evidence
        assert relay_dials == {r: 0 for r in routers}, evidence
    else:
        # Both hops dialled the relay: one dial from each fellow, through its own router(s).
        for host in hosts:
            assert relay_dials[lab.hosts[host].router] >= 1, evidence
        assert lan_bytes == 0, evidence
    for router in routers:
        assert lab.inbound_openings(router) == [], router
        # Text never leaves the leader (fellows deal in token ids), and what they exchange is Noise ciphertext.
        assert not wan[router].contains(PROMPT), router
        assert not wan[router].contains(choice["message"]["content"][:16]), router
    GRID[(nat1, nat2)] = inferred if not any(reported) else f"{inferred} ({'/'.join(sorted(set(reported)))})"
    TIMINGS[case] = time.monotonic() - started
    return evidence


def test_a_two_fellows_on_one_lan_talk_directly(ring, reference):
    _run_case(ring, reference, "a")


def test_b_two_ordinary_nats_go_over_the_relay_and_open_no_port(ring, reference):
    ring.seed_cache("a1")
    ring.use(("a1", "b1"), seed=False)  # b1 downloads its stage for real, through its NAT and the WAN delay
    _run_case(ring, reference, "b")
    lab = ring.lab
    for host in ("a1", "b1"):
        # The fellow does listen on its serving port (its own LAN reaches it)...
        assert lab.tcp_reachable(host, lab.address(host), SERVE_PORT)
        # ...but neither the internet nor the other home can open it: not at the router's public address (nothing
        # forwarded), not at the private one (unroutable outside).
        for outsider in ("leader", "core"):
            assert not lab.tcp_reachable(outsider, lab.public_address(host), SERVE_PORT, timeout=1.0), host
        other = "b1" if host == "a1" else "a1"
        assert not lab.tcp_reachable(other, lab.address(host), SERVE_PORT, timeout=1.0), host


def test_c_fully_random_nat(ring, reference):
    _run_case(ring, reference, "c")


def test_d_udp_blocked(ring, reference):
    _run_case(ring, reference, "d")


def test_e_carrier_grade_nat(ring, reference):
    _run_case(ring, reference, "e")
    lab = ring.lab
    assert not lab.tcp_reachable("leader", lab.public_address("c1"), SERVE_PORT, timeout=1.0)
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
# A punch that cannot work gives up after 8 s; waiting past that shows the hop stays on the relay.
FAIL_WAIT_S = 14.0


def _direct_links(ring: Ring, enabled: bool) -> None:
    status, body = ring.api("PUT", "/api/v1/settings/direct-links", {"enabled": enabled})
    assert status == 200 and body == {"enabled": enabled}, body


def _run_tunnel_case(ring: Ring, reference: list[int], case: str) -> None:
    nat1, nat2, hosts, expected = TUNNEL_CASES[case]
    lab = ring.lab
    started = time.monotonic()
    _direct_links(ring, True)
    try:
        ring.use(hosts, seed=True)
        routers = sorted({r for h in hosts for r in _wan_routers(lab, h)})
        wan = {r: lab.capture(r, "wan", snaplen=256) for r in routers}
        ring.load()
        deadline = time.monotonic() + (UPGRADE_WAIT_S if expected == "tunnel" else FAIL_WAIT_S)
        reported = ring.reported_transports()
        while time.monotonic() < deadline and set(reported) != {"tunnel"}:
            time.sleep(1.0)
            reported = ring.reported_transports()
        data = ring.chat()
        for cap in wan.values():
            cap.stop()
        evidence = {"reported": reported, "udp": {r: c.count("udp") for r, c in wan.items()}}
        print(f"case {case} ({nat1} x {nat2}, direct links on): {evidence}")
        assert set(reported) == {expected}, f"{evidence}\n{ring.tails()}"
        choice = data["choices"][0]
        assert choice["token_ids"] == reference, f"case {case}: {choice}"
        if expected == "tunnel":
            # The hidden states crossed both NATs over UDP, and no router opened a port for it.
            assert all(n > 20 for n in evidence["udp"].values()), evidence
        for router in routers:
            assert lab.inbound_openings(router) == [], router
            assert not wan[router].contains(PROMPT), router
            assert not wan[router].contains(choice["message"]["content"][:16]), router
        GRID[(nat1, nat2 + " +DL")] = expected
        TIMINGS[case] = time.monotonic() - started
    finally:
        _direct_links(ring, False)


def test_f_two_ordinary_nats_with_direct_links_punch_a_tunnel(ring, reference):
    _run_tunnel_case(ring, reference, "f")


def test_g_carrier_grade_nat_with_direct_links_punches_a_tunnel(ring, reference):
    _run_tunnel_case(ring, reference, "g")


def test_h_fully_random_nat_stays_on_the_relay(ring, reference):
    _run_tunnel_case(ring, reference, "h")


def test_i_udp_blocked_stays_on_the_relay(ring, reference):
    _run_tunnel_case(ring, reference, "i")


def test_j_routers_that_answer_strangers_still_punch_with_a_coordinated_low_ttl_start(ring, reference):
    _run_tunnel_case(ring, reference, "j")


def test_k_a_hop_moves_from_relay_to_tunnel_in_the_middle_of_a_long_reply(ring, smollm_model_dir):
    """Direct links switched on while a long reply streams over the relay: the hop moves to the tunnel between two
    tokens and the reply is still exactly generate's."""
    import threading

    from swarm.leader.chat_format import encode_chat
    from swarm.stage.reference import load_reference_model

    long_prompt, n = "Write a long story about a lighthouse keeper.", 160
    model = load_reference_model(smollm_model_dir, dtype=torch.float32)
    ids = encode_chat(smollm_model_dir, [{"role": "user", "content": long_prompt}], None)
    with torch.inference_mode():
        want = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
    want = want[: want.index(EOS) + 1] if EOS in want else want

    _direct_links(ring, False)
    ring.use(("a1", "b1"), seed=True)
    ring.load()
    assert ring.reported_transports() == ["relay", "relay"]
    # A second API proxy: the first one is busy with the long reply.
    proxy = ring.lab.run("leader", [sys.executable, "-c", _API_PROXY, f"http://127.0.0.1:{LEADER_PORT}"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proxy.stdout.readline().strip() == "ready"
    result = {}

    def long_reply():
        body = {"model": MODEL, "messages": [{"role": "user", "content": long_prompt}], "temperature": 0,
                "max_tokens": n, "return_token_ids": True}
        result["reply"] = ring.api("POST", "/v1/chat/completions", body, timeout=300)

    worker = threading.Thread(target=long_reply)
    started = time.monotonic()
    worker.start()
    try:
        time.sleep(1.0)
        proxy.stdin.write(json.dumps({"method": "PUT", "path": "/api/v1/settings/direct-links",
                                      "json": {"enabled": True}, "token": ring.token}) + "\n")
        proxy.stdin.flush()
        assert json.loads(json.loads(proxy.stdout.readline())["text"]) == {"enabled": True}
        moved_at = None
        while worker.is_alive():
            proxy.stdin.write(json.dumps({"method": "GET", "path": f"/api/v1/models/{MODEL}/performance",
                                          "token": ring.token}) + "\n")
            proxy.stdin.flush()
            perf = json.loads(json.loads(proxy.stdout.readline())["text"])
            if moved_at is None and [h["transport"] for h in perf["hops"]] == ["tunnel", "tunnel"]:
                moved_at = time.monotonic() - started
            time.sleep(0.3)
        worker.join()
        finished_at = time.monotonic() - started
        status, data = result["reply"]
        assert status == 200, data
        assert data["choices"][0]["token_ids"] == want
        print(f"case k: relay -> tunnel {moved_at} s into a {finished_at:.1f} s reply of {len(want)} tokens")
        assert moved_at is not None and moved_at < finished_at, (moved_at, finished_at)
        assert ring.reported_transports() == ["tunnel", "tunnel"]
        GRID[("masquerade", "masquerade +DL mid-reply")] = "relay -> tunnel"
    finally:
        worker.join(timeout=300)
        proxy.stdin.close()
        ring.lab.stop(proxy)
        _direct_links(ring, False)


def test_z_grid(ring):
    """Print the NAT grid of the cases that ran (run with -s or -rA to see it)."""
    print()
    print(ring.lab.describe())
    netlab.print_grid(GRID)
    print("timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in TIMINGS.items()))
    # Every cell that ran holds a transport the mesh knows; the expected one per case was asserted by that case.
    assert GRID and all(v.split(" ")[0] in ("direct", "tunnel", "relay") for v in GRID.values()), GRID
