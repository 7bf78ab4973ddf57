"""Tokenizer: stop ids, chat template rendered exactly as transformers renders it, streaming detokenizer."""

import json

import jinja2
import pytest

from expertstream.tokenizer import Tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather <now> & later",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Use the tool.",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "content": '{"temperature": 21}'},
    {"role": "user", "content": "Thanks!"},
]


@pytest.fixture(scope="module")
def tok(tiny_snapshot):
    return Tokenizer.from_dir(tiny_snapshot)


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte -> printable character table used by byte-level BPE vocabularies
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_ids(tok: Tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte, so multi-byte characters are split across tokens."""
    table = _bytes_to_unicode()
    ids = [tok.token_to_id(table[b]) for b in text.encode()]
    assert None not in ids
    return ids


def test_stop_ids_come_from_config_tokenizer_and_generation_config(tok, tiny_snapshot):
    text = json.loads((tiny_snapshot / "config.json").read_text())["text_config"]
    gen = json.loads((tiny_snapshot / "generation_config.json").read_text())
    im_end = tok.token_to_id("<|im_end|>")
    assert text["eos_token_id"] != im_end
    assert tok.stop_token_ids[:2] == [text["eos_token_id"], im_end]
    assert set(tok.stop_token_ids) == {text["eos_token_id"], im_end, *gen["eos_token_id"]}
    assert len(set(tok.stop_token_ids)) == len(tok.stop_token_ids)


def test_encode_decode_round_trip(tok):
    text = "<|im_start|>user\nHello, world! héllo 😀 你好<|im_end|>\n"
    ids = tok.encode(text)
    assert tok.token_to_id("<|im_start|>") == ids[0]
    assert tok.decode(ids) == text
    assert "<|im_start|>" not in tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"reasoning_effort": "low"}])
def test_chat_template_matches_transformers(tok, tiny_snapshot, kwargs):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(tiny_snapshot / "tokenizer.json"))
    hf.chat_template = (tiny_snapshot / "chat_template.jinja").read_text()
    want = hf.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False, **kwargs)
    got = tok.apply_chat_template(MESSAGES, tools=TOOLS, **kwargs)
    assert got == want
    assert '"Weather <now> & later"' in got  # tojson must not HTML-escape


def test_chat_template_switches(tok):
    msgs = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs).endswith("<|im_start|>assistant\n<think>\n")
    assert tok.apply_chat_template(msgs, enable_thinking=False).endswith("<think>\n\n</think>\n\n")
    assert not tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("assistant\n<think>\n")
    with pytest.raises(jinja2.exceptions.TemplateError, match="reasoning_effort"):
        tok.apply_chat_template(msgs, reasoning_effort="extreme")


def test_template_from_tokenizer_config(tmp_path, tiny_snapshot):
    for name in ("tokenizer.json", "config.json"):
        (tmp_path / name).write_bytes((tiny_snapshot / name).read_bytes())
    template = "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}{{ eos_token }}"
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "eos_token": "<E>"})
    )
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "[user:x]<E>"


def test_missing_tokenizer_names_the_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("split", ["bytes", "bpe"])
def test_streaming_detokenizer_never_splits_a_character(tok, split):
    text = "Hello héllo 😀 你好! <think>ok</think> done"
    ids = _byte_ids(tok, text) if split == "bytes" else tok.encode(text)
    detok = tok.detokenizer()
    pieces = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    if split == "bytes":
        # the emoji's four byte-tokens: nothing until the last one completes it
        start = text.encode().index("😀".encode())
        assert pieces[start : start + 4] == ["", "", "", "😀"]


def test_streaming_detokenizer_flush_replaces_a_truncated_character(tok):
    detok = tok.detokenizer()
    ids = _byte_ids(tok, "a😀")
    assert [detok.add(i) for i in ids[:3]] == ["a", "", ""]
    assert detok.flush() == "\ufffd"


def test_streaming_detokenizer_is_constant_work_per_token(tok):
    class CountingTokenizer:
        def __init__(self, inner):
            self.inner, self.decoded = inner, 0

        def decode(self, ids, skip_special_tokens=False):
            self.decoded += len(ids)
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    counting = CountingTokenizer(tok)
    detok = type(tok.detokenizer())(counting)
    ids = tok.encode("The quick brown fox jumps over the lazy dog. 你好 " * 40)
    text = "".join(detok.add(i) for i in ids) + detok.flush()
    assert text == tok.decode(ids)
    # re-decoding the whole generation each step would cost ~len(ids)^2 / 2 token decodes
    assert counting.decoded <= 8 * len(ids)
