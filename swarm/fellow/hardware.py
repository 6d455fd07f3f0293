"""What this fellow has to offer, reported to the leader as swarm.messages.Hardware: GPUs with free memory (through
NVML), else CPU cores and free RAM.

NVML (nvidia-ml-py) is the driver's own view of memory, the same numbers as nvidia-smi, and works without CUDA being
initialised in this process. Without the library, a driver or a GPU, the fellow reports its CPU instead.
"""

from __future__ import annotations

import os

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
            gpus.append(Gpu(index, name.decode() if isinstance(name, bytes) else name, memory.total, memory.free))
        return gpus
    except pynvml.NVMLError:
        return []
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
