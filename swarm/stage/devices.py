"""Spreading one stage over the GPUs of one PC (a plain function), for a stage no single card holds.

The user's manual: "A model trained over several fellows can also serve on one PC whose cards hold it together --
Qwen3-14B in 4 bits (8.3 GB) on two 6 GB cards, say -- with no network between its layers." Layers go to the cards
in order, each card taking a contiguous run sized to its free memory, so hidden states cross a card boundary as few
times as possible (once per card); the embedding stays with the first layer, the final norm and head with the last.
"""

from __future__ import annotations

import ctypes

from swarm.errors import ModelError

GB = 1e9


def layer_devices(layer_bytes: list[int], cards: list[tuple[str, int]], first_extra: int = 0,
                  last_extra: int = 0, headroom: float = 0.9) -> list[str]:
    """The device of each layer. ``cards``: (device, free bytes), in the order to fill them; a card is filled up to
    ``headroom`` of its free memory before the next one is used. One card that holds everything takes everything."""
    total = sum(layer_bytes) + first_extra + last_extra
    if not cards:
        raise ModelError("no device to place the stage on")
    for device, free in cards:
        if total <= free * headroom:
            return [device] * len(layer_bytes)
    out: list[str] = []
    card = 0
    used = first_extra
    for i, size in enumerate(layer_bytes):
        need = size + (last_extra if i == len(layer_bytes) - 1 else 0)
        while card < len(cards) and used + need > cards[card][1] * headroom:
            card += 1
            used = 0
        if card == len(cards):
            room = ", ".join(f"{d} {f / GB:.1f} GB free" for d, f in cards)
            raise ModelError(f"the stage needs {total / GB:.1f} GB and its cards together cannot hold it ({room})")
        out.append(cards[card][0])
        used += need
    return out


def return_freed_memory() -> None:
    """Hand the heap a load freed back to the system: glibc keeps freed memory in the process (its arenas) until asked
    (malloc_trim). Measured (bench/gguf_kind.py's middle stage of the built-in model at gguf, 22.2 MB of tensors):
    RSS added by the load 38.0 MB before, 22.8 MB after. Elsewhere than glibc there is nothing to call or to do."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator has no malloc_trim, and nothing to hand back
        pass
