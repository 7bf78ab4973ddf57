"""Errors of `expertstream serve`, all sent as OpenAI's {"error": {message, type, param, code}} body.

`APIError` is what handlers raise; `add_error_handlers` turns it, FastAPI's validation errors, unknown routes
and unexpected exceptions into that body; `BodyLimit` refuses oversized requests before they are parsed.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from expertstream.log import get_logger
from expertstream.server.protocol import ErrorResponse

log = get_logger(__name__)

# the error statuses a /v1 route documents in the OpenAPI schema
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


class APIError(Exception):
    """An error the client caused (or the server hit), sent as OpenAI's {"error": {...}} body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def generation_failed(exc: BaseException) -> APIError:
    return APIError(500, f"generation failed: {exc}", type="server_error")


def error_json(err: APIError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


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
            return await error_json(too_big)(scope, receive, send)
        # read the body here, counting, then hand it on; later receives (disconnects) pass through
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await error_json(too_big)(scope, receive, send)
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


async def _api_error(_request: Request, err: APIError):
    return error_json(err, {"Retry-After": str(RETRY_AFTER_S)} if err.status == 429 else None)


async def _validation_error(_request: Request, err: RequestValidationError):
    first = err.errors()[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        message = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}"
    else:
        message = f"{param or 'body'}: {first.get('msg')}"
    return error_json(APIError(400, message, param=param))


async def _http_error(_request: Request, err: StarletteHTTPException):
    return error_json(APIError(err.status_code, str(err.detail), code=str(err.status_code)), err.headers)


async def _internal_error(_request: Request, err: Exception):
    log.exception("request failed", exc_info=err)
    return error_json(APIError(500, f"internal error: {err}", type="server_error"))


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
