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
from pathlib import Path

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "synth": ("expertstream.synth", "write a synthetic checkpoint in NVIDIA's NVFP4 export layout"),
    "setup": ("expertstream.repack", "turn a Hugging Face snapshot into a verified working directory"),
    "verify": ("expertstream.verify", "check a working directory against its manifest and snapshot"),
    "generate": ("expertstream.generate_cli", "generate text from a working directory"),
    "chat": ("expertstream.chat", "interactive chat in the terminal"),
    "check": ("expertstream.check", "compare the engine's logits with transformers' qwen4_exp"),
    "ppl": ("expertstream.ppl", "perplexity of the engine on a text, with must-break controls"),
    "serve": ("expertstream.server", "OpenAI-compatible streaming HTTP server"),
    "bench": ("expertstream.bench", "measure speed against the machine's physical limits"),
    "plan": (
        "expertstream.plan_cli",
        "what a box gets from a model (workdir, snapshot, config.json or model id), before the download",
    ),
}


class CLIError(Exception):
    """An error the user caused and can fix; its text is the one sentence printed."""


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("expertstream")
    except PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown (not installed)"


def check_workdir(path: str) -> None:
    """Refuse, in one sentence, a WORKDIR argument that is not a finished working directory (no torch)."""
    p = Path(path)
    hint = "give a working directory made by `expertstream setup`, or none for the bundled demo model"
    if not p.exists():
        raise CLIError(f"{path} does not exist: {hint}")
    if not p.is_dir():
        raise CLIError(f"{path} is a file, not a working directory: {hint}")
    if (p / "manifest.json").is_file():
        return
    if (p / "setup.progress.json").is_file():
        raise CLIError(f"{path} is an unfinished setup: run `expertstream setup` again to finish it")
    if (p / "config.json").is_file() and any(p.glob("*.safetensors")):
        raise CLIError(
            f"{path} is a Hugging Face snapshot, not a working directory: "
            f"`expertstream setup {path} WORKDIR` makes one from it"
        )
    if not any(p.iterdir()):
        raise CLIError(f"{path} is empty: {hint}")
    raise CLIError(f"{path} has no manifest.json, so it is not a finished working directory: {hint}")


def read_text_arg(value: str, what: str) -> str:
    """`value` itself, or the text of stdin when it is '-'."""
    if value != "-":
        return value
    if sys.stdin.isatty():
        print(f"(reading the {what} from stdin; end it with Ctrl-D)", file=sys.stderr)
    return sys.stdin.read()


def read_file_arg(path: str, what: str) -> str:
    """The text of a file, or of stdin for '-'."""
    if path == "-":
        return read_text_arg("-", what)
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        raise CLIError(f"the {what} file {path} does not exist") from None
    except UnicodeDecodeError:
        raise CLIError(f"the {what} file {path} is not UTF-8 text") from None


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
    sub = argparse.ArgumentParser(prog=f"expertstream {name}", description=COMMANDS[name][1])
    try:
        module = importlib.import_module(COMMANDS[name][0])
        module.configure_parser(sub)
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
    except (ValueError, OSError, CLIError) as e:
        if os.environ.get("EXPERTSTREAM_TRACEBACK"):
            raise
        print(f"expertstream {name}: error: {_sentence(e, sub)}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
