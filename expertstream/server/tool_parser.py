"""Qwen XML tool calls -> OpenAI `tool_calls`.

The model writes
`<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>`.
Values are raw text; the template JSON-encodes non-string arguments, so they are decoded back by the tool's
JSON schema, or (for arguments the schema does not type) whenever they parse as JSON.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from expertstream.log import get_logger
from expertstream.server.reasoning import partial_tag_len

log = get_logger(__name__)

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
# a parameter ends at its closing tag, or (tolerating a missing one) at the next parameter or the end
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


class ToolCallError(ValueError):
    pass


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI sends it

    def to_openai(self, index: int | None = None) -> dict:
        call = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def _schema_types(tools: list[dict] | None) -> dict[str, dict[str, set[str]]]:
    """{function name: {argument: JSON-schema types}} from OpenAI-style tool definitions."""
    out: dict[str, dict[str, set[str]]] = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        props = (fn.get("parameters") or {}).get("properties") or {}
        types: dict[str, set[str]] = {}
        for arg, schema in props.items():
            t = schema.get("type") if isinstance(schema, dict) else None
            types[arg] = {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()
        out[fn["name"]] = types
    return out


def _convert(raw: str, types: set[str]):
    if "string" in types:
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def parse_tool_call(block: str, tools: list[dict] | None = None) -> ToolCall:
    """Parse the text between `<tool_call>` and `</tool_call>`.

    Args:
        block: the XML body (`<function=...>...</function>`), or a JSON `{"name", "arguments"}` body.
        tools: the request's tool definitions, used to type the arguments.

    Returns:
        The call with its arguments as a JSON string.

    Raises:
        ToolCallError: the body is neither form.
    """
    m = _FUNCTION.search(block)
    if m is not None:
        name = m.group(1).strip()
        types = _schema_types(tools).get(name, {})
        args = {}
        for p in _PARAMETER.finditer(m.group(2)):
            arg = p.group(1).strip()
            # the value sits on its own lines: drop exactly the newline after the tag and before the close
            raw = p.group(2).removeprefix("\n").removesuffix("\n")
            args[arg] = _convert(raw, types.get(arg, set()))
    else:
        try:
            obj = json.loads(block)
        except ValueError as e:
            raise ToolCallError(f"tool call is neither <function=...> XML nor JSON: {block[:200]!r}") from e
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ToolCallError(f"JSON tool call without a name: {block[:200]!r}")
        name, args = obj["name"], obj.get("arguments", {})
        if isinstance(args, str):
            return ToolCall(id=_new_id(), name=name, arguments=args)
    return ToolCall(id=_new_id(), name=name, arguments=json.dumps(args, ensure_ascii=False))


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStreamer:
    """Separates tool calls from streamed content: text inside `<tool_call>` blocks is never shown as content.

    Args:
        tools: the request's tool definitions (for argument types).
    """

    def __init__(self, tools: list[dict] | None):
        self._tools = tools
        self._buf = ""
        self._inside = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Add content text; return (content to show now, tool calls completed by this piece)."""
        self._buf += text
        content, calls = "", []
        while self._buf:
            if not self._inside:
                idx = self._buf.find(TOOL_CALL_OPEN)
                if idx < 0:
                    keep = partial_tag_len(self._buf, TOOL_CALL_OPEN)
                    content += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                content += self._buf[:idx]
                self._buf = self._buf[idx + len(TOOL_CALL_OPEN) :]
                self._inside = True
            idx = self._buf.find(TOOL_CALL_CLOSE)
            if idx < 0:
                break
            block, self._buf = self._buf[:idx], self._buf[idx + len(TOOL_CALL_CLOSE) :]
            self._inside = False
            content += self._parse(block, calls, TOOL_CALL_CLOSE)
        return content, calls

    def flush(self) -> tuple[str, list[ToolCall]]:
        """End of output: an unterminated call is parsed if it can be, else returned as content."""
        calls: list[ToolCall] = []
        buf, self._buf = self._buf, ""
        content = self._parse(buf, calls, "") if self._inside else buf
        self._inside = False
        return content, calls

    def _parse(self, block: str, calls: list[ToolCall], close: str) -> str:
        try:
            call = parse_tool_call(block, self._tools)
        except ToolCallError as e:
            # a malformed call is shown to the user rather than lost
            log.warning("%s", e)
            return TOOL_CALL_OPEN + block + close
        calls.append(call)
        self.calls.append(call)
        return ""
