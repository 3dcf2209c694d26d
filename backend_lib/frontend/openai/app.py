"""The OpenAI-compatible HTTP front (FastAPI): /v1/models, /v1/completions, /v1/chat/completions, /health.

Every choice of a call (``n`` of each prompt) becomes one request to our Triton model over gRPC streaming
(triton_stream.py, fan_out.py), so one engine serves both APIs and Triton's metrics and logs see every request.
Streaming answers are server-sent events ending in ``data: [DONE]``; the first model response of every choice is
awaited before the HTTP status is sent, so a refused request (bad field, busy server, unknown session) gets its
real status, not a 200 with an error event.
State (the gRPC channel, the settings) lives on ``app.state.front``.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncGenerator, AsyncIterator, Awaitable, Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from backend_lib.frontend.openai import fan_out, tools, translate
from backend_lib.frontend.openai.errors import OpenAIError, body_error
from backend_lib.frontend.openai.images import checkpoint_takes_images, fetch_remote
from backend_lib.frontend.openai.schema import (ChatCompletionChunk, ChatCompletionRequest, Completion,
                                                CompletionRequest, ModelCard, ModelList)
from backend_lib.frontend.openai.translate import ModelDelta, ModelRequest, Totals
from backend_lib.frontend.openai.triton_stream import TritonStreamClient

logger = logging.getLogger("deepinfer.openai")
_DISCONNECT_POLL_S = 0.5
_DONE = b"data: [DONE]\n\n"
T = TypeVar("T")


@dataclass(frozen=True)
class FrontSettings:
    grpc_url: str  # Triton's gRPC endpoint, e.g. localhost:8001
    triton_model: str = "deepinfer"
    served_model_name: str = "deepinfer"  # the name clients give as "model"
    # The tokenizer (chat template) of tools requests: a .gguf file or a Hugging Face directory; None = the model
    # path of the Triton model's config (its "model" parameter), read on the first tools request.
    tokenizer: str | None = None
    allow_remote_images: bool = False  # chat image_url parts with http(s) URLs fetched (images.py), else refused


def _sse(payload: BaseModel | dict) -> bytes:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return b"data: " + body.encode("utf-8") + b"\n\n"


class OpenAIFront:
    """Turns one OpenAI call into one Triton request and its responses into the OpenAI answer."""

    def __init__(self, settings: FrontSettings) -> None:
        self.settings = settings
        self.created = int(time.time())
        self.client: TritonStreamClient | None = None
        self._renderer: tools.ChatRenderer | None = None
        self._renderer_lock = asyncio.Lock()
        self._modalities: list[str] | None = None

    async def renderer(self) -> tools.ChatRenderer:
        """The served model's chat template, loaded on the first request that needs it (tools.py)."""
        async with self._renderer_lock:
            if self._renderer is None:
                assert self.client is not None, "the front is not started"
                path = self.settings.tokenizer
                if path is None:
                    path = await self.client.model_parameter("model")
                try:
                    self._renderer = await asyncio.to_thread(tools.ChatRenderer.load, path)
                except (OSError, ValueError) as exc:
                    raise OpenAIError(500, f"could not load the model's tokenizer for tools ({path!r}): {exc}",
                                      "server_error") from exc
                logger.info("chat template loaded from %r; tool-call parser %s", path, self._renderer.parser.name)
            return self._renderer

    async def input_modalities(self) -> list[str]:
        """What the served model takes, read once from its checkpoint (the Triton model's "model" parameter)."""
        if self._modalities is None:
            assert self.client is not None, "the front is not started"
            try:
                path = await self.client.model_parameter("model")
            except OpenAIError as exc:  # Triton not up yet: text for now, asked again next time
                logger.info("model inputs unknown until Triton answers: %s", exc)
                return ["text"]
            takes = bool(path) and await asyncio.to_thread(checkpoint_takes_images, path)
            self._modalities = ["text", "image"] if takes else ["text"]
        return self._modalities

    async def start(self) -> None:
        self.client = TritonStreamClient(self.settings.grpc_url, self.settings.triton_model)

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.close()

    def check_model(self, model: str) -> None:
        if model != self.settings.served_model_name:
            raise OpenAIError(404, f"the model {model!r} does not exist; this server serves "
                                   f"{self.settings.served_model_name!r}", "invalid_request_error", "model",
                              "model_not_found")

    async def respond(self, kind: Literal["chat", "completion"], choices: list[ModelRequest], include_usage: bool,
                      http_request: Request) -> Response:
        """One Triton request per choice, all at once (ids ``<id>-<index>`` when there are several)."""
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        assert self.client is not None, "the front is not started"
        ids = [request_id] if len(choices) == 1 else [f"{request_id}-{index}" for index in range(len(choices))]
        deltas = [self.client.generate(triton_id, choice) for triton_id, choice in zip(ids, choices)]
        logprobs = choices[0].logprobs
        if not choices[0].stream:
            totals = await _until_disconnected(http_request, fan_out.gather_all([_gather(d) for d in deltas]))
            call = translate.call_usage(totals, choices)
            model = self.settings.served_model_name
            answer = translate.chat_response(request_id, created, model, totals, call, logprobs, choices) \
                if kind == "chat" else translate.completion_response(request_id, created, model, totals, call, logprobs)
            return Response(answer.model_dump_json(), media_type="application/json")
        try:  # an error here raises with its status: nothing was sent yet (choices past max_num_seqs wait here)
            firsts = await _until_disconnected(http_request, fan_out.gather_all([anext(d) for d in deltas]))
        except BaseException:
            await _close_all(deltas)
            raise
        stream = _Stream(kind, request_id, created, self.settings.served_model_name, logprobs,
                         include_usage, choices)
        events = stream.events(firsts, deltas)
        # On a disconnect Starlette cancels the sending task, which may leave the generator parked at a yield, or
        # never started; closing it and the choices' streams afterwards (no-ops when they finished) cancels the
        # Triton requests without waiting for GC.
        return StreamingResponse(events, media_type="text/event-stream",
                                 background=BackgroundTask(_close_all, [events, *deltas]),
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": request_id})


async def _gather(deltas: AsyncIterator[ModelDelta]) -> Totals:
    totals = Totals()
    async for delta in deltas:
        totals.add(delta)
    return totals


async def _close_all(streams: list[AsyncGenerator]) -> None:
    """Closes each (in order: a stream that drives others first, so none of them is still running)."""
    for stream in streams:
        await stream.aclose()


async def _until_disconnected(http_request: Request, work: Awaitable[list[T]]) -> list[T]:
    """Runs ``work``; if the HTTP client goes away first, cancels it (which cancels the Triton requests)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await http_request.is_disconnected():
                raise OpenAIError(499, "the client closed the connection", "client_closed_request")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


@dataclass
class _Stream:
    """One call's server-sent events: each choice's chunks (tagged with its index) as they come, the usage chunk
    when asked for, then [DONE]."""

    kind: Literal["chat", "completion"]
    request_id: str
    created: int
    model: str
    logprobs: bool
    include_usage: bool
    choices: list[ModelRequest]

    async def events(self, firsts: list[ModelDelta], deltas: list[AsyncGenerator[ModelDelta, None]]
                     ) -> AsyncIterator[bytes]:
        totals = [Totals() for _ in firsts]
        tool_streams = [None if choice.tool_mode is None else tools.ToolStream(choice.tool_mode)
                        for choice in self.choices]
        rest = fan_out.merged(deltas)
        try:
            if self.kind == "chat":
                for index in range(len(firsts)):
                    yield _sse(translate.chat_chunk(self.request_id, self.created, self.model, index, None, False))
            for index, delta in enumerate(firsts):
                if self.choices[index].echo:  # completions with a text prompt (translate refuses the others)
                    prompt = str(self.choices[index].prompt)
                    totals[index].text.append(prompt)
                    yield _sse(translate.echo_chunk(self.request_id, self.created, self.model, index, prompt,
                                                    delta.prompt_logprobs, self.logprobs))
                yield self._chunk(index, delta, totals[index], tool_streams[index])
            async for index, delta in rest:
                yield self._chunk(index, delta, totals[index], tool_streams[index])
            if self.include_usage:
                chunk_type = ChatCompletionChunk if self.kind == "chat" else Completion
                yield _sse(chunk_type(id=self.request_id, created=self.created, model=self.model, choices=[],
                                      usage=translate.call_usage(totals, self.choices)))
        except OpenAIError as exc:  # the status is sent: the error goes as an event, as OpenAI's API does
            logger.warning("request %s failed mid-stream: %s", self.request_id, exc.message)
            yield _sse(exc.body())
        finally:
            # Also on a client disconnect (this generator is cancelled): closing cancels the Triton requests. The
            # choices' streams too: ``rest`` closes them only if it ever started.
            await _close_all([rest, *deltas])
        yield _DONE

    def _chunk(self, index: int, delta: ModelDelta, totals: Totals, tool_stream: tools.ToolStream | None) -> bytes:
        """The chunk of one choice's delta, then counted in its totals (a logprobs offset is the text before)."""
        if self.kind == "chat":
            chunk = translate.chat_chunk(self.request_id, self.created, self.model, index, delta, self.logprobs,
                                         tool_stream)
        else:
            offset = len("".join(totals.text)) if self.logprobs else 0
            chunk = translate.completion_chunk(self.request_id, self.created, self.model, index, delta, offset,
                                               self.logprobs)
        totals.add(delta)
        return _sse(chunk)


def _error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def create_app(settings: FrontSettings) -> FastAPI:
    front = OpenAIFront(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await front.start()
        yield
        await front.stop()

    app = FastAPI(title="DeepInfer OpenAI-compatible API", lifespan=lifespan)
    app.state.front = front

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(body_error(exc.errors(), request.headers.get("content-type")))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(OpenAIError(exc.status_code, str(exc.detail), kind))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error")
        return _error_response(OpenAIError(500, f"internal error: {exc}", "server_error"))

    @app.get("/health")
    async def health() -> Response:
        assert front.client is not None
        if await front.client.ready():
            return Response(status_code=200)
        raise OpenAIError(503, f"model {settings.triton_model} is not ready in Triton", "server_unavailable")

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=settings.served_model_name, created=front.created,
                                         input_modalities=await front.input_modalities())])

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> ModelCard:
        front.check_model(model)
        return ModelCard(id=settings.served_model_name, created=front.created,
                         input_modalities=await front.input_modalities())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        front.check_model(body.model)
        choices = translate.completion_requests(body, translate.session_from_headers(request.headers))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await front.respond("completion", choices, include_usage, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        front.check_model(body.model)
        if settings.allow_remote_images:
            await fetch_remote(body.messages)
        renderer = await front.renderer() if tools.needs_renderer(body) else None
        choices = translate.chat_requests(body, translate.session_from_headers(request.headers), renderer)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await front.respond("chat", choices, include_usage, request)

    return app
