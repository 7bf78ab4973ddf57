"""`expertstream serve`: an OpenAI-compatible streaming HTTP server in front of one generation worker.

HTTP handlers validate, render the chat template, tokenize and translate; the engine runs only on the worker
thread (`expertstream.worker`). `/v1/models` and `/health` answer from memory, never waiting on the worker.
Wire format and field semantics: docs/server.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from expertstream.config import EngineConfig
from expertstream.generate import GenerationResponse, SamplingParams
from expertstream.log import get_logger
from expertstream.reasoning import ReasoningSplitter, prompt_ends_in_reasoning, split_reasoning
from expertstream.server_protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatMessageOut,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
    new_id,
)
from expertstream.tool_parser import ToolCallStreamer
from expertstream.worker import EngineBackend, QueueFull

log = get_logger(__name__)

# OpenAI's reasoning_effort values -> the template's (it accepts xhigh, medium, low and raises on others)
REASONING_EFFORT = {"minimal": "low", "low": "low", "medium": "medium", "high": "xhigh", "xhigh": "xhigh"}
REASONING_FIELDS = {"reasoning_content": ("reasoning_content",), "reasoning": ("reasoning",)}
REASONING_FIELDS["both"] = REASONING_FIELDS["reasoning_content"] + REASONING_FIELDS["reasoning"]
THINKING_SUFFIX = "-thinking"
ERROR_RESPONSES = {
    status: {"model": ErrorResponse, "description": text}
    for status, text in (
        (400, "invalid request"),
        (401, "missing or wrong API key"),
        (404, "unknown model"),
        (413, "request body too large"),
        (429, "queue full; see Retry-After"),
        (500, "generation failed"),
    )
}
RETRY_AFTER_S = 5  # what a 429 tells the client to wait before retrying, in seconds
# template arguments a request may not override through chat_template_kwargs
RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "add_generation_prompt"}


@dataclass(slots=True)
class ServerSettings:
    """What the HTTP side needs besides the engine (see `configure_parser` for each flag)."""

    served_model_name: str
    max_model_len: int
    defaults: SamplingParams = field(default_factory=SamplingParams)
    default_max_tokens: int | None = None  # None: up to the end of the context
    api_key: str | None = None
    reasoning_field: str = "reasoning_content"
    allowed_origins: list[str] = field(default_factory=list)
    state_cache_bytes: int = 4 << 30
    max_queue: int = 16
    keepalive_s: float = 15.0
    max_body_bytes: int = 32 << 20

    def __post_init__(self) -> None:
        if self.reasoning_field not in REASONING_FIELDS:
            raise ValueError(
                f"reasoning_field must be one of {sorted(REASONING_FIELDS)}, got {self.reasoning_field!r}"
            )
        if self.keepalive_s <= 0:
            raise ValueError(f"keepalive interval must be positive seconds, got {self.keepalive_s}")
        if self.default_max_tokens is not None and self.default_max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.default_max_tokens}")


class APIError(Exception):
    """An error the client caused (or the server hit), sent as OpenAI's {"error": {...}} body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _error_json(err: APIError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _sse(obj) -> str:
    payload = (
        obj.model_dump_json() if hasattr(obj, "model_dump_json") else json.dumps(obj, ensure_ascii=False)
    )
    return f"data: {payload}\n\n"


