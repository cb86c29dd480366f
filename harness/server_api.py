"""The OpenAI-compatible HTTP API over an `EngineLoop` (harness/server_engine.py): /v1/completions and
/v1/chat/completions, each answered whole or streamed as server-sent events, /v1/models, /health and Prometheus
/metrics. A request the server cannot serve as asked gets OpenAI's error shape and a 4xx that names the field."""
from __future__ import annotations

import asyncio
import json
import time
from json.encoder import encode_basestring as encode_string   # a str as JSON, as dumps writes it

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from onepass.harness.server_engine import EngineLoop, Stream
from onepass.harness.server_requests import APIError, ChatBody, Common, CompletionBody, check_sampling, parse
from onepass.harness.server_text import TextStream
from onepass.kernels.errors import ConfigError, OnepassError


class ClientGone(Exception):
    pass


def dumps(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class OpenAIAPI:
    """The routes over one engine loop, with the server's model name, sampling and default max_tokens."""

    def __init__(self, loop: EngineLoop, model_name: str, max_tokens: int):
        self.loop, self.model_name, self.max_tokens = loop, model_name, max_tokens
        engine = loop.engine
        self.tokenizer, self.vocab = engine.tokenizer, engine.cfg.vocab_size
        self.stop_ids = engine.stop_ids()
        self.created = int(time.time())
        app = self.app = FastAPI(title="onepass-serve", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(APIError, lambda _, e: JSONResponse(e.body(), status_code=e.status))
        app.add_exception_handler(HTTPException, lambda _, e: JSONResponse(
            APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code))
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat)
        app.get("/v1/models")(self.models)
        app.get("/health")(self.health)
        app.get("/metrics")(self.metrics)

    # -- the small routes --------------------------------------------------------------------------------------
    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "onepass", "max_model_len": self.loop.ctx}]}

    async def health(self) -> Response:
        if self.loop.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine stopped", "why": self.loop.arrivals.failure}, status_code=503)

    async def metrics(self) -> Response:
        return Response(generate_latest(self.loop.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # -- completions ----------------------------------------------------------------------------------------------
    async def completions(self, request: HTTPRequest) -> Response:
        body = self._check(parse(await request.body(), CompletionBody))
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, f"prompt holds {len(prompt)} prompts; onepass-serve takes one a request (send "
                                    f"{len(prompt)} requests)", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            self._need_tokenizer("prompt")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            if bad := [t for t in ids if not 0 <= t < self.vocab]:
                raise APIError(400, f"prompt token {bad[0]} is not in the vocabulary (0..{self.vocab - 1})",
                               param="prompt")
        return await self._answer(request, body, ids, body.max_tokens, "prompt", chat=False)

    async def chat(self, request: HTTPRequest) -> Response:
        body = self._check(parse(await request.body(), ChatBody))
        if not body.messages:
            raise APIError(400, "messages is empty: a chat needs at least one message", param="messages")
        self._need_tokenizer("messages")
        messages = [{"role": m.role, "content": m.content if isinstance(m.content, str) else
                     "\n".join(p.text for p in m.content or []), **({"name": m.name} if m.name else {})}
                    for m in body.messages]
        try:
            ids = self.tokenizer.encode_messages(messages)
        except OnepassError as e:   # the template refused the messages, or failed on them
            raise APIError(400, f"the model's chat template: {e}", param="messages") from None
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await self._answer(request, body, ids, asked, "messages", chat=True)

    def _check(self, body: Common) -> Common:
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"The model `{body.model}` does not exist; this server serves `{self.model_name}`",
                           param="model", code="model_not_found")
        check_sampling(body, self.loop.sampling)
        if not self.loop.alive:
            raise APIError(503, f"the engine is not running ({self.loop.arrivals.failure or 'stopped'})",
                           kind="server_error", code="engine_stopped")
        return body

    def _need_tokenizer(self, param: str) -> None:
        if self.tokenizer is None:
            raise APIError(400, f"this model came without a tokenizer, so {param} cannot be text: send the prompt as "
                                "token ids (/v1/completions with prompt: [ids])", param=param)

    def _budget(self, ids: list[int], asked: int | None, where: str) -> int:
        """The request's max_tokens: as asked, or the server's default within what the context leaves."""
        ctx, P = self.loop.ctx, len(ids)
        if not ids:
            raise APIError(400, f"the {where} is empty: a request needs at least one prompt token", param=where)
        if asked is not None and asked < 1:
            raise APIError(400, f"max_tokens={asked}: a completion has at least one token", param="max_tokens")
        room = ctx - P + 1   # the last token sampled is never fed back
        if room < 1:
            raise APIError(400, f"the {where} has {P} tokens, more than this server's context of {ctx} "
                                "(kv_cache.ctx): shorten it", param=where)
        if asked is None:
            asked = min(self.max_tokens, room)
        elif asked > room:
            raise APIError(400, f"the {where}'s {P} tokens and max_tokens={asked} need {P + asked - 1} positions, "
                                f"more than this server's context of {ctx} (kv_cache.ctx): lower max_tokens to "
                                f"{room} or shorten the {where}", param="max_tokens")
        bm = self.loop.runner.sched.bm
        if bm is not None and bm.blocks_for(P + asked - 1) > bm.num_blocks - 1:
            raise APIError(400, f"the {where}'s {P} tokens and max_tokens={asked} need "
                                f"{bm.blocks_for(P + asked - 1)} KV blocks of {bm.block_size} positions; this server's "
                                f"pool has {bm.num_blocks - 1} (kv_cache.num_blocks)", param="max_tokens")
        return asked

    # -- the answer ------------------------------------------------------------------------------------------------
    async def _answer(self, request: HTTPRequest, body: Common, ids: list[int], asked: int | None, where: str,
                      chat: bool) -> Response:
        max_tokens = self._budget(ids, asked, where)
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        decode = (lambda t: self.tokenizer.decode(t, skip_special=True)) if self.tokenizer else (lambda t: "")
        text = TextStream(decode, stops, () if body.ignore_eos else self.stop_ids)
        try:
            stream = self.loop.open(ids, max_tokens, body.ignore_eos)
        except ConfigError as e:   # the loop died after _check looked
            raise APIError(503, str(e), kind="server_error", code="engine_stopped") from None
        with_usage = body.stream and body.stream_options is not None and body.stream_options.include_usage
        shape = Shape(chat, f"{'chatcmpl' if chat else 'cmpl'}-{stream.req.rid}", self.model_name, with_usage,
                      body.return_token_ids)
        usage = lambda: {"prompt_tokens": len(ids), "completion_tokens": text.tokens,  # noqa: E731
                         "total_tokens": len(ids) + text.tokens}
        if body.stream:
            return EventStream(self._events(stream, text, shape, usage),
                               lambda: self.loop.end(stream, gone=text.finish is None))
        watch = asyncio.create_task(self._watch(request, stream))
        out, taken = [], []
        try:
            async for delta, tokens in self._deltas(stream, text):
                out.append(delta)
                taken += tokens
        except ClientGone:
            return Response(status_code=499)   # nobody reads it
        finally:
            watch.cancel()
            self.loop.end(stream, gone=text.finish is None)
        return JSONResponse(shape.whole("".join(out), text.finish, usage(), taken))

    async def _deltas(self, stream: Stream, text: TextStream):
        """(text, token ids) for each batch of tokens the engine has ready for the request, until its output has
        ended (at its stop string, its stop token or max_tokens): every token ready when the handler looks goes into
        one delta. A stop string ends it here: the engine request is cancelled as the handler leaves."""
        while not text.finish:
            tokens, done = await stream.take()
            if stream.hung_up:
                raise ClientGone()
            if stream.error:
                if stream.req.rejection:
                    raise APIError(400, stream.error)
                raise APIError(503, stream.error, kind="server_error", code="engine_stopped")
            before = text.tokens
            delta = text.add(tokens, done)
            yield delta, tokens[:text.tokens - before]

    async def _watch(self, request: HTTPRequest, stream: Stream) -> None:
        """A whole answer's client that disconnects cancels its request (a stream's is noticed by its response)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.loop.end(stream, gone=True)
        stream.hung_up = True
        stream.wake()

    async def _events(self, stream: Stream, text: TextStream, shape: Shape, usage):
        """Server-sent events: a chunk per batch of tokens, the finish reason, the usage if asked, then [DONE]."""
        try:
            if shape.chat:
                yield shape.event(shape.chunk({"role": "assistant", "content": ""}, None))
            async for delta, tokens in self._deltas(stream, text):
                if delta or not text.finish or (shape.token_ids and tokens):
                    yield shape.delta_event(delta, tokens)
            yield shape.event(shape.chunk("", text.finish))
            if shape.with_usage:
                yield shape.event({**shape.head(), "choices": [], "usage": usage()})
        except APIError as e:   # the headers are out: the error goes as an event, as OpenAI's do
            yield shape.event(e.body())
        yield b"data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """Server-sent events with a last word: `on_close` runs however the response ends (a client that disconnects
    cancels the response where it waits, and with on_close its request)."""

    def __init__(self, events, on_close):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class Shape:
    """OpenAI's response objects for one request: completion or chat completion, whole or in chunks. with_usage: a
    stream's chunks carry `usage: null` (its usage comes last); token_ids: each choice carries its token ids too
    (vLLM's `return_token_ids`), so a client counts the tokens of a chunk that holds several."""

    def __init__(self, chat: bool, rid: str, model: str, with_usage: bool = False, token_ids: bool = False):
        self.chat, self.rid, self.model, self.created = chat, rid, model, int(time.time())
        self.with_usage, self.token_ids = with_usage, token_ids
        # a text chunk is written around its text, not built and encoded whole: it is what every token costs
        choice = {"index": 0, **({"delta": {"content": "@text@"}} if chat else {"text": "@text@"}),
                  **({"token_ids": "@ids@"} if token_ids else {}), "logprobs": None, "finish_reason": None}
        event = dumps({**self.head(), "choices": [choice], **({"usage": None} if with_usage else {})})
        self._open, rest = event.rsplit('"@text@"', 1)
        self._mid, self._close = rest.rsplit('"@ids@"', 1) if token_ids else (rest, "")

    def head(self, chunk: bool = True) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model}

    def whole(self, text: str, finish: str, usage: dict, tokens: list[int]) -> dict:
        choice = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        if self.token_ids:
            choice["token_ids"] = tokens
        return {**self.head(chunk=False), "choices": [{"index": 0, **choice, "logprobs": None,
                                                       "finish_reason": finish}], "usage": usage}

    def chunk(self, delta: str | dict, finish: str | None) -> dict:
        if self.chat:
            choice = {"delta": delta if isinstance(delta, dict) else {"content": delta} if delta or not finish else {}}
        else:
            choice = {"text": delta}
        out = {**self.head(), "choices": [{"index": 0, **choice, "logprobs": None, "finish_reason": finish}]}
        return {**out, "usage": None} if self.with_usage else out

    def delta_event(self, text: str, tokens: list[int]) -> bytes:
        """The event of `chunk(text, None)`, with the tokens' ids where asked."""
        if self.token_ids:
            return f"data: {self._open}{encode_string(text)}{self._mid}{tokens}{self._close}\n\n".encode()
        return f"data: {self._open}{encode_string(text)}{self._mid}\n\n".encode()

    @staticmethod
    def event(obj: dict) -> bytes:
        return f"data: {dumps(obj)}\n\n".encode()
