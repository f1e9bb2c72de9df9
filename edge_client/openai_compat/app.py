"""The HTTP side of `edge-client serve`: OpenAI's routes over one EdgeClient.

Each request is one split-decoding generation, with the link, drafter and offline policy of the
`edge-client serve` flags; requests at once run side by side over the one link, as many as
the admission lets run (admission.py). Streams carry committed text only: offline drafts stay
on the edge until the server has judged them, and text the target never checked goes out only
when the request sets `allow_unverified` (with `--offline-policy keep`). A request whose
client hangs up ends its generation and the server's session with it.
"""
from __future__ import annotations

import asyncio
import json
import sys
from typing import Any, Awaitable, Callable

from aiohttp import web
from tokenizers import Tokenizer

from edge_client.client import EdgeClient
from edge_client.reporting import GenerationResult
from edge_client.link import LinkError, ServerUnreachable
from edge_client.openai_compat.admission import Admission
from edge_client.openai_compat.requests import (
    ApiError, ApiRequest, Kind, parse_chat, parse_completion,
)
from edge_client.openai_compat.responses import Reply, error_body
from edge_client.openai_compat.stop_text import StopTrimmer
from edge_client.tokenizer import TextStream
from shared.messages import OpenRequest

# The server's refusals, as the HTTP status an OpenAI client expects.
REFUSAL_STATUS = {"invalid_argument": 400, "out_of_range": 400, "failed_precondition": 400,
                  "not_found": 404, "resource_exhausted": 429}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class AnswerText:
    """The Listener of one answer: committed ids to text, cut at the first stop string, queued
    for the stream as it comes; None on the queue marks the end of the generation."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...]):
        self._stream = TextStream(tokenizer)
        self._trim = StopTrimmer(stops)
        self.sent = ""
        self.queue: asyncio.Queue[str | None] = asyncio.Queue()

    def committed(self, ids: list[int]) -> None:
        self._send(self._stream.push(ids))

    def unverified(self, ids: list[int]) -> None: ...

    def withdraw(self) -> None: ...

    def link_event(self, text: str) -> None:
        print(f"[{text}]", file=sys.stderr, flush=True)

    def finish(self, unverified: list[int]) -> str:
        """The rest of the answer: text held back for a split character or a possible stop
        string, then the unverified ids (when the request allows them)."""
        rest = self._stream.push(unverified) + self._stream.flush()
        tail = self._trim.push(rest) + self._trim.finish()
        self.sent += tail
        return tail

    def _send(self, text: str) -> None:
        out = self._trim.push(text)
        if out:
            self.sent += out
            self.queue.put_nowait(out)


class Endpoint:
    def __init__(self, client: EdgeClient, admission: Admission):
        self.client = client
        self.admission = admission

    def app(self) -> web.Application:
        app = web.Application(middlewares=[openai_errors])
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        return app

    async def models(self, request: web.Request) -> web.Response:
        info = self.client.info
        return web.json_response({"object": "list", "data": [
            {"id": info.model_id, "object": "model", "created": 0, "owned_by": "splitdec"}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, parse_chat(await _json(request), self.client.options))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request,
                                  parse_completion(await _json(request), self.client.options))

    async def _answer(self, request: web.Request, api: ApiRequest) -> web.StreamResponse:
        model = self.client.info.model_id
        if api.model not in (None, model):
            raise ApiError(404, f"model {api.model!r} does not exist; this endpoint serves "
                                f"{model!r} (GET /v1/models)", "model", code="model_not_found")
        async with self.admission.turn():
            return await self._generate(request, api, model)

    async def _generate(self, request: web.Request, api: ApiRequest, model: str
                        ) -> web.StreamResponse:
        reply = Reply(api, model)
        text = AnswerText(self.client.tokenizer, api.options.stop_strings)
        generation = asyncio.create_task(self.client.generate(self._open(api), text))
        generation.add_done_callback(lambda _: text.queue.put_nowait(None))
        try:
            if api.stream:
                return await _stream(request, reply, text, generation)
            result = await _result(generation, text)
            return web.json_response(reply.completion(text.sent + _finish(api, text, result),
                                                      result))
        finally:
            # The caller hung up: the generation closes its session on the server before
            # its slot is free (a bounded wait, generate.py CLOSE_TIMEOUT_S).
            generation.cancel()
            await asyncio.wait({generation})

    def _open(self, api: ApiRequest) -> OpenRequest:
        if api.kind is Kind.CHAT:
            return api.options.open_request(chat=api.chat)
        prompt = api.prompt
        ids = prompt if isinstance(prompt, tuple) else self.client.encode(str(prompt))
        return api.options.open_request(prompt_ids=ids)


async def _stream(request: web.Request, reply: Reply, text: AnswerText,
                  generation: asyncio.Task[GenerationResult]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    await _event(response, reply.chunk(first=True))
    while (piece := await text.queue.get()) is not None:
        await _event(response, reply.chunk(piece))
    try:
        result = await _result(generation, text)
    except ApiError as err:  # the status line is gone: OpenAI's clients read an error event
        await _event(response, error_body(err))
        return response
    tail = _finish(reply.request, text, result)
    if tail:
        await _event(response, reply.chunk(tail))
    await _event(response, reply.chunk(result=result))
    if reply.request.include_usage:
        await _event(response, reply.usage_chunk(result))
    await response.write(b"data: [DONE]\n\n")
    return response


async def _result(generation: asyncio.Task[GenerationResult], text: AnswerText
                  ) -> GenerationResult:
    try:
        return await generation
    except LinkError as err:
        raise link_failure(err, text.sent) from None


def _finish(api: ApiRequest, text: AnswerText, result: GenerationResult) -> str:
    return text.finish(result.unverified_ids if api.allow_unverified else [])


def link_failure(err: LinkError, sent: str) -> ApiError:
    """A generation the link or the server ended: unreachable is 503; a refusal keeps its
    meaning. The message says how much of the answer had been committed."""
    status = 503 if isinstance(err, ServerUnreachable) else REFUSAL_STATUS.get(err.code or "",
                                                                               502)
    kind = "invalid_request_error" if status in (400, 404) else "server_error"
    message = f"{err} ({len(sent)} characters of the answer were committed)" if sent else str(err)
    return ApiError(status, message, kind=kind, code=err.code)


async def _event(response: web.StreamResponse, body: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(body).encode() + b"\n\n")


async def _json(request: web.Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the request body is not JSON ({err})") from None


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""
    try:
        return await handler(request)
    except ApiError as err:
        return web.json_response(error_body(err), status=err.status, headers=err.headers)
    except web.HTTPException as err:  # unknown route, wrong method
        api = ApiError(err.status, f"{request.method} {request.path}: {err.reason}",
                       code=err.reason.lower().replace(" ", "_"))
        return web.json_response(error_body(api), status=err.status)
