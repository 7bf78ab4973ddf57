"""`Engine`: loads a working directory and owns the model, the expert store and the PLE reader."""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

# The caching allocator reads this at its first CUDA allocation: growable segments keep a long-running
# server's freed blocks reusable, where fixed segments fragment past the budget's reserve (a KV pool that
# moves, prompts of every length). A user's own setting wins.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch

from expertstream.config import EngineConfig, parse_cpu_list
from expertstream.experts.controls import controlled
from expertstream.experts.cpu_bank import StreamedExperts
from expertstream.experts.speculation import SpecStats
from expertstream.formats.fp8 import quantize_fp8_rows
from expertstream.formats.snapshot import read_header
from expertstream.formats.text_config import check_config
from expertstream.log import get_logger
from expertstream.memory_plan import MemoryPlan, gpu_budget
from expertstream.models import deepseek_v4
from expertstream.models.base import ModelArgs
from expertstream.models.batched import forward_many
from expertstream.models.kv_pool import KVPool
from expertstream.models.qwen4_exp import Qwen4ExpModel
from expertstream.models.state import State
from expertstream.runtime.cpu_threads import CpuThreads
from expertstream.store import ExpertStore
from expertstream.store.ple import PleTable
from expertstream.workdir.inventory import FP8_DENSE
from expertstream.workdir.workdir import Workdir, WorkdirError

log = get_logger(__name__)

# prompt tokens per forward call: activations grow linearly with it ([T, N*H] streams, GDN chunks), while
# without a VRAM plan (CPU): attention pieces of this many tokens, spans of the whole context
PREFILL_PIECE = 8192
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(slots=True)
class EngineStats:
    requests: int  # expert lookups
    hits: int  # served from RAM (or a read already in flight)
    misses: int  # expert blocks read from disk
    bytes_read: int  # expert bytes read from disk
    read_seconds: float  # summed over reader threads
    stall_seconds: float  # compute thread waiting for expert blocks (reads, or a full RAM cache's slot)
    ple_bytes_read: int
    spec_issued: int  # next-layer experts guessed (decode)
    spec_used: int  # guesses the next layer really routed to
    spec_wasted_bytes: int  # prefetched disk blocks nobody used (yet)
    prefetch_bytes_read: int  # disk bytes read by the low-priority prefetcher (part of bytes_read)
    host_syncs: int  # device -> host reads the expert bank waited on (decode: one per MoE layer)
    bank_decode_seconds: float  # decode thread inside the bank's one-token calls (GPU bank; 0 otherwise)
    bank_sync_seconds: float  # ... of which waiting in the routing-id read-back for the GPU to catch up
    bank_spec_seconds: float  # ... of which queueing the next layer's guessed disk reads
    bus_read_bytes: int  # expert bytes decode moved over the bus without the copy engine: kernels reading
    # the pinned RAM cache in place, and guesses staged to VRAM
    resident_reads: int  # decode blocks found through the full location table, without a lookup
    resident_ram_reads: int  # ... of which read from RAM (the rest from VRAM: staged guesses, the hot set)
    staged_blocks: int  # next-layer guesses copied to VRAM staging rows (decode, every block in RAM)
    stage_hits: int  # routed blocks decode read from staging rows
    hot_hits: int  # routed blocks decode read from the hot set (every block in RAM, a large VRAM cache)
    copied_bytes: int  # expert bytes copied from host RAM into VRAM slots (with bus_read_bytes: the bus)


