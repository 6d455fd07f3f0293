"""What a fellow has to offer: GPUs with free memory (through NVML), else CPU cores and free RAM.

NVML (nvidia-ml-py) is the driver's own view of memory, the same numbers as nvidia-smi, and works without CUDA being
initialised in this process. Without the library, a driver or a GPU, the fellow reports its CPU instead.
"""

from __future__ import annotations

import dataclasses
import os

import psutil


@dataclasses.dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    total_bytes: int
    free_bytes: int


@dataclasses.dataclass(frozen=True)
class Hardware:
    cpu_cores: int
    ram_total_bytes: int
    ram_free_bytes: int
    gpus: tuple[Gpu, ...] = ()

    def serving_free_bytes(self, device: str = "auto") -> int:
        """Memory a stage may use: the roomiest GPU's free memory, or free RAM when serving on the CPU."""
        if self.gpus and device != "cpu":
            return max(g.free_bytes for g in self.gpus)
        return self.ram_free_bytes

    def to_wire(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, data: dict) -> Hardware:
        gpus = tuple(Gpu(**g) for g in data.get("gpus", ()))
        return cls(
            cpu_cores=int(data["cpu_cores"]),
            ram_total_bytes=int(data["ram_total_bytes"]),
            ram_free_bytes=int(data["ram_free_bytes"]),
            gpus=gpus,
        )

    def describe(self) -> str:
        if self.gpus:
            return ", ".join(f"{g.name} ({g.free_bytes / 1e9:.1f} GB free)" for g in self.gpus)
        return f"{self.cpu_cores} CPU cores, {self.ram_free_bytes / 1e9:.1f} GB RAM free"


def nvidia_gpus() -> tuple[Gpu, ...]:
    try:
        import pynvml
    except ImportError:
        return ()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return ()  # no driver or no GPU: serve on the CPU
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(Gpu(index, name.decode() if isinstance(name, bytes) else name, memory.total, memory.free))
        return tuple(gpus)
    except pynvml.NVMLError:
        return ()
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def probe() -> Hardware:
    memory = psutil.virtual_memory()
    return Hardware(
        cpu_cores=os.cpu_count() or 1,
        ram_total_bytes=memory.total,
        ram_free_bytes=memory.available,
        gpus=nvidia_gpus(),
    )
