"""`expertstream generate [WORKDIR] --prompt TEXT`: print the text as it comes, then one stats line.

The prompt comes from --prompt, from a file (-f FILE) or from stdin (--prompt - or -f -). With --json every
token is one JSON object per line (the `GenerationResponse` fields), for scripts. Flags are checked before
torch loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from expertstream.config import EngineConfig, SamplingParams
from expertstream.usage import CLIError, check_workdir, read_file_arg, read_text_arg

# a prompt longer than this many characters is refused before tokenizing (it could not fit any context)
MAX_PROMPT_CHARS = 64 << 20


def configure_parser(p: argparse.ArgumentParser) -> None:
    EngineConfig.add_cli_args(p)  # WORKDIR (optional: the bundled default model) and every engine flag
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", help="prompt text; - reads it from stdin")
    src.add_argument("-f", "--file", help="read the prompt from this file (- for stdin)")
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
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="divide a positive logit of a token already in the prompt or reply, multiply a negative one "
        "(llama.cpp's --repeat-penalty; default: 1, off)",
    )


def sampling_from_args(args: argparse.Namespace, stop: list[str] | None = None) -> SamplingParams:
    """SamplingParams from the flags of `add_chat_and_sampling_args` (and the engine's --seed)."""
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=list(stop or []),
    )


def stats_line(r) -> str:
    """One line of a `GenerationResponse`'s counters."""
    return (
        f"prompt: {r.prompt_tokens} tokens ({r.cached_tokens} cached), {r.prompt_tps:.1f} tok/s | "
        f"generation: {r.generation_tokens} tokens, {r.generation_tps:.2f} tok/s | "
        f"disk {r.disk_bytes / 2**20:.1f} MiB, expert hits {r.cache_hit_rate:.1%}, stall {r.stall_s:.2f} s | "
        f"peak memory {r.peak_memory_gb:.2f} GiB | finish: {r.finish_reason}"
    )


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt of --prompt or --file; refused when empty."""
    text = read_file_arg(args.file, "prompt") if args.file else read_text_arg(args.prompt, "prompt")
    if not text:
        raise CLIError("the prompt is empty: give some text with --prompt, -f FILE or on stdin")
    if len(text) > MAX_PROMPT_CHARS:
        raise CLIError(f"the prompt has {len(text):,} characters, more than any context holds")
    return text


def build_prompt(tokenizer, args: argparse.Namespace, prompt: str) -> str:
    if not args.chat:
        return prompt
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": prompt})
    kwargs = {"enable_thinking": False} if args.no_think else {}
    return tokenizer.apply_chat_template(messages, **kwargs)


def check_fits(tokenizer, text: str, max_model_len: int) -> None:
    """Refuse a prompt that leaves no room to generate, before the engine loads (the engine may clamp
    max_model_len further, to the model's positions; generation then refuses in the same words)."""
    n = len(tokenizer.encode(text))
    if n >= max_model_len:
        raise CLIError(
            f"the prompt has {n} tokens; --max-model-len {max_model_len} leaves no room to generate"
        )


def validate(args: argparse.Namespace) -> tuple[EngineConfig, SamplingParams]:
    """Every flag checked without torch: the engine's, the sampling's and WORKDIR."""
    cfg = EngineConfig.from_args(args)
    params = sampling_from_args(args, stop=getattr(args, "stop", None))
    if args.model:
        check_workdir(args.model)
    if cfg.device.startswith("cuda"):  # asked for explicitly: torch must see a GPU (this loads torch)
        from expertstream.runtime.engine import resolve_device_dtype

        resolve_device_dtype(cfg)
    return cfg, params


def main(args: argparse.Namespace) -> int:
    cfg, params = validate(args)
    prompt = read_prompt(args)
    from expertstream.default_model import resolve_model
    from expertstream.tokenizer import Tokenizer
    from expertstream.workdir.workdir import Workdir

    cfg = dataclasses.replace(cfg, model=resolve_model(cfg.model))
    Workdir(cfg.model)  # its files against the manifest's checksums before the tokenizer reads one
    tokenizer = Tokenizer.from_dir(cfg.model)
    text = build_prompt(tokenizer, args, prompt)
    check_fits(tokenizer, text, cfg.max_model_len)

    from expertstream.generate import stream_generate
    from expertstream.runtime.engine import Engine

    engine = Engine(cfg)
    last = None
    try:
        for r in stream_generate(engine, text, params):
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
