"""OpenAI's Responses API on the leader, for OpenAI's SDKs and its Agents SDK: POST /v1/responses (one JSON object,
or typed server-sent events with ``"stream": true``), GET and DELETE /v1/responses/{id} and
GET /v1/responses/{id}/input_items, with the same API tokens as /v1/chat/completions.

A request is translated into a Chat Completions body (swarm.leader.api.responses_format) and goes the same way as one
(swarm.leader.api.openai_api.OpenAIRoutes.open_chat: the parameter checks, admission, the queue, quotas, the context
check, history, structured output, tools, the reasoning switch, cancel on disconnect); only the answer's shape is
the Responses API's. A response is stored (unless ``"store": false``) for its user alone
(swarm.store.responses): ``previous_response_id`` continues its conversation, and another user's id is a 404.
"""

from __future__ import annotations

import json
import time
from typing import Any

import trio
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from swarm.errors import BadRequest, ResponseNotFound, StoreError, SwarmError
from swarm.leader.api import responses_format as fmt
from swarm.leader.api.auth import current_user
from swarm.leader.api.http_errors import json_body, openai_error
from swarm.leader.api.openai_api import OpenAIRoutes
from swarm.leader.api.replies import Choice, ReplyStream, next_event, read_choices
from swarm.leader.serving import timing

RESPONSES_PATH = "/v1/responses"


