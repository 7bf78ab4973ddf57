"""Errors of `expertstream serve`, all sent as OpenAI's {"error": {message, type, param, code}} body.

`APIError` is what handlers raise; `add_error_handlers` turns it, FastAPI's validation errors, unknown routes
and unexpected exceptions into that body.
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


# Anthropic's error types by HTTP status (its clients raise a class per type)
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
ANTHROPIC_PATHS = ("/v1/messages",)  # routes whose errors take Anthropic's shape


def anthropic_body(err: APIError) -> dict:
    kind = ANTHROPIC_ERROR_TYPES.get(
        err.status, "api_error" if err.status >= 500 else "invalid_request_error"
    )
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def error_for(path: str, err: APIError, headers: dict | None = None) -> JSONResponse:
    """The error response in the shape its route's clients expect (Anthropic's on /v1/messages)."""
    if headers is None and err.status == 429:
        headers = {"Retry-After": str(RETRY_AFTER_S)}
    if path.startswith(ANTHROPIC_PATHS):
        return JSONResponse(anthropic_body(err), status_code=err.status, headers=headers)
    return error_json(err, headers)


async def _api_error(request: Request, err: APIError):
    return error_for(request.url.path, err)


async def _validation_error(request: Request, err: RequestValidationError):
    first = err.errors()[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        message = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}"
    else:
        message = f"{param or 'body'}: {first.get('msg')}"
    return error_for(request.url.path, APIError(400, message, param=param))


async def _http_error(request: Request, err: StarletteHTTPException):
    err_ = APIError(err.status_code, str(err.detail), code=str(err.status_code))
    return error_for(request.url.path, err_, err.headers)


async def _internal_error(request: Request, err: Exception):
    log.exception("request failed", exc_info=err)
    return error_for(request.url.path, APIError(500, f"internal error: {err}", type="server_error"))


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
