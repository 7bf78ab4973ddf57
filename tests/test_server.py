"""`expertstream serve` end to end: a real server on 127.0.0.1 and a free port, driven by the openai client.

Main flows run on the real tiny engine. A scripted engine (the real tiny tokenizer and `stream_generate`,
with logits that spell out a chosen text) covers what random weights cannot: stop strings, UTF-8, the
reasoning split, tool calls, slow prefill, failures, disconnects and the queue bound.
"""

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from server_helpers import KEY, USER, LiveServer, ScriptedEngine, scripted_server, stream_parts, wait_idle

from expertstream.config import EngineConfig
from expertstream.generate import SamplingParams
from expertstream.runtime.engine import Engine
from expertstream.server.app import ServerSettings, create_app, sampling_defaults
from expertstream.server.cli import configure_parser
from expertstream.tokenizer import Tokenizer

LOCAL = "http://127.0.0.1"  # TestClient's default Host, testserver, is not a loopback name


@pytest.fixture(scope="module")
def tokenizer(tiny_workdir):
    return Tokenizer.from_dir(tiny_workdir)


@pytest.fixture(scope="module")
def scripted(tokenizer):
    server = scripted_server(tokenizer, api_key=KEY, max_queue=1, keepalive_s=0.2, max_body_bytes=64 << 10)
    yield server
    server.stop()


@pytest.fixture
def fake(scripted):
    scripted.engine.configure()
    yield scripted
    # leave the worker idle for the next test
    wait_idle(scripted)
    scripted.engine.configure()


def test_stop_string_never_leaks_streamed_or_not(fake):
    fake.engine.configure(script="The answer is 4. STOP and more text")
    r = fake.client.chat.completions.create(model="fake", messages=USER, stop=["STOP", "never"])
    assert r.choices[0].message.content == "The answer is 4. "
    assert r.choices[0].finish_reason == "stop"
    content, _, finish, _ = stream_parts(
        fake.client.chat.completions.create(model="fake", messages=USER, stop="STOP", stream=True)
    )
    assert "".join(content) == "The answer is 4. " and finish == "stop"
    assert not any("S" in piece for piece in content)  # not even the stop string's first letter


def test_utf8_characters_are_never_split(fake):
    text = "Grüße, 東京 → ✓ 🙂!"
    fake.engine.configure(script=text)
    content, _, finish, _ = stream_parts(
        fake.client.chat.completions.create(model="fake", messages=USER, stream=True)
    )
    assert "".join(content) == text and finish == "stop"
    assert all("\ufffd" not in piece for piece in content)
    assert len([p for p in content if p]) > 1  # it really streamed in pieces


def test_thinking_split_stream_and_message(fake):
    fake.engine.configure(script="Two plus two.\nThat is four.\n</think>\n\nIt is 4.")
    r = fake.client.chat.completions.create(model="fake-thinking", messages=USER)
    msg = r.choices[0].message
    assert (msg.reasoning_content, msg.content) == ("Two plus two.\nThat is four.", "It is 4.")
    content, reasoning, finish, _ = stream_parts(
        fake.client.chat.completions.create(model="fake-thinking", messages=USER, stream=True)
    )
    assert "".join(reasoning) == "Two plus two.\nThat is four." and "".join(content) == "It is 4."
    assert finish == "stop"
    # thinking off: the prompt closes the think block, so the same text is all content
    r = fake.client.chat.completions.create(model="fake", messages=USER)
    assert r.choices[0].message.content.startswith("Two plus two.")
    assert getattr(r.choices[0].message, "reasoning_content", None) is None


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
)