class Reply:
    """One response being read off the ring: its output items as they grow, and the typed events that say so."""

    def __init__(self, routes: OpenAIRoutes, choice: Choice, response_id: str, body: dict, model: str):
        self.routes = routes
        self.choice = choice
        self.id = response_id
        self.body = body
        self.model = model
        self.created = int(time.time())
        self.output: list[dict] = []
        self.seq = 0
        self.reasoning: tuple[int, str] | None = None  # the open reasoning item: (output index, text)
        self.message: tuple[int, str] | None = None  # the open message item: (output index, text)
        self.calls: dict[int, int] = {}  # a call's index among the reply's calls -> its output index
        self.reasoning_tokens = 0
        self.response: dict | None = None  # the finished response object
        self.logprobs: list[dict] = []  # the open message's tokens' logprobs, when asked for

    def event(self, kind: str, **fields: Any) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def snapshot(self, status: str, **extra: Any) -> dict:
        return fmt.response_object(self.id, self.created, self.body, self.model, status, self.output, **extra)

    def _add(self, item: dict) -> tuple[int, dict]:
        self.output.append(item)
        index = len(self.output) - 1
        return index, self.event("response.output_item.added", output_index=index, item=item)

    def _close_reasoning(self) -> list[dict]:
        if self.reasoning is None:
            return []
        index, text = self.reasoning
        self.reasoning = None
        item = self.output[index] = fmt.reasoning_item(self.output[index]["id"], text)
        return [self.event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=text),
                self.event("response.output_item.done", output_index=index, item=item)]

    def _close_message(self) -> list[dict]:
        if self.message is None:
            return []
        index, text = self.message
        self.message = None
        item = self.output[index] = fmt.message_item(self.output[index]["id"], text, logprobs=self.logprobs)
        self.logprobs = []
        part = item["content"][0]
        return [self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=text, logprobs=part["logprobs"]),
                self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=index, item=item)]

    def piece(self, reasoning: str, content: str) -> list[dict]:
        out: list[dict] = []
        if reasoning:
            self.reasoning_tokens += 1  # pushed a token at a time: this token is reasoning
            if self.reasoning is None:
                index, added = self._add(fmt.reasoning_item(fmt.new_id("rs"), ""))
                out.append(added)
                self.reasoning = (index, "")
            index, text = self.reasoning
            self.reasoning = (index, text + reasoning)
            out.append(self.event("response.reasoning_text.delta", item_id=self.output[index]["id"],
                                  output_index=index, content_index=0, delta=reasoning))
            if not content and self.choice.top is not None:
                self.choice.sent = self.choice.text.used  # thinking's tokens are no part of output_text's logprobs
        out += self._content(self.choice.content_delta(content))
        out += self._call_deltas()
        return out

    def _content(self, content: str) -> list[dict]:
        """Events for content that goes out now (past the tool-call splitter)."""
        out: list[dict] = []
        if content:
            out += self._close_reasoning()
            if self.message is None:
                item_id = fmt.new_id("msg")
                index, added = self._add(fmt.message_item(item_id, "", "in_progress"))
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                out += [added, self.event("response.content_part.added", item_id=item_id, output_index=index,
                                          content_index=0, part=part)]
                self.message = (index, "")
            index, text = self.message
            self.message = (index, text + content)
            logprobs = self._new_logprobs()
            out.append(self.event("response.output_text.delta", item_id=self.output[index]["id"], output_index=index,
                                  content_index=0, delta=content, logprobs=logprobs))
        return out

    def _new_logprobs(self) -> list[dict]:
        """The logprobs of the tokens whose text went out since the last call (none unless asked for)."""
        choice = self.choice
        if choice.top is None:
            return []
        entries = choice.logprobs(choice.text.text.tokenizer, choice.text.used, choice.sent)
        choice.sent = choice.text.used
        self.logprobs += entries
        return entries

    def _call_deltas(self) -> list[dict]:
        out: list[dict] = []
        for delta in self.choice.call_deltas():
            number = delta.get("index", 0)
            function = delta.get("function") or {}
            if number not in self.calls:
                out += self._close_reasoning() + self._close_message()
                call = {"id": delta.get("id"), "function": {"name": function.get("name"), "arguments": ""}}
                index, added = self._add(fmt.call_item(fmt.new_id("fc"), call, "in_progress"))
                out.append(added)
                self.calls[number] = index
            index = self.calls[number]
            arguments = function.get("arguments") or ""
            if arguments:
                self.output[index]["arguments"] += arguments
                out.append(self.event("response.function_call_arguments.delta", item_id=self.output[index]["id"],
                                      output_index=index, delta=arguments))
        return out

    async def finish(self, finish: str) -> list[dict]:
        choice = self.choice
        out = self._content(choice.end_content())  # what the tool-call splitter held back, the calls parsed
        out += self._call_deltas()
        choice.finish = choice.finish_reason(finish)
        out += self._close_reasoning() + self._close_message()
        for index in sorted(self.calls.values()):
            item = self.output[index]
            final = next((c for c in choice.calls if c.get("id") == item["call_id"]), None)
            if final is not None:
                item["arguments"] = final["function"]["arguments"]
            item["status"] = "completed"
            out += [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               name=item["name"], arguments=item["arguments"]),
                    self.event("response.output_item.done", output_index=index, item=item)]
        await timing.settle(self.routes.leader.serving, choice.request)
        request = choice.request
        used = min(choice.text.used, len(request.tokens))
        usage = {"input_tokens": len(request.prompt), "input_tokens_details": {"cached_tokens": request.cached_tokens},
                 "output_tokens": used, "output_tokens_details": {"reasoning_tokens": min(self.reasoning_tokens, used)},
                 "total_tokens": len(request.prompt) + used}
        status = "incomplete" if choice.finish == "length" else "completed"
        self.response = self.snapshot(status, usage=usage, finish=choice.finish)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return out + [self.event(kind, response=self.response)]

    async def events(self):
        """The reply's events, a token at a time, to its end; a failed ring raises SwarmError."""
        choice, serving = self.choice, self.routes.leader.serving
        while choice.finish is None:
            _, kind, value = await next_event([choice])
            text = choice.text
            if kind == "tokens":
                for token in value:
                    for out in self.piece(*text.push([token])):
                        yield out
                    if text.stopped:
                        break
                if text.stopped:
                    serving.cancel(choice.request)  # the ring stops now and frees the caches
                    for out in await self.finish("stop"):
                        yield out
            elif kind == "error":
                raise SwarmError(value)
            else:
                for out in self.piece(*text.flush()):
                    yield out
                for out in await self.finish("stop" if value == "cancelled" else value):
                    yield out


