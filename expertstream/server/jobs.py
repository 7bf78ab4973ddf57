"""The HTTP side of a generation: queue it on the worker, then stream its events as SSE or collect them.

The worker thread emits ("start", reused), ("progress", done, total) and ("token", record) events; `Job`
carries them onto the event loop, and `Jobs` turns them into keepalives, the reply, errors and metrics.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterable
from contextlib import aclosing
from typing import Protocol

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from expertstream.generate import GenerationResponse, SamplingParams
from expertstream.runtime.worker import EngineBackend, QueueFull
from expertstream.server.errors import APIError, generation_failed
from expertstream.server.metrics import Metrics
from expertstream.server.protocol import PromptTokensDetails, SamplingRequest, Usage


def _sse(obj) -> str:
    payload = (
        obj.model_dump_json() if hasattr(obj, "model_dump_json") else json.dumps(obj, ensure_ascii=False)
    )
    return f"data: {payload}\n\n"


def _sse_response(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        body,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


class Job:
    """One queued generation as the HTTP side sees it: an event queue fed from the worker thread, and the
    last token record and reused prompt tokens seen so far."""

    def __init__(
        self,
        backend: EngineBackend,
        ids: list[int],
        params: SamplingParams,
        endpoint: str,
        streaming: bool = False,
    ):
        self.endpoint = endpoint
        self.prompt_tokens = len(ids)
        self.last: GenerationResponse | None = None
        self.cached = 0
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()
        self._future = backend.submit(ids, params, self._emit, self._cancelled.is_set, streaming)
        self._future.add_done_callback(self._finished)

    def _emit(self, *event) -> None:
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (server shutting down): stop generating
            self._cancelled.set()

    def _finished(self, fut) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        self._emit("error", exc) if exc is not None else self._emit("done")

    def cancel(self) -> None:
        self._cancelled.set()
        self._future.cancel()

    def usage(self) -> Usage:
        completion = self.last.generation_tokens if self.last is not None else 0
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion,
            total_tokens=self.prompt_tokens + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached),
        )

    async def events(self, tick_s: float) -> AsyncIterator[tuple]:
        """The worker's events; ("tick",) after `tick_s` seconds of silence. Ends after "done" or "error"."""
        getter = None
        try:
            while True:
                getter = getter or asyncio.ensure_future(self._events.get())
                done, _ = await asyncio.wait({getter}, timeout=tick_s)
                if not done:
                    yield ("tick",)
                    continue
                event, getter = getter.result(), None
                if event[0] == "start":
                    self.cached = event[1]
                elif event[0] == "token":
                    self.last = event[1]
                yield event
                if event[0] in ("done", "error"):
                    return
        finally:
            if getter is not None:
                getter.cancel()


class Output(Protocol):
    """How an endpoint writes its reply (`server_output.ChatOutput`, `server_output.CompletionOutput`)."""

    def token_chunks(self, r: GenerationResponse) -> Iterable[BaseModel]: ...
    def final_chunks(self, last: GenerationResponse | None) -> Iterable[BaseModel]: ...
    def usage_chunk(self, usage: Usage) -> BaseModel: ...
    def add(self, r: GenerationResponse) -> None: ...
    def response(self, last: GenerationResponse | None, usage: Usage) -> BaseModel: ...
    # the stream's framing: one event per chunk, an error event, the end of the stream
    def encode(self, chunk: BaseModel) -> str: ...
    def error_event(self, err: APIError) -> str: ...
    def end(self) -> str: ...


class OpenAIFraming:
    """OpenAI's SSE framing: `data: {json}` events, errors as `{"error": ...}` events, then `[DONE]`."""

    def encode(self, chunk: BaseModel) -> str:
        return _sse(chunk)

    def error_event(self, err: APIError) -> str:
        return _sse(err.body())

    def end(self) -> str:
        return "data: [DONE]\n\n"


class Jobs:
    """Submits generations to the worker and runs them to the end for the HTTP handlers.

    Args:
        backend: the worker and engine.
        metrics: counts each request's outcome.
        keepalive_s: seconds of stream silence before a `: keepalive` comment.
    """

    def __init__(self, backend: EngineBackend, metrics: Metrics, keepalive_s: float):
        self.backend, self.metrics, self.keepalive_s = backend, metrics, keepalive_s

    def submit(self, ids: list[int], params: SamplingParams, endpoint: str, streaming: bool = False) -> Job:
        """Queue a generation; a streaming one starts ahead of waiting non-streaming ones."""
        try:
            return Job(self.backend, ids, params, endpoint, streaming)
        except QueueFull as e:
            self.metrics.count(endpoint, "rejected")
            raise APIError(
                429, f"server busy: {e}; retry later", type="rate_limit_error", code="queue_full"
            ) from None

    async def respond(self, job: Job, out: Output, req: SamplingRequest, request: Request):
        """The reply to `req`: an SSE stream, or the whole response once the job has finished."""
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse_response(self._stream(job, out, include_usage))
        await self._collect(job, out, request)
        self._finished(job)
        return out.response(job.last, job.usage())

    def _finished(self, job: Job) -> None:
        self.metrics.finished(job.endpoint, job.last, job.prompt_tokens, job.cached)

    async def _collect(self, job: Job, out: Output, request: Request) -> None:
        """Run a non-streaming job to the end, adding each token record to `out`."""
        try:
            async with aclosing(job.events(min(self.keepalive_s, 1.0))) as events:
                async for ev in events:
                    if ev[0] == "tick" and await request.is_disconnected():
                        self.metrics.count(job.endpoint, "cancelled")
                        raise APIError(499, "client disconnected")
                    if ev[0] == "token":
                        out.add(ev[1])
                    elif ev[0] == "error":
                        self.metrics.count(job.endpoint, "error")
                        raise generation_failed(ev[1])
        finally:
            job.cancel()

    async def _stream(self, job: Job, out: Output, include_usage: bool) -> AsyncIterator[str]:
        """SSE around a job: keepalive comments, the endpoint's chunks, an error event or [DONE]."""
        try:
            async with aclosing(job.events(self.keepalive_s)) as events:
                async for ev in events:
                    if ev[0] == "tick":
                        yield ": keepalive\n\n"
                    elif ev[0] == "progress":
                        yield f": keepalive {ev[1]}/{ev[2]}\n\n"
                    elif ev[0] == "error":
                        self.metrics.count(job.endpoint, "error")
                        yield out.error_event(generation_failed(ev[1]))
                        return
                    elif ev[0] == "token":
                        for chunk in out.token_chunks(ev[1]):
                            yield out.encode(chunk)
                    elif ev[0] == "done":
                        for chunk in out.final_chunks(job.last):
                            yield out.encode(chunk)
                        self._finished(job)
                        if include_usage:
                            yield out.encode(out.usage_chunk(job.usage()))
            yield out.end()
        except asyncio.CancelledError:
            self.metrics.count(job.endpoint, "cancelled")
            raise
        finally:
            job.cancel()
