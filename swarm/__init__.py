"""swarm: run a large language model split over several PCs ("fellows") in a ring."""

import os

__version__ = "0.1.0"

# OpenMP's idle threads sleep between torch's kernels instead of spinning, unless OMP_WAIT_POLICY is already set: on a
# PC busy with other work a spinning barrier waits for a thread the scheduler put aside, and a 2-stage ring of the
# built-in model decoded 6x (int4-fast) to 12x (float32) slower with 2 threads (bench/RESULTS.md, issue 13). It
# changes no result, only how threads wait. Here, so that it is set before torch loads (libgomp reads it once) in
# every swarm process, whether started as `swarm` or `python -m swarm`.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