class ResponsesRoutes:
    def __init__(self, routes: OpenAIRoutes):
        self.routes = routes
        self.leader = routes.leader

    async def _stored(self, user, response_id: str):
        store = self.leader.store
        stored = await trio.to_thread.run_sync(store.get_response, user.id, response_id)
        if stored is None:
            raise ResponseNotFound(f"no stored response has the id '{response_id}' for you. Responses are kept only "
                                   "when sent with \"store\" true (the default), for the user who made them.")
        return stored

    async def create(self, request: HttpRequest):
        try:
            user = await current_user(request, self.leader.store)
            body = await json_body(request)
            stream = body.get("stream") is True
            store = body.get("store") is not False
            if body.get("store") not in (None, True, False) or body.get("stream") not in (None, True, False):
                raise BadRequest("'store' and 'stream' must be true or false.", "invalid_request")
            history: list[dict] = []
            previous = body.get("previous_response_id")
            if previous is not None:
                if not isinstance(previous, str):
                    raise BadRequest("'previous_response_id' must be the id of a stored response.", "invalid_request")
                history = (await self._stored(user, previous)).messages
            items = fmt.input_items(body.get("input"))
            translated = fmt.chat_body(body, history, items)
            opened = await self.routes.open_chat(request, translated, user)
            if opened is None:
                return Response(status_code=499)  # the client left; nobody reads it
        except Exception as exc:  # the API boundary: any failure is answered in OpenAI's error shape
            return openai_error(exc)
        params, choices = opened
        reply = Reply(self.routes, choices[0], fmt.new_id("resp"), body, params.model)
        kept = (user.id, items, history + fmt.chat_messages(items))  # the conversation, without the instructions
        headers = {"x-swarm-request-id": reply.choice.request.id}
        if stream:
            return ReplyStream(self.leader.serving, [reply.choice.request],
                               self._stream(reply, kept if store else None),
                               headers={**headers, "cache-control": "no-cache"})

        async def collect(choice: Choice) -> None:
            async for _ in reply.events():
                pass

        failed = await read_choices(self.leader.serving, choices, collect, request.receive)
        if failed is not None:
            return failed
        assert reply.response is not None
        if store:
            try:
                await self._save(reply, kept)
            except Exception as exc:  # the API boundary: any failure is answered in OpenAI's error shape
                return openai_error(exc)
        return JSONResponse(reply.response, headers=headers)

    async def _save(self, reply: Reply, kept: tuple) -> None:
        user_id, items, conversation = kept
        assert reply.response is not None
        messages = conversation + fmt.output_messages(reply.response["output"])
        store = self.leader.store
        await trio.to_thread.run_sync(lambda: store.save_response(user_id, reply.id, reply.model, reply.response,
                                                                  items, messages))

    async def _stream(self, reply: Reply, kept: tuple | None):
        def sse(event: dict) -> str:
            return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

        try:
            yield sse(reply.event("response.created", response=reply.snapshot("in_progress")))
            yield sse(reply.event("response.in_progress", response=reply.snapshot("in_progress")))
            try:
                async for event in reply.events():
                    if event["type"] in ("response.completed", "response.incomplete") and kept is not None:
                        try:
                            await self._save(reply, kept)
                        except StoreError as exc:  # too large to keep: the reply still goes out, said so first
                            event["response"]["store"] = False
                            yield sse({"type": "error", "sequence_number": event["sequence_number"],
                                       "code": "store_refused", "message": str(exc), "param": "store"})
                            event["sequence_number"] = reply.seq
                            reply.seq += 1
                    yield sse(event)
            except SwarmError as exc:
                error = {"code": "server_error", "message": str(exc)}
                yield sse(reply.event("response.failed", response=reply.snapshot("failed", error=error)))
        finally:
            self.leader.serving.cancel(reply.choice.request)

    async def retrieve(self, request: HttpRequest):
        try:
            user = await current_user(request, self.leader.store)
            stored = await self._stored(user, request.path_params["response_id"])
        except Exception as exc:  # the API boundary: any failure is answered in OpenAI's error shape
            return openai_error(exc)
        return JSONResponse(stored.response)

    async def delete(self, request: HttpRequest):
        try:
            user = await current_user(request, self.leader.store)
            response_id = request.path_params["response_id"]
            store = self.leader.store
            if not await trio.to_thread.run_sync(store.delete_response, user.id, response_id):
                await self._stored(user, response_id)  # says it is not there
        except Exception as exc:  # the API boundary: any failure is answered in OpenAI's error shape
            return openai_error(exc)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def input_items(self, request: HttpRequest):
        """The response's input items, newest first (``order=asc``: oldest first); ``limit`` 1 to 100 (20)."""
        try:
            user = await current_user(request, self.leader.store)
            stored = await self._stored(user, request.path_params["response_id"])
            order = request.query_params.get("order", "desc")
            limit_text = request.query_params.get("limit", "20")
            if order not in ("asc", "desc") or not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
                raise BadRequest("'order' must be asc or desc, and 'limit' a number from 1 to 100.", "invalid_request")
        except Exception as exc:  # the API boundary: any failure is answered in OpenAI's error shape
            return openai_error(exc)
        items = stored.input_items if order == "asc" else list(reversed(stored.input_items))
        after = request.query_params.get("after")
        if after:
            ids = [i["id"] for i in items]
            items = items[ids.index(after) + 1:] if after in ids else []
        page = items[: int(limit_text)]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)})

