"""A network lab for the mesh tests: a routed "internet" and home networks behind NAT routers, built from Linux
network namespaces, veth pairs, bridges, nftables and tc netem. Needs root; touches nothing outside the
namespaces it creates.

Topology (every box is a namespace; names are ``swlab-<pid>-<rand>-<role>``)::

    public hosts (leader, servers)           home routers (nft masquerade)        LAN hosts (fellows)
    198.51.100.10+/24 ── bridge "dc" ── core ── 203.0.113.8j+2/29 "wan" ── router ── br0 192.168.N.0/24 ── host
                           198.51.100.1     │                                  (netem on each WAN link)
                                            └── cgnat router (wan 203.0.113.x) ── 100.64.k.0/24 ── home router ── host

With ``depth=N`` the internet is a chain of N routers ("core", "core2", ... joined by 192.0.2.x/30 links with the
lab's delay each way); a home (or carrier) hangs off any of them (``attach``), so N routers lie between a home on
the core and one on the far end. A public host may sit on a delayed link of its own (a leader far from the homes).

The core routes between its links and knows no private prefix (192.168/16, 10/8, 100.64/10 are unroutable there,
as on the real internet). Routers masquerade what leaves their "wan" interface and forward nothing new inbound:
only established/related return traffic. NAT kinds:

- ``masquerade``               ordinary Linux home NAT (keeps the source port when it can; one local socket keeps
                               its mapping towards every destination: endpoint-independent in practice)
- ``masquerade fully-random``  a fresh random source port per connection/destination
- ``udp-blocked``              masquerade, but every forwarded UDP packet towards the WAN is dropped
- ``cgnat``                    a carrier-grade NAT: its downstream links (100.64.k.0/24) lead to home routers

The lab's tests and ``bench/lab_transports.py`` share one world: ``HOMES`` (a home per NAT kind, the carrier-grade
NAT, routers that answer strangers) and public hosts such as the leader, built by ``world()`` / ``build()``::

    with netlab.world(public=["leader"], homes=["nat-a", "nat-b"]) as lab:
        lab.check("a1", ["ping", "-c1", lab.address("leader")])

Piece by piece::

    with Lab(delay_ms=10) as lab:
        lab.add_public_host("leader")
        lab.add_router("home-a", nat="masquerade")
        lab.add_host("a1", "home-a")
        out = lab.check("a1", ["ping", "-c1", lab.address("leader")])

WAN delay: ``tc netem`` on both ends of each router's WAN veth. On a kernel built without netem (CONFIG_NET_SCH_NETEM
unset, as on the VM this was written on) each delayed WAN link is instead a pair of TUN devices joined by a small
delay-line process (``python tests/netlab.py delayline ...``, ~70 MB/s): same addresses, same interface names, same
delay each way. ``Lab.delay_backend`` says which one is in use.

Leftovers: ``python tests/netlab.py cleanup [--all]`` (or ``cleanup_stale()``) deletes namespaces of runs whose
process is gone. The core of this module has no pytest dependency.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

PREFIX = "swlab-"
NAT_KINDS = ("masquerade", "masquerade fully-random", "udp-blocked", "cgnat")
DC_NET = ipaddress.ip_network("198.51.100.0/24")  # TEST-NET-2: the segment of public hosts (leader, servers)
WAN_NET = ipaddress.ip_network("203.0.113.0/24")  # TEST-NET-3: carved into /29 links core <-> router
CGN_NET = ipaddress.ip_network("100.64.0.0/10")  # RFC 6598 shared address space behind a CGNAT
CHAIN_NET = ipaddress.ip_network("192.0.2.0/24")  # TEST-NET-1: /30 links between the internet's routers (depth > 1)
NFT_TABLE = "swlab"


class NetlabError(RuntimeError):
    """A lab command failed; the message carries the command and its stderr."""


@dataclasses.dataclass
class Host:
    name: str
    ns: str
    address: str
    router: str | None  # the router on its LAN, or None for a public host on the core's "dc" segment
    kind: str  # "public" or "lan"
    port: str  # its link's name on the far side: a port of the router's br0 ("p0"...), or of the core's "dc"


@dataclasses.dataclass
class Router:
    name: str
    ns: str
    nat: str
    wan_address: str  # the router's own WAN address (public, or 100.64.x.x behind a CGNAT)
    upstream: str  # "core" or the name of the cgnat router it hangs off
    lan_network: str | None  # "192.168.N.0/24" for a home router; None for a cgnat router
    lan_address: str | None
    delay_ms: float
    hosts: list[str] = dataclasses.field(default_factory=list)
    downstream: list[str] = dataclasses.field(default_factory=list)  # home routers behind a cgnat router


def _sh(argv: Sequence[str], *, check: bool = True, timeout: float = 30, input: str | None = None) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, input=input)
    if check and proc.returncode != 0:
        raise NetlabError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): {proc.stderr.strip() or proc.stdout}")
    return proc.stdout


def available() -> str | None:
    """None when this machine can build a lab, else the reason it cannot (for pytest.skip)."""
    if os.geteuid() != 0:
        return "the network lab needs root (ip netns, nftables)"
    for tool in ("ip", "nft", "tc"):
        if shutil.which(tool) is None:
            return f"the network lab needs `{tool}` (apt-get install -y iproute2 nftables)"
    probe = f"{PREFIX}{os.getpid()}-{secrets.token_hex(2)}-probe"
    proc = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"`ip netns add` fails here: {proc.stderr.strip()}"
    try:
        nft = subprocess.run(["ip", "netns", "exec", probe, "nft", "add", "table", "inet", "probe"],
                             capture_output=True, text=True)
        if nft.returncode != 0:
            return f"nftables does not work inside a namespace here: {nft.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _lab_namespaces(prefix: str = PREFIX) -> list[str]:
    out = _sh(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_namespace(ns: str) -> None:
    # Whatever still runs inside one of our namespaces was started by a lab: end it by pid, then drop the namespace
    # (its veths go with it; a veth's peer in another namespace disappears too).
    for _ in range(3):
        pids = [int(p) for p in _sh(["ip", "netns", "pids", ns], check=False).split() if p.isdigit()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    _sh(["ip", "netns", "del", ns], check=False)


def cleanup_stale(prefix: str = PREFIX, everything: bool = False) -> list[str]:
    """Delete lab namespaces left by earlier runs: those whose creating process (the pid in the name) is gone, or
    every namespace with the prefix when ``everything``. Returns the names deleted."""
    removed = []
    for ns in _lab_namespaces(prefix):
        m = re.match(re.escape(prefix) + r"(\d+)-", ns)
        if not everything and m and _pid_alive(int(m.group(1))) and int(m.group(1)) != 0:
            continue
        _delete_namespace(ns)
        removed.append(ns)
    return removed


class Capture:
    """A tcpdump running in one namespace on one interface, writing a pcap file. Use as a context manager or call
    ``stop()``; then read it with ``packets()``, ``count()``, ``payload()``, ``contains()``."""

    def __init__(self, lab: Lab, node: str, iface: str, bpf: str = "", path: Path | None = None, snaplen: int = 0):
        if shutil.which("tcpdump") is None:
            raise NetlabError("packet capture needs tcpdump (apt-get install -y tcpdump)")
        self.lab, self.node, self.iface, self.bpf = lab, node, iface, bpf
        self.path = path or lab.workdir / f"{node}-{iface}-{secrets.token_hex(2)}.pcap"
        argv = ["tcpdump", "-i", iface, "--immediate-mode", "-U", "-s", str(snaplen), "-nn", "-Z", "root",
                "-w", str(self.path)]
        if bpf:
            argv += bpf.split()
        self.proc = lab.run(node, argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        # Wait for "listening on ..." so that nothing sent after this returns is missed.
        line = self.proc.stderr.readline()
        if "listening on" not in line:
            self.proc.kill()
            raise NetlabError(f"tcpdump on {node}/{iface} did not start: {line}{self.proc.stderr.read()}")

    def stop(self) -> Capture:
        if self.proc.poll() is None:
            self._drained()
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self

    def _drained(self, quiet_s: float = 0.05, timeout: float = 2.0) -> None:
        """Wait (at most ``timeout``) until tcpdump has written what the kernel handed it: the file (packet-buffered,
        -U) stops growing for ``quiet_s``. A stop right after the last packet was sent then still has it."""
        deadline = time.monotonic() + timeout
        size = -1
        while time.monotonic() < deadline:
            now = self.path.stat().st_size if self.path.exists() else 0
            if now == size:
                return
            size = now
            time.sleep(quiet_s)

    def seen(self, bpf: str = "") -> int:
        """How many packets (optionally matching ``bpf`` too) are in the capture so far, without stopping it."""
        out = _sh(["tcpdump", "-r", str(self.path), "-nn", *bpf.split()], check=False)
        return sum(1 for line in out.splitlines() if line.strip())

    def __enter__(self) -> Capture:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def packets(self, bpf: str = "") -> list[str]:
        """tcpdump's one-line summaries of the captured packets (optionally filtered again)."""
        self.stop()
        out = _sh(["tcpdump", "-r", str(self.path), "-nn", *bpf.split()], check=False)
        return [line for line in out.splitlines() if line.strip()]

    def count(self, bpf: str = "") -> int:
        return len(self.packets(bpf))

    def wire_bytes(self) -> int:
        """Bytes on the wire over all captured packets (original lengths, not the snapped ones)."""
        return sum(length for length, _ in self._records())

    def _records(self) -> list[tuple[int, bytes]]:
        self.stop()
        data = self.path.read_bytes()
        if len(data) < 24:
            return []
        magic = data[:4]
        endian = "<" if magic in (b"\xd4\xc3\xb2\xa1", b"\x4d\x3c\xb2\xa1") else ">"
        out, pos = [], 24
        while pos + 16 <= len(data):
            _, _, incl, orig = struct.unpack(endian + "IIII", data[pos:pos + 16])
            out.append((orig, data[pos + 16:pos + 16 + incl]))
            pos += 16 + incl
        return out

    def frames(self) -> list[bytes]:
        """The raw captured frames (pcap parsed here: no scapy needed)."""
        return [frame for _, frame in self._records()]

    def payload(self) -> bytes:
        """Every captured frame concatenated: for "is this plaintext anywhere on the wire" checks."""
        return b"".join(self.frames())

    def contains(self, needle: bytes | str) -> bool:
        if isinstance(needle, str):
            needle = needle.encode()
        return needle in self.payload()


