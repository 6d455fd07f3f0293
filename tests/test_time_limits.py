"""Every test has a time limit (pyproject.toml, tests/conftest.py): a trio test that hangs fails alone, past its
limit, with the trio task tree and every thread's stack showing where it waits, and the run goes on. Checked on an
inner pytest run with this suite's conftest."""

import shutil
import subprocess
import sys
import time
from pathlib import Path

INNER_TESTS = '''
import pytest
import trio


async def wait_for_a_reply_that_never_comes():
    await trio.sleep_forever()


@pytest.mark.timeout(2)
async def test_hangs():
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_for_a_reply_that_never_comes)


async def test_after_the_hang():
    await trio.sleep(0.01)


@pytest.mark.timeout(2)
async def test_virtual_time_is_not_real_time(autojump_clock):
    await trio.sleep(3600)  # an hour on the autojump clock: no real time, within the limit


def test_plain():
    assert sum(range(4)) == 6
'''

INNER_INI = """[pytest]
trio_mode = true
timeout = 300
timeout_method = thread
"""


def test_a_hanging_test_fails_alone_and_says_where(tmp_path: Path):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text(INNER_INI)
    (tmp_path / "test_inner.py").write_text(INNER_TESTS)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "1 failed, 3 passed" in out, out
    assert "test_hangs ran past its time limit of 2 s" in out, out
    # The task tree names the task that waits and the line it waits on; faulthandler shows the threads.
    assert "wait_for_a_reply_that_never_comes" in out and "test_inner.py" in out, out
    assert "Thread 0x" in out or "Current thread 0x" in out, out
    assert took < 60, f"the inner run took {took:.0f} s: the limit did not cut the hang short"