def test_tool_call_becomes_tool_calls(fake):
    fake.engine.configure(script="I will check.\n\n" + CALL)
    r = fake.client.chat.completions.create(model="fake", messages=USER, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will check."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Paris",
        "days": 2,
    }

    content, _, finish, calls = stream_parts(
        fake.client.chat.completions.create(model="fake", messages=USER, tools=TOOLS, stream=True)
    )
    assert finish == "tool_calls" and "<tool_call>" not in "".join(content)
    assert [(c.index, c.function.name) for c in calls] == [(0, "get_weather")]

    # the assistant's call and the tool's result go back through the template
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    fake.engine.configure(script="It is 21 degrees.")
    r = fake.client.chat.completions.create(model="fake", messages=history, tools=TOOLS)
    assert r.choices[0].message.content == "It is 21 degrees." and r.choices[0].finish_reason == "stop"


def raw_stream(server, body, path="/v1/chat/completions"):
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", server.url + path, json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return r.read().decode()


def test_wire_format_golden_transcript(fake):
    fake.engine.configure(script="Hi")
    messages = [{"role": "user", "content": "Golden test"}]
    body = {"model": "fake", "messages": messages, "stream": True, "stream_options": {"include_usage": True}}
    text = raw_stream(fake, body)
    text = re.sub(
        r'"id":"chatcmpl-[0-9a-f]{32}","object":"chat.completion.chunk","created":\d+', "HEAD", text
    )
    # 23 prompt tokens, the turn boundary (last <|im_start|>) at 12; "Hi" is two tokens, then <|im_end|>
    head = 'data: {HEAD,"model":"fake","choices":['
    usage = (
        '"usage":{"prompt_tokens":23,"completion_tokens":3,"total_tokens":26,'
        '"prompt_tokens_details":{"cached_tokens":0}}'
    )
    assert text == (
        ": keepalive 12/23\n\n"
        ": keepalive 23/23\n\n"
        f'{head}{{"index":0,"delta":{{"role":"assistant","content":""}},"finish_reason":null}}]}}\n\n'
        f'{head}{{"index":0,"delta":{{"content":"H"}},"finish_reason":null}}]}}\n\n'
        f'{head}{{"index":0,"delta":{{"content":"i"}},"finish_reason":null}}]}}\n\n'
        f'{head}{{"index":0,"delta":{{}},"finish_reason":"stop"}}]}}\n\n'
        f"{head}],{usage}}}\n\n"
        "data: [DONE]\n\n"
    )


def test_keepalive_comments_during_a_slow_prefill(fake):
    fake.engine.configure(script="ok", prefill_delay_s=0.7)
    text = raw_stream(
        fake, {"model": "fake", "messages": [{"role": "user", "content": "slow"}], "stream": True}
    )
    events = text.split("\n\n")
    first_data = next(i for i, e in enumerate(events) if e.startswith("data:"))
    # time-based comments (every 0.2 s) and progress comments (after each prefill piece) before any data
    assert ": keepalive" in events[:first_data]
    assert any(re.fullmatch(r": keepalive \d+/\d+", e) for e in events[:first_data])
    assert events[-2] == "data: [DONE]"
    # every payload line is JSON or [DONE]
    for event in events:
        if event.startswith("data: ") and event != "data: [DONE]":
            json.loads(event.removeprefix("data: "))


def test_generation_error_is_reported_and_the_next_request_works(fake):
    fake.engine.configure(script="one two three four five", fail_at=2)
    with pytest.raises(openai.APIError, match="scripted failure"):
        stream_parts(fake.client.chat.completions.create(model="fake", messages=USER, stream=True))
    with pytest.raises(openai.InternalServerError, match="scripted failure"):
        fake.client.chat.completions.create(model="fake", messages=USER)
    fake.engine.configure(script="fine")
    assert (
        fake.client.chat.completions.create(model="fake", messages=USER).choices[0].message.content == "fine"
    )


