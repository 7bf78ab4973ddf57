"""`POST /v1/messages` driven by the `anthropic` client, as the openai client drives the OpenAI routes."""

import json

import anthropic
import httpx
import pytest
from server_helpers import CALL, KEY, USER

TOOLS = [
    {
        "name": "get_weather",
        "description": "weather in a city",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    }
]


@pytest.fixture
def fake(fake):
    """The shared scripted server (conftest.py) with an anthropic client (`.anthropic`)."""
    fake.anthropic = anthropic.Anthropic(base_url=fake.url, api_key=KEY, max_retries=0, timeout=30)
    return fake


def test_text_reply_streamed_or_not(fake):
    fake.engine.configure(script="Hello there!")
    client = fake.anthropic
    m = client.messages.create(model="fake", max_tokens=50, system="Be brief.", messages=USER)
    assert m.type == "message" and m.role == "assistant" and m.model == "fake"
    assert [(b.type, b.text) for b in m.content] == [("text", "Hello there!")]
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert m.usage.input_tokens > 0 and m.usage.output_tokens == len(fake.engine.script_ids)
    with client.messages.stream(model="fake", max_tokens=50, system="Be brief.", messages=USER) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == "Hello there!" and len(pieces) > 1
    assert final.content[0].text == "Hello there!" and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == m.usage.output_tokens
    # the system prompt reaches the template
    bare = client.messages.create(model="fake", max_tokens=50, messages=USER)
    assert bare.usage.input_tokens < m.usage.input_tokens


def test_raw_stream_events_in_order(fake):
    fake.engine.configure(script="Hi")
    body = {"model": "fake", "max_tokens": 20, "messages": USER, "stream": True}
    headers = {"x-api-key": KEY}
    with httpx.stream("POST", fake.url + "/v1/messages", json=body, headers=headers, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    names = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
    assert names == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    for event in text.split("\n\n"):
        lines = event.splitlines()
        if lines and lines[0].startswith("event: "):
            assert json.loads(lines[1].removeprefix("data: "))["type"] == lines[0][7:]


def test_thinking_blocks_for_the_thinking_model(fake):
    fake.engine.configure(script="Two and two.\n</think>\n\nIt is 4.")
    client = fake.anthropic
    m = client.messages.create(model="fake-thinking", max_tokens=50, messages=USER)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert (m.content[0].thinking, m.content[1].text) == ("Two and two.", "It is 4.")
    with client.messages.stream(model="fake-thinking", max_tokens=50, messages=USER) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "thinking_delta" in kinds and "text_delta" in kinds
    assert final.content[0].thinking == "Two and two." and final.content[1].text == "It is 4."
    # thinking disabled on the thinking id: the same text is all content
    m = client.messages.create(
        model="fake-thinking", max_tokens=50, messages=USER, thinking={"type": "disabled"}
    )
    assert [b.type for b in m.content] == ["text"] and m.content[0].text.startswith("Two and two.")
    # earlier thinking comes back as a block in the history
    history = USER + [
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hm", "signature": ""},
                {"type": "text", "text": "4"},
            ],
        },
        {"role": "user", "content": "Sure?"},
    ]
    assert client.messages.create(model="fake-thinking", max_tokens=50, messages=history).content


def test_tool_use_and_tool_result(fake):
    fake.engine.configure(script="Checking.\n\n" + CALL)
    client = fake.anthropic
    m = client.messages.create(model="fake", max_tokens=200, messages=USER, tools=TOOLS)
    assert m.stop_reason == "tool_use"
    text, use = m.content
    assert text.text == "Checking." and use.type == "tool_use" and use.id
    assert (use.name, use.input) == ("get_weather", {"city": "Paris", "days": 2})
    with client.messages.stream(model="fake", max_tokens=200, messages=USER, tools=TOOLS) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].input == {"city": "Paris", "days": 2}

    history = USER + [
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}]},
    ]
    fake.engine.configure(script="It is 21 degrees.")
    m = client.messages.create(model="fake", max_tokens=50, messages=history, tools=TOOLS)
    assert m.content[0].text == "It is 21 degrees." and m.stop_reason == "end_turn"
    # tool_choice any: the reply is a call (the forced opening, then a constrained rest)
    fake.engine.configure(script=CALL.removeprefix("<tool_call>\n<function="))
    m = client.messages.create(
        model="fake", max_tokens=200, messages=USER, tools=TOOLS, tool_choice={"type": "any"}
    )
    assert m.stop_reason == "tool_use" and m.content[-1].name == "get_weather"


def test_stop_sequences_and_max_tokens(fake):
    fake.engine.configure(script="The answer is 4. STOP and more")
    client = fake.anthropic
    m = client.messages.create(model="fake", max_tokens=50, messages=USER, stop_sequences=["never", "STOP"])
    assert m.content[0].text == "The answer is 4. "
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "STOP")
    m = client.messages.create(model="fake", max_tokens=3, messages=USER)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_count_tokens_matches_usage(fake):
    client = fake.anthropic
    counted = client.messages.count_tokens(model="fake", system="Be brief.", messages=USER, tools=TOOLS)
    m = client.messages.create(model="fake", max_tokens=20, system="Be brief.", messages=USER, tools=TOOLS)
    assert counted.input_tokens == m.usage.input_tokens


def test_errors_are_anthropic_shaped(fake):
    client = fake.anthropic
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nope", max_tokens=20, messages=USER)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=fake.url, api_key="wrong", max_retries=0).messages.create(
            model="fake", max_tokens=20, messages=USER
        )
    image = [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]
    with pytest.raises(anthropic.BadRequestError, match="not supported"):
        client.messages.create(model="fake", max_tokens=20, messages=image)
    r = httpx.post(
        fake.url + "/v1/messages", json={"model": "fake", "messages": USER}, headers={"x-api-key": KEY}
    )
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    # an error once the stream has started arrives as an error event, which the client raises
    fake.engine.configure(script="one two three four", fail_at=2)
    with pytest.raises(anthropic.APIStatusError, match="scripted failure"):
        with client.messages.stream(model="fake", max_tokens=20, messages=USER) as stream:
            list(stream)
    fake.engine.configure(script="fine")
    assert client.messages.create(model="fake", max_tokens=20, messages=USER).content[0].text == "fine"


# ---- the real tiny engine


@pytest.fixture(scope="module")
def real(tiny_workdir):
    from server_helpers import LiveServer, real_settings

    from expertstream.config import EngineConfig
    from expertstream.runtime.engine import Engine
    from expertstream.server.app import create_app

    engine = Engine(EngineConfig(model=str(tiny_workdir), device="cpu", max_model_len=512))
    server = LiveServer(create_app(real_settings(), engine.tokenizer, lambda: engine))
    server.anthropic = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    yield server
    server.stop()
    engine.close()


def test_real_engine_stream_matches_message(real):
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    m = real.anthropic.messages.create(model="tiny", max_tokens=6, messages=ask)
    assert m.stop_reason in ("end_turn", "max_tokens") and 0 < m.usage.output_tokens <= 6
    with real.anthropic.messages.stream(model="tiny", max_tokens=6, messages=ask) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in m.content]
    assert (final.stop_reason, final.usage.output_tokens) == (m.stop_reason, m.usage.output_tokens)
    # a follow-up reuses the conversation state: the cached prompt shows in usage
    follow = ask + [{"role": "assistant", "content": m.content[0].text if m.content else ""}]
    follow += [{"role": "user", "content": "And Italy?"}]
    again = real.anthropic.messages.create(model="tiny", max_tokens=4, messages=follow)
    assert again.usage.cache_read_input_tokens and again.usage.cache_read_input_tokens > 0
