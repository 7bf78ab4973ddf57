"""`expertstream generate [WORKDIR] --prompt TEXT`: print the text as it comes, then one stats line.

With --json every token is one JSON object per line (the `GenerationResponse` fields), for scripts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from expertstream.config import EngineConfig
from expertstream.default_model import resolve_model
from expertstream.generate import GenerationResponse, SamplingParams, stream_generate


def configure_parser(p: argparse.ArgumentParser) -> None:
    EngineConfig.add_cli_args(p)  # WORKDIR (optional: the bundled default model) and every engine flag
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message in the chat template"
    )
    add_chat_and_sampling_args(p, max_tokens=256)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="one JSON object per token instead of text")


def add_chat_and_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    """The chat-template and sampling flags shared by `generate` and `chat`."""
    p.add_argument("--system", default=None, help="system message (chat template)")
    p.add_argument(
        "--no-think", action="store_true", help="render the chat template with enable_thinking=false"
    )
    p.add_argument(
        "--max-tokens", type=int, default=max_tokens, help=f"most tokens per reply (default: {max_tokens})"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1, off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default: 0, off)")
    p.add_argument("--min-p", type=float, default=0.0, help="relative probability floor (default: 0, off)")


def sampling_from_args(args: argparse.Namespace, stop: list[str] | None = None) -> SamplingParams:
    """SamplingParams from the flags of `add_chat_and_sampling_args` (and the engine's --seed)."""
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=list(stop or []),
    )


def stats_line(r: GenerationResponse) -> str:
    return (
        f"prompt: {r.prompt_tokens} tokens ({r.cached_tokens} cached), {r.prompt_tps:.1f} tok/s | "
        f"generation: {r.generation_tokens} tokens, {r.generation_tps:.2f} tok/s | "
        f"disk {r.disk_bytes / 2**20:.1f} MiB, expert hits {r.cache_hit_rate:.1%}, stall {r.stall_s:.2f} s | "
        f"peak memory {r.peak_memory_gb:.2f} GiB | finish: {r.finish_reason}"
    )


def build_prompt(tokenizer, args: argparse.Namespace) -> str:
    if not args.chat:
        return args.prompt
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.prompt})
    kwargs = {"enable_thinking": False} if args.no_think else {}
    return tokenizer.apply_chat_template(messages, **kwargs)


def main(args: argparse.Namespace) -> int:
    from expertstream.runtime.engine import Engine

    args.model = resolve_model(args.model)
    engine = Engine(EngineConfig.from_args(args))
    params = sampling_from_args(args, stop=args.stop)
    last = None
    try:
        for r in stream_generate(engine, build_prompt(engine.tokenizer, args), params):
            if args.json:
                print(json.dumps(dataclasses.asdict(r)), flush=True)
            else:
                print(r.text, end="", flush=True)
            last = r
    finally:
        engine.close()
    if last is not None and not args.json:
        print()
        print(stats_line(last), file=sys.stderr)
    return 0
