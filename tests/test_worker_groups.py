"""The tests run on both cores by module (scripts/bootstrap test: pytest-xdist, `--dist loadgroup`): a module's tests
in one worker, in order, sharing its fixtures; the network lab's modules all in one worker; the slow kinds handed out
before the units. Checked on an inner run with this suite's conftest (tests/conftest.py's scheduler: pytest 9.2 keeps
pytest-xdist's own loadgroup from grouping anything, pytest-xdist issue #1386)."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

UNITS = '''
import pytest


@pytest.mark.parametrize("n", range(8))
def test_unit(n):
    assert n >= 0
'''

SHARED = '''
import os

import pytest

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def fleet():
    return os.getpid()  # a module's fleet: started once, in the one worker that runs the module


@pytest.mark.parametrize("n", range(4))
def test_shares_the_fleet(fleet, n):
    assert fleet == os.getpid()
'''

LAB = '''
import pytest

pytestmark = pytest.mark.lab


@pytest.mark.parametrize("n", range(3))
def test_in_the_lab(n):
    assert n >= 0
'''

INNER_INI = """[pytest]
timeout = 300
markers =
    e2e: slow
    lab: the lab
    browser: a browser
"""


def inner(tmp_path: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args, str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    return out


def test_a_modules_tests_share_a_worker_and_the_slow_kinds_go_first(tmp_path: Path):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text(INNER_INI)
    (tmp_path / "test_a_units.py").write_text(UNITS)
    (tmp_path / "test_b_fleet.py").write_text(SHARED)
    (tmp_path / "test_c_fleet.py").write_text(SHARED)
    (tmp_path / "test_lab_one.py").write_text(LAB)
    (tmp_path / "test_netlab.py").write_text(LAB)

    # heaviest first (e2e and lab tests weigh their time limit, units 1), a module's tests in their order
    collected = [line for line in inner(tmp_path, "--collect-only", "-q", "-p", "no:xdist").splitlines()
                 if "::" in line]
    modules = list(dict.fromkeys(line.split("::")[0] for line in collected))
    assert modules == ["test_lab_one.py", "test_netlab.py", "test_b_fleet.py", "test_c_fleet.py",
                       "test_a_units.py"], modules
    assert [line.split("::")[1] for line in collected[-8:]] == [f"test_unit[{n}]" for n in range(8)]

    ran = re.findall(r"\[(gw\d)\] \[ *\d+%\] PASSED (\S+?)::", inner(tmp_path, "-n", "2", "--dist", "loadgroup", "-v"))
    assert len(ran) == 22, ran
    workers: dict[str, set[str]] = {}
    for worker, module in ran:
        group = "lab" if module in ("test_lab_one.py", "test_netlab.py") else module
        workers.setdefault(group, set()).add(worker)
    assert all(len(used) == 1 for used in workers.values()), workers
