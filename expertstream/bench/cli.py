"""`expertstream bench MODE`: speed against the machine's physical limits, measured in the same run.

Each mode is a module with `run(args) -> int`, imported only when chosen.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import shlex
import sys
from pathlib import Path

BENCH_WORKDIR = "/tmp/expertstream-bench"  # the synthetic models of the benches and the device scripts

# mode -> module
MODES: dict[str, str] = {
    "kernels": "expertstream.bench.kernels",
    "decode": "expertstream.bench.runtime",
    "prefill": "expertstream.bench.prefill",
    "routing": "expertstream.bench.routing",
    "cpu": "expertstream.bench.cpu",
    "serve": "expertstream.bench.serve",
}
# --tokens when not given: decode times a few tokens per regime; routing needs a long trace for cache locality
TOKENS = {"decode": 32, "routing": 1024, "cpu": 48}


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", choices=list(MODES), help="what to measure")
    p.add_argument(
        "model", nargs="?", default="", help="routing, serve: WORKDIR (default: the bundled demo model)"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    p.add_argument(
        "--tune",
        action="store_true",
        help="kernels: first time each kernel's candidate launch shapes on this GPU and record the fastest "
        "in ~/.cache/expertstream/tuned_configs.json ($EXPERTSTREAM_TUNED), which the engine reads over "
        "the shipped picks (a few minutes)",
    )
    p.add_argument("--out", type=Path, help="append the table, with date, device and command, to this file")
    p.add_argument(
        "--workdir",
        default=BENCH_WORKDIR,
        help="decode, prefill: where the synthetic models live (the baseline's too)",
    )
    p.add_argument(
        "--model",
        help="decode: an existing working directory of any family to measure instead of the synthetic bench "
        "model, in the regimes vram, ram and disk (without CUDA: ram and disk, on the CPU bank)",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=0,
        help="decode, prefill: full-shape layers to synthesise (0: as many as the free disk and RAM allow, "
        "up to the real 48, or a larger model already in --workdir)",
    )
    p.add_argument(
        "--tokens",
        type=int,
        help="decode: tokens timed per regime (32); routing: tokens traced (1024); cpu: demo tokens (48; 0: "
        "no demo decode); serve: tokens per request of the concurrency rows (32)",
    )
    p.add_argument(
        "--with-copy",
        action="store_true",
        help="cpu: also time the kernel while the copy engine streams pinned RAM to the GPU (needs a GPU)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="cpu: kernel threads; decode, prefill: the engine's --threads (the CPU share's kernel "
        "threads); 0: the cores other processes leave free",
    )
    p.add_argument(
        "--serve-args", help='serve: flags for the server it starts, in one string (e.g. "--device cpu")'
    )
    p.add_argument("--serve-log", type=Path, help="serve: write the server's log to this file")
    p.add_argument("--chat-tokens", type=int, default=64, help="serve: max_tokens of each chat reply")
    p.add_argument(
        "--task-lead", type=float, default=2.0, help="serve: seconds between the title task and the chat"
    )
    p.add_argument(
        "--title-tokens",
        type=int,
        default=1000,
        help="serve: max_tokens of the title task (Open WebUI's 1000; a random model never ends a turn)",
    )
    p.add_argument(
        "--text", type=Path, help="routing: text to teacher-force (default: the snapshot's heldout.txt)"
    )
    p.add_argument(
        "--gpu-memory-gb", type=float, default=8.0, help="decode, prefill: the VRAM budget to emulate"
    )
    p.add_argument(
        "--max-model-len", type=int, default=32768, help="decode, prefill: context the plan reserves"
    )
    p.add_argument(
        "--prompts", type=int, nargs="+", help="prefill: prompt lengths in tokens (default: 2451 32768)"
    )
    p.add_argument(
        "--prefill-piece",
        type=int,
        help="prefill: prompt piece in tokens (default: the 48-layer model's plan under the same budget)",
    )
    p.add_argument(
        "--prefill-span",
        type=int,
        help="prefill: tokens per layer-major span (default: the 48-layer model's plan, same budget)",
    )
    p.add_argument(
        "--max-seconds",
        type=float,
        default=120.0,
        help="prefill: skip (and estimate) a regime and prompt whose expert bytes alone would take longer",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="prefill: time each prompt this many times and report the fastest (one run of a short prompt "
        "is host-bound and varies by half between runs)",
    )
    p.add_argument(
        "--regimes",
        nargs="+",
        help="decode, prefill: run only these regimes (names as in the table, spaces and commas as _: "
        "decode: vram, vram_eager, ram, ram_unstaged, ram_CPU_share, ram_24_GiB_VRAM, disk, "
        "disk_24_GiB_VRAM; prefill: vram, ram, disk); default all",
    )
    p.add_argument(
        "--no-speculation", action="store_true", help="decode, prefill: run the engine without speculation"
    )
    p.add_argument(
        "--speculation-width",
        type=float,
        default=1.0,
        help="decode, prefill: next-layer guesses as a multiple of the experts per token",
    )
    p.add_argument(
        "--stage-guesses",
        type=int,
        default=-1,
        help="decode: next-layer guesses the `ram` regime copies to VRAM early (the engine's flag; -1: the "
        "engine's default, as many as its slots leave room for; `ram unstaged` copies none)",
    )
    p.add_argument(
        "--cpu-moe-share",
        type=float,
        default=-1.0,
        help="decode: the share of each layer's experts the `ram, CPU share` regime computes on the CPU (the "
        "engine's flag; -1: chosen from the rates measured at start)",
    )
    p.add_argument(
        "--baseline",
        action="store_true",
        help="decode, prefill: also time transformers + accelerate offloading (bf16, disk offload) per layer",
    )
    p.add_argument(
        "--baseline-layers", type=int, default=2, help="layers of the baseline's model (its own snapshot)"
    )
    p.add_argument(
        "--profile",
        type=Path,
        help="decode: also profile 3 tokens per regime with torch.profiler into this folder "
        "(REGIME.txt: ops by device time; REGIME.json: Chrome trace); prefill: the shortest prompt once "
        "more per regime (REGIME_PROMPT.txt / .json)",
    )


def append_markdown(path: Path, section: str, device: str, table: str) -> None:
    """Append one dated result block in docs/benchmarks.md format."""
    cmd = "expertstream " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    with open(path, "a") as f:
        f.write(f"\n### {section}: {stamp}, {device}\n\nCommand: `{cmd}`\n\n{table}")


def emit(args: argparse.Namespace, section: str, device: str, table: str, payload: dict) -> None:
    """Print a bench's table, append it to --out, and print --json's payload."""
    print(table)
    if args.out:
        append_markdown(args.out, section, device, table)
    if args.json:
        print(json.dumps(payload))


def regime_slug(name: str) -> str:
    """A regime's table name as --regimes spells it: "disk, 24 GiB VRAM" -> "disk_24_GiB_VRAM"."""
    return name.replace(",", "").replace(" ", "_")


def chosen(args: argparse.Namespace, regimes: dict) -> dict:
    """The regimes --regimes names (all when not given); an unknown name is an error that lists them."""
    if not getattr(args, "regimes", None):
        return regimes
    slugs = {regime_slug(n): n for n in regimes}
    unknown = [r for r in args.regimes if r not in slugs]
    if unknown:
        raise SystemExit(f"unknown regime(s) {', '.join(unknown)}; this bench has: {', '.join(slugs)}")
    return {n: regimes[n] for n in regimes if regime_slug(n) in args.regimes}


def main(args: argparse.Namespace) -> int:
    if args.tokens is None:
        args.tokens = TOKENS.get(args.what)
    return importlib.import_module(MODES[args.what]).run(args)
