"""`expertstream ppl`: sliding windows, the engine against transformers, and the controls."""

import json
import math

import pytest

from expertstream.cli import main as cli
from expertstream.commands.ppl import windows

TEXT = (
    "The user asked the assistant a question, and the assistant answered it. The weather today is sunny "
    "with a light wind.\nTomorrow it will rain in the morning and clear up by noon. The quick brown fox "
    "jumps over the lazy dog.\nA small model streams its experts from a fast disk. Hello, world! How are "
    "you? I am fine.\n"
)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ppl") / "text.txt"
    path.write_text(TEXT)
    return path


def ppl(capsys, workdir, text_file, *flags) -> dict:
    # a 48-token window over a ~160-token text: several overlapping windows
    rc = cli(["ppl", str(workdir), "--text", str(text_file), "--max-model-len", "48", "--json", *flags])
    assert rc == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("n, window, stride", [(10, 4, 2), (10, 4, 3), (7, 16, 8), (100, 48, 24), (2, 2, 1)])
def test_windows_score_every_position_once(n, window, stride):
    scored = []
    for begin, end, first in windows(n, window, stride):
        assert end - begin <= window and begin < first <= end
        scored += range(first, end)
    assert scored == list(range(1, n))


def test_windows_reject_a_stride_that_skips_tokens():
    with pytest.raises(ValueError, match="stride"):
        windows(10, 4, 4)


@pytest.fixture(scope="module")
def correct(tiny_workdir, tiny_snapshot, text_file):
    from expertstream.commands.ppl import run_ppl
    from expertstream.config import EngineConfig

    return run_ppl(
        EngineConfig(model=str(tiny_workdir), max_model_len=48), TEXT, reference=str(tiny_snapshot)
    )


def test_engine_matches_transformers(correct):
    assert correct["tokens"] > 3 * correct["window"]  # the sliding window really slides
    assert correct["engine"]["scored"] == correct["reference"]["scored"] == correct["tokens"] - 1
    # FP32 on both sides: logits agree to ~1e-6, so the perplexities agree far inside the required 1 %
    assert abs(math.log(correct["ppl_ratio"])) < 1e-4
    assert correct["engine"]["tokens_per_s"] > 0


@pytest.mark.parametrize("control", ["swap-nibbles", "no-experts"])
def test_controls_change_perplexity(capsys, tiny_workdir, text_file, correct, control):
    broken = ppl(capsys, tiny_workdir, text_file, "--control", control)
    assert broken["control"] == control and broken["tokens"] == correct["tokens"]
    # random weights give no direction, only a difference 50x the engine-vs-reference tolerance above
    assert abs(math.log(broken["engine"]["ppl"] / correct["engine"]["ppl"])) > 5e-3