class BodyLimit:
    """ASGI middleware: refuse request bodies over `max_bytes` with 413, with or without Content-Length."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_big = APIError(413, f"request body exceeds {self.max_bytes} bytes", code="body_too_large")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _error_json(too_big)(scope, receive, send)
        # read the body here, counting, then hand it on; later receives (disconnects) pass through
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await _error_json(too_big)(scope, receive, send)
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


@dataclass(slots=True)
class Metrics:
    requests: dict[tuple[str, str], int] = field(default_factory=dict)  # (endpoint, outcome) -> count
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0

    def count(self, endpoint: str, outcome: str) -> None:
        self.requests[(endpoint, outcome)] = self.requests.get((endpoint, outcome), 0) + 1

    def render(self, backend: EngineBackend) -> str:
        """Prometheus text exposition format, version 0.0.4."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples) -> None:
            lines.extend((f"# HELP expertstream_{name} {help_text}", f"# TYPE expertstream_{name} {kind}"))
            for labels, value in samples:
                label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
                lines.append(
                    f"expertstream_{name}{{{label_text}}} {value}"
                    if labels
                    else f"expertstream_{name} {value}"
                )

        metric(
            "requests_total",
            "counter",
            "Generation requests by endpoint and outcome.",
            [({"endpoint": e, "outcome": o}, n) for (e, o), n in sorted(self.requests.items())],
        )
        metric(
            "prompt_tokens_total",
            "counter",
            "Prompt tokens of finished requests.",
            [({}, self.prompt_tokens)],
        )
        metric("generation_tokens_total", "counter", "Generated tokens.", [({}, self.generation_tokens)])
        metric(
            "cached_prompt_tokens_total",
            "counter",
            "Prompt tokens reused from cached state.",
            [({}, self.cached_tokens)],
        )
        metric(
            "prompt_tokens_per_second", "gauge", "Prefill speed of the last request.", [({}, self.prompt_tps)]
        )
        metric(
            "generation_tokens_per_second",
            "gauge",
            "Decode speed of the last request.",
            [({}, self.generation_tps)],
        )
        metric(
            "queue_length", "gauge", "Requests waiting for the worker.", [({}, backend.worker.queue_length)]
        )
        metric(
            "worker_busy",
            "gauge",
            "Whether a generation is running (0 or 1).",
            [({}, int(backend.worker.busy))],
        )
        cache = backend.cache
        metric(
            "state_cache_hits_total", "counter", "Prompts that restored a cached state.", [({}, cache.hits)]
        )
        metric("state_cache_misses_total", "counter", "Prompts with no cached state.", [({}, cache.misses)])
        lookups = cache.hits + cache.misses
        metric(
            "state_cache_hit_rate",
            "gauge",
            "State cache hits / lookups.",
            [({}, cache.hits / lookups if lookups else 0.0)],
        )
        metric("state_cache_bytes", "gauge", "Bytes held by state snapshots.", [({}, cache.nbytes)])
        metric("state_cache_entries", "gauge", "State snapshots held.", [({}, len(cache))])
        if backend.engine is not None:
            stats = backend.engine.stats()
            lookups = stats.hits + stats.misses
            metric(
                "disk_read_bytes_total",
                "counter",
                "Bytes read from disk: expert blocks and PLE rows.",
                [({"kind": "experts"}, stats.bytes_read), ({"kind": "ple"}, stats.ple_bytes_read)],
            )
            metric(
                "expert_cache_hits_total", "counter", "Expert lookups served from cache.", [({}, stats.hits)]
            )
            metric(
                "expert_cache_misses_total", "counter", "Expert lookups read from disk.", [({}, stats.misses)]
            )
            rate = stats.hits / lookups if lookups else 0.0
            metric("expert_cache_hit_rate", "gauge", "Expert cache hits / lookups.", [({}, rate)])
            metric(
                "io_stall_seconds_total",
                "counter",
                "Seconds spent waiting on expert reads.",
                [({}, stats.stall_seconds)],
            )
        return "\n".join(lines) + "\n"


class _Job:
    """One queued generation as the HTTP side sees it: an event queue fed from the worker thread."""

    def __init__(self, backend: EngineBackend, ids: list[int], params: SamplingParams):
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()
        self.future = backend.submit(ids, params, self._emit, self._cancelled.is_set)
        self.future.add_done_callback(self._finished)

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
        self.future.cancel()

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
                yield event
                if event[0] in ("done", "error"):
                    return
        finally:
            if getter is not None:
                getter.cancel()


def _token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token])


