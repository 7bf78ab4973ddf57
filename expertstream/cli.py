"""One console entry point: `expertstream <subcommand>`.

Subcommand modules are imported only when chosen, so `expertstream --help` never imports torch.
Each module exposes `configure_parser(parser)` and `main(args) -> int`. An error the user can cause
(ValueError, OSError, CLIError) ends as one sentence and exit 1, a usage error as argparse's exit 2, Ctrl-C
quietly with 130; EXPERTSTREAM_TRACEBACK=1 shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

from expertstream.errors import UserError
from expertstream.usage import CLIError

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
    "serve": ("expertstream.server.cli", "OpenAI- and Anthropic-compatible streaming HTTP server"),
    "bench": ("expertstream.bench.cli", "measure speed against the machine's physical limits"),
    "plan": (
        "expertstream.commands.plan",
        "what a box gets from a model (workdir, snapshot, config.json or model id), before the download",
    ),
}


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("expertstream")
    except PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown (not installed)"


def _sentence(e: BaseException, parser: argparse.ArgumentParser) -> str:
    """The error's text, its leading field name written as the flag (max_tokens -> --max-tokens)."""
    if isinstance(e, OSError) and e.strerror:
        text = f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    else:
        text = str(e) or type(e).__name__
    flags = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
    m = re.match(r"(\w+) ", text)
    if m and m.group(1) in flags:
        text = flags[m.group(1)] + text[m.end(1) :]
    return text


class DefaultsOnce(argparse.HelpFormatter):
    """argparse's help with every flag's default said once: appended where the help does not say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        quiet = action.default in (None, False, "", [], argparse.SUPPRESS) or not action.option_strings
        return text if quiet or "default" in text.lower() else text + " (default: %(default)s)"


def subcommand_parser(name: str):
    """(the subcommand's module, its parser)."""
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(
        prog=f"expertstream {name}", description=COMMANDS[name][1], formatter_class=DefaultsOnce
    )
    module.configure_parser(parser)
    return module, parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="expertstream",
        description="Stream mixture-of-experts weights from NVMe through RAM to a small GPU.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"expertstream {version()}")
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
        parser.parse_args(argv)  # prints --help, --version or the usage error and exits
        return 2
    name, rest = argv[0], argv[1:]
    sub = argparse.ArgumentParser(prog=f"expertstream {name}")  # until the module's parser is built
    try:
        module, sub = subcommand_parser(name)
        args = sub.parse_args(rest)
        from expertstream.log import setup_logging

        setup_logging(getattr(args, "log_level", None))
        return int(module.main(args) or 0)
    except KeyboardInterrupt:
        print(file=sys.stderr)  # end the line the ^C was echoed on
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): nothing left to tell it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except UserError as e:  # a bad snapshot or workdir, a damaged block: its one sentence, no traceback
        print(f"expertstream {name}: error: {e}", file=sys.stderr, flush=True)
        return 1
    except (ValueError, OSError, CLIError) as e:
        if os.environ.get("EXPERTSTREAM_TRACEBACK"):
            raise
        print(f"expertstream {name}: error: {_sentence(e, sub)}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
