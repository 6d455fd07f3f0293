"""The control link's messages are typed records: each is read back as it was sent, a malformed one is a
ProtocolError that names the field (never a KeyError in a handler), the envelope is read across protocol versions
with the fields an older peer did not send at their defaults, and every type has a handler on the side it goes to."""

from __future__ import annotations

import dataclasses

import cbor2
import pytest

from swarm import control_links as cl
from swarm import control_messages as cm
from swarm import handover_messages as hm
from swarm import messages, wire
from swarm.errors import ProtocolError
from swarm.fellow.control import ControlLink
from swarm.leader.serving.fellow_messages import FellowMessages

HARDWARE = messages.Hardware(4, 8 << 30, 4 << 30)
SLOT = cm.StageSlot(1, 2, 15, 30, is_first=False, is_last=True)
FILE = cm.FileEntry("layers/15.safetensors", "ab" * 32, 1234)
SAMPLES = [
    cm.Welcome(3, "cred", "pc-a", ["m"], {"version": "1.0", "protocol": 1}, "fits"),
    cm.Refused("no"), cm.Alive(), cm.Heartbeat(HARDWARE, ["m"], [{"hop_id": "h1", "transport": "relay"}]),
    cm.Update("1.1", 1, "swarm-1.1-py3-none-any.whl", "ab" * 32, 10, "/api/v1/update/swarm-1.1-py3-none-any.whl"),
    cm.Updating("pc-a", "1.1"), cm.Current("1.1"), cm.UpdateFailed("pip failed"),
    cm.Load("m", "L1", SLOT, {"vocab_size": 10}, [FILE], cover=True,
            draft=cm.DraftPart("d", {}, 2, [FILE])),
    cm.Link("m", "L1", "g1", 1, 2, cm.HopOut("h1", b"k" * 32, "pc-b", ["10.0.0.2", 5559], "auto"),
            cm.HopIn("h0", b"j" * 32)),
    cm.Link("m", "L1", "g1", 1, 3, first_layer=10, end_layer=20),  # a narrowing (swarm.stage.narrow)
    cm.Load("m", "L1", SLOT, {"vocab_size": 10}, [FILE], extend=True), cm.DropExtension("m"),  # swarm.stage.resplit
    cm.RingReady("m", "g1"), cm.Unlink("m"), cm.Unload("m"), cm.LoadProgress("m", "L1", "download", 0.5),
    cm.Loaded("m", "L1", {"index": 1}), cm.LoadFailed("m", "L1", "disk full"), cm.Linked("m", "g1"),
    cm.LinkFailed("m", "g1", "not loaded"), cm.Unloaded("m", "L1", "idle"), cm.Leave(True, 30.0), cm.LeaveRefused("no"),
    cm.Left("done"), cm.VerifyPick("m", "r1", [[3, "c1"]]),
    cm.VerifySample("m", "c1", "r1", [[0, 3]], [1, 2, 3], 3, {"token": 7}, path="swarm"),
    cm.VerifyRun("m", "c1", 0, 15, "r1", [[0, 3]], [1, 2, 3], 3, {"token": 7}),
    cm.VerifyResult("c1", {"token": 7}, "swarm"),
    cl.ProbeLinks([cl.ProbePeer(2, "pc-b", b"k" * 32, "1-1-2", ["10.0.0.2", 5559], "probe-1-1-2")],
                  [cl.ProbeListen("probe-1-2-1", b"k" * 32)]),
    cl.LinkReport([cl.LinkFigures(2, "direct", 0.4, 900.0, 1.2)]), cl.PunchPing("h1", "a"), cl.PunchPong("h1", "a"),
    cl.PunchPrepare("m", "h1", "a", "who", 3478), cl.PunchCandidates("m", "h1", "a", candidates=[["1.2.3.4", 5]]),
    cl.PunchStart("m", "h1", "a", b"s" * 32, [["1.2.3.4", 5]], 0.5), cl.PunchResult("m", "h1", "a", True),
    hm.KvKeep("m", "g1", "x1", 3, 32, [["r1", [b"n" * 16]]], export=True), hm.KvImport("m", "x1", 3, [{"name": b"n"}]),
    hm.KvKept("m", "x1", [b"n" * 16], [{"name": b"n"}]), hm.KvImported("m", "x1", message="no stage"),
]
CONTROL = [cls for module in (cm, cl, hm) for cls in vars(module).values()
           if isinstance(cls, type) and cls.__module__ == module.__name__ and getattr(cls, "TYPE", None)]


