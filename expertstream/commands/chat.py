"""`expertstream chat [WORKDIR]`: a terminal chat that keeps the engine state between turns.

The first turn renders the system message and the user turn with the chat template. Later turns do not
re-render the history (a template may render past replies differently from how they were generated, e.g.
without their think block): the prompt is the state's own token history, the reply's last token, the
template's end-of-turn text and the new user turn rendered alone, so `stream_generate` always finds the
history as a prefix and runs only the new tail. Lines starting with / are commands (COMMANDS), never sent to
the model. Ctrl-C during a reply stops it at the next token and keeps the conversation; at the prompt it
quits, as Ctrl-D does. Replies go to stdout, the banner and notices to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import threading

from expertstream.commands.generate import (
    add_chat_and_sampling_args,
    sampling_from_args,
    stats_line,
    validate,
)
from expertstream.config import EngineConfig
from expertstream.usage import read_file_arg

COMMANDS = {
    "/help": "this list",
    "/reset": "forget the conversation and start a new one (also /clear)",
    "/exit": "quit (also /quit, Ctrl-D, or Ctrl-C at the prompt)",
}
ALIASES = {"/clear": "/reset", "/quit": "/exit"}


def configure_parser(p: argparse.ArgumentParser) -> None:
    EngineConfig.add_cli_args(p)
    add_chat_and_sampling_args(p, max_tokens=1024)
    p.add_argument("-f", "--file", help="send this file's text (- for stdin) as the first message")
    p.add_argument("--stats", action="store_true", help="print the stats line after each reply")


def turn_end(tokenizer) -> str:
    """Text the template puts after an assistant reply ("<|im_end|>\\n" for ChatML)."""
    sentinel = "\x00reply\x00"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": sentinel}],
        add_generation_prompt=False,
    )
    return text[text.rindex(sentinel) + len(sentinel) :]


def banner(engine, args: argparse.Namespace) -> str:
    from expertstream.default_model import model_id  # imports torch: after the flags are checked

    name = model_id(engine.config.model)
    think = "off" if args.no_think else "as the template has it"
    return (
        f"expertstream chat: {name}, context {engine.config.max_model_len:,} tokens, "
        f"replies up to {args.max_tokens:,} tokens, thinking {think}\n"
        "/help lists the commands, /reset starts over, /exit quits; Ctrl-C stops a reply"
    )


class ReplyInterrupt:
    """While active, Ctrl-C (SIGINT) sets a flag that `stream_generate` polls after each token instead of
    raising inside a forward pass, so the state stays whole and the conversation goes on."""

    def __init__(self):
        self.stop = threading.Event()
        self._old = None

    def __enter__(self) -> ReplyInterrupt:
        self.stop.clear()
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, lambda *_: self.stop.set())
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None


def chat_loop(engine, args: argparse.Namespace, lines, out=sys.stdout, err=sys.stderr) -> None:
    """Read user turns from `lines` (an iterator of strings) and stream the replies to `out`."""
    from expertstream.generate import stream_generate

    tok = engine.tokenizer
    params = sampling_from_args(args)
    template_kwargs = {"enable_thinking": False} if args.no_think else {}
    end_ids = tok.encode(turn_end(tok))
    state, history = engine.new_state(), []  # history: token ids of the conversation so far
    interrupt = ReplyInterrupt()
    for line in lines:
        line = line.strip()
        command = ALIASES.get(line, line)
        if command == "/exit":
            break
        if command == "/reset":
            state = None  # free the old state before allocating the new one
            state, history = engine.new_state(), []
            print("(new conversation)", file=err)
            continue
        if command == "/help":
            print("\n".join(f"  {c:<8} {what}" for c, what in COMMANDS.items()), file=err)
            continue
        if line.startswith("/") and " " not in line:
            print(f"unknown command {line}; /help lists them", file=err)
            continue
        if not line:
            continue
        messages = [{"role": "user", "content": line}]
        if not history and args.system:
            messages.insert(0, {"role": "system", "content": args.system})
        ids = history + tok.encode(tok.apply_chat_template(messages, **template_kwargs))
        last = None
        try:
            with interrupt:
                for r in stream_generate(engine, ids, params, state=state, should_stop=interrupt.stop.is_set):
                    print(r.text, end="", flush=True, file=out)
                    last = r
        except ValueError as e:  # the conversation outgrew max_model_len
            print(f"{e} (/reset starts a new conversation)", file=err)
            continue
        print(file=out, flush=True)
        if last is None:  # stopped during the prompt: the state is reset on the next turn
            if interrupt.stop.is_set():
                print("(stopped)", file=err)
            continue
        if last.finish_reason == "cancelled":
            print("(stopped; the conversation keeps the reply so far)", file=err)
        if args.stats:
            print(stats_line(last), file=err)
        # the state consumed everything but the last sampled token; a stop token is replaced by the turn end
        reply_tail = [] if last.token in tok.stop_token_ids else [last.token]
        history = state.tokens + reply_tail + end_ids


def main(args: argparse.Namespace) -> int:
    cfg, _ = validate(args)
    first = read_file_arg(args.file, "first message") if args.file else None
    from expertstream.default_model import resolve_model
    from expertstream.runtime.engine import Engine

    engine = Engine(dataclasses.replace(cfg, model=resolve_model(cfg.model)))
    interactive = sys.stdin.isatty()

    def prompts():
        if first is not None:
            yield first
        while True:
            try:
                yield input("> " if interactive else "")
            except EOFError:
                return

    print(banner(engine, args), file=sys.stderr)
    try:
        chat_loop(engine, args, prompts())
    except KeyboardInterrupt:  # at the prompt: quit
        print(file=sys.stderr)
    finally:
        engine.close()
    return 0
