"""`expertstream serve` end to end on the real tiny engine: a server on 127.0.0.1 and a free port, driven by
the openai client, and the `serve` command in a process of its own."""

import os
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from server_helpers import KEY, LOCAL, USER, LiveServer, raw_stream, real_settings, stream_parts

from expertstream.config import EngineConfig
from expertstream.runtime.engine import Engine
from expertstream.server.app import create_app


@pytest.fixture(scope="module")
def engine(tiny_workdir):
    engine = Engine(EngineConfig(model=str(tiny_workdir), device="cpu", max_model_len=512))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def real(engine):
    server = LiveServer(create_app(real_settings(), engine.tokenizer, lambda: engine))
    server.client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield server
    server.stop()


def test_models(real):
    assert [m.id for m in real.client.models.list()] == ["tiny", "tiny-thinking"]
    assert real.client.models.retrieve("tiny-thinking").id == "tiny-thinking"
    assert httpx.get(real.url + "/models").json()["data"][0]["max_model_len"] == 512


def test_chat_stream_matches_non_stream(real):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = real.client.chat.completions.create(model="tiny", messages=messages, max_tokens=6)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length") and 0 < r.usage.completion_tokens <= 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    stream = real.client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    content, reasoning, finish, _ = stream_parts(chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert ("".join(content) or None, "".join(reasoning) or None) == (
        choice.message.content,
        getattr(choice.message, "reasoning_content", None),
    )
    assert finish == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert raw_stream(real, {"model": "tiny", "messages": messages, "stream": True}).endswith(
        "data: [DONE]\n\n"
    )


def test_length_finish(real):
    r = real.client.chat.completions.create(model="tiny", messages=USER, max_completion_tokens=3)
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 3)


def test_chat_logprobs(real):
    r = real.client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=4, logprobs=True, top_logprobs=3
    )
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    for e in entries:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] <= 0
        assert e.logprob == pytest.approx(tops[0])  # greedy takes the most likely token


def test_legacy_completions(real):
    r = real.client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=5, logprobs=2)
    choice = r.choices[0]
    assert r.object == "text_completion" and choice.finish_reason in ("stop", "length")
    assert len(choice.logprobs.tokens) == r.usage.completion_tokens == len(choice.logprobs.top_logprobs)
    streamed = real.client.completions.create(
        model="tiny", prompt="The quick brown fox", max_tokens=5, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
    alias = httpx.post(real.url + "/completions", json={"prompt": "The quick brown fox", "max_tokens": 5})
    assert alias.json()["choices"][0]["text"] == choice.text


def test_follow_up_reuses_the_state_and_matches_an_uncached_run(real, engine):
    first = [{"role": "user", "content": "Tell me about the weather."}]
    r1 = real.client.chat.completions.create(model="tiny", messages=first)
    follow_up = first + [
        {"role": "assistant", "content": r1.choices[0].message.content or ""},
        {"role": "user", "content": "And tomorrow?"},
    ]
    r2 = real.client.chat.completions.create(model="tiny", messages=follow_up)
    generation_prompt = len(engine.tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n"))
    # at least everything before the first turn's reply comes back from the state cache
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens - generation_prompt

    fresh = create_app(real_settings(state_cache_bytes=0), engine.tokenizer, lambda: engine)
    with TestClient(fresh, base_url=LOCAL) as http:
        ref = http.post("/v1/chat/completions", json={"model": "tiny", "messages": follow_up}).json()
    assert ref["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert ref["usage"]["prompt_tokens"] == r2.usage.prompt_tokens
    assert ref["choices"][0]["message"]["content"] == r2.choices[0].message.content


def test_three_concurrent_clients(real):
    prompts = ["One fish", "Two plus two is", "The city by the river"]

    def ask(prompt):
        r = real.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}])
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens

    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(ask, prompts))
    assert together == [ask(p) for p in prompts]
    assert all(finish in ("stop", "length") for _, finish, _ in together)


def test_metrics_count_tokens(real):
    def value(name):
        text = httpx.get(real.url + "/metrics").text
        return float(re.search(f"^expertstream_{re.escape(name)} (\\S+)$", text, re.M).group(1))

    before = value("generation_tokens_total")
    r = real.client.chat.completions.create(model="tiny", messages=USER, max_tokens=2)
    assert value("generation_tokens_total") == before + r.usage.completion_tokens
    assert value('disk_read_bytes_total{kind="experts"}') > 0 and value("generation_tokens_per_second") > 0
    assert value("queue_length") == 0


@pytest.mark.parametrize("bundled", [False, True])
def test_cli_serves_a_workdir(tiny_workdir, tmp_path, bundled):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # without WORKDIR it serves the bundled demo model, set up into a fresh cache on first use
    workdir = [] if bundled else [str(tiny_workdir)]
    cmd = [sys.executable, "-m", "expertstream", "serve", *workdir, "--port", str(port)]
    cmd += ["--device", "cpu", "--max-model-len", "256", "--api-key", KEY]
    cmd += [] if bundled else ["--served-model-name", "demo"]  # the bundled model's id is demo by default
    env = {**os.environ, "EXPERTSTREAM_CACHE": str(tmp_path / "cache")}
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "the server did not become ready"
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        assert [m.id for m in client.models.list()] == ["demo", "demo-thinking"]
        r = client.chat.completions.create(model="demo", messages=USER, max_tokens=2, temperature=0)
        assert r.usage.completion_tokens <= 2 and r.choices[0].finish_reason in ("stop", "length")
        assert len(list((tmp_path / "cache").glob("demo-*/manifest.json"))) == bundled
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
