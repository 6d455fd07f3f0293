"""Stored responses of the Responses API (swarm.leader.api.responses_api): the response as it was answered, its input
items, and the whole conversation up to and including its output (as chat messages), so that a later request
continues it with ``previous_response_id``. Each belongs to one user alone: every query names the owner, so another
user's id reads as "no such response". A user keeps at most ``max_chats_per_user`` of them (the oldest go first) and
each is limited to the size of a saved chat.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from swarm.store.chats import ChatTooLarge
from swarm.store.core import StoreCore


@dataclasses.dataclass(frozen=True)
class StoredResponse:
    id: str
    user_id: int
    model: str
    response: dict
    input_items: list[dict]
    messages: list[dict]
    created_at: float


class ResponsesMixin(StoreCore):
    def save_response(self, user_id: int, response_id: str, model: str, response: dict, input_items: list[dict],
                      messages: list[dict]) -> None:
        texts = [json.dumps(v, ensure_ascii=False, separators=(",", ":")) for v in (response, input_items, messages)]
        size = sum(len(t.encode()) for t in texts)
        if size > self.max_chat_bytes:
            raise ChatTooLarge(f"this response and its conversation are {size} bytes, over the {self.max_chat_bytes} "
                               "one stored response can hold, so it was not stored; send the request with "
                               "\"store\": false, or start a new conversation.")
        with self._tx() as db:
            db.execute(
                "INSERT INTO responses (id, user_id, model, response_json, input_json, messages_json, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)", (response_id, user_id, model, *texts, self._now()))
            # the oldest go once a user keeps more than the most one user may
            db.execute(
                "DELETE FROM responses WHERE user_id = ? AND id NOT IN (SELECT id FROM responses WHERE user_id = ? "
                "ORDER BY created_at DESC LIMIT ?)", (user_id, user_id, self.max_chats_per_user))

    def get_response(self, user_id: int, response_id: str) -> StoredResponse | None:
        """The stored response if it is this user's; None otherwise, whoever asks."""
        row = self._one("SELECT * FROM responses WHERE id = ? AND user_id = ?", (response_id, user_id))
        if row is None:
            return None
        loaded: list[Any] = [json.loads(row[k]) for k in ("response_json", "input_json", "messages_json")]
        response, items, messages = loaded
        return StoredResponse(row["id"], row["user_id"], row["model"], response, items, messages, row["created_at"])

    def delete_response(self, user_id: int, response_id: str) -> bool:
        with self._tx() as db:
            return db.execute("DELETE FROM responses WHERE id = ? AND user_id = ?",
                              (response_id, user_id)).rowcount > 0
