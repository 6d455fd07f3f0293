"""Saved chats: each belongs to one user alone (admins included cannot read another's), with the seed's limits.

Mixed into :class:`swarm.store.db.Store`; ``StoreCore`` provides the connection, the transactions and the clock. Every
query names the owner, so a chat id that belongs to someone else reads as "no such chat".
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import sqlite3
from typing import Any

from swarm.errors import StoreError
from swarm.store.core import MAX_CHAT_BYTES, MAX_CHATS_PER_USER, StoreCore

__all__ = ["MAX_CHAT_BYTES", "MAX_CHATS_PER_USER", "Chat", "ChatLimitReached", "ChatSummary", "ChatTooLarge"]

TITLE_CHARS = 60  # "a chat is named after the start of its first message"
# How deep a chat's messages may nest (lists and maps): a message with content parts and tool calls is ~6 deep. At
# 950 levels a chat was stored that could never be read back (RecursionError answering it).
MAX_CHAT_DEPTH = 32
MAX_TITLE_CHARS = 200
DEFAULT_TITLE = "New chat"


class ChatLimitReached(StoreError):
    """The user already keeps as many chats as one user may."""


class ChatTooLarge(StoreError):
    """A chat's messages are larger than one saved chat may be."""


@dataclasses.dataclass(frozen=True)
class Chat:
    id: str
    user_id: int
    title: str
    model: str
    messages: list[Any]
    created_at: float
    updated_at: float


@dataclasses.dataclass(frozen=True)
class ChatSummary:
    """A row of the chat list: everything but the messages."""

    id: str
    title: str
    model: str
    message_count: int
    created_at: float
    updated_at: float


def _text_of(content: Any) -> str:
    """The text of an OpenAI-style message content: a string, or a list of parts with type "text"."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def _shorten(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    cut = text[:limit]
    space = cut.rfind(" ")
    if space >= limit // 2:  # cut at a word boundary unless that loses more than half
        cut = cut[:space]
    return cut.rstrip() + "…"


def default_title(messages: list[Any]) -> str:
    """The start of the first user message, on one line, about TITLE_CHARS long."""
    for message in messages:
        if isinstance(message, dict) and message.get("role") == "user":
            text = " ".join(_text_of(message.get("content")).split())
            if text:
                return _shorten(text, TITLE_CHARS)
    return DEFAULT_TITLE


def _depth(value: Any) -> int:
    """How deep lists and maps nest in ``value``, counted without recursion (so any depth is measured), stopping
    once past MAX_CHAT_DEPTH."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, depth)
            if depth > MAX_CHAT_DEPTH:
                break
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _size(n: int) -> str:
    return f"{n / 1_000_000:.1f} MB" if n >= 100_000 else f"{n} bytes"


