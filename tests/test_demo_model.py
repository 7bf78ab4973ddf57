"""The bundled demo model: language-like output, engine equal to transformers, controls worse (issue 7)."""

import pytest

from expertstream.commands.ppl import run_ppl
from expertstream.config import EngineConfig
from expertstream.default_model import DEMO_SNAPSHOT

CHARS = 6000  # ~1,800 tokens of the held-out book (Revelation): a few seconds per run on 2 cores


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from expertstream.workdir.repack import setup_workdir

    work = tmp_path_factory.mktemp("demo") / "wd"
    setup_workdir(DEMO_SNAPSHOT, work, progress=False)
    text = (DEMO_SNAPSHOT / "heldout.txt").read_text(encoding="utf-8")[:CHARS]
    return work, text


def score(demo, control="none", reference=None):
    work, text = demo
    config = EngineConfig(model=str(work), max_model_len=512)
    return run_ppl(config, text, control=control, reference=reference)


@pytest.fixture(scope="module")
def correct(demo):
    return score(demo, reference=str(DEMO_SNAPSHOT))


@pytest.mark.slow  # ~1,800 tokens through the engine and transformers: ~8 s on 2 cores
def test_engine_matches_transformers_on_held_out_text(correct):
    assert correct["tokens"] > 1500
    # issue 7: within 2 % of the reference on the same weights (measured: 35.08, ratio 1.0000001)
    assert abs(correct["ppl_ratio"] - 1) < 0.02
    # a trained model, not noise: a uniform guess over the ~2,100-token vocabulary would score ~2,100
    assert correct["engine"]["ppl"] < 80


@pytest.mark.slow  # the same text through a broken engine: ~5 s on 2 cores
@pytest.mark.parametrize("control", ["swap-nibbles", "no-experts"])
def test_controls_are_worse(demo, correct, control):
    broken = score(demo, control=control)
    # issue 7: a broken engine must be far worse, not merely worse (measured on this text: 17.5x and 7.4x)
    assert broken["engine"]["ppl"] > 5 * correct["engine"]["ppl"]


def test_open_webui_default_tools_fit_and_cost_few_tokens():
    from expertstream.bench.openwebui import openwebui_tools
    from expertstream.tokenizer import Tokenizer

    tools = openwebui_tools()
    assert len(tools) == len({t["function"]["name"] for t in tools}) == 36
    tok = Tokenizer.from_dir(DEMO_SNAPSHOT)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tools=tools, enable_thinking=False)
    n = len(tok.encode(text))
    # issue 36: the first message of Open WebUI with its default tools fits the context with room to answer,
    # and JSON costs about what English text does (the earlier tokenizer: 2.2 bytes a token, 10,651 tokens)
    assert 20_000 < len(text.encode()) and len(text.encode()) / n > 3.0
    import json

    context = json.loads((DEMO_SNAPSHOT / "config.json").read_text())["text_config"][
        "max_position_embeddings"
    ]
    assert context >= 32768 and n < context // 4


def test_the_demo_model_ends_its_turn(demo):
    from expertstream.generate import SamplingParams, stream_generate
    from expertstream.runtime.engine import Engine

    work, _ = demo
    engine = Engine(EngineConfig(model=str(work), device="cpu", max_model_len=1024))
    try:
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hi"}], enable_thinking=False
        )
        out = list(stream_generate(engine, prompt, SamplingParams(max_tokens=200)))
    finally:
        engine.close()
    # greedy: a reply of verses, then <|im_end|> well before the limit
    assert out[-1].finish_reason == "stop" and len(out) < 150
