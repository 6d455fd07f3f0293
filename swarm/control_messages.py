"""The control link's messages between the leader and a fellow, as typed records checked on decode (swarm.wire).

  both ways                Alive; Leave (the fellow asks to leave; the leader says go)
  leader -> fellow         Welcome, Refused, Load, Link, RingReady, Unlink, Unload, DropExtension, Update,
                           VerifyPick, VerifyRun, LeaveRefused, PunchPing, PunchPrepare, PunchStart, ProbeLinks
  fellow -> leader         Heartbeat, UpdateFailed, LoadProgress, Loaded, LoadFailed, Linked, LinkFailed, Unloaded,
                           VerifySample, VerifyResult, LinkReport, PunchPong, PunchCandidates, PunchResult, and the
                           ring's HopLost (swarm.messages)
  `swarm update`/`leave`   Current, Updating, Update, Left, Refused (one answer to the session's hello)

The hello that opens a link stays a plain map: it is read before the leader knows the sender's version, field by
field (swarm.leader.fleet.fellows), so a fellow of any earlier version still enrols and can be told to update.
The envelope's messages (swarm.wire.ENVELOPE_TYPES: Welcome, Refused, Alive, Heartbeat, Update, Updating, Current,
UpdateFailed) are read across protocol versions: every field a previous version did not send has a default, and a
field is never removed or given another type.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from swarm import messages  # the module: swarm.wire imports this one while swarm.messages may be half-loaded
from swarm.wire import message, record

# --- the envelope: read at any protocol version ---------------------------------------------------------------------


@message("welcome")
class Welcome:
    fellow_id: int
    credential: str
    name: str = ""
    stages: list[str] = dataclasses.field(default_factory=list)  # the models whose stage the fellow keeps
    leader: dict | None = None  # {"version", "protocol"} of the leader
    checks: str | None = None  # the early checks: what this PC can hold of the catalogue


@message("refused")
class Refused:
    message: str = ""


@message("alive")
class Alive:
    pass


@message("heartbeat")
class Heartbeat:
    hardware: messages.Hardware
    stages: list[str] = dataclasses.field(default_factory=list)
    hops: list[dict] = dataclasses.field(default_factory=list)  # each outgoing hop's stats (OutgoingHop.stats)
    held: dict = dataclasses.field(default_factory=dict)  # model -> {"requests", "caches"} its stage holds
    placement: dict = dataclasses.field(default_factory=dict)  # model -> where its stage's layers are
    calibration: dict | None = None  # how fast it runs a decoder layer (swarm.fellow.calibration)


@message("update")
class Update:
    """Install the leader's version (swarm.fellow.update.check_offer checks the offer's fields before any is used).
    To the running fellow on its control link, or the answer to `swarm update` (then with a node credential)."""

    version: str = "?"
    protocol: int | None = None
    file: str = ""
    sha256: str = ""
    size: int = 0
    path: str = ""
    credential: str | None = None  # `swarm update` only: to fetch the wheel with
    running: bool = False  # `swarm update` only: the fellow runs, and keeps the old version until restarted

    def offer(self) -> dict:
        return {"version": self.version, "protocol": self.protocol, "file": self.file, "sha256": self.sha256,
                "size": self.size, "path": self.path}


@message("updating")
class Updating:
    name: str = ""
    version: str = "?"


@message("current")
class Current:
    version: str = "?"


@message("update_failed")
class UpdateFailed:
    message: str = ""


# --- loading and linking stages ---------------------------------------------------------------------------------------


@record
class StageSlot:
    """Which stage a load places: its index in the ring and its layers."""

    index: int
    num_stages: int
    first_layer: int
    end_layer: int
    is_first: bool
    is_last: bool


@record
class FileEntry:
    """A file to fetch; ``params``: a GGUF's blocks' weight values (a fellow spreading a stage over cards)."""

    path: str
    sha256: str
    size: int
    params: int | None = None


@record
class DraftPart:
    """The draft model a last stage holds whole (SWARM_SERVE_DRAFT_MODEL)."""

    model: str
    config: dict
    num_layers: int
    files: list[FileEntry]
    stored_dtype: str = "float32"


@message("load")
class Load:
    model: str
    load_id: str
    stage: StageSlot
    config: dict
    files: list[FileEntry]
    gpu_dtype: str = "float16"
    cover: bool = False  # a hot cover: loaded and waiting to take over the stage
    stored_dtype: str = "float32"
    quantization: str | None = None
    kv_cache: str | None = None
    draft: DraftPart | None = None  # the last stage's only
    # a re-layout's stage for a fellow of the ring that holds a stage of the model sharing layers with it: it loads
    # only what that one lacks (swarm.stage.resplit: the layers, the embedding, the head and draft model), beside it
    # and apart from it, and splices them in at the Link that gives it this stage's layers (swarm.fellow.extending);
    # False: a plain load, which replaces any stage of the model it holds
    extend: bool = False


@record
class HopOut:
    """The hop a stage sends on: to whom, and how it may reach it."""

    hop_id: str
    peer_key: bytes
    peer_name: str
    direct: list[Any] | None = None  # [host, port] of the next stage's serving port
    transport: str = "auto"


@record
class HopIn:
    """The hop a stage receives on, and the key of the stage that sends."""

    hop_id: str
    peer_key: bytes


@message("link")
class Link:
    model: str
    load_id: str
    ring_id: str
    index: int
    num_stages: int
    hop_out: HopOut | None = None
    hop_in: HopIn | None = None
    # the stage's layers in this ring, sent to a fellow whose hello says "narrowing": a sub-range of those it holds
    # narrows its stage in place (a re-layout's switch, swarm.stage.narrow); None: the layers it holds
    first_layer: int | None = None
    end_layer: int | None = None


@message("ring_ready")
class RingReady:
    model: str
    ring_id: str | None = None


@message("unlink")
class Unlink:
    model: str


@message("unload")
class Unload:
    model: str


@message("drop_extension")
class DropExtension:
    """Drop what was loaded beside the stage of ``model`` for a re-layout that will not happen (Load.extend): the stage
    serves on as it was."""

    model: str


@message("load_progress")
class LoadProgress:
    model: str
    load_id: str
    phase: str
    fraction: float


@message("loaded")
class Loaded:
    model: str
    load_id: str
    stage: dict = dataclasses.field(default_factory=dict)  # swarm.fellow.stages.LoadedStage.summary()


@message("load_failed")
class LoadFailed:
    model: str
    load_id: str
    message: str


@message("linked")
class Linked:
    model: str
    ring_id: str


@message("link_failed")
class LinkFailed:
    model: str
    ring_id: str
    message: str


@message("unloaded")
class Unloaded:
    model: str
    load_id: str | None = None
    reason: str | None = None  # "idle": the stage unloaded itself (SWARM_MODEL_IDLE_UNLOAD_S)


# --- leaving ----------------------------------------------------------------------------------------------------------


@message("leave")
class Leave:
    """Fellow -> leader: hand my stages over (``force``: even those nobody can take), waiting at most ``wait_s``.
    Leader -> fellow: they are handed over, go (``message`` says what became of them)."""

    force: bool = False
    wait_s: float | None = None
    message: str = ""


@message("leave_refused")
class LeaveRefused:
    message: str = ""


@message("left")
class Left:
    message: str = ""


# --- spot checks (swarm.leader.serving.verify, swarm.fellow.verify) ---------------------------------------------------


@message("verify_pick")
class VerifyPick:
    """Keep the inputs of these passes of request ``rid``: ``picks`` are [position, check id] pairs."""

    model: str
    rid: str
    picks: list[list[Any]]


@message("verify_sample")
class VerifySample:
    """The picked passes' inputs since the last sample, and what the stage computed of them."""

    model: str
    check: str
    rid: str
    passes: list[list[int]]  # [position, rows] of each pass
    inputs: Any  # token ids (the first stage) or a tensor map (swarm.wire.tensor_to_wire)
    prompt_len: int
    output: dict  # {"token"} (the last stage) or {"hidden"}
    final: bool = True
    path: str | None = None  # the 4-bit kernel it computed with (swarm.stage.quantize.int4_path)


@message("verify_run")
class VerifyRun:
    """Recompute a sample on the checker: the same layers, the same passes."""

    model: str
    check: str
    first_layer: int
    end_layer: int
    rid: str
    passes: list[list[int]]
    inputs: Any
    prompt_len: int
    output: dict
    final: bool = True


@message("verify_result")
class VerifyResult:
    check: str
    output: dict | None = None
    path: str | None = None
    error: str | None = None
