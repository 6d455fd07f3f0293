"""Versions that match: the control link's envelope is read across protocols, everything else is not; a fellow on
another protocol is never chosen for a stage; the update offer a fellow acts on is checked; the leader's wheel of a
source checkout is rebuilt when (and only when) its files change."""

from __future__ import annotations

import os

import pytest

from swarm import __version__, wire
from swarm.errors import ProtocolError, UpdateError
from swarm.fellow.update import check_offer, restart_command
from swarm.leader.fleet.updates import source_digest, source_root
from swarm.leader.planning.failover import Candidate, choose_cover, choose_replacement, why_no_replacement
from swarm.leader.planning.placement import StagePlan

OTHER = wire.PROTOCOL_VERSION + 1


def _from_other_protocol(message: dict) -> bytes:
    import cbor2

    return cbor2.dumps({**message, "v": OTHER})


@pytest.mark.parametrize("kind", ["hello", "welcome", "refused", "alive", "heartbeat", "update", "updating"])
def test_envelope_messages_are_read_at_any_protocol(kind):
    assert wire.decode(_from_other_protocol({"t": kind, "version": "9.9"}))["v"] == OTHER


@pytest.mark.parametrize("kind", ["load", "link", "generate", "forward", "unload"])
def test_ring_messages_of_another_protocol_are_refused(kind):
    with pytest.raises(ProtocolError, match=f"protocol version {OTHER}"):
        wire.decode(_from_other_protocol({"t": kind}))


PLAN = StagePlan(0, 1, "f1", 0, 30, 1_000_000_000, 100_000_000)
ROOMY = 10_000_000_000


def test_failover_skips_a_fellow_on_another_protocol_and_says_why():
    old = Candidate(2, "f2", ROOMY, standby=True, serving=False,
                    outdated="f2 runs swarm 0.0.9 (protocol 0); this leader needs protocol 1 — run swarm update on f2.")
    idle = Candidate(3, "f3", ROOMY // 2, standby=False, serving=False)
    assert choose_replacement(PLAN, [old, idle]).name == "f3"  # the standby would have come first
    assert choose_replacement(PLAN, [old]) is None
    assert "f2 runs swarm 0.0.9 (protocol 0); this leader needs protocol 1 — run swarm update on f2" in \
        why_no_replacement(PLAN, [old])
    assert choose_cover([PLAN], [old], set()) is None  # nor does it hold a hot cover


def test_fellow_conn_names_what_to_do():
    from swarm.leader.fleet.fellows import FellowConn
    from swarm.messages import Hardware

    conn = FellowConn(id=2, name="f2", public_key=b"k" * 32, pool_id=1, hardware=Hardware(4, 8 << 30, 4 << 30),
                      serve_host=None, serve_port=None, version="0.0.9", channel=None,
                      last_heartbeat=0.0, protocol=wire.PROTOCOL_VERSION - 1)
    assert not conn.compatible and conn.outdated
    assert conn.why_incompatible() == (f"f2 runs swarm 0.0.9 (protocol {wire.PROTOCOL_VERSION - 1}); this leader "
                                       f"needs protocol {wire.PROTOCOL_VERSION} — run swarm update on f2.")
    summary = conn.summary()
    assert (summary["version"], summary["protocol"], summary["outdated"]) == ("0.0.9", wire.PROTOCOL_VERSION - 1, True)
    same = FellowConn(id=3, name="f3", public_key=b"k" * 32, pool_id=1, hardware=Hardware(4, 8 << 30, 4 << 30),
                      serve_host=None, serve_port=None, version=__version__, channel=None,
                      last_heartbeat=0.0)
    assert same.compatible and not same.outdated


GOOD = {"file": "swarm-0.2.0-py3-none-any.whl", "sha256": "ab" * 32, "size": 1234,
        "path": "/api/v1/update/swarm-0.2.0-py3-none-any.whl", "version": "0.2.0", "protocol": 2}


def test_an_update_offer_is_checked_before_it_names_a_file():
    assert check_offer(GOOD)["file"] == GOOD["file"]
    for bad in ({"file": "../../evil.whl"}, {"file": "swarm-0.2.0-cp311-cp311-linux_x86_64.whl"},
                {"sha256": "AB" * 31}, {"size": True}, {"size": 0}, {"path": "http://elsewhere/x.whl"}):
        with pytest.raises(UpdateError, match="malformed"):
            check_offer({**GOOD, **bad})


def test_a_restart_runs_the_same_command_with_this_interpreter(monkeypatch):
    import sys

    assert restart_command(["join", "http://l:8000", "--name", "f2"]) == \
        [sys.executable, "-m", "swarm", "join", "http://l:8000", "--name", "f2"]


def test_a_checkout_is_found_and_its_digest_follows_its_files(tmp_path):
    assert source_root() is not None  # the tests run from this repository's checkout (installed editable)
    (tmp_path / "swarm" / "web").mkdir(parents=True)
    (tmp_path / "pyproject.toml").write_text("[project]\nname='swarm'\n")
    init = tmp_path / "swarm" / "__init__.py"
    init.write_text("__version__ = '1'\n")
    (tmp_path / "swarm" / "web" / "a.js").write_text("1")
    assert source_root(str(init)) == tmp_path
    first = source_digest(tmp_path)
    (tmp_path / "swarm" / "__pycache__").mkdir()
    (tmp_path / "swarm" / "__pycache__" / "x.pyc").write_bytes(b"x")
    assert source_digest(tmp_path) == first  # byte code is not the source
    (tmp_path / "swarm" / "web" / "a.js").write_text("22")
    assert source_digest(tmp_path) != first
    os.remove(tmp_path / "pyproject.toml")
    assert source_root(str(init)) is None