def resolve_device_dtype(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    if config.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(config.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {config.device} was asked for, but torch sees no CUDA GPU here")
    if config.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = DTYPES[config.dtype]
    return device, dtype


class Engine:
    """A loaded model ready to run conversations.

    Args:
        config: the engine settings; `config.model` is a working directory made by `expertstream setup`.
        control: "none", or a must-break control of the expert bank ("swap-nibbles", "no-experts").
        vram_cache_blocks: VRAM expert cache size instead of what the memory plan leaves (benchmarks).
    """

    def __init__(self, config: EngineConfig, control: str = "none", vram_cache_blocks: int | None = None):
        t0 = time.perf_counter()
        self.workdir = Workdir(config.model)
        # DeepSeek-V4: its own model file and state; its experts (MXFP4) go through the same banks
        self.ds4 = ds4 = self.workdir.manifest["model_type"] == deepseek_v4.MODEL_TYPE
        if ds4:
            try:
                self.args = deepseek_v4.DeepseekV4Args.from_dict(self.workdir.config)
            except ValueError as e:
                raise WorkdirError(f"{self.workdir.path / 'config.json'}: {e}") from e
        else:
            check_config(self.workdir.config, self.workdir.path / "config.json", WorkdirError)
            self.args = ModelArgs.from_dict(self.workdir.text_config)
        limit = self.args.max_position_embeddings
        if limit is not None and config.max_model_len > limit:
            log.info(
                "max_model_len %d clamped to the model's max_position_embeddings %d",
                config.max_model_len,
                self.args.max_position_embeddings,
            )
            config = dataclasses.replace(config, max_model_len=self.args.max_position_embeddings)
        self.config = config
        self.device, self.dtype = resolve_device_dtype(config)
        # the CUDA expert bank (Triton kernels for NVFP4 and MXFP4 blocks) on CUDA unless torch is asked for
        gpu = self.device.type == "cuda" and config.kernels != "torch"
        # qwen4_exp's small ops, FP8 matmuls and guesses: Triton where the expert kernels run, or when asked
        # for (deepseek_v4's small ops are torch; its FP8 matmuls take the same switch, below)
        kernels = (gpu or config.kernels == "triton") and not ds4
        self.plan = self._plan_gpu_memory() if gpu else None
        # sequences a scheduler may run together (each a state from new_state())
        self.max_num_seqs = self.plan.max_num_seqs if self.plan else config.max_num_seqs
        # their attention KV: one pool, each sequence's range growing with its context (models/kv_pool.py)
        pool = self.plan.kv_pool_tokens if self.plan else config.kv_pool_tokens
        pool = pool or self.max_num_seqs * config.max_model_len
        # deepseek_v4's compressed KV is each state's own (models/deepseek_v4.py)
        self.kv_pool = None if ds4 else KVPool(self.args, pool, config.max_model_len, self.dtype, self.device)
        alloc = {}
        if gpu:
            from expertstream.experts.gpu_bank import GpuExperts
            from expertstream.store.reader import pinned_alloc

            alloc = {"alloc": pinned_alloc}
        self.store = ExpertStore(
            self.workdir, int(config.ram_cache_gb * 2**30), io_threads=config.io_threads, **alloc
        )
        if config.preload_experts:
            self._preload()
        # pinned after the store exists: its reader threads keep the process's CPUs
        if config.cpu_affinity is not None:
            if not hasattr(os, "sched_setaffinity"):
                raise ValueError("cpu_affinity needs os.sched_setaffinity (Linux)")
            if self.device.type == "cpu":
                log.warning("cpu_affinity %s also confines torch's CPU compute threads", config.cpu_affinity)
            os.sched_setaffinity(0, parse_cpu_list(config.cpu_affinity))
        speculate = not config.no_speculation
        swiglu_limit = self.args.swiglu_limit if ds4 else None  # V4 clamps its experts' gate and up
        self.cpu_threads = CpuThreads(config.threads)  # after cpu_affinity: it counts those cores
        if gpu:
            k = self.args.num_experts_per_tok
            # vram_cache_blocks overrides the plan's cache (the bench emulates the 48-layer model's share)
            cache = self.plan.vram_cache_blocks if vram_cache_blocks is None else vram_cache_blocks
            n_slots = self.plan.slots // self.workdir.layout.block_bytes + cache

            def make_bank(store):
                copy_rows = k if config.cpu_moe_share else 0  # the CPU share's GPU side copies blocks there
                bank = GpuExperts(
                    self.workdir,
                    store,
                    max(n_slots, 2 * k + copy_rows),
                    self.device,
                    speculate,
                    config.speculation_width,
                    config.stage_guesses,
                    swiglu_limit,
                    copy_rows,
                )
                # a CPU share of RAM-resident decode wraps it (experts/split_bank.py)
                return self._split_bank(bank, config.cpu_moe_share) if config.cpu_moe_share else bank

        else:

            def make_bank(store):
                return StreamedExperts(
                    self.workdir,
                    store,
                    self.dtype,
                    speculate,
                    config.speculation_width,
                    threads=self.cpu_threads,
                    kernels=kernels,
                    swiglu_limit=swiglu_limit,
                )

            if config.stage_guesses > 0:
                log.warning("--stage-guesses ignored: it stages blocks into VRAM for the CUDA expert bank")
            if config.cpu_moe_share:
                log.warning("--cpu-moe-share ignored: without the CUDA bank every expert runs on the CPU")
        # a must-break control wraps the bank (experts/controls.py); the bank itself knows none
        self.bank = controlled(control, self.store, make_bank)
        t1 = time.perf_counter()
        self.bank.warm_up(self.dtype)  # a first prompt must not wait for Triton compiles
        if gpu:
            log.info("expert kernels ready in %.1f s", time.perf_counter() - t1)
        if self.plan:
            piece, span, chunk = self.plan.prefill_piece, self.plan.prefill_span, self.plan.prefill_chunk
        else:
            piece, span, chunk = min(PREFILL_PIECE, config.max_model_len), config.max_model_len, None
        if config.prefill_piece or config.prefill_span:  # overrides: the kernels take a piece at a time
            piece = config.prefill_piece or min(piece, config.prefill_span or piece)
            span, chunk = config.prefill_span or max(span, piece), None
        self.set_prefill(piece, span, chunk)
        self.ple = None
        self.decode = None  # one-token steps through CUDA graphs (runtime/decode_graphs.py)
        self._tokenizer = None
        if ds4:  # eager decode: its model declares no decode stages for the CUDA graphs
            # FP8 matrices as shipped through the block-scaled kernel wherever qwen4_exp's FP8 runs Triton
            self.model = deepseek_v4.engine_model(
                self.workdir,
                self.args,
                self.bank,
                self.dtype,
                self.device,
                gpu or config.kernels == "triton",
                self.plan.fp8 if self.plan else (),
            )
            log.info("loaded %s on %s (%s) in %.1f s", self.workdir.path, self.device, self.dtype,
                     time.perf_counter() - t0)  # fmt: skip
            return
        if self.args.ple_layer_ids:
            if self.workdir.ple is None:
                raise ValueError(
                    f"{self.workdir.path}: the config has PLE layers but the manifest has no PLE table"
                )
            self.ple = PleTable(self.workdir.ple)
        tensors = self.workdir.load_resident(device="cpu")
        fp8 = set(self.workdir.fp8_row_scaled)
        at_load = [n for n in tensors if config.fp8_dense and FP8_DENSE.fullmatch(n)]
        for name in [*(self.plan.fp8 if self.plan else ()), *at_load]:
            if name not in fp8:  # the VRAM plan (or --fp8-dense) moved this BF16 matrix to FP8 rows
                tensors[name], tensors[f"{name}_scale"] = quantize_fp8_rows(tensors[name])
                fp8.add(name)
        # the routers go to the device here so the model's Weights.get (a no-op .to) and the bank share them
        routers = {}
        for layer in range(self.args.num_hidden_layers):
            name = f"layers.{layer}.mlp.gate.weight"
            tensors[name] = routers[layer] = tensors[name].to(self.device, self.dtype)
        self.bank.set_router_weights(routers)
        # the embedding stays in host RAM: one row per token is gathered there
        self.model = Qwen4ExpModel(
            self.args, tensors, self.bank, self.ple, self.dtype, self.device, fp8, kernels
        )
        if self.device.type == "cuda" and not config.enforce_eager:
            from expertstream.runtime.decode_graphs import DecodeGraphs

            self.decode = DecodeGraphs(self.model)
        log.info(
            "loaded %s on %s (%s) in %.1f s",
            self.workdir.path,
            self.device,
            self.dtype,
            time.perf_counter() - t0,
        )

    def _split_bank(self, bank, share: float):
        """The GPU bank with a CPU share of RAM-resident decode (experts/split_bank.py); share < 0 measures
        the bus here for it."""
        from expertstream.experts.split_bank import SplitExperts, split_threads

        bus = stage = None
        if share < 0:  # the bus alone, and the GPU's share as it crosses while splitting
            from expertstream.runtime.probes import pcie_rate, stage_rate

            bus = pcie_rate(64 << 20)
            k = self.workdir.text_config["num_experts_per_tok"]
            stage = stage_rate(self.workdir.layout.block_bytes, k)
            torch.cuda.empty_cache()  # the probes' memory goes back, outside the plan's budget
        # the decode graphs time the tokens the auto share tunes itself by: eager, it keeps the rates' choice
        threads, tune = split_threads(self.cpu_threads), not self.config.enforce_eager
        return SplitExperts(bank, self.workdir, share, threads, bus_gbps=bus, tune=tune, share_gbps=stage)

    def _plan_gpu_memory(self) -> MemoryPlan:
        """Plan VRAM for the budget and enforce it through the caching allocator's per-process limit."""
        c = self.config
        torch.cuda.empty_cache()  # blocks cached by this process but unused count as free
        free, total = torch.cuda.mem_get_info(self.device)
        # live tensors of this process (another engine, a test) are not free but not the budget's either
        held = torch.cuda.memory_reserved(self.device)
        budget = gpu_budget(c.gpu_memory_gb, c.gpu_memory_utilization, free, total)
        act = torch.finfo(self.dtype).bits // 8
        # deepseek_v4's model holds its FP8 as stored and its other float tensors in the activation dtype: the
        # plan gets the budget they leave (a negative surplus, F32 tensors held in BF16, stays margin)
        surplus = 0
        if self.ds4:
            inventory = {n: (i.shape, i.dtype) for n, i in read_header(self.workdir.resident_path).items()}
            surplus = max(0, deepseek_v4.dense_surplus(inventory, act, "embed.weight"))
        plan = self.workdir.memory_plan(
            budget - surplus, c.max_model_len, act, c.max_num_seqs, c.kv_pool_tokens
        )
        # the allocator's limit is per process, so it covers what this process already holds plus the budget
        torch.cuda.set_per_process_memory_fraction(min(1.0, (budget + held) / total), self.device.index or 0)
        log.info("%s", plan.describe())
        return plan

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from expertstream.tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_dir(self.workdir.path)
        return self._tokenizer

    def _preload(self) -> None:
        wd = self.workdir
        blocks = wd.num_layers * wd.num_experts
        if self.store.capacity < blocks:
            log.warning(
                "--preload-experts ignored: the RAM cache holds %d of %d expert blocks (%.1f GiB needed)",
                self.store.capacity, blocks, blocks * self.store.block_bytes / 2**30,
            )  # fmt: skip
            return
        n = self.store.preload((layer, e) for layer in range(wd.num_layers) for e in range(wd.num_experts))
        log.info("reading %d expert blocks (%.1f GiB) into RAM in the background", n,
                 n * self.store.block_bytes / 2**30)  # fmt: skip

    def set_prefill(self, piece: int, span: int, chunk: int | None = None) -> None:
        """Prompts run layer by layer in spans of `span` tokens (each layer's experts once per span), each
        layer's attention in pieces of `piece` tokens, its expert kernels `chunk` tokens at a time (default:
        a piece)."""
        if piece <= 0 or span < piece:
            raise ValueError(f"prefill needs 0 < piece <= span, got piece {piece}, span {span}")
        self.prefill_piece, self.prefill_span = piece, span
        self.bank.set_prefill_chunk(chunk or piece)

    def new_state(self) -> State:
        """An empty conversation; its KV comes from the engine's pool as it grows (deepseek_v4: preallocated
        for max_model_len)."""
        if self.ds4:
            return deepseek_v4.State.new(self.args, self.config.max_model_len)
        return State(self.args, self.config.max_model_len, self.dtype, self.device, self.kv_pool)

    def forward(self, state: State, ids, all_logits: bool = False) -> torch.Tensor:
        """Feed a prompt or one token and advance `state`.

        Args:
            state: the conversation, from `new_state()`.
            ids: token ids (list or 1-D tensor).
            all_logits: return logits of every fed position instead of the last one.

        Returns:
            [V] float32 logits of the last position, or [T, V] with all_logits.
        """
        ids = self._checked_ids(ids)
        state.check_room(ids.numel())
        if ids.numel() == 1 and self.decode is not None:
            logits = self.model.logits(self.decode.step(ids, state))
            return logits if all_logits else logits[0]
        rows, span = [], self.prefill_span
        for i in range(0, ids.numel(), span):
            h = self.model(ids[i : i + span], state, piece=self.prefill_piece)
            rows.append(self.model.logits(h if all_logits else h[-1:]))
        return torch.cat(rows) if all_logits else rows[-1][0]

    def forward_batch(self, items: list[tuple[State, list[int]]]) -> list[torch.Tensor]:
        """`forward` for several sequences at once: items [(state, ids)], each at most one prefill span ->
        [V] logits of each one's last position, the same as `forward` of each alone. Without CUDA-graph
        decode every sequence goes through one layer-major pass (each expert block fetched once per layer for
        all of them); with it, one-token steps keep their graphs and the prompts share a pass."""
        if len(items) == 1:
            return [self.forward(*items[0])]
        out: list[torch.Tensor | None] = [None] * len(items)
        batch = []
        for i, (state, ids) in enumerate(items):
            ids = self._checked_ids(ids)
            if ids.numel() == 1 and self.decode is not None:
                out[i] = self.forward(state, ids)
            elif ids.numel() > self.prefill_span:
                raise ValueError(f"forward_batch takes at most {self.prefill_span} ids a sequence")
            else:
                batch.append((i, ids, state))
        if batch and self.ds4:  # no layer-major batched pass for it: one sequence at a time
            for i, ids, state in batch:
                out[i] = self.forward(state, ids)
        elif batch:
            hs = forward_many(self.model, [(ids, st) for _, ids, st in batch], self.prefill_piece)
            for (i, _, _), h in zip(batch, hs):
                out[i] = self.model.logits(h[-1:])[0]
        return out

    def _checked_ids(self, ids) -> torch.Tensor:
        """Token ids as a 1-D int64 tensor; none, or one outside the vocabulary, is an error."""
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        if ids.numel() == 0:
            raise ValueError("forward needs at least one token id")
        bad = ids[(ids < 0) | (ids >= self.args.vocab_size)]
        if bad.numel():
            raise ValueError(f"token id {int(bad[0])} is outside the vocabulary of {self.args.vocab_size}")
        return ids

    def stats(self) -> EngineStats:
        s, spec = self.store.stats, self.bank.spec.stats if self.bank.spec is not None else SpecStats()
        unused_reads = s.prefetches - s.prefetch_hits
        return EngineStats(
            requests=s.requests,
            hits=s.hits,
            misses=s.misses,
            bytes_read=s.bytes_read,
            read_seconds=s.read_seconds,
            stall_seconds=self.bank.stall_seconds + s.evict_wait_seconds,
            ple_bytes_read=self.ple.bytes_read if self.ple is not None else 0,
            spec_issued=spec.issued,
            spec_used=spec.used,
            spec_wasted_bytes=unused_reads * self.store.block_bytes,
            prefetch_bytes_read=s.prefetches * self.store.block_bytes,
            host_syncs=self.bank.host_syncs,
            **dataclasses.asdict(self.bank.counters()),  # BankCounters' fields are EngineStats' own
        )

    def gpu_memory(self) -> dict[str, int]:
        """VRAM bytes now: what the allocator holds for tensors, what it reserves from the driver, and the
        decode graphs' shared pool (part of the reserved); empty off CUDA."""
        if self.device.type != "cuda":
            return {}
        graphs = self.decode.pool_bytes() if self.decode is not None else 0  # 0 without graphs
        return {
            "allocated": torch.cuda.memory_allocated(self.device),
            "reserved": torch.cuda.memory_reserved(self.device),
            "decode_graphs": graphs,
        }

    def close(self) -> None:
        """Stop the readers and give the VRAM back (weights, slots), so another engine can plan on it."""
        self.bank.close()
        self.store.close()
        if self.ple is not None:
            self.ple.close()
        self.model = self.decode = self.kv_pool = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
