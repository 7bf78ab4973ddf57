"""The server under large bodies: early refusals, /health and small requests answering meanwhile."""

import json
import os
import threading
import time

import httpx
import pytest
from server_helpers import USER, scripted_server

from expertstream.server.limits import body_limit


@pytest.fixture(scope="module")
def server(tiny_tokenizer):
    # the default body limit: what a 1024-token context can hold
    server = scripted_server(tiny_tokenizer, max_model_len=1024)
    yield server
    server.stop()


JSON = {"Content-Type": "application/json"}


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def chat_body(text: str) -> bytes:
    return json.dumps({"model": "fake", "messages": [{"role": "user", "content": text}]}).encode()


def test_body_limit_follows_the_context(server, tiny_tokenizer):
    limit = body_limit(1024, tiny_tokenizer.max_token_bytes)
    assert limit < 2 << 20  # far under the old fixed 32 MiB
    r = httpx.post(server.url + "/v1/chat/completions", content=chat_body("x" * limit), headers=JSON)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    # under the body limit but more text than the context can hold: refused before any tokenizer work
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "word " * 200_000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "at least" in r.json()["error"]["message"]
    # under the byte limit but thousands of one-word messages: refused before parsing
    r = httpx.post(server.url + "/v1/chat/completions", content=many_messages(400 << 10), headers=JSON)
    assert r.status_code == 413 and "JSON objects" in r.json()["error"]["message"]
    # token ids are counted before each one is looked at
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [5] * 2000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def many_messages(size: int) -> bytes:
    """A body of one-word messages: cheap to send, costly to validate (one model per message)."""
    one = {"role": "user", "content": "hi"}
    return json.dumps({"model": "fake", "messages": [one] * (size // len(json.dumps(one)))}).encode()


def test_flood_of_large_bodies_leaves_health_and_small_requests_answering(server):
    # over the body limit; under it but over the context; and under it as 28,000 one-word messages
    bodies = [chat_body("lorem ipsum " * (4 << 20 >> 4)), chat_body("lorem ipsum " * (1 << 20 >> 4))]
    bodies += [chat_body("lorem ipsum " * (600 << 10 >> 4)), many_messages(900 << 10)]
    stop = threading.Event()
    statuses: list[int] = []

    def flood(body: bytes):
        with httpx.Client(base_url=server.url, timeout=60) as http:
            for _ in range(6):  # bounded: a broken server cannot keep the test running
                if stop.is_set():
                    return
                try:
                    statuses.append(http.post("/v1/chat/completions", content=body, headers=JSON).status_code)
                except httpx.TransportError:
                    statuses.append(-1)  # the server may close a connection whose body it refused

    rss0 = rss()
    flooders = [threading.Thread(target=flood, args=(b,)) for b in bodies * 2]
    for t in flooders:
        t.start()
    slowest = 0.0
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            for _ in range(20):
                t0 = time.monotonic()
                assert http.get("/health").status_code == 200
                r = http.post(
                    "/v1/chat/completions", json={"model": "fake", "messages": USER, "max_tokens": 2}
                )
                assert r.status_code == 200, r.text
                slowest = max(slowest, time.monotonic() - t0)
                if not any(t.is_alive() for t in flooders):
                    break
    finally:
        stop.set()
        for t in flooders:
            t.join(120)
    assert slowest < 1.0, f"a small request took {slowest:.2f} s during the flood"
    assert statuses and set(statuses) <= {400, 413, -1}, statuses
    # what refused bodies took goes back to the OS (measured: ~22 MiB kept, ~54 MiB without malloc_trim)
    assert rss() - rss0 < 40 << 20