class Lab:
    """One lab: a core router namespace plus whatever is added. Delete everything with ``close()`` (or use it as a
    context manager); ``close()`` also ends every process started with ``run``."""

    def __init__(self, delay_ms: float = 10.0, prefix: str = PREFIX, workdir: Path | None = None,
                 delay_backend: str | None = None, depth: int = 1):
        self.delay_ms = delay_ms
        if not 1 <= depth <= 8:
            raise ValueError("the internet's depth is 1 to 8 routers")
        self.depth = depth
        self.prefix = prefix
        self.tag = f"{prefix}{os.getpid()}-{secrets.token_hex(2)}"
        self.namespaces: list[str] = []
        self.hosts: dict[str, Host] = {}
        self.routers: dict[str, Router] = {}
        self.procs: list[subprocess.Popen] = []
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix=self.tag + "-"))
        self._wan_links = 0
        self._lan_nets = 0
        self._closed = False
        atexit.register(self.close)
        try:
            self.core = self._add_ns("core")
            self._ip(self.core, "link", "add", "dc", "type", "bridge")
            self._ip(self.core, "addr", "add", f"{DC_NET[1]}/{DC_NET.prefixlen}", "dev", "dc")
            self._ip(self.core, "link", "set", "dc", "up")
            self._sysctl(self.core, "net.ipv4.ip_forward=1")
            self._no_bridge_netfilter(self.core)
            # netem where the kernel has it; else a userspace delay line over TUN devices (same delay each way).
            self.delay_backend = delay_backend or ("netem" if self._netem_works() else "tun")
            if self.delay_backend not in ("netem", "tun"):
                raise ValueError("delay_backend must be 'netem' or 'tun'")
            # The internet: "core", then "core2", "core3"... in a chain, delay_ms each way on every link between them.
            self.chain = [self.core]
            for k in range(2, depth + 1):
                ns = self._add_ns(f"core{k}")
                self._sysctl(ns, "net.ipv4.ip_forward=1")
                link = ipaddress.ip_network(f"{CHAIN_NET[4 * (k - 2)]}/30")
                self._wan_link(self.chain[-1], f"c{k}", ns, f"c{k}", delay_ms)
                self._ip(self.chain[-1], "addr", "add", f"{link[1]}/30", "dev", f"c{k}")
                self._ip(ns, "addr", "add", f"{link[2]}/30", "dev", f"c{k}")
                self._ip(ns, "route", "add", "default", "via", str(link[1]))
                self.chain.append(ns)
        except BaseException:
            self.close()
            raise

    # --- building -------------------------------------------------------------------------------------------------

    def _add_ns(self, role: str) -> str:
        ns = f"{self.tag}-{role}"
        _sh(["ip", "netns", "add", ns])
        self.namespaces.append(ns)
        self._ip(ns, "link", "set", "lo", "up")
        return ns

    @staticmethod
    def _ip(ns: str, *args: str) -> str:
        return _sh(["ip", "-n", ns, *args])

    @staticmethod
    def _sysctl(ns: str, setting: str, check: bool = True) -> None:
        _sh(["ip", "netns", "exec", ns, "sysctl", "-qw", setting], check=check)

    def _no_bridge_netfilter(self, ns: str) -> None:
        # br_netfilter (loaded on many hosts for containers) would push bridged LAN frames through the inet hooks;
        # a home switch does not do that. These sysctls are per namespace on kernels >= 5.3.
        for key in ("bridge-nf-call-iptables", "bridge-nf-call-ip6tables", "bridge-nf-call-arptables"):
            if Path(f"/proc/sys/net/bridge/{key}").exists():
                self._sysctl(ns, f"net.bridge.{key}=0", check=False)

    def _netem(self, ns: str, dev: str, delay_ms: float) -> None:
        if delay_ms and delay_ms > 0:
            _sh(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "netem", "delay",
                 f"{delay_ms}ms", "limit", "100000"])

    def _netem_works(self) -> bool:
        ok = subprocess.run(["ip", "netns", "exec", self.core, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                             "delay", "1ms"], capture_output=True).returncode == 0
        if ok:
            _sh(["ip", "netns", "exec", self.core, "tc", "qdisc", "del", "dev", "lo", "root"], check=False)
        return ok

    def _wan_link(self, up_ns: str, up_dev: str, ns: str, dev: str, delay_ms: float) -> None:
        """A point-to-point link with ``delay_ms`` each way: a veth with netem on both ends, or, on a kernel built
        without netem, a pair of TUN devices joined by a delay-line process (see ``_delay_line``)."""
        if delay_ms and delay_ms > 0 and self.delay_backend == "tun":
            proc = self.run(ns, [sys.executable, str(Path(__file__).resolve()), "delayline", dev, up_ns, up_dev,
                                 str(delay_ms)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
            line = proc.stdout.readline()
            if line.strip() != "ready":
                proc.kill()
                raise NetlabError(f"the delay line {ns}/{dev} <-> {up_ns}/{up_dev} did not start: "
                                  f"{line}{proc.stderr.read()}")
            self._ip(ns, "link", "set", dev, "up")
            self._ip(up_ns, "link", "set", up_dev, "up")
            return
        self._veth(up_ns, up_dev, ns, dev)
        self._netem(ns, dev, delay_ms)
        self._netem(up_ns, up_dev, delay_ms)

    def _veth(self, ns_a: str, name_a: str, ns_b: str, name_b: str) -> None:
        # Created inside ns_a with its peer put straight into ns_b: no name ever lives in the root namespace.
        self._ip(ns_a, "link", "add", name_a, "type", "veth", "peer", "name", name_b, "netns", ns_b)
        self._ip(ns_a, "link", "set", name_a, "up")
        self._ip(ns_b, "link", "set", name_b, "up")

    def _internet_link(self, attach: int) -> tuple[ipaddress.IPv4Network, str, str]:
        """A new /29 of WAN_NET on the ``attach``-th router of the internet's chain (1: "core"), routed there from
        the routers before it: (link, that router's namespace, its device name)."""
        if not 1 <= attach <= self.depth:
            raise ValueError(f"attach must be 1..{self.depth} (the internet's routers)")
        j = self._wan_links
        self._wan_links += 1
        if j >= 31:
            raise NetlabError("the lab's WAN range holds 31 links at most")
        link = ipaddress.ip_network(f"{WAN_NET[8 * j]}/29")
        for m in range(1, attach):  # "core" .. the router before: towards the next router of the chain
            nxt = ipaddress.ip_network(f"{CHAIN_NET[4 * (m - 1)]}/30")[2]
            self._ip(self.chain[m - 1], "route", "add", str(link), "via", str(nxt))
        return link, self.chain[attach - 1], f"w{j}"

    def add_public_host(self, name: str, address: str | None = None, delay_ms: float = 0.0,
                        attach: int | None = None) -> Host:
        """A host with a public address on the core's "dc" segment (the leader, test servers); or, with
        ``attach`` (the chain router it hangs off, 1 = "core") or a delay on a kernel without netem, on a link of
        its own with ``delay_ms`` each way (a leader far from the homes)."""
        self._check_name(name)
        if attach is not None or (delay_ms and self.delay_backend == "tun"):
            ns = self._add_ns(name)
            link, up_ns, up_dev = self._internet_link(attach or 1)
            self._wan_link(up_ns, up_dev, ns, "eth0", delay_ms)
            self._ip(up_ns, "addr", "add", f"{link[1]}/{link.prefixlen}", "dev", up_dev)
            self._ip(ns, "addr", "add", f"{link[2]}/{link.prefixlen}", "dev", "eth0")
            self._ip(ns, "route", "add", "default", "via", str(link[1]))
            host = Host(name, ns, str(link[2]), None, "public", up_dev)
            self.hosts[name] = host
            return host
        ns = self._add_ns(name)
        idx = sum(1 for h in self.hosts.values() if h.kind == "public")
        address = address or str(DC_NET[10 + idx])
        port = f"h{idx}"
        self._veth(self.core, port, ns, "eth0")
        self._ip(self.core, "link", "set", port, "master", "dc")
        self._ip(ns, "addr", "add", f"{address}/{DC_NET.prefixlen}", "dev", "eth0")
        self._ip(ns, "route", "add", "default", "via", str(DC_NET[1]))
        self._netem(ns, "eth0", delay_ms)
        self._netem(self.core, port, delay_ms)
        host = Host(name, ns, address, None, "public", port)
        self.hosts[name] = host
        return host

    def add_router(self, name: str, nat: str = "masquerade", upstream: str | None = None,
                   lan_network: str | None = None, delay_ms: float | None = None,
                   input_filter: bool = True, attach: int = 1) -> Router:
        """A NAT router whose WAN hangs off the core (the ``attach``-th router of the internet's chain; or off the
        cgnat router named by ``upstream``).

        ``nat`` is one of NAT_KINDS. A home router gets a LAN bridge ``br0`` with ``lan_network`` (default
        192.168.N.0/24, N counting up; pass the same network twice to model two homes with overlapping LANs).
        ``delay_ms`` is the netem delay each way on its WAN link (default: the lab's).

        ``input_filter`` (default on) drops new traffic from the WAN to the router itself. Off, an unsolicited packet
        to the router's public address is conntracked and confirmed (the kernel answers it with ICMP), and a later
        outbound flow from a LAN host to that same peer address:port then clashes with it and gets a NEW source port
        (seen here: 40000 -> 28677): the "first inbound punch packet changes the far NAT's port" case.
        """
        self._check_name(name)
        if nat not in NAT_KINDS:
            raise ValueError(f"nat must be one of {NAT_KINDS}, not {nat!r}")
        delay = self.delay_ms if delay_ms is None else delay_ms
        ns = self._add_ns(name)
        self._sysctl(ns, "net.ipv4.ip_forward=1")
        self._no_bridge_netfilter(ns)

        if upstream is None:
            link, up_ns, up_dev = self._internet_link(attach)
            core_side, wan_address = str(link[1]), str(link[2])
            upstream_name = "core"
        else:
            parent = self.routers.get(upstream)
            if parent is None or parent.nat != "cgnat":
                raise ValueError(f"upstream {upstream!r} is not a cgnat router of this lab")
            k = len(parent.downstream)
            link = ipaddress.ip_network(f"{CGN_NET[0] + 256 * k}/24")
            core_side, wan_address = str(link[1]), str(link[2])
            up_ns, up_dev = parent.ns, f"d{k}"
            upstream_name = upstream
            parent.downstream.append(name)
        self._wan_link(up_ns, up_dev, ns, "wan", delay)
        self._ip(up_ns, "addr", "add", f"{core_side}/{link.prefixlen}", "dev", up_dev)
        self._ip(ns, "addr", "add", f"{wan_address}/{link.prefixlen}", "dev", "wan")
        self._ip(ns, "route", "add", "default", "via", core_side)

        lan_address = None
        if nat != "cgnat":
            if lan_network is None:
                self._lan_nets += 1
                lan_network = f"192.168.{self._lan_nets}.0/24"
            net = ipaddress.ip_network(lan_network)
            lan_address = str(net[1])
            self._ip(ns, "link", "add", "br0", "type", "bridge")
            self._ip(ns, "addr", "add", f"{lan_address}/{net.prefixlen}", "dev", "br0")
            self._ip(ns, "link", "set", "br0", "up")
        self._nft(ns, self._ruleset(nat, input_filter))
        router = Router(name, ns, nat, wan_address, upstream_name, lan_network, lan_address, delay)
        self.routers[name] = router
        return router

    def add_host(self, name: str, router: str, address: str | None = None) -> Host:
        """A host on a home router's LAN (default address: .10, .11, ... of the LAN)."""
        self._check_name(name)
        r = self.routers[router]
        if r.lan_network is None:
            raise ValueError(f"{router} is a cgnat router: put a home router behind it and hosts behind that")
        net = ipaddress.ip_network(r.lan_network)
        idx = len(r.hosts)
        address = address or str(net[10 + idx])
        ns = self._add_ns(name)
        port = f"p{idx}"
        self._veth(r.ns, port, ns, "eth0")
        self._ip(r.ns, "link", "set", port, "master", "br0")
        self._ip(ns, "addr", "add", f"{address}/{net.prefixlen}", "dev", "eth0")
        self._ip(ns, "route", "add", "default", "via", r.lan_address)
        r.hosts.append(name)
        host = Host(name, ns, address, router, "lan", port)
        self.hosts[name] = host
        return host

    def _check_name(self, name: str) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9-]{0,15}", name) or name == "core":
            raise ValueError(f"bad lab node name {name!r}: lower-case letters, digits and '-', at most 16")
        if name in self.hosts or name in self.routers:
            raise ValueError(f"{name!r} is already in this lab")

    @staticmethod
    def _ruleset(nat: str, input_filter: bool = True) -> str:
        fully_random = " fully-random" if nat == "masquerade fully-random" else ""
        wan_input = ('        iifname "wan" counter name "local_wan_dropped" drop\n' if input_filter else "")
        udp = ('        oifname "wan" meta l4proto udp counter name "udp_dropped" drop\n'
               if nat == "udp-blocked" else "")
        return f"""
table inet {NFT_TABLE} {{
    counter wan_out {{}}
    counter wan_in {{}}
    counter inbound_new_dropped {{}}
    counter local_wan_dropped {{}}
    counter udp_dropped {{}}
    counter masqueraded {{}}
    chain input {{
        type filter hook input priority filter; policy accept;
        iifname "wan" ct state established,related accept
        iifname "wan" meta l4proto icmp accept
{wan_input}    }}
    chain forward {{
        type filter hook forward priority filter; policy accept;
        iifname "wan" ct state established,related counter name "wan_in" accept
        iifname "wan" counter name "inbound_new_dropped" drop
{udp}        oifname "wan" counter name "wan_out" accept
    }}
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        oifname "wan" counter name "masqueraded" masquerade{fully_random}
    }}
}}
"""

    @staticmethod
    def _nft(ns: str, ruleset: str) -> None:
        _sh(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=ruleset)

    # --- using ----------------------------------------------------------------------------------------------------

    def ns(self, node: str) -> str:
        """The namespace of a host, a router, or "core"."""
        if node == "core":
            return self.core
        if re.fullmatch(r"core\d", node) and 2 <= int(node[4:]) <= self.depth:
            return self.chain[int(node[4:]) - 1]
        if node in self.hosts:
            return self.hosts[node].ns
        if node in self.routers:
            return self.routers[node].ns
        if node in self.namespaces:
            return node
        raise KeyError(f"no lab node {node!r}; hosts: {sorted(self.hosts)}, routers: {sorted(self.routers)}")

    def address(self, node: str) -> str:
        """A host's own address (private for a LAN host); a router's WAN address."""
        if node in self.hosts:
            return self.hosts[node].address
        if node in self.routers:
            return self.routers[node].wan_address
        if node == "core":
            return str(DC_NET[1])
        raise KeyError(node)

    def public_address(self, node: str) -> str:
        """The address the internet sees for traffic from this node (through every NAT on its way out)."""
        if node in self.hosts:
            h = self.hosts[node]
            return h.address if h.router is None else self.public_address(h.router)
        r = self.routers[node]
        return r.wan_address if r.upstream == "core" else self.public_address(r.upstream)

    def run(self, node: str, argv: Sequence[str], **popen_kwargs) -> subprocess.Popen:
        """Start ``argv`` inside the node's namespace with this process's environment; ended by ``close()``."""
        popen_kwargs.setdefault("env", dict(os.environ))
        popen_kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(node), *map(str, argv)], **popen_kwargs)
        self.procs.append(proc)
        return proc

    def check(self, node: str, argv: Sequence[str], timeout: float = 30, input: str | None = None) -> str:
        """Run ``argv`` in the node's namespace to completion; its stdout, or NetlabError with its stderr."""
        return _sh(["ip", "netns", "exec", self.ns(node), *map(str, argv)], timeout=timeout, input=input)

    def python(self, node: str, code: str, *args: str, timeout: float = 30) -> str:
        """Run a Python snippet with this interpreter inside the node's namespace; its stdout."""
        return self.check(node, [sys.executable, "-c", code, *args], timeout=timeout)

    def tcp_reachable(self, node: str, address: str, port: int, timeout: float = 1.5) -> bool:
        """Can ``node`` open a TCP connection to address:port? (refused, unreachable and silence all say no)"""
        code = ("import socket,sys\n"
                "try:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))\n"
                "except OSError: print('no')\nelse: print('yes')")
        return self.python(node, code, address, str(port), str(timeout), timeout=timeout + 20).strip() == "yes"

    def reflector(self, node: str, port: int, proto: str = "udp") -> subprocess.Popen:
        """Start a server in ``node`` that answers every UDP datagram (or TCP connection) on ``port`` with the
        sender's address as it sees it, "ip:port". Returns once it is listening; ``close()`` ends it."""
        proc = self.run(node, [sys.executable, "-c", _REFLECTOR, proto, str(port)], stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = proc.stdout.readline()
        if line.strip() != "ready":
            proc.kill()
            raise NetlabError(f"the {proto} reflector on {node}:{port} did not start: {line}{proc.stderr.read()}")
        return proc

    def probe(self, node: str, targets: Sequence[tuple[str, int]], proto: str = "udp", local_port: int = 0,
              timeout: float = 1.0) -> tuple[int, list[str | None]]:
        """From ONE local socket in ``node`` (bound to ``local_port``; 0 = any), ask each reflector target how it
        sees us. Returns (local port, ["ip:port" as seen by each target, or None when nothing came back]).
        UDP tries three times per target; TCP uses a socket per target, all bound to the same local port."""
        argv = [proto, str(local_port), str(timeout), *[f"{a}:{p}" for a, p in targets]]
        out = self.python(node, _PROBE, *argv, timeout=30 + 4 * timeout * len(targets))
        data = json.loads(out)
        return data["local"], data["seen"]

    def capture(self, node: str, iface: str, bpf: str = "", snaplen: int = 0) -> Capture:
        """Start tcpdump on ``iface`` in ``node``: a router's "wan", a host's "eth0", the core's "wN"/"dc", or a
        host's switch port in its router (``lab.hosts[h].port``; a bridge's own "br0" shows only the frames for the
        router itself, not what it switches between two hosts). ``snaplen`` caps bytes kept per packet (0: all)."""
        return Capture(self, node, iface, bpf, snaplen=snaplen)

    def counters(self, router: str) -> dict[str, tuple[int, int]]:
        """The router's nft counters: name -> (packets, bytes). Names: wan_out (forwarded out of the WAN, new or
        established), wan_in (return traffic forwarded in), inbound_new_dropped (new connections from outside),
        local_wan_dropped (new traffic from outside to the router itself), udp_dropped (udp-blocked), masqueraded
        (connections NATed: one per new connection/flow)."""
        out = json.loads(self.check(router, ["nft", "-j", "list", "counters", "table", "inet", NFT_TABLE]))
        result = {}
        for item in out.get("nftables", []):
            c = item.get("counter")
            if c:
                result[c["name"]] = (c["packets"], c["bytes"])
        return result

    def reset_counters(self, router: str) -> None:
        self.check(router, ["nft", "reset", "counters", "table", "inet", NFT_TABLE])

    def ruleset(self, node: str) -> str:
        return self.check(node, ["nft", "list", "ruleset"])

    def inbound_openings(self, router: str) -> list[str]:
        """Rules on the router that would let a new connection in from the WAN: DNAT/redirect/tproxy anywhere, or an
        accept for WAN-side traffic that is not conditioned on established/related state. Empty when closed."""
        bad = []
        for line in self.ruleset(router).splitlines():
            s = line.strip()
            if re.search(r"\b(dnat|redirect|tproxy)\b", s):
                bad.append(s)
            elif 'iifname "wan"' in s and s.endswith("accept") and "established" not in s and "icmp" not in s:
                bad.append(s)
        return bad

    def conntrack(self, router: str) -> str:
        """The router's connection-tracking table (via /proc, needs no conntrack tool), best effort."""
        try:
            return self.check(router, ["cat", "/proc/net/nf_conntrack"])
        except NetlabError:
            return ""

    # --- tearing down ---------------------------------------------------------------------------------------------

    def stop(self, proc: subprocess.Popen, timeout: float = 10) -> int | None:
        """End one process started by ``run`` (its whole session): SIGTERM, then SIGKILL after ``timeout``."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        return proc.returncode

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(Exception):
                proc.wait(5)
        for ns in reversed(self.namespaces):
            _delete_namespace(ns)
        self.namespaces.clear()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self) -> str:
        lines = [f"lab {self.tag} (delay {self.delay_ms} ms each way per WAN link)"]
        for r in self.routers.values():
            lines.append(f"  router {r.name}: {r.nat}, wan {r.wan_address} via {r.upstream}"
                         + (f", lan {r.lan_network}" if r.lan_network else ""))
        for h in self.hosts.values():
            where = f"behind {h.router}" if h.router else "public"
            lines.append(f"  host {h.name}: {h.address} ({where}, seen as {self.public_address(h.name)})")
        return "\n".join(lines)


_REFLECTOR = r"""
import socket, sys
proto, port = sys.argv[1], int(sys.argv[2])
if proto == "udp":
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", port))
    print("ready", flush=True)
    while True:
        data, peer = s.recvfrom(4096)
        s.sendto(f"{peer[0]}:{peer[1]}".encode(), peer)
else:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(64)
    print("ready", flush=True)
    while True:
        c, peer = s.accept()
        try:
            c.sendall(f"{peer[0]}:{peer[1]}".encode())
        except OSError:
            pass
        c.close()
"""

_PROBE = r"""
import json, socket, sys
proto, local_port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
targets = [(t.rsplit(":", 1)[0], int(t.rsplit(":", 1)[1])) for t in sys.argv[4:]]
seen = []
if proto == "udp":
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", local_port))
    s.settimeout(timeout)
    local = s.getsockname()[1]
    for t in targets:
        got = None
        for _ in range(3):
            s.sendto(b"probe", t)
            try:
                while True:
                    data, peer = s.recvfrom(4096)
                    if peer == t:
                        got = data.decode()
                        break
                break
            except OSError:
                continue
        seen.append(got)
else:
    local = local_port
    for t in targets:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", local))
        local = s.getsockname()[1]
        s.settimeout(timeout)
        try:
            s.connect(t)
            got = s.recv(100).decode() or None
        except OSError:
            got = None
        s.close()
        seen.append(got)
print(json.dumps({"local": local, "seen": seen}))
"""


def print_grid(results: dict[tuple[str, str], str], file=None, title: str = "transport") -> str:
    """Print (and return) ``grid_text(results, title)``."""
    text = grid_text(results, title)
    print(text, file=file or sys.stdout, flush=True)
    return text


def grid_text(results: dict[tuple[str, str], str], title: str = "transport") -> str:
    """A grid of NAT pair -> transport, rows = first NAT, columns = second, like Tailscale's NAT test grid. Pairs
    given one way are shown both ways; missing pairs show "-"."""
    names: list[str] = []
    for a, b in results:
        for n in (a, b):
            if n not in names:
                names.append(n)
    cell = {}
    for (a, b), value in results.items():
        cell[(a, b)] = value
        cell.setdefault((b, a), value)
    width0 = max([len(title)] + [len(n) for n in names])
    widths = [max([len(n)] + [len(str(cell.get((r, n), "-"))) for r in names]) for n in names]
    rows = [" | ".join([title.ljust(width0)] + [n.ljust(w) for n, w in zip(names, widths)])]
    rows.append("-+-".join(["-" * width0] + ["-" * w for w in widths]))
    for r in names:
        cells = [str(cell.get((r, n), "-")).ljust(w) for n, w in zip(names, widths)]
        rows.append(" | ".join([r.ljust(width0)] + cells))
    return "\n".join(rows)


@contextlib.contextmanager
def lab(delay_ms: float = 10.0, **kwargs):
    """``with netlab.lab() as lab:`` — removes stale namespaces of dead runs first, and everything it made after."""
    cleanup_stale()
    the_lab = Lab(delay_ms=delay_ms, **kwargs)
    try:
        yield the_lab
    finally:
        the_lab.close()


# --- the lab's world: one topology for the lab's tests and the benchmark -------------------------------------------

WAN_DELAY_MS = 10.0  # each way on every router's WAN link (a home's, and a carrier's)
LEADER = "leader"  # the leader's place: a public host on the internet's "dc" segment


@dataclasses.dataclass(frozen=True)
class Home:
    """A home network: a NAT router of kind ``nat`` with ``hosts`` on its LAN. ``carrier`` names the carrier-grade
    NAT the home's WAN hangs off (made with the first home behind it) instead of the internet core."""

    router: str
    nat: str
    hosts: tuple[str, ...]
    carrier: str | None = None
    input_filter: bool = True


HOMES: dict[str, Home] = {home.router: home for home in (
    Home("nat-a", "masquerade", ("a1", "a2")),
    Home("nat-b", "masquerade", ("b1", "b2")),
    Home("nat-r", "masquerade fully-random", ("r1",)),
    Home("nat-u", "udp-blocked", ("u1",)),
    Home("nat-c", "masquerade", ("c1",), carrier="cgn"),
    # Routers that answer unsolicited packets to themselves (no input filter): the setting where an early punch
    # packet makes a Linux masquerade NAT change port, unless the first probes die before reaching it.
    Home("nat-p", "masquerade", ("p1",), input_filter=False),
    Home("nat-q", "masquerade", ("q1",), input_filter=False),
)}


def add_home(lab: Lab, home: Home | str, attach: int = 1) -> Router:
    """Add a home of ``HOMES`` (or any ``Home``): its carrier's NAT if not there yet, its router, its hosts. Its WAN
    (or its carrier's) hangs off the ``attach``-th router of the internet (1: "core"; ``lab.depth``: the far end)."""
    home = HOMES[home] if isinstance(home, str) else home
    if home.carrier is not None and home.carrier not in lab.routers:
        lab.add_router(home.carrier, "cgnat", attach=attach)
    router = lab.add_router(home.router, home.nat, upstream=home.carrier, input_filter=home.input_filter,
                            attach=1 if home.carrier else attach)
    for host in home.hosts:
        lab.add_host(host, home.router)
    return router


def build(lab: Lab, public: Sequence[str] = (LEADER,), homes: Iterable[Home | str] = tuple(HOMES),
          far: Iterable[str] = (), public_delay_ms: float = 0.0) -> Lab:
    """The lab's world in ``lab``: public hosts on the internet (the leader's place, test servers), then homes.
    Homes named in ``far`` hang off the far end of the internet (``lab.depth`` routers from the others); with
    ``public_delay_ms`` the public hosts sit on links of their own that far (each way) from the core."""
    far = set(far)
    for name in public:
        if public_delay_ms:
            lab.add_public_host(name, delay_ms=public_delay_ms, attach=1)
        else:
            lab.add_public_host(name)
    for home in homes:
        name = home if isinstance(home, str) else home.router
        add_home(lab, home, attach=lab.depth if name in far else 1)
    return lab


@contextlib.contextmanager
def world(public: Sequence[str] = (LEADER,), homes: Iterable[Home | str] = tuple(HOMES),
          delay_ms: float = WAN_DELAY_MS, far: Iterable[str] = (), public_delay_ms: float = 0.0, **kwargs):
    """``with netlab.world() as lab:`` — a fresh lab (``lab()``) holding ``build(lab, public, homes, far,
    public_delay_ms)``; ``depth=N`` makes the internet a chain of N routers."""
    with lab(delay_ms=delay_ms, **kwargs) as the_lab:
        yield build(the_lab, public, homes, far, public_delay_ms)


def _open_tun(name: str) -> int:
    import fcntl

    tunsetiff, iff_tun, iff_no_pi = 0x400454CA, 0x0001, 0x1000
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, tunsetiff, struct.pack("16sH", name.encode(), iff_tun | iff_no_pi))
    os.set_blocking(fd, False)
    return fd


