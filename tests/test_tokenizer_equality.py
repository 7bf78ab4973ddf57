"""The engine's tokenizer equals transformers' AutoTokenizer on the same snapshot: the backend it builds
(normalizer, pre-tokenizer, model, added tokens, decoder, post-processor), and encode, decode and the
streaming detokenizer on a few hundred strings, on the bundled demo snapshot and the synthetic one."""

import json
import random
import shutil
import unicodedata
from pathlib import Path

import pytest

from expertstream.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

DEMO = Path(__file__).resolve().parents[1] / "expertstream" / "assets" / "demo-snapshot"

HANDWRITTEN = [
    "",
    " ",
    "Hello, world!",
    "I'M here, we'LL see; they'D've it's",
    "don't DON'T Don'T",
    "caf\u00e9 vs cafe\u0301",  # NFC and NFD forms of the same word
    "\u1e9b\u0323 \u0071\u0307\u0323 \u00c5 \u212b \u0041\u030a",  # canonical-equivalence classics
    "e\u0301\u0301\u0301 a\u0300\u0316\u0301",  # stacked combining marks
    "\u1100\u1161\u11a8 \ud55c\uad6d\uc5b4",  # Hangul jamo (NFD) and syllables (NFC)
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",  # Devanagari with marks
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",  # Arabic
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u6f22\u5b57\u304b\u306a\u30ab\u30ca",  # CJK and kana
    "\uff21\uff22\uff23\uff11\uff12\uff13",  # full-width forms (NFC keeps them)
    "\U0001f600\U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467 \U0001f1eb\U0001f1f7",  # emoji
    "\u2764\ufe0f \u263a\ufe0e \U0001f9d1\U0001f3ff\u200d\U0001f4bb",
    "tab\there\x00nul\x01\x02\x1f\x7f del",  # control characters
    "zero\u200bwidth\u200c\u200d\ufeffbom\u2060",
    "    four spaces",
    "trailing spaces    ",
    "a  b   c    d",
    "\t\t\ttabs\t \t",
    "line\nbreak\r\nwindows\rold mac\n\n\nthree",
    " \n \n\t\n",
    "\u00a0nbsp\u2003em\u3000ideographic\u2028line\u2029para",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|endoftext|><|endoftext|>",
    "<think>\nreasoning\n</think>\n\nanswer",
    '<tool_call>{"name": "f"}</tool_call>',
    "<|im_start|> spaced <|im_end|> tokens",
    "<|im_startx|> <|im_end <|endoftext|",  # near misses stay text
    "x = [1, 2, 3]; print(x[0] ** 2)  # comment",
    "def f(a, b):\n    return a + b\n",
    "3.14159 1,000,000 1e-9 0x1F 12345678901234567890",
    "\u00bd \u2153 \u2460 \u00b2 \u0660\u0661\u0662",  # numeric forms
    "UPPER lower MiXeD \u00c9COLE \u00df \u0130stanbul",
    "https://example.com/path?q=1&r=a%20b#frag",
    "email@example.com @handle #tag $5.00 100%",
    "\u00e9" * 40,
    "ab" * 300,
    "!!!???...,,,;;;",
    "\ufffd replacement \U0010ffff max",
]
PIECES = [
    "word", " word", "Word", "  ", "\n", "\t", "'s", "'LL", "123", "4", "\u00e9", "e\u0301", "\u0301",
    "\u4e2d\u6587", "\u3042", "\U0001f600", "\u200d", "\U0001f3fd", "\x00", "\x1b", "\u00a0", "\u3000",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>", ".", ",", "?!",
    "()", "{}", "->", "\r\n", "\u0627\u0644", "\u0915\u093f", "\u1100", "\u1161", "\ufeff",
]  # fmt: skip


def probe_strings(n_random: int = 260) -> list[str]:
    rng = random.Random(33)
    out = list(HANDWRITTEN)
    for s in HANDWRITTEN[5:15]:  # both normal forms of the unicode lines
        out += [unicodedata.normalize("NFD", s), unicodedata.normalize("NFKC", s)]
    out += ["".join(rng.choices(PIECES, k=rng.randint(1, 12))) for _ in range(n_random)]
    return out


STRINGS = probe_strings()


def snapshots(tiny_snapshot):
    return {"demo": DEMO, "synthetic": tiny_snapshot}


@pytest.fixture(scope="module", params=["demo", "synthetic"])
def pair(request, tiny_snapshot):
    path = snapshots(tiny_snapshot)[request.param]
    return Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)


def test_there_are_a_few_hundred_probe_strings():
    assert len(STRINGS) >= 300 and len(set(STRINGS)) >= 280


def test_backend_equals_transformers(pair):
    ours, hf = pair
    assert json.loads(ours.to_json()) == json.loads(hf.backend_tokenizer.to_str())


def test_encode_equals_transformers(pair):
    ours, hf = pair
    for s in STRINGS:
        assert ours.encode(s) == hf.encode(s, add_special_tokens=False), repr(s)
    for s in STRINGS[:40]:
        assert ours.encode(s, add_special_tokens=True) == hf.encode(s), repr(s)


def test_decode_and_streaming_equal_transformers(pair):
    ours, hf = pair
    for s in STRINGS:
        ids = hf.encode(s, add_special_tokens=False)
        want = hf.decode(ids)
        assert ours.decode(ids) == want, repr(s)
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), repr(s)
        d = ours.detokenizer()
        assert "".join([d.add(t) for t in ids] + [d.flush()]) == want, repr(s)


def test_tokenizer_json_alone_would_differ_on_the_demo_snapshot():
    """The demo's tokenizer.json has no normalizer and plain byte-level splitting: read as it is, it gives
    other ids than transformers on some probes (so the equality above is not vacuous)."""
    import tokenizers

    raw = tokenizers.Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    hf = transformers.AutoTokenizer.from_pretrained(DEMO)
    differ = [s for s in STRINGS if raw.encode(s).ids != hf.encode(s, add_special_tokens=False)]
    assert len(differ) >= 20


def test_added_token_flags_come_from_tokenizer_config(tmp_path):
    snap = tmp_path / "snap"
    shutil.copytree(DEMO, snap, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((snap / "tokenizer_config.json").read_text())
    think = next(i for i, t in cfg["added_tokens_decoder"].items() if t["content"] == "<think>")
    assert cfg["added_tokens_decoder"][think]["special"] is False
    ours, hf = Tokenizer.from_dir(snap), transformers.AutoTokenizer.from_pretrained(snap)
    ids = ours.encode("<think>x</think><|im_end|>")
    assert (
        ours.decode(ids, skip_special_tokens=True)
        == hf.decode(ids, skip_special_tokens=True)
        == "<think>x</think>"
    )
