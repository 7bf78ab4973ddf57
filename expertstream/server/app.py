"""`expertstream serve`: an OpenAI-compatible streaming HTTP server in front of one generation worker.

HTTP handlers validate, render the chat template, tokenize and translate; the engine runs only on the worker
thread (`expertstream.runtime.worker`). `/v1/models` and `/health` answer from memory, never waiting on the
worker.
This module holds the CLI and the routes; the code map and wire format are in docs/server.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse

from expertstream.config import EngineConfig
from expertstream.generate import SamplingParams
from expertstream.log import get_logger
from expertstream.runtime.worker import EngineBackend
from expertstream.server.anthropic import add_anthropic_routes
from expertstream.server.cli import SAMPLING_FLAGS
from expertstream.server.errors import ERROR_RESPONSES, APIError, add_error_handlers
from expertstream.server.guard import Guard, host_name, is_loopback
from expertstream.server.jobs import Jobs
from expertstream.server.limits import BodyLimit, body_limit, item_limit
from expertstream.server.metrics import Metrics
from expertstream.server.output import ChatOutput, CompletionOutput
from expertstream.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    new_id,
)
from expertstream.server.request import Prompts, sampling_params
from expertstream.server.settings import THINKING_SUFFIX, ServerSettings

log = get_logger(__name__)


def create_app(settings: ServerSettings, tokenizer, load_engine: Callable[[], object]) -> FastAPI:
    """Build the server app; the engine loads on the worker thread (`/health` answers 503 until then).

    Args:
        settings: names, limits and defaults.
        tokenizer: the model's `Tokenizer` (validation needs it while the engine loads).
        load_engine: returns the engine (an `expertstream.runtime.engine.Engine`, or a stand-in in tests).
    """

    def load():
        engine = load_engine()
        # the engine clamps max_model_len to the model's positions; validate against what it holds
        settings.max_model_len = engine.config.max_model_len
        return engine

    backend = EngineBackend(load, settings.max_queue, settings.state_cache_bytes)
    metrics = Metrics()
    jobs = Jobs(backend, metrics, settings.keepalive_s)
    created = int(time.time())
    name = settings.served_model_name
    model_ids = {name: False, name + THINKING_SUFFIX: True}  # id -> thinking on

    app = FastAPI(title="expertstream", summary="OpenAI-compatible API of expertstream")
    app.state.backend = backend
    app.state.metrics = metrics
    prompts = Prompts(tokenizer, settings)
    tokenizer.max_token_bytes  # noqa: B018 (computed once here, not on the first request's event loop)

    def max_body_bytes() -> int:
        if settings.max_body_bytes is not None:
            return settings.max_body_bytes
        return body_limit(settings.max_model_len, tokenizer.max_token_bytes)

    # the last added runs first: CORS preflights, then Host and key, then the body bound
    app.add_middleware(
        BodyLimit, max_bytes=max_body_bytes, max_items=lambda: item_limit(settings.max_model_len)
    )
    app.add_middleware(Guard, allowed_hosts=settings.allowed_hosts, api_key=settings.api_key)
    if settings.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.allowed_origins,
            allow_methods=["*"],
            allow_headers=["*"],
        )
    add_error_handlers(app)

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

    v1 = {"responses": ERROR_RESPONSES}

    @app.get("/v1/models", **v1)
    async def list_models() -> ModelList:
        return ModelList(data=[card(m) for m in model_ids])

    @app.get("/v1/models/{model}", **v1)
    async def get_model(model: str) -> ModelCard:
        resolve_model(model)
        return card(model)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, **v1)
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        thinking = resolve_model(req.model)
        prompt = await prompts.chat(req, thinking)
        want_logprobs = bool(req.logprobs)
        max_tokens = req.max_completion_tokens or req.max_tokens
        top_n = req.top_logprobs or 0
        params = sampling_params(
            settings, req, len(prompt.ids), max_tokens, want_logprobs, top_n, prompt.processors
        )
        model = req.model or name
        out = ChatOutput(
            tokenizer, new_id("chatcmpl"), model, prompt, settings.reasoning_field, want_logprobs
        )
        return await jobs.respond(jobs.submit(prompt.ids, params, "chat", req.stream), out, req, request)

    @app.post("/v1/completions", response_model=CompletionResponse, **v1)
    async def completions(req: CompletionRequest, request: Request):
        resolve_model(req.model)
        ids = await prompts.completion(req)
        want_logprobs = req.logprobs is not None
        params = sampling_params(settings, req, len(ids), req.max_tokens, want_logprobs, req.logprobs or 0)
        out = CompletionOutput(tokenizer, new_id("cmpl"), req.model or name, want_logprobs)
        return await jobs.respond(jobs.submit(ids, params, "completions", req.stream), out, req, request)

    add_anthropic_routes(app, tokenizer, settings, prompts, jobs, resolve_model)

    # the same routes without the /v1 prefix, as mlx-lm serves them; kept out of the schema
    for path, endpoint, methods in (
        ("/models", list_models, ["GET"]),
        ("/chat/completions", chat_completions, ["POST"]),
        ("/completions", completions, ["POST"]),
    ):
        app.add_api_route(path, endpoint, methods=methods, include_in_schema=False)

    return app


def sampling_defaults(args: argparse.Namespace, workdir: Path) -> SamplingParams:
    """Flags first, then the model's generation_config.json, then `SamplingParams` defaults (greedy)."""
    path = workdir / "generation_config.json"
    gen = json.loads(path.read_text()) if path.is_file() else {}
    if gen.get("do_sample") is False:
        gen["temperature"] = 0.0  # transformers' meaning: greedy whatever the temperature says
    base = SamplingParams()
    picked = {}
    for key in SAMPLING_FLAGS:
        flag = getattr(args, key)
        picked[key] = flag if flag is not None else gen.get(key, getattr(base, key))
    return SamplingParams(seed=args.seed, **picked)


