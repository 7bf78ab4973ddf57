"""Tokenizer, chat template and streaming detokenizer, from the files of a snapshot or workdir.

Uses the `tokenizers` library and jinja2 only (no transformers). For a qwen4_exp snapshot the tokenizer is
built as transformers' AutoTokenizer builds it (`Qwen3_5Tokenizer`): only the BPE vocabulary and merges come
from tokenizer.json; the normalizer (NFC), pre-tokenizer (Qwen's split regex, then byte level) and decoder
are the class's own, and the added tokens and their flags come from tokenizer_config.json. The chat template
is rendered the way transformers renders it: sandboxed jinja2, `trim_blocks`/`lstrip_blocks`,
`raise_exception`, a `tojson` that does not HTML-escape, and the tokenizer's special tokens as variables.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

import jinja2
import tokenizers
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors

from expertstream.log import get_logger

log = get_logger(__name__)

# chat turns end with <|im_end|> while config.json names only <|endoftext|> as eos (checkpoint doc §2.4)
IM_END = "<|im_end|>"
# model types transformers' AutoTokenizer maps to Qwen3_5Tokenizer whatever tokenizer_config.json names
QWEN35_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen4_exp")
# Qwen3_5Tokenizer's PRETOKENIZE_REGEX
SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
# the special-token keys of tokenizer_config.json, with Qwen3_5Tokenizer's defaults for absent keys
NAMED_TOKENS = {"bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                "unk_token": "<|endoftext|>"}  # fmt: skip


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson HTML-escapes; HF's does not, and templates are written against HF's
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _as_id_list(value, source: str) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return list(value)
    raise ValueError(f"{source}: eos_token_id must be an int or a list of ints, got {value!r}")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path) as f:
        return json.load(f)


def _token_content(value) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as AddedToken dicts
    if isinstance(value, dict):
        return value.get("content")
    return value


def qwen35_tokenizer(tokenizer_json: dict, tok_config: dict, source: str) -> tokenizers.Tokenizer:
    """The backend tokenizer transformers' Qwen3_5Tokenizer builds from these two files."""
    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"{source}/tokenizer.json: model type {model.get('type')!r} is not BPE")
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
    tok = tokenizers.Tokenizer(
        tokenizers.models.BPE(vocab=model.get("vocab", {}), merges=merges, dropout=None, unk_token=None,
                              continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                              byte_fallback=False)
    )  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(
                add_prefix_space=bool(tok_config.get("add_prefix_space")), use_regex=False
            ),
        ]
    )
    # added tokens: tokenizer_config.json's, else tokenizer.json's, in id order; named ones are special
    if "added_tokens_decoder" in tok_config:
        added = sorted((int(i), t) for i, t in tok_config["added_tokens_decoder"].items())
    else:
        added = sorted(
            (t["id"], {k: v for k, v in t.items() if k != "id"})
            for t in tokenizer_json.get("added_tokens", [])
        )
    named = {k: _token_content(tok_config.get(k, default)) for k, default in NAMED_TOKENS.items()}
    tokens = [AddedToken(**t) for _, t in added]
    for t in tokens:
        t.special = t.special or t.content in named.values()
    missing = [c for c in named.values() if c is not None and c not in {t.content for t in tokens}]
    tok.add_tokens(tokens + [AddedToken(c, special=True) for c in dict.fromkeys(missing)])
    if tokenizer_json.get("post_processor") is not None:
        tok.post_processor = tokenizers.Tokenizer.from_str(
            json.dumps({**tokenizer_json, "model": {**model, "vocab": {}, "merges": []}, "added_tokens": []})
        ).post_processor
    else:
        tok.post_processor = _template(tok, named, tok_config)
    tok.encode_special_tokens = bool(tok_config.get("split_special_tokens", False))
    return tok


def _template(tok: tokenizers.Tokenizer, named: dict, tok_config: dict) -> processors.TemplateProcessing:
    # transformers' update_post_processor: BOS / EOS around each sequence when add_bos/eos_token say so
    bos = named["bos_token"] if tok_config.get("add_bos_token") else None
    eos = named["eos_token"] if tok_config.get("add_eos_token") else None
    single = f"{bos + ':0 ' if bos else ''}$A:0{' ' + eos + ':0' if eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if bos else ''} $B:1{' ' + eos + ':1' if eos else ''}"
    special = [(t, tok.token_to_id(t)) for t in (bos, eos) if t]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


