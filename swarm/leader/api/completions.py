"""POST /v1/completions, the legacy route that evaluation harnesses and older tools use: a prompt as text or token
ids (or a list of them), no chat template, ``echo``, ``logprobs`` (the legacy shape: tokens, token_logprobs,
top_logprobs, text_offset), ``stop``, ``n``, streaming.

``echo`` with ``logprobs`` returns the prompt's own logprobs too (the model's, computed on the last stage over every
prompt row): with ``max_tokens`` 0 that is a prompt's log-likelihood, what lm-evaluation-harness asks for.
"""

from __future__ import annotations

import json
import time

import trio
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from swarm.errors import BadRequest, ContextTooLong, SwarmError
from swarm.leader.api.auth import current_user
from swarm.leader.api.completion_params import CompletionParams, parse_completion_body
from swarm.leader.api.http_errors import json_body, openai_error
from swarm.leader.api.limits import check_prompt_bytes, check_replies
from swarm.leader.api.replies import Choice, ReplyStream, ReplyText, error_events, next_event, read_choices
from swarm.leader.chat.chat_format import load_tokenizer
from swarm.leader.chat.logprobs import token_text
from swarm.leader.serving import timing
from swarm.leader.serving.request import Request


class Completion(Choice):
    """A choice of the legacy route: its prompt (for echo) and how much of the reply it shows."""

    def __init__(self, *args, prompt_text: str, limit: int):
        super().__init__(*args)
        self.prompt_text = prompt_text
        self.limit = limit  # 0: nothing generated is shown (the ring still draws one token)
        self.offset = 0  # text_offset of the next token, in a stream
        self.echoed = False