def _delay_line(name_a: str, other_ns: str, name_b: str, delay_ms: float, limit: int = 20000) -> None:
    """A WAN link for kernels without netem: TUN device ``name_a`` in this process's namespace and ``name_b`` in
    ``other_ns``; every IP packet read from one is written to the other ``delay_ms`` later (FIFO, at most ``limit``
    packets in flight each way, then tail drop). Lives until killed; its TUN devices vanish with it."""
    import collections
    import ctypes
    import selectors

    fa = _open_tun(name_a)
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/run/netns/{other_ns}") as f:
        if libc.setns(f.fileno(), 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns into {other_ns}")
    fb = _open_tun(name_b)
    print("ready", flush=True)
    delay = delay_ms / 1000.0
    queues: dict[int, collections.deque] = {fa: collections.deque(), fb: collections.deque()}
    other = {fa: fb, fb: fa}
    sel = selectors.DefaultSelector()
    sel.register(fa, selectors.EVENT_READ)
    sel.register(fb, selectors.EVENT_READ)
    while True:
        now = time.monotonic()
        timeout = None
        for src, q in queues.items():
            while q and q[0][0] <= now:
                try:
                    os.write(other[src], q.popleft()[1])
                except OSError:  # the far device is down: the packet is lost, as on a cut cable
                    pass
            if q:
                wait = q[0][0] - now
                timeout = wait if timeout is None else min(timeout, wait)
        for key, _ in sel.select(timeout):
            q = queues[key.fd]
            for _ in range(512):
                try:
                    packet = os.read(key.fd, 65536)
                except BlockingIOError:
                    break
                except OSError:
                    time.sleep(0.005)
                    break
                if len(q) < limit:
                    q.append((time.monotonic() + delay, packet))


def _main(argv: Iterable[str]) -> int:
    """`python tests/netlab.py cleanup [--all]`: remove leftover lab namespaces."""
    args = list(argv)
    if args[:1] == ["delayline"]:
        _delay_line(args[1], args[2], args[3], float(args[4]))
        return 0
    if args[:1] == ["cleanup"]:
        for ns in cleanup_stale(everything="--all" in args):
            print("deleted", ns)
        return 0
    print(_main.__doc__)
    return 2


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