def test_disconnect_frees_the_worker_and_models_answer_while_busy(fake):
    fake.engine.configure(script="word " * 200, token_delay_s=0.03)
    body = {"model": "fake", "messages": USER, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", fake.url + "/v1/chat/completions", json=body, headers=headers) as r:
        lines = r.iter_lines()
        while not re.search('"content":"[^"]', next(lines)):
            pass  # until text is flowing
        t0 = time.monotonic()
        assert [m.id for m in fake.client.models.list()] == ["fake", "fake-thinking"]
        assert httpx.get(fake.url + "/health").status_code == 200
        assert time.monotonic() - t0 < 0.5
    wait_idle(fake, timeout=2.0)
    calls = fake.engine.forward_calls
    time.sleep(0.2)
    assert fake.engine.forward_calls == calls  # generation really stopped
    assert 'outcome="cancelled"' in httpx.get(fake.url + "/metrics").text
    fake.engine.configure(script="next")
    assert (
        fake.client.chat.completions.create(model="fake", messages=USER).choices[0].message.content == "next"
    )


def test_full_queue_answers_429_with_retry_after(fake):
    fake.engine.configure(script="word " * 200, token_delay_s=0.03)
    body = {"model": "fake", "messages": USER, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=fake.url, headers=headers, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as running:
            lines = running.iter_lines()  # keep a reference: a dropped line iterator closes the stream
            next(lines)
            with http.stream("POST", "/v1/chat/completions", json=body) as queued:
                assert queued.status_code == 200  # waits behind the running one (max_queue=1)
                assert re.search("^expertstream_queue_length 1$", http.get("/metrics").text, re.M)
                r = http.post("/v1/chat/completions", json={**body, "stream": False})
                assert r.status_code == 429 and int(r.headers["retry-after"]) > 0
                assert r.json()["error"]["type"] == "rate_limit_error"


BAD = [
    (b"{not json", 400, None),
    (json.dumps({"model": "fake", "messages": "hello"}), 400, "messages"),
    (json.dumps({"model": "fake", "messages": []}), 400, "messages"),
    (
        json.dumps({"model": "fake", "messages": [{"role": "user", "content": 5}]}),
        400,
        "messages.0.content.str",
    ),
    (json.dumps({"model": "nope", "messages": USER}), 404, "model"),
    (json.dumps({"model": "fake", "messages": USER, "max_tokens": 0}), 400, "max_tokens"),
    (
        json.dumps({"model": "fake", "messages": USER, "max_completion_tokens": -3}),
        400,
        "max_completion_tokens",
    ),
    (json.dumps({"model": "fake", "messages": USER, "n": 2}), 400, "n"),
    (json.dumps({"model": "fake", "messages": USER, "temperature": "hot"}), 400, "temperature"),
    (json.dumps({"model": "fake", "messages": USER, "reasoning_effort": "extreme"}), 400, "reasoning_effort"),
    (
        json.dumps({"model": "fake", "messages": [{"role": "user", "content": "word " * 1500}]}),
        400,
        "messages",
    ),
    (
        json.dumps({"model": "fake", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        400,
        "messages",
    ),
    (json.dumps({"model": "fake", "messages": USER, "chat_template_kwargs": {"messages": []}}), 400, None),
    (json.dumps({"model": "fake", "messages": [{"role": "user", "content": "x" * (70 << 10)}]}), 413, None),
]


@pytest.mark.parametrize("body,status,param", BAD, ids=range(len(BAD)))
def test_bad_input_gets_an_openai_error(fake, body, status, param):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(fake.url + "/v1/chat/completions", content=body, headers=headers)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    assert httpx.get(fake.url + "/health").status_code == 200


def test_bad_input_openai_client_and_chunked_oversized_body(fake):
    with pytest.raises(openai.BadRequestError, match="context"):
        fake.client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "go " * 1500}]
        )
    with pytest.raises(openai.NotFoundError):
        fake.client.chat.completions.create(model="gpt-4", messages=USER)

    def chunks():
        for _ in range(80):
            yield b"x" * 1024

    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(fake.url + "/v1/chat/completions", content=chunks(), headers=headers)
    assert r.status_code == 413
    assert fake.client.chat.completions.create(model="fake", messages=USER).choices[0].finish_reason == "stop"


def test_api_key_is_required_on_v1_routes_only(fake):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        for method, path in (
            ("GET", "/v1/models"),
            ("POST", "/v1/chat/completions"),
            ("POST", "/completions"),
        ):
            r = httpx.request(
                method, fake.url + path, headers=headers, json={"messages": USER, "prompt": "x"}
            )
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(fake.url + "/health").status_code == 200
    assert httpx.get(fake.url + "/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=fake.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_unknown_fields_ignored_and_open_webui_reasoning_in_history(fake):
    fake.engine.configure(script="Sure.</think>Done.")

    def history(assistant):
        return [
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]},
            {"role": "assistant", **assistant},
            {"role": "user", "content": "And?"},
        ]

    first = fake.client.chat.completions.create(
        model="fake-thinking",
        messages=history({"content": "Hello!", "reasoning_content": "earlier thoughts"}),
        reasoning_effort="high",
        extra_body={"some_ui_field": {"x": 1}, "top_k": 5, "min_p": 0.1, "chat_template_kwargs": {"x": 1}},
        temperature=0.5,
        seed=3,
    )
    assert (first.choices[0].message.reasoning_content, first.choices[0].message.content) == (
        "Sure.",
        "Done.",
    )
    # Open WebUI's form of the same history renders the same prompt, so everything before the new
    # generation prompt comes from the state cache
    second = fake.client.chat.completions.create(
        model="fake-thinking",
        messages=history({"content": "<think>\nearlier thoughts\n</think>\n\nHello!"}),
        reasoning_effort="high",
    )
    generation_prompt = len(fake.engine.tokenizer.encode("<|im_start|>assistant\n<think>\n"))
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - generation_prompt


