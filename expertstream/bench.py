"""`expertstream bench MODE`: speed against the machine's physical limits, measured in the same run.

Each mode is a module with `run(args) -> int`, imported only when chosen.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import shlex
import sys
from pathlib import Path

# mode -> module
MODES: dict[str, str] = {"kernels": "expertstream.bench_kernels"}


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", choices=list(MODES), help="what to measure")
    p.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    p.add_argument("--out", type=Path, help="append the table, with date, device and command, to this file")


def append_markdown(path: Path, section: str, device: str, table: str) -> None:
    """Append one dated result block in docs/benchmarks.md format."""
    cmd = "expertstream " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    with open(path, "a") as f:
        f.write(f"\n### {section}: {stamp}, {device}\n\nCommand: `{cmd}`\n\n{table}")


def main(args: argparse.Namespace) -> int:
    return importlib.import_module(MODES[args.what]).run(args)
