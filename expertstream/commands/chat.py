"""`expertstream chat [WORKDIR]`: a terminal chat that keeps the engine state between turns.

The first turn renders the system message and the user turn with the chat template. Later turns do not
re-render the history (a template may render past replies differently from how they were generated, e.g.
without their think block): the prompt is the state's own token history, the reply's last token, the
template's end-of-turn text and the new user turn rendered alone, so `stream_generate` always finds the
history as a prefix and runs only the new tail. Commands: /reset (new conversation), /exit (or Ctrl-D).
"""

from __future__ import annotations

import argparse
import sys

from expertstream.commands.generate import add_chat_and_sampling_args, sampling_from_args, stats_line
from expertstream.config import EngineConfig
from expertstream.default_model import resolve_model
from expertstream.generate import stream_generate


def configure_parser(p: argparse.ArgumentParser) -> None:
    EngineConfig.add_cli_args(p)
    add_chat_and_sampling_args(p, max_tokens=1024)
    p.add_argument("--stats", action="store_true", help="print the stats line after each reply")


def turn_end(tokenizer) -> str:
    """Text the template puts after an assistant reply ("<|im_end|>\\n" for ChatML)."""
    sentinel = "\x00reply\x00"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": sentinel}],
        add_generation_prompt=False,
    )
    return text[text.rindex(sentinel) + len(sentinel) :]


def chat_loop(engine, args: argparse.Namespace, lines, out=sys.stdout) -> None:
    """Read user turns from `lines` (an iterator of strings) and stream the replies to `out`."""
    tok = engine.tokenizer
    params = sampling_from_args(args)
    template_kwargs = {"enable_thinking": False} if args.no_think else {}
    end_ids = tok.encode(turn_end(tok))
    state, history = engine.new_state(), []  # history: token ids of the conversation so far
    for line in lines:
        line = line.strip()
        if line == "/exit":
            break
        if line == "/reset":
            state = None  # free the old state before allocating the new one
            state, history = engine.new_state(), []
            print("(new conversation)", file=out)
            continue
        if not line:
            continue
        messages = [{"role": "user", "content": line}]
        if not history and args.system:
            messages.insert(0, {"role": "system", "content": args.system})
        ids = history + tok.encode(tok.apply_chat_template(messages, **template_kwargs))
        last = None
        try:
            for r in stream_generate(engine, ids, params, state=state):
                print(r.text, end="", flush=True, file=out)
                last = r
        except ValueError as e:  # the conversation outgrew max_model_len
            print(f"{e} (/reset starts a new conversation)", file=out)
            continue
        print(file=out)
        if last is None:
            continue
        if args.stats:
            print(stats_line(last), file=out)
        # the state consumed everything but the last sampled token; a stop token is replaced by the turn end
        reply_tail = [] if last.token in tok.stop_token_ids else [last.token]
        history = state.tokens + reply_tail + end_ids


def main(args: argparse.Namespace) -> int:
    from expertstream.runtime.engine import Engine

    args.model = resolve_model(args.model)
    engine = Engine(EngineConfig.from_args(args))

    def prompts():
        while True:
            try:
                yield input("> ")
            except EOFError:
                return

    try:
        chat_loop(engine, args, prompts())
    except KeyboardInterrupt:
        print()
    finally:
        engine.close()
    return 0
