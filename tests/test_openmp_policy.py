"""Every swarm process lets OpenMP's idle threads sleep (OMP_WAIT_POLICY=PASSIVE) unless the user chose a policy:
set when the package is imported, before torch loads, so libgomp reads it (bench/RESULTS.md, issue 13)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = "import swarm, torch, os; print(os.environ.get('OMP_WAIT_POLICY'))"


@pytest.mark.parametrize(("given", "seen"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_swarm_processes_wait_passively_unless_the_user_chose(given, seen):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip() == seen