def test_reasoning_effort_maps_to_the_template_values(fake):
    def prompt_tokens(effort):
        r = fake.client.chat.completions.create(model="fake-thinking", messages=USER, reasoning_effort=effort)
        return r.usage.prompt_tokens

    # the template adds a note to the system turn for xhigh and low, none for medium
    tokens = {effort: prompt_tokens(effort) for effort in ("minimal", "low", "medium", "high", "xhigh")}
    assert tokens["minimal"] == tokens["low"] and tokens["high"] == tokens["xhigh"]
    assert len({tokens["low"], tokens["medium"], tokens["xhigh"]}) == 3


def test_reasoning_field_both(tokenizer):
    engine = ScriptedEngine(tokenizer, max_model_len=256)
    engine.configure(script="why</think>because")
    settings = ServerSettings(served_model_name="m", max_model_len=256, reasoning_field="both")
    with TestClient(create_app(settings, tokenizer, lambda: engine), base_url=LOCAL) as http:
        body = {"model": "m-thinking", "messages": USER}
        message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert message["reasoning_content"] == message["reasoning"] == "why"
        assert message["content"] == "because"
        events = http.post("/v1/chat/completions", json={**body, "stream": True}).text.split("\n\n")
        deltas = [json.loads(e[6:])["choices"][0]["delta"] for e in events if e.startswith('data: {"id')]
        thoughts = [d for d in deltas if "reasoning" in d]
        assert all(d["reasoning"] == d["reasoning_content"] for d in thoughts)
        assert "".join(d["reasoning"] for d in thoughts) == "why"


def test_health_is_503_while_loading(tokenizer):
    release = threading.Event()

    def load():
        release.wait(10)
        return ScriptedEngine(tokenizer, max_model_len=64)

    app = create_app(ServerSettings(served_model_name="m", max_model_len=64), tokenizer, load)
    with TestClient(app, base_url=LOCAL) as http:
        assert http.get("/health").status_code == 503
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["m", "m-thinking"]
        release.set()
        app.state.backend.loaded.result(10)
        assert http.get("/health").status_code == 200