class StreamingDetokenizer:
    """Turns generated token ids into text pieces, never splitting a UTF-8 character.

    Keeps two offsets into the generated ids: text up to `read` has been emitted, and decoding restarts at
    `prefix` (the previous clean boundary) so byte-level merges and leading-space rules see their context.
    Each step decodes only the ids since `prefix`, so the cost per token is O(1) amortised.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def add(self, token: int) -> str:
        """Append one token id and return the newly completed text ('' while a character is incomplete)."""
        self._ids.append(token)
        return self._emit(final=False)

    def flush(self) -> str:
        """Return what is still held back (an incomplete character becomes U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        done = self._tok.decode(self._ids[self._prefix : self._read], skip_special_tokens=False)
        text = self._tok.decode(self._ids[self._prefix :], skip_special_tokens=False)
        # a trailing U+FFFD means the last token ended inside a multi-byte character: wait for the rest
        if len(text) <= len(done) or (text.endswith("\ufffd") and not final):
            return ""
        # drop the window before the last emitted token; keep it as context for the next decode
        self._prefix = self._read
        self._read = len(self._ids)
        return text[len(done) :]


class Tokenizer:
    """Byte-level BPE tokenizer with the checkpoint's chat template and stop tokens."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        chat_template: str | None,
        stop_token_ids: list[int],
        special_tokens: dict[str, str],
        source: str = "",
    ):
        self._tok = tokenizer
        self._template = _compile_template(chat_template) if chat_template else None
        self.stop_token_ids = stop_token_ids
        self.special_tokens = special_tokens  # template variables: bos_token, eos_token, pad_token, ...
        self.source = source

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json`, the chat template and the stop tokens of a snapshot or workdir."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        tok_config = _read_json(path / "tokenizer_config.json")
        config = _read_json(path / "config.json")
        if config.get("model_type") in QWEN35_MODEL_TYPES:
            tok = qwen35_tokenizer(json.loads(tok_file.read_text()), tok_config, str(path))
        else:
            tok = tokenizers.Tokenizer.from_file(str(tok_file))
        template_file = path / "chat_template.jinja"
        if template_file.is_file():
            template = template_file.read_text()
        else:
            template = tok_config.get("chat_template")
            if isinstance(template, list):  # the named-templates form: [{"name": ..., "template": ...}]
                template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None:
            log.warning("%s has no chat template; apply_chat_template will raise", path)

        text_config = config.get("text_config", config)
        stop = _as_id_list(text_config.get("eos_token_id", config.get("eos_token_id")), f"{path}/config.json")
        im_end = tok.token_to_id(IM_END)
        if im_end is not None:
            stop.append(im_end)
        gen_config = _read_json(path / "generation_config.json")
        stop += _as_id_list(gen_config.get("eos_token_id"), f"{path}/generation_config.json")
        stop = list(dict.fromkeys(stop))  # unique, order kept

        special = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            content = _token_content(tok_config.get(key))
            if content is not None:
                special[key] = content
        return cls(tok, template, stop, special, source=str(path))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # chat prompts already carry their special tokens as text, so no BOS/EOS is added by default;
        # encode_batch releases the GIL while it runs (encode holds it: a long prompt stalls other threads)
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """UTF-8 bytes of the longest token's text: a text of B bytes has at least B / this many tokens."""
        texts = self._tok.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=False)
        # +1: a decoder may drop a leading space from a token decoded alone (SentencePiece's metaspace)
        return 1 + max(len(t.encode("utf-8", "surrogatepass")) for t in texts)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer as `tokenizer.json` text (constrained decoding builds its token trie from it)."""
        return self._tok.to_str()

    def detokenizer(self) -> StreamingDetokenizer:
        return StreamingDetokenizer(self._tok)

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs,
    ) -> str:
        """Render a conversation to the prompt text (tokenize it with `encode`).

        Args:
            messages: OpenAI-style messages (`role`, `content`, optional `reasoning_content`, `tool_calls`).
            tools: JSON schemas of the tools, as the template expects them.
            add_generation_prompt: end with the opening of an assistant turn.
            **template_kwargs: template switches such as `enable_thinking` or `reasoning_effort`.

        Returns:
            The prompt text.
        """
        if self._template is None:
            raise ValueError(
                f"{self.source}: no chat_template.jinja and no chat_template in tokenizer_config.json"
            )
        variables = {**self.special_tokens, **template_kwargs}
        return self._template.render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **variables
        )
