"""The control link's messages of a drain's KV handover (swarm.leader.serving.kv_carry, swarm.fellow.handover), as
typed records checked on decode (swarm.wire), beside swarm.control_messages.

  leader -> fellow    KvKeep (every stage of the old ring: keep the running requests' blocks; the leaving stage also
                      exports them), KvImport (the taker's copy of the stage: hold these blocks)
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
    blocks: list[dict] = dataclasses.field(default_factory=list)  # the leaving stage's export
    message: str | None = None


@message("kv_imported")
class KvImported:
    model: str
    handover: str
    names: list[bytes] = dataclasses.field(default_factory=list)
    message: str | None = None