class _ChatOutput:
    """Turns generated records into chat deltas: reasoning split, tool calls, logprobs."""

    def __init__(
        self, tokenizer, in_reasoning: bool, tools: list[dict] | None, reasoning_field: str, logprobs: bool
    ):
        self.tokenizer = tokenizer
        self.splitter = ReasoningSplitter(in_reasoning)
        self.tool_stream = ToolCallStreamer(tools) if tools is not None else None
        self.fields = REASONING_FIELDS[reasoning_field]
        self.logprobs = logprobs
        self.content = ""
        self.reasoning = ""

    def feed(self, text: str) -> list[DeltaMessage]:
        return self._deltas(self.splitter.feed(text), final=False)

    def finish(self) -> list[DeltaMessage]:
        return self._deltas(self.splitter.flush(), final=True)

    def _deltas(self, pieces: list[tuple[str, str]], final: bool) -> list[DeltaMessage]:
        out: list[DeltaMessage] = []
        for kind, text in pieces:
            if kind == "reasoning":
                self.reasoning += text
                out.append(DeltaMessage(**dict.fromkeys(self.fields, text)))
            else:
                out.extend(self._content(text, final=False))
        if final:
            out.extend(self._content("", final=True))
        return out

    def _content(self, text: str, final: bool) -> list[DeltaMessage]:
        if self.tool_stream is None:
            self.content += text
            return [DeltaMessage(content=text)] if text else []
        content, calls = self.tool_stream.flush() if final else self.tool_stream.feed(text)
        self.content += content
        out = [DeltaMessage(content=content)] if content else []
        first = len(self.tool_stream.calls) - len(calls)
        out.extend(DeltaMessage(tool_calls=[c.to_openai(first + i)]) for i, c in enumerate(calls))
        return out

    @property
    def tool_calls(self) -> list:
        return self.tool_stream.calls if self.tool_stream is not None else []

    def token_logprobs(self, r: GenerationResponse) -> TokenLogprob | None:
        if not self.logprobs or r.logprobs is None:
            return None

        def entry(token: int, logprob: float) -> TopLogprob:
            text = _token_text(self.tokenizer, token)
            return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8", "surrogatepass")))

        top = [entry(t, lp) for t, lp in r.top_logprobs or []]
        return TokenLogprob(**entry(r.token, r.logprobs).model_dump(), top_logprobs=top)


def _usage(last: GenerationResponse | None, prompt_tokens: int, cached: int) -> Usage:
    completion = last.generation_tokens if last is not None else 0
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def _message_dict(m: ChatMessage) -> dict:
    """A request message as the chat template wants it."""
    if isinstance(m.content, list):
        if any(p.type != "text" or p.text is None for p in m.content):
            raise APIError(400, "only text content parts are supported", param="messages")
        content = "".join(p.text for p in m.content)
    else:
        content = m.content
    out = {"role": "system" if m.role == "developer" else m.role, "content": content}
    if m.role == "assistant":
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is None and content:
            # Open WebUI sends earlier reasoning back inside <think> tags in the content
            reasoning, out["content"] = split_reasoning(content)
        if reasoning:
            out["reasoning_content"] = reasoning
        if m.tool_calls:
            out["tool_calls"] = [_tool_call_dict(c) for c in m.tool_calls]
    for key in ("name", "tool_call_id"):
        if getattr(m, key) is not None:
            out[key] = getattr(m, key)
    return out


def _tool_call_dict(call) -> dict:
    args = call.function.arguments
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise APIError(
                400, f"tool call arguments are not JSON: {args[:200]!r}", param="messages"
            ) from None
    if not isinstance(args, dict):
        raise APIError(400, "tool call arguments must be a JSON object", param="messages")
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": args}}


def _template_kwargs(req: ChatCompletionRequest, thinking: bool) -> dict:
    kwargs = {"enable_thinking": thinking}
    extra = req.chat_template_kwargs or {}
    if RESERVED_TEMPLATE_KWARGS & extra.keys():
        bad = sorted(RESERVED_TEMPLATE_KWARGS & extra.keys())
        raise APIError(400, f"chat_template_kwargs may not set {bad}", param="chat_template_kwargs")
    kwargs.update(extra)
    if req.reasoning_effort is not None:
        if req.reasoning_effort not in REASONING_EFFORT:
            raise APIError(
                400,
                f"reasoning_effort must be one of {sorted(REASONING_EFFORT)}, got {req.reasoning_effort!r}",
                param="reasoning_effort",
            )
        kwargs["reasoning_effort"] = REASONING_EFFORT[req.reasoning_effort]
    return kwargs


