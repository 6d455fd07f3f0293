"""The fellow: `swarm join URL --token T` runs one on a PC with memory to spare (see process.py for its parts)."""

from swarm.fellow.process import Fellow, run_fellow

__all__ = ["Fellow", "run_fellow"]
