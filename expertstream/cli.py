"""One console entry point: `expertstream <subcommand>`.

Subcommand modules are imported only when chosen, so `expertstream --help` never imports torch.
Each module exposes `configure_parser(parser)` and `main(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "synth": (
        "expertstream.synth.synth",
        "write a synthetic checkpoint in a published layout (qwen4_exp, DeepSeek-V4)",
    ),
    "setup": (
        "expertstream.workdir.repack",
        "turn a Hugging Face snapshot into a verified working directory",
    ),
    "verify": ("expertstream.workdir.verify", "check a working directory against its manifest and snapshot"),
    "generate": ("expertstream.commands.generate", "generate text from a working directory"),
    "chat": ("expertstream.commands.chat", "interactive chat in the terminal"),
    "check": ("expertstream.commands.check", "compare the engine's logits with transformers' qwen4_exp"),
    "ppl": ("expertstream.commands.ppl", "perplexity of the engine on a text, with must-break controls"),
    "serve": ("expertstream.server.app", "OpenAI-compatible streaming HTTP server"),
    "bench": ("expertstream.bench.cli", "measure speed against the machine's physical limits"),
    "plan": ("expertstream.commands.plan", "a configuration's VRAM plan and bytes per token, before loading"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="expertstream",
        description="Stream mixture-of-experts weights from NVMe through RAM to a small GPU.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        parser = build_parser()
        if not argv:
            parser.print_help()
            return 0
        parser.parse_args(argv)  # prints --help or the usage error and exits
        return 2
    name, rest = argv[0], argv[1:]
    module = importlib.import_module(COMMANDS[name][0])
    sub = argparse.ArgumentParser(prog=f"expertstream {name}", description=COMMANDS[name][1])
    module.configure_parser(sub)
    args = sub.parse_args(rest)
    from expertstream.log import setup_logging

    setup_logging(getattr(args, "log_level", "INFO"))
    return int(module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
