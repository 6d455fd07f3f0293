"""What the benches that run the built-in model on a leader and two fellows in one process (tests/harness.py) share:
the import path (the repository and tests/), the fellows' thread settings as `swarm join` sets them, the built-in
model imported once into --data-dir, and the command line (--tokens, --data-dir and a bench's own options).

    from builtin_swarm import COUNT, main   # first: it puts tests/ on the path for `from harness import ...`
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from swarm.cli import FELLOW_THREAD_ENV  # noqa: E402

for _name, _value in {**FELLOW_THREAD_ENV, "OMP_WAIT_POLICY": "PASSIVE"}.items():  # as `swarm join` and the tests
    os.environ.setdefault(_name, _value)

from swarm.demo import BUILTIN  # noqa: E402
from swarm.model_import import ensure_imported  # noqa: E402

# A reply that runs its whole length greedily (with ignore_eos): the steady decode speed.
COUNT = [{"role": "user", "content": "List the numbers from 1 to 80, separated by commas."}]


def main(bench: Callable[[Path, Path, argparse.Namespace], Awaitable[None]], doc: str,
         options: Callable[[argparse.ArgumentParser], None] | None = None) -> None:
    """Parse the command line, import the built-in model, and run ``bench(model_dir, tmp, args)`` under trio with a
    scratch folder ``tmp`` for the swarms it starts."""
    parser = argparse.ArgumentParser(description=" ".join(doc.strip().split("\n\n")[0].split()))
    parser.add_argument("--tokens", type=int, default=64, help="tokens per timed reply")
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/swarm-bench"),
                        help="where the built-in model is imported once")
    if options is not None:
        options(parser)
    args = parser.parse_args()
    (args.data_dir / "leader").mkdir(parents=True, exist_ok=True)
    ensure_imported(BUILTIN, args.data_dir / "leader", BUILTIN)
    with tempfile.TemporaryDirectory() as tmp:
        trio.run(bench, args.data_dir / "leader" / "models" / BUILTIN, Path(tmp), args)
