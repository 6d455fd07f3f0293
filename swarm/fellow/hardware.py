"""What this fellow has to offer, reported to the leader as swarm.messages.Hardware: GPUs with free memory, load,
power and temperature (through NVML), else CPU cores, free RAM and CPU load.

NVML (nvidia-ml-py) is the driver's own view of memory, the same numbers as nvidia-smi, and works without CUDA being
initialised in this process. Without the library, a driver or a GPU, the fellow reports its CPU instead.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

import psutil

from swarm.messages import Gpu, Hardware


def nvidia_gpus() -> list[Gpu]:
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []  # no driver or no GPU: serve on the CPU
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(Gpu(index, name.decode() if isinstance(name, bytes) else name, memory.total, memory.free,
                            **_gpu_activity(pynvml, handle)))
        return gpus
    except pynvml.NVMLError:
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:  # NVML did not start (no driver): nothing to shut down
            pass


def _gpu_activity(pynvml, handle) -> dict:
    """Load, power and temperature of one card, each None where this card or driver does not report it (NVML
    answers NotSupported for power on some consumer cards)."""
    def read(fn):
        try:
            return fn()
        except pynvml.NVMLError:
            return None

    rates = read(lambda: pynvml.nvmlDeviceGetUtilizationRates(handle))
    power = read(lambda: pynvml.nvmlDeviceGetPowerUsage(handle))  # milliwatts
    limit = read(lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(handle))
    temperature = read(lambda: pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))
    return {"load_percent": float(rates.gpu) if rates is not None else None,
            "power_w": round(power / 1000, 1) if power is not None else None,
            "power_limit_w": round(limit / 1000, 1) if limit is not None else None,
            "temperature_c": float(temperature) if temperature is not None else None}


@functools.cache
def quantization_kinds(has_gpus: bool) -> dict[str, list[str]]:
    """The quantization kinds this fellow can load, by device: asked of the installed packages once."""
    from swarm.quantization import kinds_on

    kinds = {"cpu": kinds_on("cpu")}
    if has_gpus:
        kinds["cuda"] = kinds_on("cuda")
    return kinds


def probe() -> Hardware:
    memory = psutil.virtual_memory()
    gpus = nvidia_gpus()
    return Hardware(
        cpu_cores=os.cpu_count() or 1,
        ram_total_bytes=memory.total,
        ram_free_bytes=memory.available,
        gpus=gpus,
        # since the previous call: the heartbeat's period (the first report says 0, as psutil does)
        cpu_load_percent=psutil.cpu_percent(interval=None),
        quantization=quantization_kinds(bool(gpus)),
    )


def lent(hw: Hardware, limit_bytes: int, held_bytes: int) -> Hardware:
    """``hw`` as the leader may use it under SWARM_SERVE_MEMORY_GB (``limit_bytes``, 0: no limit): each free figure at
    most the limit less what this fellow's stages hold (``held_bytes``), so that the leader places no more on it."""
    if limit_bytes <= 0:
        return hw
    left = max(0, limit_bytes - held_bytes)
    gpus = [dataclasses.replace(g, free_bytes=min(g.free_bytes, left)) for g in hw.gpus]
    return dataclasses.replace(hw, ram_free_bytes=min(hw.ram_free_bytes, left), gpus=gpus)


class MachineShare:
    """How many fellows run on this machine, so each takes its share of the cores when they are all busy.

    Each fellow keeps a file named by its pid in the user's runtime folder while it runs; the others count the files
    whose process is alive. (The demo, and a PC with two GPUs running a fellow per card, run several.)"""

    def __init__(self, folder: Path | None = None):
        self.folder = folder or _runtime_dir() / "fellows"
        self._mine: Path | None = None

    def register(self) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._mine = self.folder / str(os.getpid())
            self._mine.write_text("")
        except OSError:
            self._mine = None  # no runtime folder: count as alone

    def unregister(self) -> None:
        if self._mine is not None:
            self._mine.unlink(missing_ok=True)

    def fellows(self) -> int:
        try:
            pids = [int(p.name) for p in self.folder.iterdir() if p.name.isdigit()]
        except OSError:
            return 1
        return max(1, sum(1 for pid in pids if psutil.pid_exists(pid)))

    def busy_threads(self) -> int:
        """Threads a busy stage takes: the machine's cores split between the fellows on it."""
        return max(1, (os.cpu_count() or 1) // self.fellows())


def _runtime_dir() -> Path:
    """Where a running fellow leaves notes for the others on this machine: the user's runtime folder."""
    import sys
    import tempfile

    import platformdirs

    if sys.platform.startswith("linux") and not os.environ.get("XDG_RUNTIME_DIR"):
        # no session runtime folder (a service, a container)
        return Path(tempfile.gettempdir()) / f"swarm-{os.getuid()}"
    return Path(platformdirs.user_runtime_dir("swarm"))