def test_every_control_message_reads_back_as_it_was_sent():
    assert {type(m) for m in SAMPLES} == set(CONTROL)  # one sample of each type
    for message in SAMPLES:
        assert wire.unpack(wire.encode(message)) == message


def test_every_control_message_has_a_handler_where_it_goes():
    fellow = ControlLink(None).handlers
    leader = FellowMessages(None).handlers
    # the handshakes' answers (enrol, `swarm update`, `swarm leave`) and what FellowHub reads itself
    read_in_place = {cm.Welcome, cm.Refused, cm.Current, cm.Updating, cm.Left, cm.UpdateFailed, cm.Heartbeat}
    assert set(CONTROL) <= set(fellow) | set(leader) | read_in_place
    assert cm.Heartbeat in leader and messages.HopLost in leader and messages.Generate in fellow


@pytest.mark.parametrize(("raw", "where"), [
    ({"t": "load", "model": "m", "load_id": "L", "config": {}, "files": [],
      "stage": {"index": 0, "num_stages": 1, "first_layer": 0, "end_layer": 2, "is_first": True}},
     "load.stage lacks the field 'is_last'"),
    ({"t": "link", "model": "m", "load_id": "L", "ring_id": "g", "index": 0, "num_stages": 2,
      "hop_in": {"hop_id": "h", "peer_key": "not bytes"}}, "link.hop_in.peer_key must be a byte string"),
    ({"t": "verify_result", "check": 7}, "verify_result.check must be a string"),
    ({"t": "link_report", "links": [{"fellow_id": "2", "path": "direct"}]},
     "link_report.links[0].fellow_id must be an integer"),
    ({"t": "punch_start", "model": "m", "hop_id": "h", "role": "a", "secret": b"s", "peer_candidates": [],
      "start_in_s": "soon"}, "punch_start.start_in_s must be a number"),
])
def test_a_malformed_control_message_is_a_protocol_error_naming_its_field(raw, where):
    with pytest.raises(ProtocolError, match=where.replace("[", r"\[").replace("]", r"\]")):
        wire.unpack(wire.encode(raw))


def test_the_envelope_of_another_protocol_is_read_with_what_it_did_not_send_at_defaults():
    other = wire.PROTOCOL_VERSION + 1
    old_heartbeat = {"t": "heartbeat", "v": other, "hardware": dataclasses.asdict(HARDWARE), "stages": ["m"]}
    read = wire.unpack(cbor2.dumps(old_heartbeat))
    assert read == cm.Heartbeat(HARDWARE, ["m"])
    offer = {"t": "update", "v": other, "version": "2.0", "protocol": other, "file": "f.whl", "sha256": "ab",
             "size": 1, "path": "/api/v1/update/f.whl", "changelog": "a field this version does not know"}
    assert wire.unpack(cbor2.dumps(offer)).offer() == {k: offer[k] for k in cm.Update().offer()}
    with pytest.raises(ProtocolError, match="protocol version"):  # the rest is read at this protocol only
        wire.unpack(cbor2.dumps({"t": "unload", "v": other, "model": "m"}))
    # a type this version does not know stays a plain map: the dispatchers log and skip it
    assert wire.unpack(wire.encode({"t": "from_the_future", "x": 1}))["x"] == 1
