"""Qwen XML tool calls -> OpenAI tool_calls, whole and streamed."""

import json

import pytest

from expertstream.server.tool_parser import ToolCallError, ToolCallStreamer, parse_tool_call

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "zip": {"type": "string"},
                    "detail": {"type": ["object", "null"]},
                },
            },
        },
    }
]

# as the model writes it after the template's instructions
CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=zip>\n75001\n</parameter>\n"
    '<parameter=detail>\n{"hourly": true}\n</parameter>\n</function>\n</tool_call>'
)


def args_of(call):
    return json.loads(call.arguments)


def test_xml_call_with_schema_types():
    call = parse_tool_call(CALL.removeprefix("<tool_call>").removesuffix("</tool_call>"), TOOLS)
    assert call.name == "get_weather"
    # "zip" is a string in the schema, so 75001 stays a string; "days" is an integer
    assert args_of(call) == {"city": "Paris", "days": 3, "zip": "75001", "detail": {"hourly": True}}
    assert call.id.startswith("call_")
    assert call.to_openai(0)["function"] == {"name": "get_weather", "arguments": call.arguments}
    assert call.to_openai(0)["index"] == 0 and "index" not in call.to_openai()


def test_untyped_arguments_decode_when_they_parse():
    block = (
        "<function=f>\n<parameter=n>\n1.5\n</parameter>\n<parameter=flag>\ntrue\n</parameter>\n"
        "<parameter=text>\nhello world\n</parameter>\n<parameter=items>\n[1, 2]\n</parameter>\n</function>"
    )
    assert args_of(parse_tool_call(block, None)) == {
        "n": 1.5,
        "flag": True,
        "text": "hello world",
        "items": [1, 2],
    }


def test_multiline_string_value_keeps_inner_newlines():
    block = "<function=write>\n<parameter=body>\nline 1\n\nline 2\n</parameter>\n</function>"
    assert args_of(parse_tool_call(block, None)) == {"body": "line 1\n\nline 2"}


def test_missing_closing_parameter_tags_are_tolerated():
    block = "<function=f>\n<parameter=a>\nx\n<parameter=b>\ny\n</function>"
    assert args_of(parse_tool_call(block, None)) == {"a": "x", "b": "y"}


def test_json_body_and_no_arguments():
    call = parse_tool_call('{"name": "g", "arguments": {"q": "x"}}', None)
    assert (call.name, args_of(call)) == ("g", {"q": "x"})
    assert args_of(parse_tool_call("<function=now>\n</function>", None)) == {}


def test_garbage_raises():
    with pytest.raises(ToolCallError):
        parse_tool_call("not a call", None)


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_streamed_content_and_two_calls(step):
    text = "Checking.\n\n" + CALL + "\n" + CALL.replace("Paris", "Rome")
    s = ToolCallStreamer(TOOLS)
    content, calls = "", []
    for i in range(0, len(text), step):
        c, new = s.feed(text[i : i + step])
        assert "<" not in c  # no tag text ever leaks into content
        content, calls = content + c, calls + new
    c, new = s.flush()
    content, calls = content + c, calls + new
    assert content.strip() == "Checking."
    assert [args_of(c)["city"] for c in calls] == ["Paris", "Rome"]
    assert s.calls == calls


def test_unterminated_call_is_parsed_at_flush():
    s = ToolCallStreamer(TOOLS)
    content, calls = s.feed(CALL.removesuffix("\n</tool_call>"))
    assert (content, calls) == ("", [])
    content, calls = s.flush()
    assert content == "" and args_of(calls[0])["days"] == 3


def test_malformed_call_becomes_content_and_text_without_tags_passes():
    s = ToolCallStreamer(None)
    assert s.feed("a < b and <tool") == ("a < b and ", [])
    assert s.feed("_call>oops</tool_call> end") == ("<tool_call>oops</tool_call> end", [])
    assert s.flush() == ("", [])
