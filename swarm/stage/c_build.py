"""Building swarm's C kernels (int4_kernel.c, q8_kernel.c) on the machine that runs them, and checking what Python
hands them.

A kernel's source is compiled once per CPU, compiler and source with the machine's C compiler (``cc -O3
-march=native -fopenmp``, about a second) into the user's cache folder, and loaded with ctypes (which lets go of the
GIL while C computes). The library's name carries a hash of all of these, so a new CPU, compiler or source builds
anew; it is built under a temporary name and renamed, so processes building at once each get a whole file.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

import platformdirs
import torch

from swarm.errors import KernelMismatch, SwarmError

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC")
COMPILE_TIMEOUT_S = 120


class NoCompiler(RuntimeError):
    """This machine has no C compiler: the kernels' callers fall back to torch and say so."""


def compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def build(source: Path, flags: tuple[str, ...] = FLAGS) -> tuple[ctypes.CDLL, Path]:
    """The library compiled from ``source`` with ``flags`` for this CPU (from the cache when built before), loaded.
    Raises NoCompiler, or what compiling or loading raised (the caller logs it and falls back to torch)."""
    cc = compiler()
    if cc is None:
        raise NoCompiler("no C compiler (cc)")
    code = source.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, timeout=30).stdout
    key = hashlib.sha256(b"\0".join([code, version, " ".join(flags).encode(), cpu_identity()])).hexdigest()
    folder = Path(platformdirs.user_cache_dir("swarm")) / "kernels"
    target = folder / f"{source.stem}-{key[:16]}.so"
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=folder, suffix=".so.part")
        os.close(handle)
        try:
            done = subprocess.run([cc, *flags, "-o", temporary, str(source), "-lm"], capture_output=True, text=True,
                                  timeout=COMPILE_TIMEOUT_S)
            if done.returncode:
                raise SwarmError(f"{cc} exited with {done.returncode}: {done.stderr.strip()[-400:]}")
            os.replace(temporary, target)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
    return ctypes.CDLL(str(target)), target


K = TypeVar("K")


class Kernels(Generic[K]):
    """One C kernel in this process: built once per set of flags (the first caller builds, the others wait), or None
    where it cannot be built here (said once, in the log) or while switched off (:meth:`use`)."""

    def __init__(self, source: Path, make: Callable[[ctypes.CDLL, Path], K], what: str, fallback: str):
        self.source, self.make = source, make
        self.what, self.fallback = what, fallback  # "int4-fast layers", "torch's int4 kernel": for the log
        self.enabled = True
        self.built: dict[tuple[str, ...], K | None] = {}
        self._lock = threading.Lock()

    def use(self, enabled: bool) -> None:
        """Whether layers made from now on take this kernel (SWARM_INT4_KERNEL; the fellow sets it)."""
        self.enabled = bool(enabled)

    def get(self, flags: tuple[str, ...] = FLAGS) -> K | None:
        """The kernel built for this CPU (``flags`` for other builds, as the tests compile the AVX2 and plain-C
        paths), or None."""
        if not self.enabled:
            return None
        with self._lock:
            if flags not in self.built:
                self.built[flags] = self._build(flags)
            return self.built[flags]

    def _build(self, flags: tuple[str, ...]) -> K | None:
        if compiler() is None:
            log.warning("%s run on %s: this machine has no C compiler (cc) to build swarm's kernel for them; install "
                        "gcc (apt-get install gcc) and load the model again", self.what, self.fallback)
            return None
        try:
            kernel = self.make(*build(self.source, flags))
        except Exception as exc:  # noqa: BLE001 - any failure to build or load leaves the fallback, said once
            log.warning("%s run on %s: swarm's kernel for them could not be built here (%s: %s); "
                        "SWARM_INT4_KERNEL=0 silences this", self.what, self.fallback, type(exc).__name__, exc)
            return None
        log.info("%s: %s path, %s", self.source.name, getattr(kernel, "simd", "?"), getattr(kernel, "path", "?"))
        return kernel


def cpu_identity() -> bytes:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))]
        return "\n".join(dict.fromkeys(lines)).encode()
    except OSError:
        return f"{platform.machine()} {platform.processor()}".encode()


def describe(t: torch.Tensor) -> str:
    layout = "contiguous" if t.is_contiguous() else "not contiguous"
    return f"{t.dtype} {tuple(t.shape)}, {layout}, on {t.device}"


def expect(t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...], kernel: str) -> None:
    """Raise KernelMismatch unless ``t`` is a contiguous CPU tensor of ``dtype`` and ``shape``: what the C code reads
    through a raw pointer. One test of four attributes where it is so (under a microsecond). ``kernel``: the
    kernel's name in the message."""
    if t.dtype != dtype or t.shape != shape or not t.is_cpu or not t.is_contiguous():
        raise mismatch(kernel, name, f"a contiguous CPU tensor of {dtype} {tuple(shape)}", describe(t))


def mismatch(kernel: str, name: str, wanted: str, got: str) -> KernelMismatch:
    return KernelMismatch(f"swarm's {kernel} takes {name} as {wanted}, not {got}: this is a bug in swarm, refused "
                          "before the C code read the wrong memory; report it, and run with SWARM_INT4_KERNEL=0 "
                          "(torch computes those layers then) meanwhile")
