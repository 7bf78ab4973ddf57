"""What the command line tells a user: `CLIError` (one sentence, exit 1) and the argument checks that run
before torch loads (imported by the commands and the server, below `expertstream.cli`)."""

from __future__ import annotations

import sys
from pathlib import Path


class CLIError(Exception):
    """An error the user caused and can fix; its text is the one sentence printed."""


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