def test_schemathesis_finds_no_server_errors(fake):
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis.checks import not_a_server_error
    from schemathesis.generation.modes import GenerationMode

    fake.engine.configure(script="ok")
    schema = schemathesis.openapi.from_url(
        fake.url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}
    )
    cases = st.one_of(schema.as_strategy(generation_mode=m) for m in GenerationMode)

    # the same cases every CI run (a red CI must mean a change broke something); EXPERTSTREAM_FUZZ=1 explores
    # new random ones, which is how top_p = 5e-324 was found
    explore = bool(os.environ.get("EXPERTSTREAM_FUZZ"))

    @settings(
        max_examples=300 if explore else 100,
        derandomize=not explore,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(case=cases)
    def call(case):
        case.call_and_validate(
            base_url=fake.url,
            headers={"Authorization": f"Bearer {KEY}"},
            checks=[not_a_server_error],
            timeout=30,
        )

    call()


# ---- the real tiny engine


@pytest.fixture(scope="module")
def engine(tiny_workdir):
    engine = Engine(EngineConfig(model=str(tiny_workdir), device="cpu", max_model_len=512))
    yield engine
    engine.close()


def real_settings(**kw):
    return ServerSettings(
        served_model_name="tiny",
        max_model_len=512,
        defaults=SamplingParams(temperature=0.0),
        default_max_tokens=8,
        **kw,
    )


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


def test_sampling_defaults_flags_then_generation_config(tiny_workdir):
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    # the tiny model's generation_config.json: do_sample, temperature 1.0, top_k 20, top_p 0.95
    d = sampling_defaults(parser.parse_args([str(tiny_workdir), "--top-k", "5", "--seed", "7"]), tiny_workdir)
    assert (d.temperature, d.top_k, d.top_p, d.min_p, d.seed) == (1.0, 5, 0.95, 0.0, 7)


@pytest.mark.parametrize("bundled", [False, True])
def test_cli_serves_a_workdir(tiny_workdir, tmp_path, bundled):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # without WORKDIR it serves the bundled demo model, set up into a fresh cache on first use
    workdir = [] if bundled else [str(tiny_workdir)]
    cmd = [sys.executable, "-m", "expertstream", "serve", *workdir, "--port", str(port)]
    cmd += ["--device", "cpu", "--max-model-len", "256", "--api-key", KEY, "--served-model-name", "demo"]
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
        assert (tmp_path / "cache" / "demo" / "manifest.json").is_file() == bundled
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


@pytest.mark.parametrize("thinking", [False, True])
def test_tool_choice_required_and_named_force_a_call(fake, thinking):
    model = "fake-thinking" if thinking else "fake"
    # the reply is forced to open the call: the model only writes the rest of the XML
    fake.engine.configure(script=CALL.removeprefix("<tool_call>\n<function="))
    r = fake.client.chat.completions.create(model=model, messages=USER, tools=TOOLS, tool_choice="required")
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}

    fake.engine.configure(script=CALL.removeprefix("<tool_call>\n<function=get_weather>\n"))
    named = {"type": "function", "function": {"name": "get_weather"}}
    _, _, finish, calls = stream_parts(
        fake.client.chat.completions.create(
            model=model, messages=USER, tools=TOOLS, tool_choice=named, stream=True
        )
    )
    assert finish == "tool_calls" and [c.function.name for c in calls if c.function.name] == ["get_weather"]

    with pytest.raises(openai.BadRequestError, match="not one of"):
        fake.client.chat.completions.create(
            model=model,
            messages=USER,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )


def test_penalties_are_request_fields_over_the_flag():
    from expertstream.config import SamplingParams
    from expertstream.server.protocol import ChatCompletionRequest
    from expertstream.server.request import sampling_params
    from expertstream.server.settings import ServerSettings

    settings = ServerSettings("m", 256, defaults=SamplingParams(repetition_penalty=1.1))
    req = ChatCompletionRequest(messages=USER, frequency_penalty=0.5, presence_penalty=-0.25)
    p = sampling_params(settings, req, 10, None, False, 0)
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (1.1, 0.5, -0.25)
    req = ChatCompletionRequest(messages=USER, repetition_penalty=1.3)
    p = sampling_params(settings, req, 10, None, False, 0)
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (1.3, 0.0, 0.0)
    with pytest.raises(ValueError):  # OpenAI's range, a 400 through the app
        ChatCompletionRequest(messages=USER, frequency_penalty=3)
