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


def test_engine_matches_transformers_on_held_out_text(correct):
    assert correct["tokens"] > 1500
    assert abs(correct["ppl_ratio"] - 1) < 0.02  # issue 7: within 2 % of the reference on the same weights
    # a trained model, not noise: a uniform guess over the ~2,100-token vocabulary would score ~2,100
    assert correct["engine"]["ppl"] < 80


@pytest.mark.parametrize("control", ["swap-nibbles", "no-experts"])
def test_controls_are_worse(demo, correct, control):
    broken = score(demo, control=control)
    # issue 7: a broken engine must be far worse, not merely worse (measured: 17x and 7.6x)
    assert broken["engine"]["ppl"] > 5 * correct["engine"]["ppl"]