def _forced_tool_prefix(choice, tools: list[dict], in_reasoning: bool) -> str:
    """Text the reply is made to start with so that tool_choice "required" or a named function holds.

    The model then writes only the rest of the Qwen XML call (the function name, or its parameters).
    """
    if choice in (None, "auto", "none"):
        return ""
    close = "</think>\n\n" if in_reasoning else ""  # a forced call ends the (empty) reasoning first
    if choice == "required":
        return close + "<tool_call>\n<function="
    named = isinstance(choice, dict) and choice.get("type") == "function"
    function = choice.get("function") if named else None
    name = function.get("name") if isinstance(function, dict) else None
    if isinstance(name, str):
        known = {t["function"]["name"] for t in tools}
        if name not in known:
            msg = f"tool_choice names {name!r}, not one of {sorted(known)}"
            raise APIError(400, msg, param="tool_choice")
        return close + f"<tool_call>\n<function={name}>\n"
    raise APIError(
        400, f"tool_choice must be none, auto, required or a function, got {choice!r}", param="tool_choice"
    )


def _render(tokenizer, render: Callable[[], str]) -> tuple[str, list[int]]:
    """Render and tokenize; a template or text error is the request's fault (400)."""
    try:
        prompt = render()
        return prompt, tokenizer.encode(prompt)
    except (jinja2.TemplateError, TypeError, ValueError, LookupError) as e:
        raise APIError(400, f"cannot build the prompt: {e}", param="messages") from None


