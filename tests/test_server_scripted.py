"""`expertstream serve` in front of a scripted engine (the real tiny tokenizer and `stream_generate`, with
logits that spell out a chosen text): what random weights cannot show. Stop strings, UTF-8, the reasoning
split, tool calls, the wire format, slow prefill, failures, disconnects and the queue bound."""

import json
import re
import time

import httpx
import openai
import pytest
from server_helpers import CALL, KEY, USER, raw_stream, stream_parts, wait_idle


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


def long_stream(fake) -> tuple[dict, dict]:
    """Scripts 200 words at 30 ms each: (a streamed chat body keeping the worker busy ~6 s, the headers)."""
    fake.engine.configure(script="word " * 200, token_delay_s=0.03)
    return {"model": "fake", "messages": USER, "stream": True}, {"Authorization": f"Bearer {KEY}"}


def test_disconnect_frees_the_worker_and_models_answer_while_busy(fake):
    body, headers = long_stream(fake)
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
    body, headers = long_stream(fake)
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
