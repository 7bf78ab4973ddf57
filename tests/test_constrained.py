"""Constrained decoding: response_format and forced tool calls always give output that parses.

Unit tests drive `GrammarProcessor` with random logits (any model's worst case) on the CPU, and on CUDA when
present; the live tests run the bundled demo model behind the server, sampling, over several schemas.
"""

import json

import jsonschema_rs
import openai
import pytest
import torch
from server_helpers import USER, LiveServer

from expertstream.config import EngineConfig
from expertstream.default_model import DEMO_SNAPSHOT
from expertstream.generate import SamplingParams
from expertstream.runtime.engine import Engine
from expertstream.server.app import ServerSettings, create_app
from expertstream.server.constrained import Constraints
from expertstream.tokenizer import Tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "member"],
    "additionalProperties": False,
}
SCHEMAS = {
    "person": PERSON,
    "nested": {
        "type": "object",
        "properties": {
            "kind": {"enum": ["city", "river", "mountain"]},
            "where": {
                "type": "object",
                "properties": {
                    "lat": {"type": "number", "minimum": -90, "maximum": 90},
                    "lon": {"type": "number", "minimum": -180, "maximum": 180},
                },
                "required": ["lat", "lon"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        },
        "required": ["kind", "where", "tags"],
        "additionalProperties": False,
    },
    "list": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "maxItems": 4},
    "choice": {"anyOf": [{"type": "boolean"}, {"type": "null"}, {"const": "unknown"}]},
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "forecast",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    "hourly": {"type": "boolean"},
                },
                "required": ["city", "days"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "convert",
            "parameters": {
                "type": "object",
                "properties": {
                    "amount": {"type": "number", "minimum": 0, "maximum": 1e6},
                    "to": {"enum": ["EUR", "USD"]},
                },
                "required": ["amount", "to"],
            },
        },
    },
]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def demo_tokenizer():
    return Tokenizer.from_dir(DEMO_SNAPSHOT)