def create_app(settings: ServerSettings, tokenizer, load_engine: Callable[[], object]) -> FastAPI:
    """Build the server app; the engine loads on the worker thread (`/health` answers 503 until then).

    Args:
        settings: names, limits and defaults.
        tokenizer: the model's `Tokenizer` (validation needs it while the engine loads).
        load_engine: returns the engine (an `expertstream.engine.Engine`, or a stand-in in tests).
    """

    def load():
        engine = load_engine()
        # the engine clamps max_model_len to the model's positions; validate against what it holds
        settings.max_model_len = engine.config.max_model_len
        return engine

    backend = EngineBackend(load, settings.max_queue, settings.state_cache_bytes)
    metrics = Metrics()
    created = int(time.time())
    name = settings.served_model_name
    model_ids = {name: False, name + THINKING_SUFFIX: True}  # id -> thinking on

    app = FastAPI(title="expertstream", summary="OpenAI-compatible API of expertstream")
    app.state.backend = backend
    app.state.metrics = metrics
    if settings.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.allowed_origins,
            allow_methods=["*"],
            allow_headers=["*"],
        )
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, err: APIError):
        return _error_json(err, {"Retry-After": str(RETRY_AFTER_S)} if err.status == 429 else None)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, err: RequestValidationError):
        first = err.errors()[0]
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            message = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}"
        else:
            message = f"{param or 'body'}: {first.get('msg')}"
        return _error_json(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, err: StarletteHTTPException):
        return _error_json(APIError(err.status_code, str(err.detail), code=str(err.status_code)), err.headers)

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, err: Exception):
        log.exception("request failed", exc_info=err)
        return _error_json(APIError(500, f"internal error: {err}", type="server_error"))

    def check_key(request: Request) -> None:
        if settings.api_key is None:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not secrets.compare_digest(given.encode(), settings.api_key.encode()):
            raise APIError(
                401, "invalid or missing API key (send Authorization: Bearer KEY)", code="invalid_api_key"
            )

    def resolve_model(model: str | None) -> bool:
        if model is None:
            return False
        if model not in model_ids:
            raise APIError(
                404,
                f"model {model!r} does not exist; this server has {sorted(model_ids)}",
                param="model",
                code="model_not_found",
            )
        return model_ids[model]

    def sampling(
        req, n_prompt: int, max_tokens: int | None, logprobs: bool, top_logprobs: int
    ) -> SamplingParams:
        if n_prompt >= settings.max_model_len:
            raise APIError(
                400,
                f"the prompt has {n_prompt} tokens; the context holds {settings.max_model_len}",
                param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                code="context_length_exceeded",
            )
        d = settings.defaults
        room = settings.max_model_len - n_prompt
        max_tokens = max_tokens or settings.default_max_tokens or room
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        return SamplingParams(
            max_tokens=min(max_tokens, room),
            temperature=d.temperature if req.temperature is None else req.temperature,
            top_k=d.top_k if req.top_k is None else max(req.top_k, 0),
            top_p=d.top_p if req.top_p is None else req.top_p,
            min_p=d.min_p if req.min_p is None else req.min_p,
            seed=d.seed if req.seed is None else req.seed,
            stop=stop,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        )

    def submit(ids: list[int], params: SamplingParams, endpoint: str) -> _Job:
        try:
            return _Job(backend, ids, params)
        except QueueFull as e:
            metrics.count(endpoint, "rejected")
            raise APIError(
                429, f"server busy: {e}; retry later", type="rate_limit_error", code="queue_full"
            ) from None

    def finished(endpoint: str, last: GenerationResponse | None, prompt_tokens: int, cached: int) -> None:
        metrics.count(endpoint, "ok")
        metrics.prompt_tokens += prompt_tokens
        metrics.cached_tokens += cached
        if last is not None:
            metrics.generation_tokens += last.generation_tokens
            metrics.prompt_tps, metrics.generation_tps = last.prompt_tps, last.generation_tps

    async def collect(
        job: _Job, request: Request, endpoint: str, on_token: Callable[[GenerationResponse], None]
    ):
        """Run a non-streaming job to the end; returns (last record, reused tokens)."""
        last, cached = None, 0
        try:
            async with aclosing(job.events(min(settings.keepalive_s, 1.0))) as events:
                async for ev in events:
                    if ev[0] == "tick" and await request.is_disconnected():
                        metrics.count(endpoint, "cancelled")
                        raise APIError(499, "client disconnected")
                    if ev[0] == "start":
                        cached = ev[1]
                    elif ev[0] == "token":
                        last = ev[1]
                        on_token(last)
                    elif ev[0] == "error":
                        metrics.count(endpoint, "error")
                        raise APIError(500, f"generation failed: {ev[1]}", type="server_error")
        finally:
            job.cancel()
        return last, cached

    async def stream(job: _Job, endpoint: str, on_event) -> AsyncIterator[str]:
        """SSE around a job: keepalive comments, the caller's chunks, an error event or [DONE]."""
        try:
            async with aclosing(job.events(settings.keepalive_s)) as events:
                async for ev in events:
                    if ev[0] == "tick":
                        yield ": keepalive\n\n"
                    elif ev[0] == "progress":
                        yield f": keepalive {ev[1]}/{ev[2]}\n\n"
                    elif ev[0] == "error":
                        metrics.count(endpoint, "error")
                        err = APIError(500, f"generation failed: {ev[1]}", type="server_error")
                        yield _sse(err.body())
                        return
                    else:
                        for chunk in on_event(ev):
                            yield chunk
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            metrics.count(endpoint, "cancelled")
            raise
        finally:
            job.cancel()

    def sse_response(body: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(
            body,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @app.get("/health")
    async def health():
        if backend.loaded.done() and backend.engine is not None:
            return {"status": "ok"}
        exc = backend.loaded.exception() if backend.loaded.done() else None
        status = f"failed to load: {exc}" if exc is not None else "loading"
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics():
        return PlainTextResponse(
            metrics.render(backend), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    def card(model_id: str) -> ModelCard:
        return ModelCard(id=model_id, created=created, max_model_len=settings.max_model_len)

    @app.get("/v1/models", dependencies=[Depends(check_key)], responses=ERROR_RESPONSES)
    async def list_models() -> ModelList:
        return ModelList(data=[card(m) for m in model_ids])

    @app.get("/v1/models/{model}", dependencies=[Depends(check_key)], responses=ERROR_RESPONSES)
    async def get_model(model: str) -> ModelCard:
        resolve_model(model)
        return card(model)

    @app.post(
        "/v1/chat/completions",
        dependencies=[Depends(check_key)],
        response_model=ChatCompletionResponse,
        responses=ERROR_RESPONSES,
    )
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        thinking = resolve_model(req.model)
        model = req.model or name
        parse_tools = bool(req.tools) and req.tool_choice != "none"
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if parse_tools else None
        messages = [_message_dict(m) for m in req.messages]
        kwargs = _template_kwargs(req, thinking)
        prompt, ids = await run_in_threadpool(
            _render, tokenizer, lambda: tokenizer.apply_chat_template(messages, tools=tools, **kwargs)
        )
        in_reasoning = prompt_ends_in_reasoning(prompt)
        forced = _forced_tool_prefix(req.tool_choice, tools, in_reasoning) if parse_tools else ""
        ids = ids + tokenizer.encode(forced) if forced else ids
        want_logprobs = bool(req.logprobs)
        params = sampling(
            req, len(ids), req.max_completion_tokens or req.max_tokens, want_logprobs, req.top_logprobs or 0
        )
        out = _ChatOutput(tokenizer, in_reasoning, tools, settings.reasoning_field, want_logprobs)
        forced_deltas = out.feed(forced) if forced else []  # e.g. the forced call's name
        job = submit(ids, params, "chat")
        chat_id = new_id("chatcmpl")

        def finish_reason(last: GenerationResponse | None) -> str:
            if out.tool_calls:
                return "tool_calls"
            return last.finish_reason if last is not None and last.finish_reason == "length" else "stop"

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            last, cached, started = None, 0, False

            def chunk(delta: DeltaMessage, logprobs=None, finish=None) -> str:
                choice = ChatChunkChoice(delta=delta, logprobs=logprobs, finish_reason=finish)
                return _sse(ChatCompletionChunk(id=chat_id, model=model, choices=[choice]))

            def on_event(ev):
                nonlocal last, cached, started
                if ev[0] == "start":
                    cached = ev[1]
                    return
                if not started:
                    started = True
                    yield chunk(DeltaMessage(role="assistant", content=""))
                    for delta in forced_deltas:
                        yield chunk(delta)
                if ev[0] == "token":
                    last = ev[1]
                    lp = out.token_logprobs(last)
                    deltas = out.feed(last.text)
                    if lp is not None and not deltas:
                        deltas = [DeltaMessage()]
                    for i, delta in enumerate(deltas):
                        yield chunk(
                            delta, ChoiceLogprobs(content=[lp]) if lp is not None and i == 0 else None
                        )
                elif ev[0] == "done":
                    for delta in out.finish():
                        yield chunk(delta)
                    yield chunk(DeltaMessage(), finish=finish_reason(last))
                    finished("chat", last, len(ids), cached)
                    if include_usage:
                        usage = _usage(last, len(ids), cached)
                        yield _sse(ChatCompletionChunk(id=chat_id, model=model, choices=[], usage=usage))

            return sse_response(stream(job, "chat", on_event))

        logprobs: list[TokenLogprob] = []

        def on_token(r: GenerationResponse) -> None:
            out.feed(r.text)
            if (lp := out.token_logprobs(r)) is not None:
                logprobs.append(lp)

        last, cached = await collect(job, request, "chat", on_token)
        out.finish()
        finished("chat", last, len(ids), cached)
        reasoning = dict.fromkeys(out.fields, out.reasoning or None)
        message = ChatMessageOut(
            content=(out.content.strip() if out.tool_calls else out.content) or None,
            tool_calls=[c.to_openai() for c in out.tool_calls] or None,
            **reasoning,
        )
        choice = ChatChoice(
            message=message,
            logprobs=ChoiceLogprobs(content=logprobs) if want_logprobs else None,
            finish_reason=finish_reason(last),
        )
        return ChatCompletionResponse(
            id=chat_id, model=model, choices=[choice], usage=_usage(last, len(ids), cached)
        )

    @app.post(
        "/v1/completions",
        dependencies=[Depends(check_key)],
        response_model=CompletionResponse,
        responses=ERROR_RESPONSES,
    )
    async def completions(req: CompletionRequest, request: Request):
        resolve_model(req.model)
        model = req.model or name
        if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str):
            if len(req.prompt) != 1:
                raise APIError(400, "prompt lists must hold exactly one prompt (no batching)", param="prompt")
            prompt = req.prompt[0]
        else:
            prompt = req.prompt
        if isinstance(prompt, str):
            ids = (await run_in_threadpool(_render, tokenizer, lambda: prompt))[1]
        else:
            ids = list(prompt)
            if any(not 0 <= t < tokenizer.vocab_size for t in ids):
                raise APIError(400, f"token ids must be in [0, {tokenizer.vocab_size})", param="prompt")
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        top_n = req.logprobs or 0
        params = sampling(req, len(ids), req.max_tokens, req.logprobs is not None, top_n)
        job = submit(ids, params, "completions")
        cmpl_id = new_id("cmpl")
        text_offset = 0

        def logprobs_of(r: GenerationResponse) -> CompletionLogprobs | None:
            nonlocal text_offset
            if req.logprobs is None or r.logprobs is None:
                return None
            top = {_token_text(tokenizer, t): lp for t, lp in r.top_logprobs or []}
            lp = CompletionLogprobs(
                tokens=[_token_text(tokenizer, r.token)],
                token_logprobs=[r.logprobs],
                top_logprobs=[top],
                text_offset=[text_offset],
            )
            text_offset += len(r.text)
            return lp

        def finish_reason(last: GenerationResponse | None) -> str:
            return "length" if last is not None and last.finish_reason == "length" else "stop"

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            last, cached = None, 0

            def chunk(text: str, logprobs=None, finish=None, usage=None) -> str:
                choices = (
                    [] if usage else [CompletionChoice(text=text, logprobs=logprobs, finish_reason=finish)]
                )
                return _sse(CompletionResponse(id=cmpl_id, model=model, choices=choices, usage=usage))

            def on_event(ev):
                nonlocal last, cached
                if ev[0] == "start":
                    cached = ev[1]
                elif ev[0] == "token":
                    last = ev[1]
                    lp = logprobs_of(last)
                    if last.text or lp is not None:
                        yield chunk(last.text, lp)
                elif ev[0] == "done":
                    yield chunk("", finish=finish_reason(last))
                    finished("completions", last, len(ids), cached)
                    if include_usage:
                        yield chunk("", usage=_usage(last, len(ids), cached))

            return sse_response(stream(job, "completions", on_event))

        pieces: list[str] = []
        merged = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])

        def on_token(r: GenerationResponse) -> None:
            if (lp := logprobs_of(r)) is not None:
                for key in CompletionLogprobs.model_fields:
                    getattr(merged, key).extend(getattr(lp, key))
            pieces.append(r.text)

        last, cached = await collect(job, request, "completions", on_token)
        finished("completions", last, len(ids), cached)
        merged = merged if req.logprobs is not None else None
        choice = CompletionChoice(text="".join(pieces), logprobs=merged, finish_reason=finish_reason(last))
        return CompletionResponse(
            id=cmpl_id, model=model, choices=[choice], usage=_usage(last, len(ids), cached)
        )

    # the same routes without the /v1 prefix, as mlx-lm serves them; kept out of the schema
    for path, endpoint, methods in (
        ("/models", list_models, ["GET"]),
        ("/chat/completions", chat_completions, ["POST"]),
        ("/completions", completions, ["POST"]),
    ):
        app.add_api_route(
            path, endpoint, methods=methods, dependencies=[Depends(check_key)], include_in_schema=False
        )

    return app


