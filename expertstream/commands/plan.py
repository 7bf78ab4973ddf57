"""`expertstream plan [MODEL] [engine flags]`: what a configuration gets, before anything loads.

MODEL is a working directory, a Hugging Face snapshot or its config.json, or a Hub model id (its config.json,
a few KB, is fetched with huggingface_hub): so a box can be weighed before the download. Prints the VRAM plan
the engine would make (the same `plan_memory` call and text as at start), where a token's routed experts
come from with the given caches, and the decode time those bytes alone take at the drive's and the bus's
rates, and the same for a 2,048-token and a full-context prompt run in the plan's spans: lower bounds, the
answer to "which flags for this box". From a workdir it reads the manifest and the resident file's header
only; from a config the resident tensors are the ones setup keeps, in BF16. Needs no GPU when
`--gpu-memory-gb` is given; a rate neither given nor measurable (no GPU, no workdir) is said to be unknown.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from expertstream.config import EngineConfig
from expertstream.memory_plan import GiB, MemoryPlan, MemoryPlanError, bank_slots, gpu_budget, plan_memory
from expertstream.usage import CLIError, check_workdir

HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def configure_parser(p: argparse.ArgumentParser) -> None:
    # MODEL (default: the bundled model) and every engine flag, as `serve`
    EngineConfig.add_cli_args(
        p,
        model_help="working directory, Hugging Face snapshot, its config.json, or a Hub model id such as "
        "nvidia/Qwen3.8-Flash-Next-NVFP4 (default: the bundled demo model)",
    )
    p.add_argument(
        "--disk-gbps",
        type=float,
        help="the drive's O_DIRECT rate for expert blocks (default: measured now, ~1 s of random block reads "
        "of the working directory's experts.bin at --io-threads; unknown before setup)",
    )
    p.add_argument(
        "--pcie-gbps",
        type=float,
        help="pinned host->device rate (default: measured now when a GPU is visible, else unknown)",
    )
    p.add_argument(
        "--stage-gbps",
        type=float,
        help="the rate at which --cpu-moe-share's GPU side crosses the bus (a kernel's reads of pinned RAM, "
        "which can be slower than the copy engine's; default: measured now when a GPU is visible and "
        "--pcie-gbps is not given, else --pcie-gbps)",
    )
    p.add_argument(
        "--cpu-gbps",
        type=float,
        help="the CPU expert kernel's rate for one token (default: measured now on this box's free cores, "
        "or from --cpu-cores and --mem-gbps): what --cpu-moe-share's split weighs against the bus",
    )
    p.add_argument(
        "--cpu-cores", type=int, help="cores of the box to weigh (with --mem-gbps; default: this one)"
    )
    p.add_argument("--mem-gbps", type=float, help="that box's memory read rate (default: measured here)")


@dataclass(frozen=True)
class TokenBytes:
    """Where one decode token's routed expert blocks come from, under uniform routing (every block equally
    likely: the worst case for the caches; real routing is skewed, and LFU hits more, `bench routing`). A
    block in the VRAM cache needs no read; the RAM cache is taken to hold other blocks (its LFU counts only
    the requests that reach it, so blocks the VRAM cache serves age out of it)."""

    routed: int  # bytes of the L x K routed blocks
    vram_share: float  # of the model's blocks, held in the VRAM expert cache
    ram_share: float  # ... held in the pinned RAM cache and not in VRAM
    from_disk: int  # expected bytes read from the drive (not in the RAM cache)
    over_bus: int  # expected bytes crossing PCIe (not in the VRAM cache)
    ram_holds_all: bool  # the RAM cache has a row for every block of the model


def token_bytes(
    layers: int, experts: int, k: int, block: int, vram_blocks: int, ram_gb: float, hot_blocks: int = 0
) -> TokenBytes:
    """hot_blocks: what decode reads from VRAM once the RAM cache holds every block (the hot set)."""
    total = layers * experts
    vram = min(1.0, vram_blocks / total)
    rows = int(ram_gb * GiB) // block
    if rows >= total and vram < 1:
        # every block gets a fixed RAM row and decode reads it there, except the hot set's blocks: the
        # rest of a partial VRAM cache serves prompt passes (docs/runtime.md)
        vram = hot_blocks / total
    ram = min(1.0 - vram, rows / total)  # the blocks the VRAM cache does not hold
    routed = layers * k * block
    far, bus = round(routed * (1 - vram - ram)), round(routed * (1 - vram))
    return TokenBytes(routed, vram, ram, far, bus, rows >= total)


# of the machine's RAM, the most the pinned RAM cache should take (the OS, PLE reads, Python need the rest)
RAM_SHARE = 0.75


def physical_ram() -> int:
    """Bytes of RAM in this machine (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 0


def prompt_bytes(tokens: int, span: int, layers: int, experts: int, k: int, block: int, tb: TokenBytes):
    """(spans, bytes from the drive, bytes over PCIe) of a `tokens`-token prompt run in `span`-token spans:
    each span fetches every expert its tokens route to once per layer, E (1 - (1 - K/E)^n) of them for n
    tokens under uniform routing; from the drive unless cached (prompt misses bypass the RAM cache)."""
    spans, far, bus = -(-tokens // span), 0.0, 0.0
    for s in range(spans):
        n = min(span, tokens - s * span)
        fetched = layers * experts * (1 - (1 - k / experts) ** n) * block
        far += fetched * (1 - tb.vram_share - tb.ram_share)
        bus += fetched * (1 - tb.vram_share)
    return spans, round(far), round(bus)


def _budget(cfg: EngineConfig) -> int:
    if cfg.gpu_memory_gb is None:
        import torch

        if not torch.cuda.is_available():
            raise CLIError("no GPU is visible: give --gpu-memory-gb to plan for a card (e.g. 8)")
        free, total = torch.cuda.mem_get_info()
        return gpu_budget(None, cfg.gpu_memory_utilization, free, total)
    return int(cfg.gpu_memory_gb * GiB * cfg.gpu_memory_utilization)


@dataclass
class ConfigModel:
    """What `plan` needs of a model, read from a config.json alone (a `Workdir` has the same attributes)."""

    text_config: dict
    block_bytes: int
    num_layers: int
    num_experts: int
    experts_path: Path | None = None  # none before setup: the drive's rate cannot be measured

    family: object = None  # workdir/families.Family

    @classmethod
    def from_config(cls, config: dict) -> ConfigModel:
        from expertstream.workdir.families import family_of

        family = family_of(config)
        tc = config.get("text_config", config)
        layers, experts, _ = family.dims(tc)
        return cls(tc, family.layout(tc).block_bytes, layers, experts, family=family)

    def resident_spec(self) -> dict:
        return self.family.resident_spec(self.text_config)

    @property
    def layout(self):
        """The family's expert block (NVFP4 or MXFP4), as setup would write it."""
        return self.family.layout(self.text_config)

    def memory_plan(self, budget_bytes: int, max_model_len: int, *args, **kw) -> MemoryPlan:
        """`Workdir.memory_plan`'s plan (same arguments), from the resident tensors setup would write."""
        inventory = {name: (shape, dtype) for name, (dtype, shape) in self.resident_spec().items()}
        return plan_memory(
            self.text_config, inventory, self.block_bytes, budget_bytes, max_model_len, *args, **kw
        )


def _fetch_config(model_id: str) -> dict:
    """config.json of a Hub model id, through huggingface_hub (a few KB)."""
    how = (
        f"download it elsewhere (`huggingface-cli download {model_id} config.json --local-dir DIR`) "
        "and give DIR/config.json"
    )
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        missing = "but huggingface_hub is not installed"
        raise CLIError(f"{model_id} looks like a Hub model id, {missing}: {how}") from None
    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname
    try:  # a second's probe: offline, huggingface_hub retries for half a minute
        socket.create_connection((host, 443), timeout=3).close()
    except OSError as e:
        raise CLIError(
            f"cannot reach {host} ({e.strerror or e}) to fetch config.json of {model_id}: {how}"
        ) from None
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    try:
        return json.loads(Path(hf_hub_download(model_id, "config.json")).read_text())
    except Exception as e:  # unknown repo, gated, network: the library's own errors vary by version
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CLIError(f"could not fetch config.json of {model_id} ({reason}): {how}") from None


def load_model(source: str):
    """(the model, whether it is a finished workdir) for `plan`'s MODEL argument."""
    path = Path(source)
    if path.is_file():
        try:
            return ConfigModel.from_config(json.loads(path.read_text())), False
        except (ValueError, KeyError) as e:
            raise CLIError(f"{path} is not a config.json plan reads ({type(e).__name__}: {e})") from None
    if path.is_dir() and not (path / "manifest.json").is_file() and (path / "config.json").is_file():
        return load_model(str(path / "config.json"))  # a snapshot, not set up yet
    if not path.exists() and HUB_ID.fullmatch(source):
        try:
            return ConfigModel.from_config(_fetch_config(source)), False
        except (ValueError, KeyError) as e:
            raise CLIError(f"the config.json of {source} is not one plan reads ({e})") from None
    check_workdir(source)
    from expertstream.workdir.workdir import Workdir

    wd = Workdir(source)
    wd.block_bytes = wd.layout.block_bytes
    return wd, True


def _rates(args, model, cfg: EngineConfig) -> tuple[float | None, float | None]:
    """(disk GB/s, PCIe GB/s): as given, else measured here, else None (unknown)."""
    disk, pcie = args.disk_gbps, args.pcie_gbps
    if not disk and model.experts_path is not None:
        from expertstream.runtime.probes import disk_rate

        disk = disk_rate(model.experts_path, model.block_bytes, cfg.io_threads, n=256)
    if not pcie:
        import torch

        if torch.cuda.is_available():
            from expertstream.runtime.probes import pcie_rate

            pcie = pcie_rate(256 << 20)
    return disk, pcie


def cpu_rate(args, model, threads: int) -> tuple[float, str]:
    """(GB/s, how it was found) of the CPU expert kernel for one token on a layer's K experts: --cpu-gbps;
    else, for another box, min(cores x this box's one-thread rate, its memory rate); else measured here on
    `threads` threads."""
    import torch

    from expertstream.kernels import cpu_moe

    if args.cpu_gbps:
        return args.cpu_gbps, "--cpu-gbps"
    if cpu_moe.library() is None:
        return 0.0, "no C compiler to build the CPU kernel"
    k, layout = model.text_config["num_experts_per_tok"], model.layout  # the model's own block format
    # written (ones, not zeros: untouched zero pages would all map to one cached page)
    rows = torch.ones(max(5 * k, (1 << 30) // layout.block_bytes), layout.block_bytes, dtype=torch.uint8)
    here = cpu_moe.layer_rate(rows, layout, k, threads)
    if not (args.cpu_cores or args.mem_gbps):
        return here, f"measured on {threads} thread{'s' * (threads > 1)} here"
    one = cpu_moe.layer_rate(rows, layout, k, 1)
    cores, mem = args.cpu_cores or threads, args.mem_gbps or cpu_moe.read_rate(256 << 20, threads)
    rate = min(cores * one, mem)
    return rate, f"{cores} cores x {one:.1f} GB/s a core here, at most the {mem:.0f} GB/s memory rate"


def stage_rate(args, model, k: int) -> tuple[float | None, str]:
    """(GB/s or None, how it was found) of the GPU side of a CPU share crossing the bus: --stage-gbps;
    else measured here (`probes.stage_rate` on half a layer's K blocks) when a GPU is visible and the bus is
    this box's; else None (taken as the bus rate, an upper bound)."""
    if args.stage_gbps:
        return args.stage_gbps, "--stage-gbps"
    import torch

    if args.pcie_gbps or not torch.cuda.is_available():
        return None, "not measured: the bus rate, an upper bound"
    from expertstream.runtime.probes import stage_rate as probe

    return probe(model.block_bytes, k), "the staging kernel, measured here"


def cpu_share_lines(
    tb: TokenBytes, layers: int, k: int, pcie: float, cpu: float, how: str, stage=(None, "")
) -> list[str]:
    """What a CPU share of decode gives when every expert is in RAM: the CPU takes n of a layer's K routed
    experts, those that would cross the bus first (a hot set in VRAM serves its share of the K), the bus
    the rest at `stage` = (GB/s or None: pcie, how) while the CPU reads its own; n makes the slower side
    least (`expert_seconds`, as --cpu-moe-share -1 first picks)."""
    from expertstream.experts.split_bank import cpu_experts, expert_seconds

    block, hot = tb.routed / (layers * k), k * tb.vram_share  # a block's bytes; hot-set hits a layer
    share = stage[0] or pcie
    n = cpu_experts(k, cpu, share, block, alone_gbps=pcie, in_vram=hot)
    alone = layers * expert_seconds(k, 0, block, cpu, pcie, hot)
    split = layers * expert_seconds(k, n, block, cpu, share, hot)
    lines = [
        f"CPU share of decode (--cpu-moe-share -1), the CPU expert kernel at {cpu:.1f} GB/s ({how}):",
        f"  the GPU's share crossing at {share:.1f} GB/s beside it ({stage[1] or 'the bus rate'})",
    ]
    if not n:
        lines.append(f"  none: the bus at {pcie:.1f} GB/s is much faster than the CPU kernel")
    else:
        lines.append(f"  {n} of {k} experts a layer on the CPU, {k - n} on the GPU: at most {1 / split:.1f} "
                     f"tok/s from these bytes, {alone / split:.2f}x the bus alone")  # fmt: skip
    return lines


def report(
    plan: MemoryPlan,
    tb: TokenBytes,
    disk: float | None,
    pcie: float | None,
    ram_gb: float,
    prompts: dict | None = None,
) -> str:
    """The plan's text, then where a token's experts come from and the decode time they alone take, and
    the same for prompts {tokens: prompt_bytes(...)}. A rate of None is unknown: its share is not timed."""
    mb = 1e6
    unknown = []  # what a bound lacks

    def row(what: str, nbytes: float, rate: float | None = None) -> str:
        time = f" = {nbytes / rate / mb:.1f} ms" if rate else ""
        return f"  {what:<44} {nbytes / mb:9.1f} MB{time}"

    lines = [plan.describe(), "", "Decode, one token (uniform routing: the caches' worst case):"]
    lines.append(row("routed experts", tb.routed))
    lines.append(row(f"in the VRAM cache ({tb.vram_share:.1%} of the blocks)", tb.routed * tb.vram_share))
    lines.append(row(f"in the RAM cache ({tb.ram_share:.1%} of the blocks)", tb.routed * tb.ram_share))
    bound = 0.0
    if disk:
        rate = f"{disk:.2f}" if disk >= 0.01 else f"{disk:.1e}"  # a tiny model's few blocks read slowly
        lines.append(row(f"from the drive, at {rate} GB/s", tb.from_disk, disk))
        bound = tb.from_disk / disk / 1e9
    else:
        lines.append(row("from the drive, rate unknown (--disk-gbps)", tb.from_disk))
        unknown += ["the drive's rate (--disk-gbps; measured from a workdir)"] if tb.from_disk else []
    if pcie:
        lines.append(row(f"over PCIe, at {pcie:.1f} GB/s", tb.over_bus, pcie))
        bound = max(bound, tb.over_bus / pcie / 1e9)
    else:
        lines.append(row("over PCIe, rate unknown (--pcie-gbps)", tb.over_bus))
        unknown += ["the bus rate (--pcie-gbps; measured when a GPU is visible)"] if tb.over_bus else []
    if unknown:
        known = f"at most {1 / bound:.1f} tok/s from the known rates; " if bound else ""
        lines.append(f"  {known}unknown: {' and '.join(unknown)}")
    else:
        lines.append(
            f"  at most {1 / bound:.1f} tok/s from these bytes alone" if bound else "  no expert bytes move"
        )
    lines.append(
        "  (a bound: compute and the dense part add to it; skewed real routing hits the caches more)"
    )
    phys = physical_ram()
    if phys and ram_gb * GiB > RAM_SHARE * phys:
        share = f"{ram_gb * GiB / phys:.0%} of this machine's {phys / GiB:.0f} GiB"
        lines.append(f"  note: --ram-cache-gb {ram_gb:g} pins {share}; leave room for the OS, PLE reads")
    elif phys and tb.from_disk and ram_gb * GiB < RAM_SHARE * phys / 2:
        lines.append(f"  note: this machine has {phys / GiB:.0f} GiB of RAM: a --ram-cache-gb up to about "
                     f"{RAM_SHARE * phys / GiB:.0f} keeps more experts off the drive")  # fmt: skip
    if tb.ram_holds_all:
        lines.append("  note: the RAM cache holds every expert: --preload-experts fills it at start,")
        where = (
            f"reads its hot set ({tb.vram_share:.1%} of the blocks) from VRAM, the rest from RAM"
            if tb.vram_share
            else "reads every block from RAM (too few VRAM cache slots for a hot set)"
        )
        lines.append(f"  and decode then reads no routing back and {where}")
    if prompts:
        lines += ["", "Prompts (each span fetches the experts its tokens route to once per layer; uniform):"]
    for tokens, (spans, far, bus) in (prompts or {}).items():
        t = max(far / disk if disk else 0.0, bus / pcie if pcie else 0.0) / 1e9
        what = f"{tokens:,} tokens, {spans} span{'s' * (spans > 1)} of {plan.prefill_span:,}"
        moved = f"{far / 1e9:6.1f} GB from the drive, {bus / 1e9:6.1f} GB over PCIe"
        least = f"at least {t:.1f} s" + (" from the known rates" if unknown else "") if t else "time unknown"
        lines.append(f"  {what:<40} {moved}: {least}")
    return "\n".join(lines)


def disk_report(model: ConfigModel) -> str:
    """What `setup` will write for a model known by its config alone (about; the resident part in BF16)."""
    from expertstream.memory_plan import ELEM_BYTES

    experts = model.num_layers * model.num_experts * model.block_bytes
    resident = 0
    for dtype, shape in model.resident_spec().values():
        n = ELEM_BYTES[dtype]
        for d in shape:
            n *= d
        resident += n
    return (
        f"setup writes about {(experts + resident) / 1e9:.1f} GB: experts.bin {experts / 1e9:.1f} GB "
        f"({model.num_layers} layers x {model.num_experts} experts x {model.block_bytes:,} B), resident "
        f"weights {resident / 1e9:.1f} GB as shipped (a PLE table is read from the snapshot in place)"
    )


def main(args: argparse.Namespace) -> int:
    cfg = EngineConfig.from_args(args)  # the flags, checked before torch loads
    if not args.model:
        from expertstream.default_model import resolve_model

        args.model = resolve_model(args.model)
    model, is_workdir = load_model(args.model)
    tc = model.text_config
    max_len = min(cfg.max_model_len, tc.get("max_position_embeddings") or cfg.max_model_len)
    try:
        act = 4 if cfg.dtype == "float32" else 2  # the engine's activations: bf16 on a GPU unless asked
        plan = model.memory_plan(_budget(cfg), max_len, act, cfg.max_num_seqs, cfg.kv_pool_tokens)
    except MemoryPlanError as e:
        print(e)
        return 1
    k = tc["num_experts_per_tok"]
    L, E, block = model.num_layers, model.num_experts, model.block_bytes
    # the bank's cache slots as the engine sizes them: the plan's three banks and its cache, less staging
    n_slots = plan.slots // block + plan.vram_cache_blocks
    width = 0 if cfg.no_speculation else cfg.speculation_width
    hot = bank_slots(cfg.stage_guesses, k, n_slots, width, E, L)[2] * L
    tb = token_bytes(L, E, k, block, plan.vram_cache_blocks, cfg.ram_cache_gb, hot)
    disk, pcie = _rates(args, model, cfg)
    shape = (plan.prefill_span, L, E, k, block, tb)
    prompts = {n: prompt_bytes(n, *shape) for n in sorted({min(2048, max_len), max_len})}
    if not is_workdir:
        print(disk_report(model), end="\n\n")
    print(report(plan, tb, disk, pcie, cfg.ram_cache_gb, prompts))
    if tb.ram_holds_all and tb.over_bus and pcie:
        from expertstream.experts.split_bank import split_threads
        from expertstream.runtime.cpu_threads import CpuThreads

        threads = split_threads(CpuThreads(cfg.threads))()  # those the share runs on
        cpu, how = cpu_rate(args, model, threads)
        lines = cpu_share_lines(tb, L, k, pcie, cpu, how, stage_rate(args, model, k))
        print("\n" + "\n".join(lines))
    return 0