def allowed_hosts(bind: str, flag: list[str] | None) -> list[str] | None:
    """--allowed-hosts, else loopback names only (None) on a loopback bind, else any host."""
    if flag is not None:
        return flag
    return None if is_loopback(host_name(bind)) else ["*"]


def serve(args: argparse.Namespace, config: EngineConfig, sock: socket.socket) -> int:
    """Load the model and serve on `sock` (bound by `server.cli`, the flags checked there) until stopped."""
    import uvicorn

    from expertstream.default_model import model_id, resolve_model
    from expertstream.runtime.engine import Engine, resolve_device_dtype
    from expertstream.tokenizer import Tokenizer
    from expertstream.workdir.workdir import Workdir

    config = dataclasses.replace(config, model=resolve_model(config.model))
    Workdir(config.model)  # a partial manifest or a changed file: refused before the engine loads
    resolve_device_dtype(config)  # --device cuda without a GPU, likewise
    settings = ServerSettings(
        served_model_name=args.served_model_name or model_id(config.model),
        max_model_len=config.max_model_len,
        defaults=sampling_defaults(args, Path(config.model)),
        default_max_tokens=args.max_tokens,
        api_key=args.api_key,
        reasoning_field=args.reasoning_field,
        allowed_origins=args.allowed_origins,
        allowed_hosts=allowed_hosts(args.host, args.allowed_hosts),
        state_cache_bytes=int(args.state_cache_gb * 2**30),
        max_queue=args.max_queue,
        keepalive_s=args.keepalive_interval,
    )
    tokenizer = Tokenizer.from_dir(config.model)
    if not is_loopback(host_name(args.host)) and args.api_key is None:
        log.warning("listening on %s without --api-key: anyone who can reach it can use the model", args.host)
    app = create_app(settings, tokenizer, lambda: Engine(config))
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level.lower()))
    loaded = app.state.backend.loaded

    def stop_if_failed(fut) -> None:
        if fut.exception() is not None:
            log.error("could not load %s: %s", config.model, fut.exception())
            server.should_exit = True

    loaded.add_done_callback(stop_if_failed)
    log.info(
        "serving %s as %s and %s%s on http://%s:%d/v1",
        config.model,
        settings.served_model_name,
        settings.served_model_name,
        THINKING_SUFFIX,
        args.host,
        args.port,
    )
    server.run(sockets=[sock])
    return 1 if loaded.done() and loaded.exception() is not None else 0
