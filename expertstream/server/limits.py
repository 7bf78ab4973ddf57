"""What a request may carry: the body bound the context implies, the length check made before any template
or tokenizer work, and handing memory back after a large request was refused.

A token's text is at most `Tokenizer.max_token_bytes` long, so a text of B UTF-8 bytes has at least
B / max_token_bytes tokens: a prompt whose text alone exceeds the context is refused without rendering or
tokenizing it (both cost seconds per megabyte), and a body far larger than any prompt that fits is refused
before it is parsed.
"""

from __future__ import annotations

import ctypes
import ctypes.util

from starlette.concurrency import run_in_threadpool

from expertstream.server.errors import APIError, error_for

# bytes of a body that are not prompt text: tool definitions, schemas, sampling fields
BODY_SLACK = 1 << 20
# JSON escapes a UTF-8 character of n bytes as at most 3n bytes (\u00e9 for the 2-byte é)
JSON_EXPANSION = 3
# a refused body at least this large hands its freed memory back to the OS
LARGE_BODY = 1 << 20
# JSON objects and arrays a body may hold, per context token, plus slack for tool schemas: parsing and
# validating holds the GIL (~10 us an object), so 10^5 one-word messages would stall every request for seconds
ITEMS_PER_TOKEN = 8
ITEMS_SLACK = 4096


def body_limit(max_model_len: int, max_token_bytes: int) -> int:
    """Bytes of the largest body whose prompt could fit the context."""
    return JSON_EXPANSION * max_model_len * max_token_bytes + BODY_SLACK


def item_limit(max_model_len: int) -> int:
    """JSON objects and arrays (counted as `{` and `[` bytes, strings included) a body may hold."""
    return ITEMS_PER_TOKEN * max_model_len + ITEMS_SLACK


def text_bytes(texts) -> int:
    """UTF-8 bytes of the strings among `texts` (None and other values count 0)."""
    return sum(len(t.encode("utf-8", "surrogatepass")) for t in texts if isinstance(t, str))


def check_fits(nbytes: int, max_token_bytes: int, max_model_len: int, param: str) -> None:
    """Refuse a prompt whose text alone holds at least the whole context (400, context_length_exceeded)."""
    at_least = -(-nbytes // max_token_bytes)
    if at_least >= max_model_len:
        raise APIError(
            400,
            f"the prompt has at least {at_least} tokens ({nbytes} bytes of text); "
            f"the context holds {max_model_len}",
            param=param,
            code="context_length_exceeded",
        )


def check_tokens(n: int, max_model_len: int, param: str) -> None:
    """Refuse a prompt of `n` tokens that leaves no room to generate (400, context_length_exceeded)."""
    if n >= max_model_len:
        raise APIError(
            400,
            f"the prompt has {n} tokens; the context holds {max_model_len}",
            param=param,
            code="context_length_exceeded",
        )


def _malloc_trim():
    path = ctypes.util.find_library("c")
    fn = getattr(ctypes.CDLL(path), "malloc_trim", None) if path else None
    return fn


_TRIM = _malloc_trim()


def release_memory() -> None:
    """Return freed heap pages to the OS (glibc keeps them after a large body otherwise)."""
    if _TRIM is not None:
        _TRIM(0)


class BodyLimit:
    """ASGI middleware: refuse with 413, before parsing, a body over `max_bytes()` (with or without
    Content-Length) or one holding more than `max_items()` JSON objects and arrays.

    After a large body was refused (here or by the route), its freed memory goes back to the OS.
    """

    def __init__(self, app, max_bytes, max_items):
        self.app, self.max_bytes, self.max_items = app, max_bytes, max_items

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_bytes()
        too_big = APIError(413, f"request body exceeds {limit} bytes", code="body_too_large")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await error_for(scope["path"], too_big)(scope, receive, send)
        # read the body here, counting, then hand it on; later receives (disconnects) pass through
        messages, size, items = [], 0, 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            items += chunk.count(b"{") + chunk.count(b"[")
            if size > limit:
                messages.clear()
                await error_for(scope["path"], too_big)(scope, receive, send)
                return await run_in_threadpool(release_memory)
            if not message.get("more_body", False):
                break
        if items > self.max_items():
            messages.clear()
            err = APIError(
                413,
                f"request body holds {items} JSON objects and arrays; at most {self.max_items()}",
                code="body_too_large",
            )
            await error_for(scope["path"], err)(scope, receive, send)
            return await run_in_threadpool(release_memory)

        async def replay():
            return messages.pop(0) if messages else await receive()

        status = 0

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        await self.app(scope, replay, send_status)
        if size >= LARGE_BODY and status >= 400:
            messages.clear()
            await run_in_threadpool(release_memory)
