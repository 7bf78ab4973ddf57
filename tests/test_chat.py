"""`expertstream chat`: commands are handled, never sent to the model; Ctrl-C stops a reply and keeps the
conversation; the banner names the model and the context; the terminal program reads stdin."""

import argparse
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import expertstream.generate as generate_module
from expertstream.commands.chat import chat_loop

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def engine(tiny_workdir):
    from expertstream.config import EngineConfig
    from expertstream.runtime.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_workdir), max_model_len=512))
    yield engine
    engine.close()


def chat_args(**kw) -> argparse.Namespace:
    base = dict(system=None, no_think=True, max_tokens=3, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                repetition_penalty=1.0, seed=None, stats=True)  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_commands_are_handled_and_never_sent_to_the_model(engine, monkeypatch):
    prompts = []
    real = generate_module.stream_generate

    def spy(engine, ids, *a, **k):
        prompts.append(engine.tokenizer.decode(ids))
        return real(engine, ids, *a, **k)

    monkeypatch.setattr(generate_module, "stream_generate", spy)
    out, err = io.StringIO(), io.StringIO()
    lines = ["/help", "/nonsense", "Hi", "/reset", "", "Hello there", "/clear", "/quit", "never read"]
    chat_loop(engine, chat_args(), iter(lines), out=out, err=err)
    said = err.getvalue()
    assert "/reset" in said and "/exit" in said and "unknown command /nonsense" in said
    assert said.count("(new conversation)") == 2
    commands = ("/help", "/nonsense", "/reset", "/clear", "/quit", "never read")
    assert len(prompts) == 2 and not any(c in p for p in prompts for c in commands)
    # /reset forgets the first turn: the second prompt does not hold it
    assert "Hi" in prompts[0] and "Hi" not in prompts[1].replace("Hello there", "")
    assert len([line for line in said.splitlines() if line.startswith("prompt:")]) == 2


def test_ctrl_c_stops_the_reply_and_keeps_the_conversation(engine, monkeypatch):
    forward, calls = engine.forward, []

    def interrupted_after_3_tokens(state, ids, *a, **k):
        calls.append(len(ids))
        if len(calls) == 4:  # the prompt, then 3 decode steps: Ctrl-C, as the terminal sends it
            os.kill(os.getpid(), signal.SIGINT)
        return forward(state, ids, *a, **k)

    monkeypatch.setattr(engine, "forward", interrupted_after_3_tokens)
    before = signal.getsignal(signal.SIGINT)  # the default handler; ignored in a pytest-xdist worker
    out, err = io.StringIO(), io.StringIO()
    chat_loop(engine, chat_args(max_tokens=8), iter(["Hi", "And then?"]), out=out, err=err)
    said = err.getvalue()
    assert "(stopped; the conversation keeps the reply so far)" in said
    stats = [line for line in said.splitlines() if line.startswith("prompt:")]
    assert "generation: 4 tokens" in stats[0] and "finish: cancelled" in stats[0]
    # the second turn reuses the first turn's state: the conversation went on, and Ctrl-C is as before again
    assert "(0 cached)" not in stats[1]
    assert signal.getsignal(signal.SIGINT) is before


def test_chat_reads_stdin_and_prints_a_banner(tiny_workdir):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run(
        [sys.executable, "-m", "expertstream", "chat", str(tiny_workdir), "--max-tokens", "4", "--stats"],
        input="/help\nHello\n/exit\n",
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode == 0 and "Traceback" not in res.stderr
    banner = res.stderr
    assert f"expertstream chat: {tiny_workdir.name}, context 4,096 tokens" in banner
    assert "/help lists the commands" in banner and "quit (also /quit" in banner
    assert res.stderr.count("prompt:") == 1 and res.stdout.strip()  # one reply, on stdout