def draw(tokenizer, processor, seed, device, limit=400):
    """Sample from random logits (wider than the vocabulary) through `processor` until a stop token."""
    gen = torch.Generator().manual_seed(seed)
    stop = set(tokenizer.stop_token_ids)
    out = []
    for _ in range(limit):
        logits = (torch.randn(tokenizer.vocab_size + 30, generator=gen) * 4).to(device)
        probs = torch.softmax(processor(out, logits).float(), dim=-1).cpu()
        token = int(torch.multinomial(probs, 1, generator=gen))
        if token in stop:
            return tokenizer.decode(out)
        assert token < tokenizer.vocab_size
        out.append(token)
    raise AssertionError(f"no stop token after {limit} tokens: {tokenizer.decode(out)[:200]!r}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_logits_still_give_valid_json(demo_tokenizer, name, device):
    constraints = Constraints(demo_tokenizer)
    validator = jsonschema_rs.validator_for(SCHEMAS[name])
    for seed in range(4):
        text = draw(demo_tokenizer, constraints.json(SCHEMAS[name]), seed, device)
        assert validator.is_valid(json.loads(text)), text


@pytest.mark.parametrize("device", DEVICES)
def test_random_logits_still_give_a_declared_tool_call(demo_tokenizer, device):
    from expertstream.server.tool_parser import ToolCallStreamer

    constraints = Constraints(demo_tokenizer)
    for seed in range(6):
        for name in (None, "convert"):
            opening = "<tool_call>\n<function=" + ("convert>\n" if name else "")
            stream = ToolCallStreamer(TOOLS)
            content, calls = stream.feed(
                opening + draw(demo_tokenizer, constraints.tool_call(TOOLS, name), seed, device)
            )
            assert content == "" and len(calls) == 1, content
            (call,) = calls
            assert call.name == (name or call.name) and call.name in ("forecast", "convert")
            schema = next(t for t in TOOLS if t["function"]["name"] == call.name)["function"]["parameters"]
            assert jsonschema_rs.validator_for(schema).is_valid(json.loads(call.arguments)), call.arguments


def test_bad_schema_is_a_400(demo_tokenizer):
    from expertstream.server.errors import APIError

    with pytest.raises(APIError, match="grammar"):
        Constraints(demo_tokenizer).json({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})


# ---- the bundled demo model behind the server


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from expertstream.workdir.repack import setup_workdir

    work = tmp_path_factory.mktemp("demo") / "wd"
    setup_workdir(DEMO_SNAPSHOT, work, progress=False)
    engine = Engine(EngineConfig(model=str(work), device="cpu", max_model_len=1024))
    settings = ServerSettings(
        served_model_name="demo", max_model_len=1024, defaults=SamplingParams(temperature=1.0)
    )
    server = LiveServer(create_app(settings, engine.tokenizer, lambda: engine))
    server.client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield server
    server.stop()
    engine.close()


ASK = [{"role": "user", "content": "Describe it as JSON."}]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_demo_model_output_matches_the_schema(demo, name):
    schema = SCHEMAS[name]
    validator = jsonschema_rs.validator_for(schema)
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
    for seed in range(2):
        r = demo.client.chat.completions.create(
            model="demo", messages=ASK, response_format=fmt, seed=seed, max_tokens=120
        )
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop" and validator.is_valid(json.loads(text)), text
    streamed = demo.client.chat.completions.create(
        model="demo", messages=ASK, response_format=fmt, seed=0, max_tokens=120, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert validator.is_valid(json.loads(text)), text


def test_demo_model_json_object(demo):
    for seed in range(3):
        r = demo.client.chat.completions.create(
            model="demo", messages=ASK, response_format={"type": "json_object"}, seed=seed, max_tokens=60
        )
        text = r.choices[0].message.content
        if r.choices[0].finish_reason == "stop":  # a string the model never closes runs into max_tokens
            assert isinstance(json.loads(text), dict), text
        else:
            assert text.startswith("{")


@pytest.mark.slow
def test_demo_model_tool_choice_required_and_named(demo):
    for seed in range(2):
        for choice in ("required", {"type": "function", "function": {"name": "convert"}}):
            r = demo.client.chat.completions.create(
                model="demo", messages=ASK, tools=TOOLS, tool_choice=choice, seed=seed, max_tokens=80
            )
            (call,) = r.choices[0].message.tool_calls
            assert r.choices[0].finish_reason == "tool_calls"
            schema = next(t for t in TOOLS if t["function"]["name"] == call.function.name)["function"]
            assert jsonschema_rs.validator_for(schema["parameters"]).is_valid(
                json.loads(call.function.arguments)
            )
            if isinstance(choice, dict):
                assert call.function.name == "convert"


# ---- the scripted engine: a model that wants to write something else


def test_forced_call_never_names_an_undeclared_tool(fake):
    # what issue 38 saw: the model, forced into a call, writes a name nobody declared
    fake.engine.configure(script="3\ufffdum\x15\x14<|im_start|>\n</function>\n</tool_call>")
    r = fake.client.chat.completions.create(
        model="fake", messages=USER, tools=TOOLS, tool_choice="required", max_tokens=60
    )
    choice = r.choices[0]
    for call in choice.message.tool_calls or []:
        assert call.function.name in ("forecast", "convert")
        json.loads(call.function.arguments)
    assert choice.finish_reason == ("tool_calls" if choice.message.tool_calls else "length")


def test_thinking_then_json(fake):
    fake.engine.configure(script='Let me think.</think>\n\n{"name": "Ann", "age": 7, "member": true}')
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    r = fake.client.chat.completions.create(model="fake-thinking", messages=USER, response_format=fmt)
    message = r.choices[0].message
    assert message.reasoning_content == "Let me think."
    assert json.loads(message.content) == {"name": "Ann", "age": 7, "member": True}


def test_stream_generate_calls_the_processors_with_the_ids_so_far(tiny_tokenizer):
    from server_helpers import ScriptedEngine

    from expertstream.generate import stream_generate

    tokenizer = tiny_tokenizer
    engine = ScriptedEngine(tokenizer, max_model_len=256)
    engine.configure(script="Hello!")
    allowed = tokenizer.encode("ab")
    seen = []

    def only_a_and_b(generated, logits):
        seen.append(list(generated))
        masked = torch.full_like(logits, float("-inf"))
        masked[allowed] = logits[allowed]
        return masked

    params = SamplingParams(max_tokens=5, logits_processors=[only_a_and_b], logprobs=True)
    records = list(stream_generate(engine, tokenizer.encode("Hi"), params))
    tokens = [r.token for r in records]
    assert set(tokens) <= set(allowed) and len(tokens) == 5  # the script's own tokens were masked away
    assert seen == [tokens[:i] for i in range(5)]
    # logprobs stay those of the model's distribution, not of the masked one
    assert all(r.logprobs < -1 for r in records)
