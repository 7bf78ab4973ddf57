"""Who may talk to the server: the `Host` header (against DNS rebinding) and the API key.

A web page can point a name it controls at 127.0.0.1 and drive a loopback server from the victim's browser;
the browser then sends that name as `Host`. So a server bound to loopback answers only requests whose `Host`
is a loopback name, unless `--allowed-hosts` lists more. With `--api-key`, every route but `/health` and
`/metrics` (the schema and its docs page included) needs `Authorization: Bearer KEY` or `x-api-key: KEY`.
"""

from __future__ import annotations

import ipaddress
import secrets

from expertstream.server.errors import APIError, error_for

# answered without a key: orchestrators and Prometheus poll them
OPEN_PATHS = frozenset({"/health", "/metrics"})


def host_name(host: str) -> str:
    """The name in a `Host` header value: no port, no IPv6 brackets, lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host[1:]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_loopback(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_allowed(name: str, allowed: list[str] | None) -> bool:
    """`allowed` None: loopback names only; entries are names, `.suffix` for a domain and its subdomains,
    or `*` for any."""
    if allowed is None:
        return is_loopback(name)
    for entry in allowed:
        entry = entry.lower()
        if entry == "*" or name == host_name(entry):
            return True
        if entry.startswith(".") and (name.endswith(entry) or name == entry[1:]):
            return True
    return False


def key_given(headers: dict[bytes, bytes]) -> str | None:
    """The key from `Authorization: Bearer KEY` (the scheme is required) or `x-api-key: KEY`."""
    auth = headers.get(b"authorization")
    if auth is not None:
        scheme, _, token = auth.decode("latin-1").strip().partition(" ")
        return token.strip() if scheme.lower() == "bearer" else None
    key = headers.get(b"x-api-key")
    return key.decode("latin-1").strip() if key is not None else None


class Guard:
    """ASGI middleware: refuse a disallowed `Host` (403) and a missing or wrong API key (401).

    Args:
        allowed_hosts: see `host_allowed`.
        api_key: None: no key needed.
        error_response: `(path, APIError) -> JSONResponse` (`errors.error_for`).
    """

    def __init__(self, app, allowed_hosts: list[str] | None, api_key: str | None, error_response=error_for):
        self.app, self.allowed_hosts, self.api_key = app, allowed_hosts, api_key
        self.error_response = error_response

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        err = self.check(scope)
        if err is not None:
            return await self.error_response(scope["path"], err)(scope, receive, send)
        await self.app(scope, receive, send)

    def check(self, scope) -> APIError | None:
        headers = dict(scope["headers"])
        name = host_name(headers.get(b"host", b"").decode("latin-1"))
        if not host_allowed(name, self.allowed_hosts):
            return APIError(
                403,
                f"Host {name!r} is not allowed; start the server with --allowed-hosts {name or 'NAME'} "
                "to accept it",
                code="host_not_allowed",
            )
        if self.api_key is None or scope["path"] in OPEN_PATHS:
            return None
        given = key_given(headers)
        if given is None or not secrets.compare_digest(given.encode(), self.api_key.encode()):
            return APIError(
                401,
                "invalid or missing API key (send Authorization: Bearer KEY)",
                code="invalid_api_key",
            )
        return None
