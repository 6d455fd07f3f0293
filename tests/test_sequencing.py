import pytest

from swarm.errors import ProtocolError
from swarm.mesh.sequencing import PING, PONG, Resequencer, Sequencer, kind, ping, pong


def test_messages_from_two_paths_come_out_in_order():
    s, r = Sequencer(), Resequencer()
    frames = [s.wrap(f"m{i}".encode()) for i in range(6)]
    out = []
    # m0, m1 on the old path; m4, m5 on the new one overtake m2, m3 still on the old path.
    for f in (frames[0], frames[1], frames[4], frames[5], frames[2], frames[3]):
        out += r.push(f)
    assert out == [b"m0", b"m1", b"m2", b"m3", b"m4", b"m5"]


def test_reset_skips_what_a_broken_path_lost():
    s, r = Sequencer(), Resequencer()
    assert r.push(s.wrap(b"a")) == [b"a"]
    s.wrap(b"lost on the broken path")
    assert r.push(s.wrap(b"c", reset=True)) == [b"c"]
    assert r.push(s.wrap(b"d")) == [b"d"]


def test_duplicates_are_dropped_and_pings_are_not_sequenced():
    s, r = Sequencer(), Resequencer()
    f = s.wrap(b"x")
    assert r.push(f) == [b"x"] and r.push(f) == []
    p = ping(123456)
    assert kind(p) == (PING, 123456) and kind(pong(p)) == (PONG, 123456)
    with pytest.raises(ProtocolError):
        r.push(p)
    with pytest.raises(ProtocolError):
        kind(b"\x09" * 9)
