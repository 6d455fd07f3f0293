"""The OpenAI-compatible API: GET /v1/models and POST /v1/chat/completions (streaming and not); the parameters
are checked in swarm.leader.api.openai_params, /v1/completions lives in swarm.leader.api.completions."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import trio
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from swarm.errors import BadRequest, ContextTooLong, ModelNotLoaded, SwarmError
from swarm.leader.api.anthropic_params import anthropic_models
from swarm.leader.api.auth import current_user
from swarm.leader.api.http_errors import json_body, openai_error
from swarm.leader.api.limits import check_prompt_bytes, check_replies
from swarm.leader.api.openai_params import ChatParams, choice_seed, parse_chat_body, to_sampling
from swarm.leader.api.replies import Choice, ReplyStream, ReplyText, error_events, next_event, read_choices
from swarm.leader.chat.chat_format import (
    chat_format,
    encode_chat,
    eos_ids,
    generation_top_k,
    load_tokenizer,
    prompt_thinking,
    sampling_defaults,
    think_tokens,
)
from swarm.leader.chat.tool_calls import ToolCallSplitter, forced_grammar
from swarm.leader.serving import timing
from swarm.leader.serving.request import Reader, Request

log = logging.getLogger(__name__)


class OpenAIRoutes:
    def __init__(self, leader):
        self.leader = leader

    async def models(self, request: HttpRequest):
        """The models of the caller's pools (an admin's: every pool's)."""
        try:
            user = await current_user(request, self.leader.store)
            store = self.leader.store
            rows = await trio.to_thread.run_sync(lambda: store.list_models(store.visible_pool_ids(user)))
        except Exception as exc:  # the API boundary: any failure is answered in OpenAI's error shape
            return openai_error(exc)
        if "anthropic-version" in request.headers:  # Anthropic's clients (swarm.leader.api.anthropic_api): their shape
            return JSONResponse(anthropic_models(rows))
        data = [{"id": m.name, "object": "model", "created": int(m.created_at), "owned_by": "swarm",
                 "status": self.leader.serving.status(m.name)} for m in rows]
        return JSONResponse({"object": "list", "data": data})

    async def chat_completions(self, request: HttpRequest):
        stream = False
        try:
            user = await current_user(request, self.leader.store)
            body = await json_body(request)
            stream = body.get("stream") is True
            opened = await self.open_chat(request, body, user)
            if opened is None:
                return Response(status_code=499)  # nobody reads it
        except Exception as exc:  # every failure becomes the client's OpenAI-shaped error, not a 500
            if stream and isinstance(exc, ContextTooLong):  # the seed: context_length_exceeded in a stream
                return StreamingResponse(error_events(exc), media_type="text/event-stream")
            return openai_error(exc)
        params, choices = opened
        tokenizer = choices[0].text.text.tokenizer
        ring_requests = [c.request for c in choices]
        first = ring_requests[0]
        created = int(time.time())
        if params.stream:
            return ReplyStream(self.leader.serving, ring_requests, self._stream(choices, created),
                               headers={"x-swarm-request-id": first.id, "cache-control": "no-cache"})
        failed = await read_choices(self.leader.serving, choices, self.collect, request.receive)
        if failed is not None:
            return failed
        await timing.settle(self.leader.serving, first)
        out = []
        for choice in choices:
            message: dict[str, Any] = {"role": "assistant", "content": choice.content}
            if choice.reasoning:
                message["reasoning_content"] = choice.reasoning
            if choice.calls:
                message["content"] = choice.content or None
                message["tool_calls"] = choice.calls
            item = {"index": choice.index, "message": message, "finish_reason": choice.finish}
            if choice.top is not None:
                item["logprobs"] = {"content": choice.logprobs(tokenizer, choice.text.used), "refusal": None}
            if params.return_token_ids:  # vLLM's extension: the exact tokens, for tests and tools
                item["token_ids"] = list(choice.request.tokens[: choice.text.used])
                item["prompt_token_ids"] = list(choice.request.prompt)
            out.append(item)
        return JSONResponse({
            "id": f"chatcmpl-{first.id}", "object": "chat.completion", "created": created,
            "model": params.model, "choices": out, "usage": _usage(choices),
            "swarm": {"timing": timing.of_request(self.leader.serving, first)},
        }, headers={"x-swarm-request-id": first.id})

    async def open_chat(self, request: HttpRequest, body: dict, user) -> tuple[ChatParams, list[Choice]] | None:
        """A chat completion ``body`` (the OpenAI route's, or another API's translated into it) checked, on its way
        to the ring and started there: its parameters and its choices, ready to read. None when the client left
        while the requests waited (they are cancelled then); a 503 if they wait too long. Whatever fails cancels
        the requests already submitted, and raises."""
        ring_requests: list[Request] = []
        try:
            settings = self.leader.settings
            # in a worker thread: it walks every message, and a body may hold megabytes of them
            params = await trio.to_thread.run_sync(parse_chat_body, body, settings.max_tokens_limit)
            check_replies(1, params.n, settings.serve_request_replies)
            params.model = await self.resolve(params.model, user)
            inside, tool_family = await self._submit(params, user, ring_requests)
            # a client that leaves meanwhile cancels them all
            if await self.leader.serving.intake.wait_started(ring_requests, request.receive):
                return None
            tokenizer = load_tokenizer(str(self.leader.models_root / params.model))
        except BaseException:
            for ring_request in ring_requests:
                self.leader.serving.cancel(ring_request)
            raise
        harmony = tool_family == "harmony"
        choices = [Choice(i, r, ReplyText(tokenizer, inside, params.stop, harmony=harmony), self.reader(r),
                          params.logprobs) for i, r in enumerate(ring_requests)]
        if params.tools:
            for choice in choices:  # harmony's calls reach it in the <tool_call> format (swarm.leader.chat.harmony)
                choice.tools = ToolCallSplitter("hermes" if harmony else tool_family, params.tools)
        return params, choices

    async def _submit(self, params: ChatParams, user, out: list[Request]) -> tuple[str, str]:
        """The request's choices on their way to the ring (appended to ``out`` as they go, so that the caller can
        cancel them if a later one is refused); where the prompt left the thinking block (opened, closed: see
        swarm.leader.chat.chat_format.prompt_thinking), and the format of the model's tool calls (chat_format)."""
        manifest, model_dir = await self.model(params.model)
        architecture = manifest.get("architecture", "")
        prompt = await self.encode(params, architecture)
        inside = await trio.to_thread.run_sync(prompt_thinking, model_dir, prompt)
        family = chat_format(architecture)
        if params.forced_tool is not None and params.tools and family in ("harmony", "glm"):
            raise BadRequest(f"model {params.model} writes tool calls in its own format ({family}), which swarm cannot "
                             "force yet. Send tool_choice 'auto' (the model still sees the tools) and ask for the call "
                             "in the message.", "unsupported_parameter")
        if params.forced_tool is not None and params.tools:  # tool_choice forces a call: a grammar makes the reply one
            params.grammar = forced_grammar(params.tools, family, None if params.forced_tool == "*" else
                                            params.forced_tool)
        await self.send(params.model, prompt, params.max_tokens, params.sampling, params, user.id, out,
                        thinking=params.thinking is not False, token_id=user.token_id)
        return inside, family

    async def encode(self, params: ChatParams, architecture: str) -> list[int]:
        """The prompt of ``params`` as token ids: its messages, tools and thinking switch through the model's chat
        template (Anthropic's count_tokens counts the same)."""
        model_dir = self.leader.models_root / params.model
        # Refused by its byte count before the tokenizer sees it (swarm.leader.api.limits): a 24 MB prompt took 11 s. In
        # a worker thread, as the tokenizer: both walk the whole text.
        context = await self.leader.serving.contexts.context_of(params.model)
        await trio.to_thread.run_sync(check_prompt_bytes, params.messages, model_dir, context)
        try:
            return await trio.to_thread.run_sync(encode_chat, model_dir, params.messages, params.thinking,
                                                 architecture, params.tools, params.effort)
        except Exception as exc:
            from jinja2 import TemplateError

            if isinstance(exc, TemplateError):  # the template refused these messages (roles out of order, say)
                raise BadRequest(f"the messages cannot be put through the model's chat template: {exc}",
                                 "invalid_messages") from None
            raise

    async def resolve(self, name: str, user) -> str:
        """The id of the model ``name`` names among ``user``'s pools (swarm.store.fleet.FleetMixin.resolve_model):
        a model of another pool is a 404, as one that does not exist."""
        store = self.leader.store
        return (await trio.to_thread.run_sync(lambda: store.resolve_model(name, store.visible_pool_ids(user)))).name

    async def model(self, name: str) -> tuple[dict, Path]:
        """The manifest and folder of a model that is served (or comes back for a request)."""
        leader = self.leader
        manifest = await leader.serving.manifest(name)
        if leader.serving.status(name) == "not_loaded" and not await leader.serving.auto_load.comes_back(name):
            raise ModelNotLoaded(
                f"model {name} is not loaded, and auto-load is off (the admin page). Load it first (swarm model-load "
                f"{name}, or Load on the chat page), then send the request again.")
        return manifest, leader.models_root / name

    async def send(self, name: str, prompt: list[int], max_tokens: int | None, asked: dict, params, owner: int,
                   out: list[Request], thinking: bool = True, prompt_logprobs: int | None = None,
                   token_id: int | None = None) -> None:
        """``params.n`` requests for ``prompt`` on their way to the ring, appended to ``out``: the sampling asked for
        over the model's defaults, choice i seeded from the request's seed (choice 0 is the reply n=1 gets)."""
        leader = self.leader
        manifest, model_dir = await self.model(name)
        context = await leader.serving.contexts.context_of(name)
        if max_tokens is None:  # as long a reply as the model's served context leaves room for
            max_tokens = max(1, min(leader.settings.max_tokens_limit, context - len(prompt)))
        # before anything is submitted (or a model that went idle loaded for it): the served context, not the pool
        leader.serving.contexts.check_context(name, len(prompt) + max_tokens, len(prompt), max_tokens)
        serving = leader.serving.models.get(name)
        own_top_k = generation_top_k(model_dir) if serving is not None and len(serving.stages) == 1 else None
        sampling = sampling_defaults(manifest.get("architecture", ""), thinking, name, own_top_k)
        sampling.update(asked)
        vocab = int(manifest.get("vocab_size") or 0)
        outside = [t for t in sampling.get("logit_bias", {}) if vocab and t >= vocab]
        if outside:
            raise BadRequest(f"'logit_bias' names token {outside[0]}, but model {name} has tokens 0 to {vocab - 1}.",
                             "invalid_logit_bias")
        eos = [] if params.ignore_eos else await trio.to_thread.run_sync(eos_ids, model_dir, manifest)
        grammar = getattr(params, "grammar", None)
        think = await trio.to_thread.run_sync(think_tokens, model_dir) if grammar and thinking else None
        first = to_sampling(sampling, params.logprobs, prompt_logprobs, grammar, think)
        if first.temperature <= 0:
            # Greedy choices are one reply: it runs once on the ring and every choice reads it.
            request = Request(model=name, prompt=prompt, max_tokens=max_tokens, sampling=first, eos=eos, owner=owner,
                              token_id=token_id)
            out.extend([await leader.serving.intake.submit(request)] * params.n)
            return
        choices = []
        for i in range(params.n):
            seed = first.seed if i == 0 or first.seed is None else choice_seed(first.seed, i)
            choices.append(Request(model=name, prompt=prompt, max_tokens=max_tokens,
                                   sampling=dataclasses.replace(first, seed=seed), eos=eos, owner=owner,
                                   token_id=token_id))
        if len(choices) > 1 and prompt_logprobs is None:
            # One group: the ring prefills the prompt once and copies its cache to each choice. (Prompt logprobs come
            # from the prefill's rows, which a group computes under its carrier: such choices run on their own.)
            await leader.serving.intake.submit_group(choices)
            out.extend(choices)
            return
        for request in choices:
            out.append(await leader.serving.intake.submit(request))

    def reader(self, ring_request: Request) -> Reader:
        """A reader of ``ring_request``'s tokens that gives up on it after the settings' stall and queue times."""
        settings = self.leader.settings
        return Reader(ring_request, settings.request_stall_s, settings.serve_queue_timeout_s)

    async def collect(self, choice: Choice) -> None:
        """Read one choice to its end (its text, finish reason and token count in ``choice``)."""
        while True:
            kind, value = await choice.reader.next()
            if kind == "error":
                raise SwarmError(value)
            r, c = choice.text.push(value) if kind == "tokens" else choice.text.flush()
            choice.reasoning += r
            choice.content += choice.content_delta(c)
            if choice.text.stopped:
                self.leader.serving.cancel(choice.request)  # the ring stops now and frees the request's caches
            if choice.text.stopped or kind != "tokens":
                choice.content += choice.end_content()
                finish = "stop" if choice.text.stopped or value == "cancelled" else value
                choice.finish = choice.finish_reason(finish)
                return

    async def _stream(self, choices: list[Choice], created: int):
        first = choices[0].request
        base = {"id": f"chatcmpl-{first.id}", "object": "chat.completion.chunk", "created": created,
                "model": first.model}
        tokenizer = choices[0].text.text.tokenizer

        def chunk(choice: Choice, delta: dict, finish=None, extra=None) -> str:
            item = {"index": choice.index, "delta": delta, "finish_reason": finish}
            if choice.top is not None and (delta or finish):  # the tokens behind this chunk's text
                item["logprobs"] = {"content": choice.logprobs(tokenizer, choice.text.used, choice.sent)}
                choice.sent = choice.text.used
            data = {**base, "choices": [item], **(extra or {})}
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        def deltas(choice: Choice, reasoning: str, content: str):
            if reasoning:
                yield chunk(choice, {"reasoning_content": reasoning})
            content = choice.content_delta(content)
            if content:
                yield chunk(choice, {"content": content})
            for call in choice.call_deltas():  # a tool call's name, then its arguments piece by piece
                yield chunk(choice, {"tool_calls": [call]})

        async def finished(choice: Choice, finish: str):
            content = choice.end_content()
            if content:
                yield chunk(choice, {"content": content})
            calls = choice.call_deltas()  # what of the calls had not streamed yet
            if calls:
                yield chunk(choice, {"tool_calls": calls})
            choice.finish = choice.finish_reason(finish)
            extra = None
            if all(c.finish is not None for c in choices):  # usage and timing come with the last choice's end
                await timing.settle(self.leader.serving, first)
                extra = {"usage": _usage(choices), "swarm": {"timing": timing.of_request(self.leader.serving, first)}}
            yield chunk(choice, {}, finish=choice.finish, extra=extra)

        try:
            for choice in choices:
                yield chunk(choice, {"role": "assistant", "content": ""})
            while any(c.finish is None for c in choices):
                choice, kind, value = await next_event([c for c in choices if c.finish is None])
                text = choice.text
                if kind == "tokens":
                    for token in value:  # one token per chunk, however the fellows batched them
                        for line in deltas(choice, *text.push([token])):
                            yield line
                        if text.stopped:
                            break
                    if text.stopped:
                        self.leader.serving.cancel(choice.request)  # the ring stops now and frees the caches
                        async for line in finished(choice, "stop"):
                            yield line
                elif kind == "error":
                    payload = {"error": {"message": value, "type": "server_error", "code": "ring_failed"}}
                    yield f"data: {json.dumps(payload)}\n\n"
                    break
                else:
                    for line in deltas(choice, *text.flush()):
                        yield line
                    async for line in finished(choice, "stop" if value == "cancelled" else value):
                        yield line
            yield "data: [DONE]\n\n"
        finally:
            # The client went away or the stream ended: make sure the fellows stop (hypercorn may never tell us of a
            # disconnect, so this also runs when a send fails).
            for choice in choices:
                self.leader.serving.cancel(choice.request)


def _usage(choices: list[Choice]) -> dict:
    """Token counts: the prompt once, and every choice's reply up to the token that completed a stop string."""
    prompt = len(choices[0].request.prompt)
    reply = sum(min(c.text.used, len(c.request.tokens)) for c in choices)
    # OpenAI's shape for prompt caching: the prompt tokens the prefix cache held (swarm.leader.serving.prefix_index)
    cached = choices[0].request.cached_tokens
    return {"prompt_tokens": prompt, "completion_tokens": reply, "total_tokens": prompt + reply,
            "prompt_tokens_details": {"cached_tokens": cached}}
