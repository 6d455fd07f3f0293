"""How long a conversation each model takes: its served context (its own, capped by SWARM_SERVE_CONTEXT_TOKENS
and its load's context_tokens), read from its config when it is not served yet, and the check of a request
against it."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

import trio

from swarm.errors import ContextTooLong
from swarm.leader.api.limits import context_reason, model_context, served_context
from swarm.leader.serving.requests import too_long

if TYPE_CHECKING:
    from swarm.leader.serving.serving import Serving

log = logging.getLogger(__name__)


class Contexts:
    """The served contexts of the models of one leader (its :class:`~swarm.leader.serving.serving.Serving`)."""

    def __init__(self, serving: Serving):
        self.serving = serving

    def context_tokens(self, name: str) -> int:
        """The served context of ``name`` (swarm.leader.api.limits.served_context): the longest conversation, prompt and
        reply, it takes -- its own context, capped by SWARM_SERVE_CONTEXT_TOKENS and its load's context_tokens. Never
        the pool's KV budget, which may hold far more than the model was made for (issue 32)."""
        return served_context(self._own_context(name), self.serving.settings.serve_context_tokens,
                              self.serving.context_caps.get(name))

    def largest_context(self) -> int:
        """The longest served context of the models loaded since the leader started (FALLBACK_CONTEXT before any):
        what a /v1 body may carry (swarm.leader.api.limits.chat_body_limit). A chat needs its model loaded (or loaded
        before, to load again on request), so no chat is refused by it that its model would take."""
        known = [*self.serving.served_contexts.values(), *(self.context_tokens(m) for m in self.serving.models)]
        return max(known, default=served_context(None, self.serving.settings.serve_context_tokens))

    async def context_of(self, name: str) -> int:
        """``context_tokens``, reading the model's config (in a worker thread) when it is not served yet."""
        if name not in self.serving.models and name not in self.serving.own_contexts:
            path = self.serving.models_root / name / "config.json"

            def read() -> int | None:
                try:
                    return model_context(json.loads(path.read_text()))
                except (OSError, ValueError):
                    return None

            self.serving.own_contexts[name] = await trio.to_thread.run_sync(read)
        return self.context_tokens(name)

    def _own_context(self, name: str) -> int | None:
        serving = self.serving.models.get(name)
        if serving is not None and serving.config:
            return model_context(serving.config)
        return self.serving.own_contexts.get(name)

    def check_context(self, name: str, need: int, prompt: int, reply: int) -> None:
        """ContextTooLong when a conversation of ``need`` tokens (``prompt`` and up to ``reply``) is longer than the
        served context of ``name``."""
        context = self.context_tokens(name)
        if need > context:
            why = context_reason(self._own_context(name), self.serving.settings.serve_context_tokens,
                                 self.serving.context_caps.get(name))
            raise ContextTooLong(too_long(need, prompt, reply, context, why))
