"""The VRAM plan: what lives on the GPU under an enforced budget, and what is left for the expert cache.

Everything is arithmetic on the config, the resident weights' inventory and the expert block size, so it is
unit-tested on the CPU; the engine enforces the result with the allocator's per-process limit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

GiB = 1024**3
MiB = 1024**2

# Largest first: prompt pieces (the tokens one layer's attention, DeltaNet and router take at a time).
PREFILL_PIECES = (4096, 2048, 1024, 512, 256, 128)
# The prefill budget: matrices go FP8 until a piece-major workspace for this many tokens fits, before any are
# kept in BF16; it is then split into a smaller piece and a span (below)
PREFILL_TARGET = 1024
# Prompts run layer by layer in spans: every piece of a span goes through a layer's attention, then the
# layer's experts run once over the whole span, so a prompt fetches each expert once per span. The span's
# streams and MoE rows cost far less per token than a piece's attention workspace, so the plan trades piece
# length (down to this) for span length.
SPAN_MIN_PIECE = 256
# Resident matrices the plan may store FP8 row-scaled, in the order it gives them up (largest savings first).
FP8_CANDIDATES = (
    "linear_attn.in_proj_qkv.weight",
    "linear_attn.in_proj_z.weight",
    "linear_attn.out_proj.weight",
    "self_attn.q_proj.weight",
    "self_attn.o_proj.weight",
    "ple.key_proj.weight",
    "lm_head.weight",
)
# DeepSeek-V4 ships its matrices FP8 already; its BF16 head and compressor projections are the candidates
DS4_FP8_CANDIDATES = ("head.weight", "compressor.wkv.weight", "compressor.wgate.weight")
# Allocator fragmentation and kernel workspaces the per-token accounting cannot see, e.g. an expert
# launch's tile padding: up to 64 rows of h per expert (512 x 64 x 640 BF16 = 40 MiB of the 0.29 GiB).
RESERVE_FRACTION = 0.04
# One token's activations and workspaces (the decode graphs' shared pool holds them once for every sequence,
# runtime/decode_graphs.py; the fused attention kernel reads the KV window in place)
DECODE_ACTIVATIONS = 16 * MiB
# Per sequence: its decode graphs' static outputs in the shared pool (docs/server.md gives the pool measured)
GRAPH_OUTPUTS = 4 * MiB
# Tokens of one block of the shared KV pool (models/kv_pool.py): a sequence's range is whole blocks, and a
# block holds whole indexer blocks (compress ratios divide it)
KV_BLOCK = 256
ELEM_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "U8": 1, "I8": 1, "I64": 8, "I32": 4}


class MemoryPlanError(ValueError):
    pass


@dataclass(slots=True)
class MemoryPlan:
    budget: int
    resident: int
    fp8: list[str]
    embed_on_host: bool
    state: int  # DeltaNet recurrent + conv, PLE context, of one sequence
    kv: int  # attention K/V of the shared pool's kv_pool_tokens
    indexer_keys: int  # indexer keys of the shared pool's kv_pool_tokens
    slots: int  # three banks of K expert slots: this layer, the previous one, and half a prompt pass
    decode_workspace: int  # one token's workspace, held once (graphs of every sequence share one pool)
    seq_workspace: int  # each sequence's own decode memory beside it (its graphs' static outputs)
    prefill_piece: int
    prefill_span: int  # tokens per layer-major span (a multiple of the piece)
    prefill_chunk: int  # tokens per expert-kernel launch in a span (the piece's workspace holds their rows)
    prefill_workspace: int
    reserve: int
    vram_cache_blocks: int
    block_bytes: int
    max_num_seqs: int = 1  # sequences whose state and graphs' outputs the plan holds (at least 1)
    kv_pool_tokens: int = 0  # tokens of KV and indexer keys the sequences share (at least max_model_len)
    notes: list[str] = field(default_factory=list)

    @property
    def seq_bytes(self) -> int:
        """VRAM one more sequence holds for itself: its state and its decode graphs' outputs, and its KV where
        the family has no shared pool (kv_pool_tokens 0)."""
        own = 0 if self.kv_pool_tokens else self.kv + self.indexer_keys
        return self.state + self.seq_workspace + own

    @property
    def vram_cache(self) -> int:
        return self.vram_cache_blocks * self.block_bytes

    def describe(self) -> str:
        rows = [
            (
                "resident weights"
                + (f" ({len(self.fp8)} matrices FP8 row-scaled)" if self.fp8 else " (as stored)"),
                self.resident,
            ),
            ("state, one sequence (DeltaNet, conv, PLE, window)", self.state),
            (
                f"KV pool ({self.kv_pool_tokens:,} tokens, shared by the sequences)"
                if self.kv_pool_tokens
                else "KV cache (of one sequence's context)",
                self.kv,
            ),
            ("indexer keys" + " (of the pool's tokens)" * bool(self.kv_pool_tokens), self.indexer_keys),
            ("expert slots", self.slots),
            ("decode workspace (one token, the graphs' shared pool)", self.decode_workspace),
            (
                f"{self.max_num_seqs - 1} more sequence{'s' * (self.max_num_seqs != 2)} (state, graphs)",
                (self.max_num_seqs - 1) * self.seq_bytes,
            ),
            (
                f"prefill ({self.prefill_span}-token spans, {self.prefill_piece}-token pieces)",
                self.prefill_workspace,
            ),
            ("reserve", self.reserve),
            (f"VRAM expert cache ({self.vram_cache_blocks} experts)", self.vram_cache),
        ]
        lines = [f"VRAM plan for a {self.budget / GiB:.2f} GiB budget:"]
        lines += [f"  {name:<52} {nbytes / GiB:8.3f} GiB" for name, nbytes in rows]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _tensor_bytes(shape: tuple[int, ...], dtype: str) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * ELEM_BYTES[dtype]


def _fp8_bytes(shape: tuple[int, ...]) -> int:
    return shape[0] * shape[1] + 4 * shape[0]  # e4m3 values + one FP32 scale per row


def gpu_budget(gpu_memory_gb: float | None, utilization: float, free: int, total: int) -> int:
    """Bytes the engine may use: `--gpu-memory-utilization` of the GPU's total memory, as in vLLM, or of
    `--gpu-memory-gb` when given. A budget the GPU cannot give (more than is free now) is refused."""
    budget = int((gpu_memory_gb * GiB if gpu_memory_gb else total) * utilization)
    if budget > total:
        raise ValueError(f"--gpu-memory-gb {gpu_memory_gb} exceeds the GPU's {total / GiB:.1f} GiB")
    if budget > free:
        asked = f"--gpu-memory-gb {gpu_memory_gb} x {utilization}" if gpu_memory_gb else (
            f"--gpu-memory-utilization {utilization} of {total / GiB:.1f} GiB")  # fmt: skip
        raise ValueError(
            f"{asked} = {budget / GiB:.1f} GiB, but only {free / GiB:.1f} GiB of the GPU's "
            f"{total / GiB:.1f} GiB are free (other processes hold the rest): lower it"
        )
    return budget


def plan_memory(
    text_config: Mapping,
    resident: Mapping[str, tuple[tuple[int, ...], str]],
    block_bytes: int,
    budget_bytes: int,
    max_model_len: int,
    act_bytes: int = 2,
    max_num_seqs: int = 1,
    kv_pool_tokens: int | None = None,
) -> MemoryPlan:
    """Plan the GPU memory.

    Args:
        text_config: the checkpoint's text_config.
        resident: name -> (shape, safetensors dtype) of every resident tensor (workdir names; FP8 row-scaled
            ones appear as F8_E4M3 plus their `_scale`).
        block_bytes: bytes of one repacked expert block.
        budget_bytes: VRAM the engine may use.
        max_model_len: the context of one sequence; the KV pool holds at least that many tokens.
        act_bytes: bytes per activation element (2 for bf16).
        max_num_seqs: sequences that run together. Each has a fixed-size state of its own (DeltaNet, conv,
            PLE, its decode graphs' outputs); their attention KV and indexer keys come from one shared pool
            that sequences take blocks of as their contexts grow. The first sequence and a pool of
            max_model_len tokens are part of the minimum; the other sequences' states come out of what the
            prefill workspace leaves (a second one out of the prompt span if need be), then the pool grows
            toward max_num_seqs x max_model_len tokens with at most half of what is left (the rest is the
            VRAM cache).
        kv_pool_tokens: the pool's tokens instead (at least max_model_len).

    Returns:
        The plan; raises MemoryPlanError naming the shortfall if even the minimum does not fit.
    """
    c = text_config
    # this module sits below formats and models: the family's terms are chosen by its config's model_type
    t = (_ds4_terms if c.get("model_type") == "deepseek_v4" else _qwen4_exp_terms)(
        c, act_bytes, max_model_len
    )
    h, n_layers, k, hc = c["hidden_size"], c["num_hidden_layers"], c["num_experts_per_tok"], t.hc
    kv_tok, idx_tok = t.kv_per_token, t.indexer_keys_per_token
    state = t.state + t.own_kv + t.own_indexer_keys  # of each sequence, beside the pool
    # KV and indexer keys per pooled token (the pool starts with one whole context), state per sequence
    pool_tok = kv_tok + idx_tok
    pool_min = -(-max_model_len // KV_BLOCK) * KV_BLOCK
    if kv_pool_tokens is not None and kv_pool_tokens < max_model_len:
        raise MemoryPlanError(
            f"a KV pool of {kv_pool_tokens} tokens cannot hold one {max_model_len}-token context"
        )
    pool = pool_min if kv_pool_tokens is None else -(-kv_pool_tokens // KV_BLOCK) * KV_BLOCK
    pool *= pool_tok > 0  # a family without a shared pool keeps each sequence's KV in its state
    # this layer's K and the previous layer's (its kernel may still read them), and K more so that a prompt
    # pass takes 1.5 K experts (passes take half the slots)
    slots = 3 * k * block_bytes
    prefill_ws = t.prefill_ws
    i_moe = c["moe_intermediate_size"]
    # Per token of an expert-kernel launch: its (token, k) pairs' rows of h and of the output. A span's
    # experts run after its attention, so their launches may take the piece's whole workspace
    per_moe_tok = act_bytes * k * (2 * i_moe + h)

    # Per token of a span, held across a layer: the streams (updated in place, one copy), the MoE input, the
    # routed FP32 sums (the bank returns them as they are), the routing; the shared expert, the cast of the
    # routed sums and the injection run piece by piece
    per_span_tok = act_bytes * (hc * h + h) + 4 * h + 16 * k

    embed = resident.get(t.embed)
    weights = {n: v for n, v in resident.items() if n != t.embed}
    # matrices stored FP8 row-scaled (`<name>_scale`); block-scaled FP8 as shipped is not counted
    fp8 = sorted(n for n, (_, dt) in weights.items() if dt == "F8_E4M3" and f"{n}_scale" in weights)
    base = sum(_tensor_bytes(s, d) for s, d in weights.values())
    reserve = int(budget_bytes * RESERVE_FRACTION)
    fixed = state + pool * pool_tok + slots + DECODE_ACTIVATIONS + GRAPH_OUTPUTS + reserve

    def minimum(weight_bytes: int, piece: int = PREFILL_PIECES[-1]) -> int:
        return weight_bytes + fixed + prefill_ws(piece)

    notes: list[str] = []
    # Give up BF16 for the largest matrices, family by family, until a PREFILL_TARGET piece fits (at least
    # the minimum; the smallest piece is the floor when even all-FP8 leaves no more room), and then, when
    # several sequences are asked for, until a second sequence's state fits beside it too (never the LM
    # head for that: concurrency does not buy logits' precision); else a budget that keeps more BF16 could
    # hold one sequence where a smaller one holds two
    seq_bytes = state + GRAPH_OUTPUTS
    second = seq_bytes * (max_num_seqs > 1)
    for suffix in t.fp8_candidates:
        if minimum(base, PREFILL_TARGET) + (second if suffix != t.head else 0) <= budget_bytes:
            break
        for name, (shape, dtype) in weights.items():
            if name.endswith(suffix) and dtype in ("BF16", "F16") and len(shape) == 2:
                base += _fp8_bytes(shape) - _tensor_bytes(shape, dtype)
                fp8.append(name)
    if minimum(base) > budget_bytes:
        raise MemoryPlanError(
            f"a {budget_bytes / GiB:.2f} GiB VRAM budget cannot hold this model with a {max_model_len}-token "
            f"context: it needs at least {minimum(base) / GiB:.2f} GiB (weights {base / GiB:.2f} GiB, state, "
            f"KV and indexer keys {(state + pool * pool_tok) / GiB:.2f} GiB); raise --gpu-memory-gb or lower "
            "--max-model-len"
        )
    left = budget_bytes - base - fixed

    # the largest piece taking at most half of what is left (the rest is the VRAM cache), and at least the
    # largest piece up to PREFILL_TARGET that fits at all
    def affordable(p: int) -> bool:
        return prefill_ws(p) <= left // 2 or (p <= PREFILL_TARGET and prefill_ws(p) <= left)

    budget_piece = max(p for p in PREFILL_PIECES if affordable(p) or p == PREFILL_PIECES[-1])

    # split a workspace into the piece and the span that make the span longest (ties: the longer piece)
    def split(workspace: int) -> tuple[int, int]:
        def span_of(p: int) -> int:
            extra = (workspace - prefill_ws(p)) // per_span_tok
            return max(p, min(max_model_len, p + extra) // p * p)

        fits = [
            p for p in PREFILL_PIECES if SPAN_MIN_PIECE <= p <= budget_piece and prefill_ws(p) <= workspace
        ]
        piece = max(fits or [budget_piece], key=lambda p: (span_of(p), p))
        return piece, span_of(piece)

    workspace = prefill_ws(budget_piece)
    # a second sequence (Open WebUI's title task beside the chat) before a longer span: the span gives up what
    # its state lacks, down to the smallest span piece's own workspace; a prompt longer than the span costs
    # one more sweep of the experts per span
    short = seq_bytes - (left - workspace)
    if max_num_seqs > 1 and short > 0 and workspace - short >= prefill_ws(min(budget_piece, SPAN_MIN_PIECE)):
        alone = split(workspace)[1]
        workspace -= short
        notes.append(
            f"the second sequence's state comes out of the prompt span: {split(workspace)[1]}-token spans "
            f"instead of {alone} (--max-num-seqs 1 keeps them)"
        )
    left -= workspace
    piece, span = split(workspace)
    chunk = min(span, max(piece, prefill_ws(piece) // per_moe_tok // piece * piece))
    workspace_used = prefill_ws(piece) + (span - piece) * per_span_tok
    left += workspace - workspace_used  # what rounding the span left goes to the cache
    seqs = 1 + max(0, min(max_num_seqs - 1, left // seq_bytes))
    left -= (seqs - 1) * seq_bytes
    if seqs < max_num_seqs:
        notes.append(
            f"{seqs} of --max-num-seqs {max_num_seqs} sequences fit ({seq_bytes / GiB:.2f} GiB of state "
            f"each{' beside the shared KV pool' * bool(pool_tok)}); a larger budget holds more"
        )
    if (
        kv_pool_tokens is None and pool_tok
    ):  # the pool grows toward a whole context a sequence, in whole blocks
        more = min((seqs - 1) * pool_min, left // 2 // pool_tok // KV_BLOCK * KV_BLOCK)
        pool += more
        left -= more * pool_tok
    if pool_tok and seqs > 1 and pool < seqs * max_model_len:
        notes.append(
            f"the {seqs} sequences share a KV pool of {pool:,} tokens: one reaches the whole "
            f"{max_model_len}-token context; while the pool is full, a sequence waits for room (its KV "
            "goes to host RAM and comes back), streaming and earlier requests first"
        )
    if span < max_model_len:  # a longer prompt fetches each expert once per span
        notes.append(
            f"prompts run layer by layer in {span}-token spans ({piece}-token pieces) and each span fetches "
            f"its experts once per layer: a {max_model_len}-token prompt moves ~{-(-max_model_len // span)}x "
            "the expert bytes of one pass; a shorter --max-model-len leaves room for longer spans"
        )
    # more cache rows than the model has experts would hold nothing (a small model on a large GPU)
    cache_blocks = min(max(0, left // block_bytes), n_layers * t.num_experts)
    if cache_blocks < left // block_bytes:
        notes.append(
            f"every expert fits in the VRAM cache; {(left - cache_blocks * block_bytes) / GiB:.2f} GiB of "
            "the budget stay unallocated"
        )
    if embed is not None:
        embed_gib = _tensor_bytes(*embed) / GiB
        notes.append(f"token embedding ({embed_gib:.2f} GiB) stays in host RAM; rows gathered per step")
    return MemoryPlan(
        budget=budget_bytes,
        resident=base,
        fp8=sorted(fp8),
        embed_on_host=embed is not None,
        state=t.state,
        kv=pool * kv_tok + t.own_kv,
        indexer_keys=pool * idx_tok + t.own_indexer_keys,
        slots=slots,
        decode_workspace=DECODE_ACTIVATIONS + GRAPH_OUTPUTS,
        seq_workspace=GRAPH_OUTPUTS,
        prefill_piece=piece,
        prefill_span=span,
        prefill_chunk=chunk,
        prefill_workspace=workspace_used,
        reserve=reserve,
        vram_cache_blocks=cache_blocks,
        block_bytes=block_bytes,
        max_num_seqs=seqs,
        kv_pool_tokens=pool,
        notes=notes,
    )


def stage_guesses_for(requested: int, k: int, n_slots: int) -> int:
    """Guesses staged per layer for --stage-guesses `requested` with n_slots expert slots (staging rows for
    two layers come out of them). Auto (-1): at most K / 2 (4 and 5 of K = 10 paid on the H200,
    docs/runtime.md), from slots beyond the memory plan's three banks of K only, so that prompt passes keep
    their 1.5 K experts; an explicit count needs two layers' K slots left beside its rows, else 0."""
    g = min(k // 2, (n_slots - 3 * k) // 2) if requested < 0 else requested
    g = max(0, g)
    return g if n_slots - 2 * g >= 2 * k else 0


def bank_slots(
    requested: int, k: int, n_slots: int, speculation_width: float, num_experts: int, num_layers: int
) -> tuple[int, int, int]:
    """How a decode bank uses its n_slots VRAM slots: (G guesses staged a layer, experts per prompt pass and
    hot blocks a layer once every block sits in RAM). G is `stage_guesses_for`, no more than the bank
    guesses (speculation_width x K; 0 without speculation); two layers' G staging rows come off the top, and
    `hot_split` shares the cache slots left."""
    g = min(stage_guesses_for(requested, k, n_slots), round(speculation_width * k))
    return (g, *hot_split(n_slots - 2 * g, num_experts, k, num_layers))


def hot_split(n_slots: int, num_experts: int, k: int, num_layers: int) -> tuple[int, int]:
    """(experts per prompt pass, hot blocks per layer) of a bank whose every block sits in the RAM cache, with
    n_slots VRAM cache slots. Its prompt passes take half the slots, at most two layers' experts and at
    least 1.5 K a pass (what the memory plan's three banks give); the rest is split evenly over the layers
    as a hot set. None left for a layer: no hot set, and passes of half the slots as before."""
    p = min(num_experts, max(-(-3 * k // 2), n_slots // 4))
    q = (n_slots - 2 * p) // num_layers
    return (p, q) if q > 0 else (max(1, n_slots // 2), 0)


@dataclass(frozen=True, slots=True)
class ModelTerms:
    """What a family's config costs beside its weights: per-sequence state, KV and indexer keys for the
    context, the widest activations per prompt token, and the names the plan treats specially."""

    state: int  # of one sequence
    kv_per_token: int  # attention K/V per token of the shared pool (0: each sequence's KV is its own)
    indexer_keys_per_token: int
    own_kv: int  # K/V and indexer keys each sequence holds for the whole context outside the pool
    own_indexer_keys: int
    per_token: int  # activation bytes per prompt token at the widest point of a layer
    scores_per_token: int  # mask and score bytes per prompt token over the visible context
    hc: int  # residual streams
    num_experts: int
    embed: str  # the token embedding's resident name (kept in host RAM)
    head: str  # the LM head's resident name (never FP8 to make room for more sequences)
    fp8_candidates: tuple[str, ...]

    def prefill_ws(self, piece: int) -> int:
        return piece * (self.per_token + self.scores_per_token)


def _qwen4_exp_terms(c: Mapping, act_bytes: int, max_model_len: int) -> ModelTerms:
    h, n_layers = c["hidden_size"], c["num_hidden_layers"]
    # without layer_types every full_attention_interval-th layer (4 by default) is indexed, as in transformers
    # (formats/text_config.layer_types; this module sits below formats)
    types = c.get("layer_types")
    n_attn = (
        sum(t != "linear_attention" for t in types)
        if types
        else n_layers // c.get("full_attention_interval", 4)
    )
    n_lin = n_layers - n_attn
    k = c["num_experts_per_tok"]
    hc = c.get("hc_count", 1)

    # KV and indexer keys per token (of the shared pool), state for one sequence
    kv = n_attn * 2 * c["num_key_value_heads"] * c["head_dim"] * act_bytes
    idx = n_attn * (c.get("indexer_kv_heads") or 0) * (c.get("indexer_head_dim") or 0) * act_bytes
    kd, vd = (
        c["linear_num_key_heads"] * c["linear_key_head_dim"],
        c["linear_num_value_heads"] * c["linear_value_head_dim"],
    )
    conv_ch = 2 * kd + vd
    state = n_lin * (c["linear_num_value_heads"] * c["linear_key_head_dim"] * c["linear_value_head_dim"] * 4)
    state += n_lin * (c["linear_conv_kernel_dim"] - 1) * conv_ch * act_bytes
    if c.get("ple_layer_ids"):
        ple_rows = (c.get("ple_conv_kernel_size", 4) - 1) * c.get("ngram_size", 3)
        state += len(c["ple_layer_ids"]) * ple_rows * hc * h * act_bytes
    # Activation bytes per prompt token at the widest point of a layer, plus the attention mask/score terms.
    i_moe = c["moe_intermediate_size"]
    per_tok = (
        act_bytes
        * (3 * hc * h + conv_ch + vd + 2 * c["num_attention_heads"] * c["head_dim"] + k * (2 * i_moe + h))
        + 4 * c["linear_num_value_heads"] * 64
    )  # FP32 chunk state terms of the chunked DeltaNet
    # bool selection mask over the visible keys, FP32 indexer scores over the compressed blocks
    scores = max_model_len + (max_model_len // max(1, c.get("indexer_compress_ratio") or 1)) * 4
    names = ("embed_tokens.weight", "lm_head.weight", FP8_CANDIDATES)
    return ModelTerms(state, kv, idx, 0, 0, per_tok, scores, hc, c["num_experts"], *names)


def _ds4_terms(c: Mapping, act_bytes: int, max_model_len: int) -> ModelTerms:
    """DeepSeek-V4 (docs/deepseek-v4.md): one shared K=V head; a sliding window of keys per layer; CSA layers
    keep one entry (head_dim) and one indexer key per 4 tokens, HCA layers one entry per 128."""
    h, d, hc, k = c["hidden_size"], c["head_dim"], c["hc_mult"], c["num_experts_per_tok"]
    ratios = c["compress_ratios"][: c["num_hidden_layers"]]
    csa, hca = ratios.count(4), ratios.count(128)
    kv = (csa * -(-max_model_len // 4) + hca * -(-max_model_len // 128)) * d * act_bytes
    idx = csa * -(-max_model_len // 4) * c["index_head_dim"] * act_bytes
    # the sliding window's keys and each compressor's open window (two for CSA, kv and gate, FP32)
    state = len(ratios) * c["sliding_window"] * d * act_bytes
    state += (csa * 2 * 4 * (2 * d + 2 * c["index_head_dim"]) + hca * 128 * 2 * d) * 4
    nh, i_moe = c["num_attention_heads"], c["moe_intermediate_size"]
    per_tok = act_bytes * (3 * hc * h + c["q_lora_rank"] + 2 * nh * d + k * (2 * i_moe + h))
    # FP32 attention scores per head over the window and the indexer's top-k, the indexer's scores
    scores = 4 * nh * (c["sliding_window"] + c["index_topk"]) + 4 * -(-max_model_len // 4)
    # its compressed KV is the sequence's own, preallocated for the context (models/deepseek_v4.py): no pool
    names = ("embed.weight", "head.weight", DS4_FP8_CANDIDATES)
    return ModelTerms(state, 0, 0, kv, idx, per_tok, scores, hc, c["n_routed_experts"], *names)