def sampling_defaults(args: argparse.Namespace, workdir: Path) -> SamplingParams:
    """Flags first, then the model's generation_config.json, then `SamplingParams` defaults (greedy)."""
    path = workdir / "generation_config.json"
    gen = json.loads(path.read_text()) if path.is_file() else {}
    if gen.get("do_sample") is False:
        gen["temperature"] = 0.0  # transformers' meaning: greedy whatever the temperature says
    base = SamplingParams()
    picked = {}
    for key in ("temperature", "top_p", "top_k", "min_p"):
        flag = getattr(args, key)
        picked[key] = flag if flag is not None else gen.get(key, getattr(base, key))
    return SamplingParams(seed=args.seed, **picked)


def configure_parser(p: argparse.ArgumentParser) -> None:
    EngineConfig.add_cli_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind; 0.0.0.0 listens on every interface")
    g.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    g.add_argument(
        "--served-model-name",
        default=None,
        help=f"model id (default: the workdir's name); NAME{THINKING_SUFFIX} is the same with thinking on",
    )
    g.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on every /v1 route")
    g.add_argument(
        "--reasoning-field",
        choices=sorted(REASONING_FIELDS),
        default="reasoning_content",
        help="where reasoning text goes in message and delta (default: reasoning_content)",
    )
    g.add_argument("--allowed-origins", nargs="*", default=[], help="CORS origins allowed (default: none)")
    g.add_argument(
        "--state-cache-gb", type=float, default=4.0, help="RAM for conversation state snapshots, GiB"
    )
    g.add_argument(
        "--max-queue", type=int, default=16, help="requests that may wait; more get 429 (default: 16)"
    )
    g.add_argument(
        "--keepalive-interval",
        type=float,
        default=15.0,
        help="seconds between SSE keepalive comments (default: 15)",
    )
    g.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default: INFO)")
    s = p.add_argument_group("default sampling (a request's own fields win; unset: generation_config.json)")
    s.add_argument("--temperature", type=float, default=None, help="0 is greedy")
    s.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1]")
    s.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (0: off)")
    s.add_argument("--min-p", type=float, default=None, help="probability floor relative to the top token")
    s.add_argument(
        "--max-tokens", type=int, default=None, help="most tokens per reply (default: the context left)"
    )


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from expertstream.default_model import resolve_model
    from expertstream.engine import Engine
    from expertstream.tokenizer import Tokenizer

    args.model = resolve_model(args.model)
    config = EngineConfig.from_args(args)
    settings = ServerSettings(
        served_model_name=args.served_model_name or Path(config.model).resolve().name,
        max_model_len=config.max_model_len,
        defaults=sampling_defaults(args, Path(config.model)),
        default_max_tokens=args.max_tokens,
        api_key=args.api_key,
        reasoning_field=args.reasoning_field,
        allowed_origins=args.allowed_origins,
        state_cache_bytes=int(args.state_cache_gb * 2**30),
        max_queue=args.max_queue,
        keepalive_s=args.keepalive_interval,
    )
    if args.host not in ("127.0.0.1", "localhost", "::1") and args.api_key is None:
        log.warning("listening on %s without --api-key: anyone who can reach it can use the model", args.host)
    app = create_app(settings, Tokenizer.from_dir(config.model), lambda: Engine(config))
    server = uvicorn.Server(
        uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower())
    )
    loaded = app.state.backend.loaded

    def stop_if_failed(fut) -> None:
        if fut.exception() is not None:
            log.error("could not load %s: %s", config.model, fut.exception())
            server.should_exit = True

    loaded.add_done_callback(stop_if_failed)
    log.info(
        "serving %s as %s and %s%s",
        config.model,
        settings.served_model_name,
        settings.served_model_name,
        THINKING_SUFFIX,
    )
    server.run()
    return 1 if loaded.done() and loaded.exception() is not None else 0