class ChatsMixin(StoreCore):
    def _messages_json(self, messages: list[Any]) -> str:
        if not isinstance(messages, list):
            raise StoreError("a chat's messages must be a list of {role, content} objects.")
        if _depth(messages) > MAX_CHAT_DEPTH:
            raise StoreError(f"a chat's messages nest lists and objects more than {MAX_CHAT_DEPTH} levels deep; "
                             "send them as {role, content} objects whose content is text or a list of parts.")
        text = json.dumps(messages, ensure_ascii=False, separators=(",", ":"))
        size = len(text.encode())
        if size > self.max_chat_bytes:
            raise ChatTooLarge(
                f"this chat is {_size(size)}, over the {_size(self.max_chat_bytes)} one saved chat can hold, so it "
                "was not saved; start a new chat to go on (this one stays as it was last saved)."
            )
        return text

    @staticmethod
    def _chat(row: sqlite3.Row) -> Chat:
        return Chat(
            id=row["id"],
            user_id=row["user_id"],
            title=row["title"],
            model=row["model"],
            messages=json.loads(row["messages_json"]),
            created_at=row["created_at"],
            updated_at=row["updated_at"],
        )

    def create_chat(
        self, user_id: int, title: str | None = None, model: str = "", messages: list[Any] | None = None
    ) -> Chat:
        """A new chat; ``title`` defaults to the start of the first user message."""
        messages = [] if messages is None else messages
        text = self._messages_json(messages)
        title = _shorten(" ".join((title or "").split()), MAX_TITLE_CHARS) or default_title(messages)
        chat_id = secrets.token_urlsafe(12)
        now = self._now()
        with self._tx() as db:
            (count,) = db.execute("SELECT count(*) FROM chats WHERE user_id = ?", (user_id,)).fetchone()
            if count >= self.max_chats_per_user:
                raise ChatLimitReached(
                    f"you already keep {count} saved chats, the most one user can keep "
                    f"({self.max_chats_per_user}); delete some chats or start a new one after that."
                )
            db.execute(
                "INSERT INTO chats (id, user_id, title, model, messages_json, message_count, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (chat_id, user_id, title, model or "", text, len(messages), now, now),
            )
        chat = self.get_chat(user_id, chat_id)
        assert chat is not None
        return chat

    def get_chat(self, user_id: int, chat_id: str) -> Chat | None:
        """The chat if it is this user's; None otherwise, whoever asks."""
        row = self._one("SELECT * FROM chats WHERE id = ? AND user_id = ?", (chat_id, user_id))
        return self._chat(row) if row else None

    def list_chats(self, user_id: int, query: str | None = None) -> list[ChatSummary]:
        """This user's chats, most recently used first; ``query`` keeps those whose title or model contains it."""
        sql = "SELECT id, title, model, message_count, created_at, updated_at FROM chats WHERE user_id = ?"
        args: tuple[Any, ...] = (user_id,)
        needle = (query or "").strip().casefold()
        if needle:
            sql += " AND (instr(swarm_fold(title), ?) > 0 OR instr(swarm_fold(model), ?) > 0)"
            args += (needle, needle)
        sql += " ORDER BY updated_at DESC, rowid DESC"
        return [
            ChatSummary(
                id=r["id"],
                title=r["title"],
                model=r["model"],
                message_count=r["message_count"],
                created_at=r["created_at"],
                updated_at=r["updated_at"],
            )
            for r in self._all(sql, args)
        ]

    def update_chat(
        self,
        user_id: int,
        chat_id: str,
        title: str | None = None,
        messages: list[Any] | None = None,
        model: str | None = None,
    ) -> Chat | None:
        """Change what is given; None when the chat is not this user's. A chat still called "New chat" takes its
        title from the first user message once it has one."""
        text = None if messages is None else self._messages_json(messages)
        with self._tx() as db:
            row = db.execute(
                "SELECT title, messages_json FROM chats WHERE id = ? AND user_id = ?", (chat_id, user_id)
            ).fetchone()
            if row is None:
                return None
            sets: list[str] = ["updated_at = ?"]
            args: list[Any] = [self._now()]
            if title is not None:
                new_title = _shorten(" ".join(title.split()), MAX_TITLE_CHARS)
                sets.append("title = ?")
                if not new_title:  # a blank name goes back to the default
                    new_title = default_title(messages if messages is not None else json.loads(row["messages_json"]))
                args.append(new_title)
            elif messages is not None and row["title"] == DEFAULT_TITLE:
                sets.append("title = ?")
                args.append(default_title(messages))
            if messages is not None:
                sets += ["messages_json = ?", "message_count = ?"]
                args += [text, len(messages)]
            if model is not None:
                sets.append("model = ?")
                args.append(model)
            db.execute(f"UPDATE chats SET {', '.join(sets)} WHERE id = ? AND user_id = ?", (*args, chat_id, user_id))
        return self.get_chat(user_id, chat_id)

    def delete_chat(self, user_id: int, chat_id: str) -> bool:
        with self._tx() as db:
            return db.execute("DELETE FROM chats WHERE id = ? AND user_id = ?", (chat_id, user_id)).rowcount > 0
