"""Constrained decoding with llguidance: JSON output (`response_format`) and forced tool calls.

llguidance compiles a grammar (a JSON schema, or a Lark grammar) against the model's own tokenizer and, at
each step, gives the set of tokens that keep the output inside the grammar; `GrammarProcessor` is that set
as a logits mask, a `sampling.LogitsProcessor`, so the CPU and GPU paths (and a batch scheduler, per
sequence) apply it the same way. Once the grammar is complete only the stop tokens remain allowed.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence

import llguidance
import torch

from expertstream.server.errors import APIError
from expertstream.server.reasoning import THINK_CLOSE

# the JSON the grammar allows: no free whitespace (a model could pad forever), ", " and ": " between items
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}
# a tool-call parameter holding text: anything up to the closing tag, which it may not contain
_TEXT_PARAMETER = r"""
TEXT_BODY: /(?s:.*)/ & ~/(?s:.*)\n<\/parameter>(?s:.*)/
TEXT_PARAMETER: TEXT_BODY "\n</parameter>\n"
"""
# reasoning before the constrained part, when the prompt leaves a think block open
_REASONING = r"""
REASONING_BODY: /(?s:.*)/ & ~/(?s:.*)<\/think>(?s:.*)/
"""


EMPTY = '""'  # the Lark item matching nothing
CLOSE_PARAMETER = '"\\n</parameter>\\n"'


def _lark_str(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


class GrammarProcessor:
    """A logits processor that keeps one sequence inside a grammar.

    Args:
        matcher: an `llguidance.LLMatcher`, fresh (nothing consumed).
        stop_ids: the tokens allowed when the matcher fails (so generation ends instead of drawing from
            an empty set).
    """

    def __init__(self, matcher: llguidance.LLMatcher, stop_ids: Sequence[int]):
        self.matcher = matcher
        self.stop_ids = list(stop_ids)
        self._consumed = 0
        self._bits: dict[torch.device, torch.Tensor] = {}

    def __call__(self, generated: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        for token in generated[self._consumed :]:
            self.matcher.consume_token(token)
        self._consumed = len(generated)
        vocab = logits.shape[-1]
        if self.matcher.is_error():
            allowed = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            allowed[self.stop_ids] = True
        else:
            allowed = self._allowed(self.matcher.compute_bitmask(), vocab, logits.device)
        return logits.masked_fill(~allowed, float("-inf"))

    def _allowed(self, bitmask: bytes, vocab: int, device: torch.device) -> torch.Tensor:
        """The packed mask (bit i of 32-bit word i // 32 = token i) as bools [vocab] on `device`."""
        words = torch.frombuffer(bytearray(bitmask), dtype=torch.int32).to(device, non_blocking=True)
        bits = self._bits.get(device)
        if bits is None:
            bits = self._bits[device] = torch.arange(32, dtype=torch.int32, device=device)
        allowed = ((words.unsqueeze(-1) >> bits) & 1).flatten().bool()  # [32 * words]
        if allowed.numel() >= vocab:
            return allowed[:vocab]
        # logits wider than the tokenizer (a padded embedding): the extra ids are never allowed
        return torch.cat([allowed, allowed.new_zeros(vocab - allowed.numel())])


class Constraints:
    """Builds grammar processors over one tokenizer (its llguidance view is built once, on first use).

    Args:
        tokenizer: the model's `Tokenizer`.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def _lltokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                self._ll = llguidance.LLTokenizer(
                    self.tokenizer.to_json(), eos_token=list(self.tokenizer.stop_token_ids)
                )
            return self._ll

    def _literal(self, text: str) -> str:
        """A Lark item matching `text`: the special token itself when the vocabulary has one for it."""
        token = self.tokenizer.token_to_id(text)
        if token is not None and self._lltokenizer().is_special_token(token):
            return f"<[{token}]>"
        return _lark_str(text)

    def _processor(self, lark: str, param: str) -> GrammarProcessor:
        matcher = llguidance.LLMatcher(
            self._lltokenizer(), llguidance.LLMatcher.grammar_from_lark(lark), log_level=0
        )
        if matcher.is_error():
            raise APIError(400, f"cannot build the output grammar: {matcher.get_error()}", param=param)
        return GrammarProcessor(matcher, self.tokenizer.stop_token_ids)

    def _start(self, body: str, in_reasoning: bool) -> str:
        """A grammar's `start`: reasoning closed by </think> when the prompt opened it, then `body`."""
        if not in_reasoning:
            return f"start: {body}\n"
        close = self._literal(THINK_CLOSE)
        return f"start: REASONING_BODY {close} /[ \\t\\n]*/ {body}\n{_REASONING}"

    def json(self, schema: dict | None, in_reasoning: bool = False) -> GrammarProcessor:
        """Output that is one JSON value valid under `schema` (None: any JSON object).

        Raises:
            APIError: the schema does not compile (400, param response_format).
        """
        schema = {"type": "object"} if schema is None else schema
        if not isinstance(schema, dict):
            raise APIError(400, "response_format's schema must be a JSON object", param="response_format")
        lark = self._start("json_value", in_reasoning) + f"json_value: {_json_item(schema)}\n"
        return self._processor(lark, "response_format")

    def tool_call(self, tools: list[dict], name: str | None) -> GrammarProcessor:
        """The rest of one Qwen XML tool call after the forced opening (`<tool_call>\\n<function=`, or with
        `name`, `<tool_call>\\n<function=NAME>\\n`): a declared function, its parameters (required ones
        present, non-text ones as JSON of their schema), the closing tags, then a stop token."""
        close = f'"</function>\\n" {self._literal("</tool_call>")}'
        rules, alternatives = [], []
        for i, tool in enumerate(tools):
            fn = tool["function"]
            if name is not None and fn["name"] != name:
                continue
            params = _parameters(fn.get("parameters"))
            rules.append(f"args_{i}: {params or EMPTY}")
            opening = "" if name is not None else f'{_lark_str(fn["name"] + ">")} "\\n" '
            alternatives.append(f"{opening}args_{i} {close}")
        lark = "start: " + " | ".join(alternatives) + "\n" + "\n".join(rules) + "\n" + _TEXT_PARAMETER
        return self._processor(lark, "tools")


def _json_item(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


def _parameters(schema) -> str:
    """Lark items for a function's parameters in declared order; optional ones may be left out."""
    if not isinstance(schema, dict) or not isinstance(schema.get("properties"), dict):
        return ""
    required = set(schema.get("required") or [])
    items = []
    for arg, prop in schema["properties"].items():
        prop = prop if isinstance(prop, dict) else {}
        opening = f'{_lark_str(f"<parameter={arg}>")} "\\n"'
        types = prop.get("type")
        types = {types} if isinstance(types, str) else set(types or [])
        choices = prop.get("enum")
        if isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices):
            # strings are written raw (unquoted): one of the names, as text
            value = "(" + " | ".join(_lark_str(c) for c in choices) + f") {CLOSE_PARAMETER}"
        elif (types and "string" not in types) or (not types and ("enum" in prop or "const" in prop)):
            value = f"{_json_item(prop)} {CLOSE_PARAMETER}"
        else:
            value = "TEXT_PARAMETER"  # raw text, as the template renders strings (and untyped values)
        item = f"({opening} {value})"
        items.append(item if arg in required else item + "?")
    return " ".join(items)