class CompletionRoutes:
    def __init__(self, routes):
        self.routes = routes  # the OpenAIRoutes: a model's folder, sending requests, readers
        self.leader = routes.leader

    async def completions(self, request: HttpRequest):
        stream = False
        ring_requests: list[Request] = []
        try:
            user = await current_user(request, self.leader.store)
            body = await json_body(request)
            stream = body.get("stream") is True
            settings = self.leader.settings
            # in a worker thread: it checks every token id of every prompt, and a body may hold megabytes of them
            params = await trio.to_thread.run_sync(parse_completion_body, body, settings.max_tokens_limit)
            check_replies(len(params.prompts), params.n, settings.serve_request_replies)
            params.model = await self.routes.resolve(params.model, user)
            manifest, model_dir = await self.routes.model(params.model)
            vocab = int(manifest.get("vocab_size") or 0)
            tokenizer = await trio.to_thread.run_sync(load_tokenizer, str(model_dir))
            serving = self.leader.serving
            context = await serving.contexts.context_of(params.model)
            reply = max(1, params.max_tokens)
            prompts = []
            for prompt in params.prompts:
                if isinstance(prompt, str):
                    # by its byte count before tokenising; both walk the whole text, in a worker thread
                    await trio.to_thread.run_sync(check_prompt_bytes, prompt, model_dir, context)
                    ids = await trio.to_thread.run_sync(_token_ids, tokenizer, prompt)
                    serving.contexts.check_context(params.model, len(ids) + reply, len(ids), reply)
                    prompts.append((prompt, ids))
                else:
                    # before decoding
                    serving.contexts.check_context(params.model, len(prompt) + reply, len(prompt), reply)
                    text = await trio.to_thread.run_sync(_prompt_text, tokenizer, prompt, vocab, params.model)
                    prompts.append((text, prompt if isinstance(prompt, list) else list(prompt)))  # not a 2nd copy
            # the prompt's own logprobs only when they are returned: echo with logprobs
            prompt_logprobs = params.logprobs if params.echo else None
            for _, ids in prompts:
                await self.routes.send(params.model, ids, reply, params.sampling, params,
                                       user.id, ring_requests, prompt_logprobs=prompt_logprobs,
                                       token_id=user.token_id)
            # a client that leaves while they wait cancels them all
            if await serving.intake.wait_started(ring_requests, request.receive):
                return Response(status_code=499)  # nobody reads it
        except Exception as exc:  # the API boundary: any failure is the client's error reply, its requests cancelled
            for ring_request in ring_requests:
                self.leader.serving.cancel(ring_request)
            if stream and isinstance(exc, ContextTooLong):
                return StreamingResponse(error_events(exc), media_type="text/event-stream")
            return openai_error(exc)
        choices = []
        for i, ring_request in enumerate(ring_requests):
            reply_text = ReplyText(tokenizer, False, params.stop, reasoning=False)
            choices.append(Completion(i, ring_request, reply_text, self.routes.reader(ring_request), params.logprobs,
                                      prompt_text=prompts[i // params.n][0], limit=params.max_tokens))
        first = ring_requests[0]
        created = int(time.time())
        if params.stream:
            return ReplyStream(self.leader.serving, ring_requests, self._stream(choices, params, tokenizer, created),
                               headers={"x-swarm-request-id": first.id, "cache-control": "no-cache"})
        failed = await read_choices(self.leader.serving, choices, self._collect, request.receive)
        if failed is not None:
            return failed
        await timing.settle(self.leader.serving, first)
        out = []
        for choice in choices:
            item = {"index": choice.index, "text": (choice.prompt_text if params.echo else "") + choice.content,
                    "logprobs": None, "finish_reason": choice.finish}
            if choice.top is not None:
                item["logprobs"] = legacy_logprobs(tokenizer, choice, params.echo)
            if params.return_token_ids:
                item["token_ids"] = list(choice.request.tokens[: choice.text.used])
                item["prompt_token_ids"] = list(choice.request.prompt)
            out.append(item)
        return JSONResponse({
            "id": f"cmpl-{first.id}", "object": "text_completion", "created": created, "model": params.model,
            "choices": out, "usage": usage(choices, params.n),
            "swarm": {"timing": timing.of_request(self.leader.serving, first)},
        }, headers={"x-swarm-request-id": first.id})

    async def _collect(self, choice: Completion) -> None:
        while True:
            kind, value = await choice.reader.next()
            if kind == "error":
                raise SwarmError(value)
            if choice.limit == 0:  # the prompt was all that was asked for
                if kind != "tokens":
                    choice.finish = "length"
                    return
                continue
            _, content = choice.text.push(value) if kind == "tokens" else choice.text.flush()
            choice.content += content
            if choice.text.stopped:
                self.leader.serving.cancel(choice.request)
                choice.finish = "stop"
                return
            if kind != "tokens":
                choice.finish = "stop" if value == "cancelled" else value
                return

    async def _stream(self, choices: list[Completion], params: CompletionParams, tokenizer, created: int):
        first = choices[0].request
        base = {"id": f"cmpl-{first.id}", "object": "text_completion", "created": created, "model": params.model}

        async def chunk(choice: Completion, text: str, finish=None) -> str:
            item = {"index": choice.index, "text": text, "logprobs": None, "finish_reason": finish}
            if params.echo and not choice.echoed:
                choice.echoed = True
                item["text"] = choice.prompt_text + text
                if choice.top is not None:
                    item["logprobs"] = _prompt_logprobs(tokenizer, choice)
            if choice.top is not None:
                part = _generated_logprobs(tokenizer, choice, choice.sent, choice.text.used)
                choice.sent = choice.text.used
                item["logprobs"] = _join(item["logprobs"], part)
            data = {**base, "choices": [item]}
            if finish is not None:
                choice.finish = finish
                if all(c.finish is not None for c in choices):
                    await timing.settle(self.leader.serving, first)
                    data["usage"] = usage(choices, params.n)
                    data["swarm"] = {"timing": timing.of_request(self.leader.serving, first)}
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        try:
            while any(c.finish is None for c in choices):
                choice, kind, value = await next_event([c for c in choices if c.finish is None])
                if kind == "error":
                    payload = {"error": {"message": value, "type": "server_error", "code": "ring_failed"}}
                    yield f"data: {json.dumps(payload)}\n\n"
                    break
                if choice.limit == 0:
                    if kind != "tokens":
                        yield await chunk(choice, "", finish="length")
                    continue
                if kind == "tokens":
                    for token in value:
                        _, content = choice.text.push([token])
                        if content:
                            yield await chunk(choice, content)
                        if choice.text.stopped:
                            break
                    if choice.text.stopped:
                        self.leader.serving.cancel(choice.request)
                        yield await chunk(choice, "", finish="stop")
                else:
                    _, content = choice.text.flush()
                    yield await chunk(choice, content, finish="stop" if value == "cancelled" else value)
            yield "data: [DONE]\n\n"
        finally:
            for choice in choices:
                self.leader.serving.cancel(choice.request)


def _token_ids(tokenizer, prompt: str) -> list[int]:
    return list(tokenizer(prompt)["input_ids"])


def _prompt_text(tokenizer, prompt: list[int], vocab: int, model: str) -> str:
    """The text of a prompt given as token ids (for echo), once they are checked against the vocabulary. It walks
    every id: call it in a worker thread."""
    top = max(prompt)
    if vocab and top >= vocab:
        raise BadRequest(f"'prompt' holds token {top}, but model {model} has tokens 0 to {vocab - 1}.",
                         "invalid_prompt")
    return tokenizer.decode(prompt)


def usage(choices: list[Completion], n: int) -> dict:
    """Each prompt once (its n choices share it), and every choice's reply."""
    prompt = sum(len(c.request.prompt) for c in choices[::n])
    reply = sum(min(c.text.used, len(c.request.tokens)) for c in choices)
    cached = sum(c.request.cached_tokens for c in choices[::n])  # the prefix cache's hits (OpenAI's shape)
    return {"prompt_tokens": prompt, "completion_tokens": reply, "total_tokens": prompt + reply,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _empty() -> dict:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def _join(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    return {key: a[key] + b[key] for key in a}


def _add(out: dict, tokenizer, token: int, logprob, top: dict | None, choice: Completion) -> None:
    text = token_text(tokenizer, token)
    out["tokens"].append(text)
    out["token_logprobs"].append(logprob)
    out["top_logprobs"].append(top)
    out["text_offset"].append(choice.offset)
    choice.offset += len(text)


def _top(tokenizer, entry) -> dict:
    return {token_text(tokenizer, t): v for t, v in zip(entry.top_ids, entry.top_logprobs)}


def _prompt_logprobs(tokenizer, choice: Completion) -> dict:
    """The prompt's tokens: the first has no logprob (nothing comes before it), the others the model's."""
    out = _empty()
    request = choice.request
    for k, token in enumerate(request.prompt):
        entry = request.prompt_logprobs[k - 1] if 0 < k <= len(request.prompt_logprobs) else None
        if entry is None:
            _add(out, tokenizer, token, None, None, choice)
        else:
            _add(out, tokenizer, token, entry.logprob, _top(tokenizer, entry), choice)
    return out


def _generated_logprobs(tokenizer, choice: Completion, start: int, end: int) -> dict:
    out = _empty()
    request = choice.request
    for token, entry in zip(request.tokens[start:end], request.logprobs[start:end]):
        _add(out, tokenizer, token, entry.logprob, _top(tokenizer, entry), choice)
    return out


def legacy_logprobs(tokenizer, choice: Completion, echo: bool) -> dict:
    choice.offset = 0
    out = _prompt_logprobs(tokenizer, choice) if echo else _empty()
    return _join(out, _generated_logprobs(tokenizer, choice, 0, choice.text.used))
