"""The control link's messages of a KV handover at a drain or a re-layout (swarm.leader.serving.kv_carry,
swarm.fellow.handover), as typed records checked on decode (swarm.wire), beside swarm.control_messages.

  leader -> fellow    KvKeep (every stage of the old ring: keep the running requests' blocks; a stage whose layers a
                      new stage needs also exports them, all its layers or ``export_layers``), KvImport (a new stage:
                      hold these blocks, its layers put together in order)
  fellow -> leader    KvKept, KvImported: the names held, or why not (``message``)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from swarm.wire import message


@message("kv_keep")
class KvKeep:
    model: str
    ring_id: str
    handover: str
    epoch: int
    block: int  # tokens a block
    requests: list[list[Any]]  # [ring request id, [block name, ...]] of each running request
    export: bool = False
    # [first, end) of the stage's own cache layers (0: its first) to export; empty: all of them. A fellow from before
    # ignores it and exports all, which the leader then does not use.
    export_layers: list[int] = dataclasses.field(default_factory=list)


@message("kv_import")
class KvImport:
    model: str
    handover: str
    epoch: int
    blocks: list[dict]  # swarm.stage.kv_handover.export_blocks's maps


@message("kv_kept")
class KvKept:
    model: str
    handover: str
    names: list[bytes] = dataclasses.field(default_factory=list)
    blocks: list[dict] = dataclasses.field(default_factory=list)  # its export, when asked for one
    message: str | None = None


@message("kv_imported")
class KvImported:
    model: str
    handover: str
    names: list[bytes] = dataclasses.field(default_factory=list)
    message: str | None = None
