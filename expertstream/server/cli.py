"""`expertstream serve`: its flags, checked before torch loads, and the listening socket, bound before the
engine starts loading (a port in use is one sentence); the app and its routes are in `server/app.py`."""

from __future__ import annotations

import argparse
import errno
import socket

from expertstream.config import EngineConfig, SamplingParams
from expertstream.server.settings import REASONING_FIELDS, THINKING_SUFFIX
from expertstream.usage import CLIError, check_workdir

# the default-sampling flags (a request's own fields win; `app.sampling_defaults`), checked as SamplingParams
# with --max-tokens before anything loads
SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def configure_parser(p: argparse.ArgumentParser) -> None:
    EngineConfig.add_cli_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind; 0.0.0.0 listens on every interface")
    g.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    g.add_argument(
        "--served-model-name",
        default=None,
        help=f"model id (default: the workdir's name, demo for the bundled model); NAME{THINKING_SUFFIX} "
        "is the same with thinking on",
    )
    g.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on all routes but /health, /metrics",
    )
    g.add_argument(
        "--allowed-hosts",
        nargs="+",
        default=None,
        metavar="HOST",
        help="Host header names accepted (`.example.com` for a domain, `*` for any); default: loopback names "
        "when bound to loopback, any otherwise",
    )
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
        "--repetition-penalty", type=float, default=None, help="over the prompt's and reply's tokens (1: off)"
    )
    s.add_argument(
        "--max-tokens", type=int, default=None, help="most tokens per reply (default: the context left)"
    )


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the engine starts loading: a port in use is one sentence, not a
    uvicorn error racing a loading thread at exit."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        why = "is in use (another server?): pick another" if e.errno == errno.EADDRINUSE else (
            f"cannot be bound ({e.strerror})")  # fmt: skip
        raise CLIError(f"port {port} on {host} {why}") from None
    sock.listen(2048)
    return sock


def main(args: argparse.Namespace) -> int:
    config = EngineConfig.from_args(args)
    flags = (*SAMPLING_FLAGS, "max_tokens")
    SamplingParams(**{k: getattr(args, k) for k in flags if getattr(args, k) is not None})
    if config.model:
        check_workdir(config.model)
    sock = bind(args.host, args.port)
    try:
        from expertstream.server.app import serve

        return serve(args, config, sock)
    finally:  # also when loading is refused (--device cuda without a GPU): the port is free again
        sock.close()
