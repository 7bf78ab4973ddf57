"""Pieces the server tests share: a live server on 127.0.0.1 and a free port, and a scripted engine (the
real tiny tokenizer and `stream_generate`, with logits that spell out a chosen text)."""

import re
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import torch
import uvicorn

from expertstream.generate import SamplingParams
from expertstream.runtime.engine import EngineStats
from expertstream.server.app import ServerSettings, create_app
from expertstream.tokenizer import Tokenizer

KEY = "sk-test"
LOCAL = "http://127.0.0.1"  # TestClient's default Host, testserver, is not a loopback name


class LiveServer:
    def __init__(self, app):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not (self.server.started and httpx.get(self.url + "/health").status_code == 200):
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.05)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


# ---- scripted engine


class ScriptedState:
    def __init__(self):
        self.reset()

    def reset(self):
        self.tokens, self.generated = [], 0

    def snapshot(self):
        return SimpleNamespace(
            tokens=list(self.tokens), generated=self.generated, nbytes=8 * len(self.tokens)
        )

    def restore(self, snap):
        self.tokens, self.generated = list(snap.tokens), snap.generated


class ScriptedEngine:
    """Writes `script` (then <|im_end|>) whatever the prompt; knobs make it slow or fail."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.config = SimpleNamespace(max_model_len=max_model_len)
        self.device = torch.device("cpu")
        self.im_end = tokenizer.token_to_id("<|im_end|>")
        self.forward_calls = 0
        self.configure()

    def configure(self, script="Hello!", prefill_delay_s=0.0, token_delay_s=0.0, fail_at=None):
        self.script_ids = self.tokenizer.encode(script) + [self.im_end]
        self.prefill_delay_s, self.token_delay_s, self.fail_at = prefill_delay_s, token_delay_s, fail_at

    def new_state(self):
        return ScriptedState()

    def stats(self):
        return EngineStats(**dict.fromkeys(EngineStats.__dataclass_fields__, 0))

    def gpu_memory(self):
        return {}  # a CPU engine's

    def forward(self, state, ids, all_logits=False):
        self.forward_calls += 1
        ids = list(ids)
        script = self.script_ids
        decode = len(ids) == 1 and state.generated < len(script) and ids[0] == script[state.generated]
        state.generated = state.generated + 1 if decode else 0
        time.sleep(self.token_delay_s if decode else self.prefill_delay_s)
        if self.fail_at is not None and state.generated >= self.fail_at:
            raise RuntimeError("scripted failure")
        state.tokens.extend(ids)
        logits = torch.full((self.tokenizer.vocab_size,), -30.0)
        logits[script[min(state.generated, len(script) - 1)]] = 30.0
        return logits


def wait_idle(server, timeout=10.0):
    deadline = time.monotonic() + timeout
    while re.search("^expertstream_worker_busy 1$", httpx.get(server.url + "/metrics").text, re.M):
        assert time.monotonic() < deadline, "the worker stayed busy"
        time.sleep(0.02)


USER = [{"role": "user", "content": "Hi"}]
# the template's tool call of get_weather(city="Paris", days=2), as the model writes it
CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
)


def raw_stream(server, body, path="/v1/chat/completions") -> str:
    """The event stream's text of one streamed request."""
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", server.url + path, json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return r.read().decode()


def stream_parts(stream):
    content, reasoning, finish, tool_calls = [], [], None, []
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content.append(delta.content or "")
            reasoning.append(getattr(delta, "reasoning_content", None) or "")
            tool_calls += delta.tool_calls or []
            finish = choice.finish_reason or finish
    return content, reasoning, finish, tool_calls


def real_settings(**kw) -> ServerSettings:
    """Settings of a server in front of the real tiny engine: greedy, 8 tokens unless asked, 512 positions."""
    defaults = dict(served_model_name="tiny", max_model_len=512, default_max_tokens=8)
    return ServerSettings(**{**defaults, "defaults": SamplingParams(temperature=0.0), **kw})


# ---- scripted engine: what random weights cannot show


def scripted_server(tokenizer: Tokenizer, max_model_len: int = 1024, **settings) -> "LiveServer":
    """A live server in front of a `ScriptedEngine` (`.engine`), with an openai client (`.client`)."""
    engine = ScriptedEngine(tokenizer, max_model_len=max_model_len)
    settings = ServerSettings(
        served_model_name="fake",
        max_model_len=max_model_len,
        defaults=SamplingParams(temperature=0.0),
        **settings,
    )
    server = LiveServer(create_app(settings, tokenizer, lambda: engine))
    server.engine = engine
    server.client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    return server
