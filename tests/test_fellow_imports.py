"""A fellow that has joined but holds no stage has not imported torch or transformers (about 1.3 s and 300 MB it
spends only once a stage is placed on it), and they come with its first stage. A real `swarm join` process: a
sitecustomize module on its PYTHONPATH answers, from inside it, which of them its sys.modules holds and its RSS."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from fleet import Pool
from harness import wait_for

pytestmark = pytest.mark.e2e

HEAVY = ("torch", "transformers", "safetensors", "numpy")

# Python imports sitecustomize at start-up, before `-m swarm join` runs: a daemon thread that answers each ask-N file
# with report-N.json (the heavy modules loaded, VmRSS) without touching the fellow's own code.
PROBE = '''
import json, os, sys, threading, time

def _answer(folder):
    n = 1
    while True:
        ask = os.path.join(folder, f"ask-{n}")
        if not os.path.exists(ask):
            time.sleep(0.05)
            continue
        with open("/proc/self/status") as status:
            rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
        report = {"heavy": sorted(m for m in HEAVY if m in sys.modules), "rss_kb": rss}
        with open(os.path.join(folder, f"report-{n}.json.part"), "w") as out:
            json.dump(report, out)
        os.replace(os.path.join(folder, f"report-{n}.json.part"), os.path.join(folder, f"report-{n}.json"))
        n += 1

if os.environ.get("SWARM_TEST_PROBE"):
    threading.Thread(target=_answer, args=(os.environ["SWARM_TEST_PROBE"],), daemon=True).start()
'''.replace("HEAVY", repr(HEAVY))


def ask(folder: Path, n: int) -> dict:
    (folder / f"ask-{n}").touch()
    report = folder / f"report-{n}.json"
    wait_for(report.exists, 30, message=f"the fellow did not answer {report}")
    return json.loads(report.read_text())


def test_a_fellow_imports_torch_with_its_first_stage_not_on_joining(tmp_path, tiny_model_dirs):
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(PROBE)
    path = os.pathsep.join(filter(None, [str(probe), os.environ.get("PYTHONPATH")]))
    pool = Pool(tmp_path, tiny_model_dirs["llama"], count=1,
                fellow_env={"PYTHONPATH": path, "SWARM_TEST_PROBE": str(probe)})
    try:
        time.sleep(2)  # online, and two heartbeats (SWARM_HEARTBEAT_S=1) with their hardware reports since
        joined = ask(probe, 1)
        assert joined["heavy"] == [], joined
        pool.load(num_stages=1)
        serving = ask(probe, 2)
        assert {"torch", "transformers"} <= set(serving["heavy"]), serving
        assert serving["rss_kb"] > joined["rss_kb"] + 100_000  # what the lazy import keeps off an idle fellow
        print(f"joined, no stage: RSS {joined['rss_kb'] / 1024:.0f} MB; "
              f"with a stage of the tiny model: {serving['rss_kb'] / 1024:.0f} MB")
    finally:
        pool.stop()


def test_the_stage_packages_names_are_its_modules_names():
    """swarm.stage imports its names on first use: each is the object of the module it comes from."""
    import importlib

    import swarm.stage as stage

    assert sorted(stage.__all__) == sorted(stage._WHERE)
    for name, module in stage._WHERE.items():
        assert getattr(stage, name) is getattr(importlib.import_module(f"swarm.stage.{module}"), name)
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        stage.Nothing  # noqa: B018
