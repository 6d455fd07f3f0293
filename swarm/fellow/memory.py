"""Giving freed memory back to the system once a fellow's stages go quiet.

glibc keeps memory that torch freed in its arenas for reuse. After a burst of large and varied allocations -- prompts
of thousands of tokens computed together, each with its own attention scores -- a fellow's resident size stays at
the burst's high-water mark although nothing uses it. ``malloc_trim(0)`` hands the free pages back; it costs a few
milliseconds, so it runs only when the fellow has just gone idle. Elsewhere (no glibc) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


def release_free_memory() -> bool:
    """Return the heap's free pages to the system; whether that was possible here."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class IdleTrimmer:
    """Calls ``release_free_memory`` once each time the fellow goes from working to idle."""

    def __init__(self) -> None:
        self.dirty = False

    def due(self, busy: bool) -> bool:
        if busy:
            self.dirty = True
            return False
        due, self.dirty = self.dirty, False
        return due
