"""`expertstream bench kernels`: kernel time against the HBM bandwidth and BF16 tensor-core rate measured in
the same run.

Real dims: H 2560, I 640, k 10 of 512 experts, one block 2,764,800 B of codes and scales. Decode and the
FP8 matrices run microseconds per call, so they are timed as the engine runs them: ROTATE calls captured in
one CUDA graph (`graph_ms`), each on other blocks or weight copies so that they read HBM, not L2; one eager
decode row shows what Python's launches add. Prefill: one call per graph (its pairs sorted before the
capture), and one engine pass. Staging: triton.testing.do_bench (median, L2 cleared before every call).
Roofline time = max(bytes / bandwidth, FLOP / tensor-core rate); efficiency = roofline time / measured.
Read floor: the decode and FP8 rows' weight bytes read alone (`stream_read`, 4 KiB pieces) in the same
harness: what the memory takes at that size, launch and tail included, beside what the kernel takes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

HIDDEN, INTER, TOPK, EXPERTS = 2560, 640, 10, 512
FP8_SHAPES = ((10240, 2560), (6144, 2560), (2560, 6144))  # in_proj_qkv, in_proj_z, out_proj
FP8_M = (1, 4, 64)
# the model's in_proj: the qkv and z rows, both FP8, are one GEMV
FP8_IN_PROJ = (FP8_SHAPES[0][0] + FP8_SHAPES[1][0], FP8_SHAPES[0][1])
# the other FP8 shapes of the real model's 8 GiB plan that the sweep tunes: the attention q_proj with its
# output gate (2 x 24 heads x 256); o_proj and the PLE key projection share the DeltaNet shapes
FP8_MODEL_SHAPES = (*FP8_SHAPES, FP8_IN_PROJ, (2 * 24 * 256, HIDDEN))
PREFILL_T = (32, 512, 2451, 8192)
PREFILL_HOST_T = 2451  # a prompt whose tiles read each block about once: the case for reading RAM in place
GDN_HEADS = (16, 48, 128, 128)  # key heads, value heads, Dk, Dv
HC_STREAMS, HC_LOWRANK = 4, 320  # hyper-connection streams and low rank
# a decode layer's BF16 matrices, read by cuBLAS at M = 1 in the model: the hyper-connection projection (low
# rank and injection) and its up projection (each twice a layer), in_proj's b and a rows, the router gate,
# the shared expert's gate and up (with its own gate row) and its down projection
BF16_SHAPES = (
    (HC_LOWRANK + HC_STREAMS, HC_STREAMS * HIDDEN), (HC_STREAMS * HIDDEN, HC_LOWRANK),
    (2 * GDN_HEADS[1], HIDDEN), (EXPERTS, HIDDEN), (2 * INTER + 1, HIDDEN), (HIDDEN, INTER),
)  # fmt: skip


@dataclass(slots=True)
class Row:
    kernel: str
    shape: str
    us: float  # median microseconds per call
    gbps: float  # bytes the kernel must move / time, GB/s
    tflops: float
    pct_hbm: float  # of the measured copy bandwidth
    pct_roofline: float
    goal: str
    floor_us: float | None = None  # the same weight bytes read alone (stream_read), same harness


def measure_ceilings(do_bench) -> tuple[float, float]:
    """(copy bandwidth GB/s counting read + write, dense BF16 matmul TFLOP/s), measured now."""
    import torch

    src = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    bw = 2 * src.numel() / do_bench(lambda: dst.copy_(src)) / 1e6
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    tf = 2 * 8192**3 / do_bench(lambda: a @ b) / 1e9
    return bw, tf


def graph_ms(calls: list, reps: int = 20) -> float:
    """Median ms per call of `calls` captured in one CUDA graph and replayed: GPU time without Python's
    launch cost, as the engine replays decode. Callers give each call other inputs (routes, weight
    copies) so that together they overflow L2 and every call reads HBM (or host RAM)."""
    import statistics

    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) / len(calls)


def launch_us(calls: list) -> dict[str, float]:
    """Each kernel's us per call (by name, largest first) in one replay of `calls` captured as one CUDA
    graph, from a torch.profiler trace: which launch of a call takes the time."""
    import torch

    for c in calls:  # compiled and warm outside the capture
        c()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    per: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name] = per.get(ev.name, 0.0) + ev.device_time / len(calls)
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def random_bank(num: int, seed: int = 0, layout=None):
    """(layout, num random blocks, their ws2): every code; NVFP4 scales (the default layout, the real dims)
    positive around 2^-2, subnormals included; MXFP4 scales 2^-9 .. 2^-5."""
    import torch

    from expertstream.formats.expert_block import ExpertLayout

    layout = layout or ExpertLayout.for_dims(HIDDEN, INTER)
    g = torch.Generator(device="cuda").manual_seed(seed)
    slots = torch.randint(0, 256, (num, layout.block_bytes), dtype=torch.uint8, device="cuda", generator=g)
    scale_bytes = {"float8_e4m3fn": (0, 0x38), "float8_e8m0fnu": (118, 123)}  # E4M3: 0, subnormals, < 1
    for p in layout.parts:
        if p.dtype in scale_bytes:
            slots[:, p.offset : p.offset + p.nbytes] = torch.randint(
                *scale_bytes[p.dtype], (num, p.nbytes), dtype=torch.uint8, device="cuda", generator=g
            )
    ws2 = torch.full((num, 3), 0.02, device="cuda")
    return layout, slots, ws2


ROTATE = 16  # calls per timed graph, each on other blocks or weights: 16 x 27.6 MB is well past L2


def decode_calls(layout, slots, ws2, place: str, config: dict | None = None, decode=None) -> list:
    """ROTATE decode calls (k = TOPK), each on another random route, with the routed blocks in VRAM slots
    (place "vram") or in pinned host RAM read over the bus ("host"); `decode`: the launcher (default
    nvfp4_moe_decode)."""
    import torch

    from expertstream.kernels import nvfp4_moe_decode

    decode = decode or nvfp4_moe_decode

    ids, w = route(ROTATE)
    x = torch.randn(HIDDEN, dtype=torch.bfloat16, device="cuda")
    if place == "vram":
        loc = torch.arange(EXPERTS, dtype=torch.int32, device="cuda")  # expert i in slot i
        return [lambda r=r: decode(x, ids[r], loc, ws2, w[r], layout, slots, config=config)
                for r in range(ROTATE)]  # fmt: skip
    host = slots[ids.reshape(-1)].cpu().pin_memory()  # route r's blocks in rows r K .. r K + K - 1
    locs = torch.zeros(ROTATE, EXPERTS, dtype=torch.int32, device="cuda")
    rows = torch.arange(ROTATE * TOPK, dtype=torch.int32, device="cuda").view(ROTATE, TOPK)
    locs.scatter_(1, ids, -1 - rows)
    return [lambda r=r: decode(x, ids[r], locs[r], ws2, w[r], layout, slots, host, config=config)
            for r in range(ROTATE)]  # fmt: skip


PASS_TOKENS, PASS_EXPERTS = 2560, 15  # the real 8 GiB plan's prefill span, and half its 30 slots


def _prompt(layout, experts: int, tokens: int, seed: int, dev):
    """A random prompt's routing (ids [T, K], weights [T, K]) and activations [T, H] (bf16 on CUDA)."""
    import torch

    ids, w = route(tokens, experts, seed=seed, device=dev)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    return ids, w, torch.randn(tokens, layout.hidden_size, dtype=dtype, device=dev)


def pass_calls(
    layout,
    slots,
    ws2,
    n: int = 4,
    tokens: int = PASS_TOKENS,
    group: int = PASS_EXPERTS,
    launch: dict | None = None,
):
    """n prefill passes as the engine runs them (experts/gpu_prefill.py): one `tokens`-token span's pairs
    sorted by expert once, each pass mapping the next `group` of its experts to their slots (expert e in
    slot e; the rest map to -1), launching over those experts' tiles and adding their rows into the FP32
    token sums; 4 x 15 real blocks are past L2. Returns (calls, the span's routed ids [tokens, K], the sums
    [tokens, H] they fill); launch: the kernels' block_n, block_k, num_warps, num_stages (default: the
    order's)."""
    import torch

    from expertstream.kernels.nvfp4_moe import (
        combine_rows,
        nvfp4_moe_prefill_rows,
        order_pairs,
        prefill_buffers,
        tile_starts,
    )

    experts, dev = slots.shape[0], slots.device
    ids, w, x = _prompt(layout, experts, tokens, 1, dev)
    counts = torch.bincount(ids.reshape(-1), minlength=experts).tolist()
    touched = [e for e, c in enumerate(counts) if c]
    order = order_pairs(ids, experts, layout, distinct=len(touched))
    bm = order.config["block_m"]
    starts = tile_starts(counts, bm)
    passes = []
    for i in range(n):
        members = touched[i * group : (i + 1) * group]
        e2s = torch.full((experts,), -1, dtype=torch.int32, device=dev)
        e2s[members] = torch.tensor(members, dtype=torch.int32, device=dev)
        passes.append((e2s, (starts[members[0]], starts[members[-1] + 1])))
    y, work = prefill_buffers(x, layout, max(b - a for _, (a, b) in passes) * bm)
    total = torch.zeros(tokens, layout.hidden_size, dtype=torch.float32, device=dev)

    def one(e2s, tiles, first):
        nvfp4_moe_prefill_rows(x, slots, e2s, ws2, w, layout, order, tiles, y, work, launch=launch)
        combine_rows(y, order, e2s, tiles, total, accumulate=not first)

    calls = [lambda i=i, p=p: one(*p, i == 0) for i, p in enumerate(passes)]
    return calls, ids, total


def prefill_calls(layout, slots, ws2, tokens: int, config: dict | None = None, device=None):
    """One `nvfp4_moe_prefill` over a `tokens`-token prompt (expert e in slot e) in `config` (default: the
    launcher's pick) with its pairs sorted beforehand: what a CUDA graph can capture (the sort writes a host
    scalar into a device tensor). `device`: where the prompt lives when the slots are pinned host RAM.
    Returns ([call], the prompt's routed ids [tokens, K])."""
    import torch

    from expertstream.kernels import nvfp4_moe_prefill
    from expertstream.kernels.nvfp4_moe import order_pairs

    experts, dev = slots.shape[0], torch.device(device) if device else slots.device
    ids, w, x = _prompt(layout, experts, tokens, tokens, dev)
    e2s = torch.arange(experts, dtype=torch.int32, device=dev)
    order = order_pairs(ids, experts, layout, config=config)
    return [lambda: nvfp4_moe_prefill(x, slots, ids, e2s, ws2, w, layout, order=order)], ids


def fp8_weights(n: int, k: int, copies: int = 8) -> list:
    """`copies` random [n, k] E4M3 weights on the GPU (8 x 26 MB, for the largest DeltaNet matrix, is past
    L2)."""
    import torch

    return [torch.randint(0, 0x7F, (n, k), dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
            for _ in range(copies)]  # fmt: skip


def fp8_calls(
    n: int, k: int, m: int, config: dict | None = None, copies: int = 8, weights: list | None = None
) -> list:
    """fp8_rows_matmul calls of [m, k] x [n, k]^T, each on its own copy of the weight (`weights`, else
    `copies` new ones from fp8_weights)."""
    import torch

    from expertstream.kernels import fp8_rows_matmul

    qs = weights or fp8_weights(n, k, copies)
    scale = torch.rand(n, device="cuda")
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    return [lambda q=q: fp8_rows_matmul(x, q, scale, config=config) for q in qs]


def matvec16_calls(n: int, k: int, config: dict | None = None, cublas: bool = False) -> list:
    """One-token calls of x [1, k] @ w^T for BF16 w [n, k], by `matvec16` (alone: no dependent launch) or by
    torch's F.linear (cuBLAS), each on its own copy of w: at least 8 and 64 MB of them, past L2."""
    import torch
    import torch.nn.functional as F

    from expertstream.kernels import matvec16
    from expertstream.kernels.codec import cdiv
    from expertstream.kernels.fp8_gemv import matvec16_config

    copies = max(8, cdiv(64 << 20, 2 * n * k))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    if cublas:
        return [lambda w=w: F.linear(x, w) for w in ws]
    cfg = {**(config or matvec16_config(n, k, x.device)), "pdl": False}
    return [lambda w=w: matvec16(x, w, config=cfg) for w in ws]


def route(t: int, num_experts: int = EXPERTS, k: int = TOPK, seed: int = 0, device="cuda"):
    """Random top-k routing: ids [t, k] int64 (distinct per token), weights [t, k] fp32 summing to 1."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    probs, ids = torch.rand(t, num_experts, device=device, generator=g).topk(k, dim=1)
    return ids, probs / probs.sum(dim=1, keepdim=True)


def _row(kernel, shape, ms, nbytes, flop, bw, tf, goal, floor_ms: float | None = None) -> Row:
    roof = max(nbytes / (bw * 1e6), flop / (tf * 1e9))  # ms
    return Row(kernel, shape, ms * 1e3, nbytes / ms / 1e6, flop / ms / 1e9, 100 * nbytes / ms / 1e6 / bw,
               100 * roof / ms, goal, None if floor_ms is None else floor_ms * 1e3)  # fmt: skip


def read_floor_calls(rows_of_calls: list, nbytes: int) -> list:
    """stream_read calls reading, for each (rows [R, B] uint8, ids [n]) pair, nbytes of each listed row:
    the floor under calls that read those bytes."""
    from expertstream.kernels.stream_read import stream_read

    return [lambda r=r, i=i: stream_read(r, i, nbytes) for r, i in rows_of_calls]


def run_benchmarks() -> tuple[list[Row], dict]:
    import torch
    import triton.testing

    def do_bench(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")

    bw, tf = measure_ceilings(do_bench)
    pinned = torch.empty(2**28, dtype=torch.uint8).pin_memory()
    h2d = pinned.numel() / do_bench(lambda: pinned.to("cuda", non_blocking=True)) / 1e6
    rows: list[Row] = []
    layout, slots, ws2 = random_bank(EXPERTS)
    payload = layout.payload_bytes
    flop_per_pair = 2 * 3 * HIDDEN * INTER

    nbytes = TOPK * (payload + 12) + 2 * 2 * HIDDEN  # blocks, ws2, x in and y out
    for place, label in (("vram", f"k={TOPK}"), ("host", f"k={TOPK}, in host RAM")):
        calls = decode_calls(layout, slots, ws2, place)
        ms, floor = graph_ms(calls), None
        if place == "vram":  # the routed blocks of decode_calls' routes (expert i in slot i), read alone
            goal = ">= 50% HBM"
            floor = graph_ms(read_floor_calls([(slots, ids) for ids in route(ROTATE)[0]], payload))
        else:  # the engine's RAM-cache path: blocks read over the bus
            goal = f"{100 * nbytes / ms / 1e6 / h2d:.0f}% of H2D copy ({h2d:.1f} GB/s)"
        rows.append(_row("nvfp4_moe_decode", label, ms, nbytes, TOPK * flop_per_pair, bw, tf, goal, floor))
    # the same VRAM call launched from Python one at a time (do_bench): what launch overhead adds
    ms = do_bench(decode_calls(layout, slots, ws2, "vram")[0])
    rows.append(_row("nvfp4_moe_decode", f"k={TOPK}, eager", ms, nbytes, TOPK * flop_per_pair, bw, tf, "-"))
    ids, w = route(1)
    host = slots[ids[0]].cpu().pin_memory()
    host_loc = torch.full((EXPERTS,), 0, dtype=torch.int32, device="cuda")
    host_loc[ids[0]] = -1 - torch.arange(TOPK, dtype=torch.int32, device="cuda")
    # staging 4 guessed blocks from pinned host RAM into VRAM rows (decode's side stream, --stage-guesses)
    from expertstream.kernels.stage_blocks import stage_blocks

    guess, out_loc = ids[0][:4].contiguous(), torch.empty_like(host_loc)
    rows_to = torch.empty(4, layout.block_bytes, dtype=torch.uint8, device="cuda")
    ms = do_bench(lambda: stage_blocks(guess, host_loc, host, rows_to, 0, out_loc))
    staged = 4 * layout.block_bytes
    bus = f"{100 * staged / ms / 1e6 / h2d:.0f}% of H2D copy ({h2d:.1f} GB/s)"
    rows.append(_row("stage_blocks", "G=4, host RAM -> VRAM", ms, 2 * staged, 0, bw, tf, bus))

    for t in PREFILL_T:  # the kernels of one call, graph-timed (the launcher's pair sort is not timed)
        calls, ids = prefill_calls(layout, slots, ws2, t)
        ms = graph_ms(calls, reps=10)
        touched = int(torch.unique(ids).numel())
        nbytes = touched * payload + 2 * 2 * t * HIDDEN
        goal = ">= 50% roofline" if t >= 512 else "-"
        rows.append(_row("nvfp4_moe_prefill", f"T={t}", ms, nbytes, t * TOPK * flop_per_pair, bw, tf, goal))
    # the same prompt with every block in pinned host RAM, read over the bus in place (no copy)
    t = PREFILL_HOST_T
    calls, ids = prefill_calls(layout, slots.cpu().pin_memory(), ws2, t, device="cuda")
    ms = graph_ms(calls, reps=5)
    nbytes = int(torch.unique(ids).numel()) * payload
    bus = f"{100 * nbytes / ms / 1e6 / h2d:.0f}% of H2D copy ({h2d:.1f} GB/s)"
    flop = t * TOPK * flop_per_pair
    rows.append(_row("nvfp4_moe_prefill", f"T={t}, in host RAM", ms, nbytes, flop, bw, tf, bus))
    # one pass of the engine's prefill: a span's pairs sorted once, PASS_EXPERTS of its experts with a slot
    ms, nbytes = graph_ms(pass_calls(layout, slots, ws2)[0]), PASS_EXPERTS * payload
    pairs = PASS_TOKENS * TOPK * PASS_EXPERTS / EXPERTS  # the pass's share of the pairs, on average
    shape = f"T={PASS_TOKENS}, {PASS_EXPERTS} of {EXPERTS} experts (a pass)"
    rows.append(_row("prefill pass (rows + combine)", shape, ms, nbytes, pairs * flop_per_pair, bw, tf, "-"))

    from expertstream.kernels.fp8_gemv import fp8_config

    first = torch.zeros(1, dtype=torch.int64, device="cuda")
    for n, k in FP8_SHAPES:
        qs = fp8_weights(n, k)
        floor = graph_ms(read_floor_calls([(q.view(torch.uint8).view(1, -1), first) for q in qs], n * k))
        for m in FP8_M:
            # M = 1 alone: no dependent launch, whose weight prefetch would overlap the call before (the
            # model's sequences below show what it gains there)
            cfg = {**fp8_config(1, n, k, torch.device("cuda")), "pdl": False} if m == 1 else None
            ms = graph_ms(fp8_calls(n, k, m, cfg, weights=qs))
            nbytes = n * k + 4 * n + 2 * m * (k + n)
            goal = ">= 70% HBM" if m == 1 else "-"
            shape = f"M={m} N={n} K={k}"
            rows.append(_row("fp8_rows_matmul", shape, ms, nbytes, 2 * m * n * k, bw, tf, goal, floor))
    # one GatedDeltaNet decode step, real heads: the kernel against its torch twin (~33 launches)
    from expertstream.kernels import gdn_step, gdn_step_ref

    for name, fn in (("gdn_step", gdn_step), ("gdn_step_ref (torch)", gdn_step_ref)):
        run, states = gdn_layers(fn)  # graph-timed, each call on its own layer's state
        nbytes = 2 * states[0].nbytes  # the FP32 state read and written
        calls = [lambda s=s, f=run: f(s) for s in states]
        rows.append(_row(name, "Hv=48 Dk=Dv=128", graph_ms(calls), nbytes, 0, bw, tf, "-"))
    # the model's two GEMVs after the kernels before them, which let them start early: their weights stream
    # into L2 while those run (as shipped), or only after (alone)
    for name, shape, make in sequences():
        for label, pdl in ((" (PDL)", True), (", alone", False)):
            calls, nbytes = make({"pdl": pdl})
            rows.append(_row(name + label, shape, graph_ms(calls), nbytes, 0, bw, tf, "-"))
    # a decode layer's BF16 matrices at M = 1: cuBLAS, as the model runs them, and matvec16 (alone)
    for n, k in BF16_SHAPES:
        nbytes = 2 * n * k + 2 * (n + k)
        for name, cublas in (("F.linear (cuBLAS)", True), ("matvec16", False)):
            ms = graph_ms(matvec16_calls(n, k, cublas=cublas))
            rows.append(_row(name, f"M=1 N={n} K={k}", ms, nbytes, 2 * n * k, bw, tf, "-"))
    device = {"name": torch.cuda.get_device_name(), "copy_gbps": bw, "bf16_tflops": tf}
    return rows, device


def sequences() -> list:
    """(name, shape, make) of the model's kernel pairs that end in an FP8 GEMV: make(config overrides) ->
    (calls, bytes a call must move), each call on its own weights and state (as the layers are)."""
    import torch

    from expertstream.kernels import fp8_rows_matmul, gdn_step
    from expertstream.kernels.fp8_gemv import fp8_config
    from expertstream.kernels.hyper import hc_mix

    def gemv_after(first, n: int, k: int, inputs: list, extra: int):
        qs, scale = fp8_weights(n, k), torch.rand(n, device="cuda")

        def make(over: dict):
            cfg = {**fp8_config(1, n, k, torch.device("cuda")), **over}
            calls = [lambda q=q, i=i: fp8_rows_matmul(first(i)[None], q, scale, config=cfg)
                     for q, i in zip(qs, inputs)]  # fmt: skip
            return calls, n * k + 4 * n + extra

        return make

    n, k = FP8_SHAPES[2]  # out_proj after gdn_step, each layer its own state
    gdn, states = gdn_layers(gdn_step)
    shape = f"Hv={GDN_HEADS[1]}, N={n} K={k}"
    out = [("gdn_step -> out_proj", shape, gemv_after(gdn, n, k, states, 2 * states[0].nbytes))]
    n, k = FP8_IN_PROJ
    streams = [torch.randn(2, HC_STREAMS * k, dtype=torch.bfloat16, device="cuda") for _ in range(8)]

    def mix(s):
        return hc_mix(s[0:1], s[1:2], None, HC_STREAMS)[0][0]

    shape = f"{HC_STREAMS} streams, N={n} K={k}"
    out.append(("hc_mix -> in_proj", shape, gemv_after(mix, n, k, streams, streams[0].nbytes)))
    return out


def gdn_layers(fn, layers: int = 8) -> tuple:
    """(run, states): run(state) is the GatedDeltaNet decode step `fn` (gdn_step or its twin) on one token's
    real-size inputs and a layer's FP32 state; `layers` such states, each layer its own as in the model."""
    step = gdn_inputs()

    def run(state):
        return fn(*step[:4], state, *step[5:], num_k_heads=GDN_HEADS[0], eps=1e-6, gate="silu")

    return run, [gdn_inputs(seed)[4] for seed in range(layers)]


def gdn_inputs(seed: int = 0) -> tuple:
    """Random inputs of one GatedDeltaNet decode step at the real head counts (bf16, state FP32, on CUDA)."""
    import torch

    hk, hv, dk, dv = GDN_HEADS
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", generator=g).to(dtype)

    f32 = torch.float32
    qkv, b, a, z = r(2 * hk * dk + hv * dv, dtype=f32), r(hv), r(hv), r(hv * dv)
    state, neg_a = 0.1 * r(hv, dk, dv, dtype=f32), -r(hv, dtype=f32).exp()
    return qkv, b, a, z, state, neg_a, r(hv), r(dv)


def table(rows: list[Row], device: dict) -> str:
    head = (
        f"Measured ceilings: copy {device['copy_gbps']:.0f} GB/s, "
        f"dense BF16 matmul {device['bf16_tflops']:.0f} TFLOP/s.\n\n"
        "| kernel | shape | us/call | GB/s | % HBM | TFLOP/s | % roofline | read floor us | goal |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---|\n"
    )
    body = "".join(
        f"| {r.kernel} | {r.shape} | {r.us:.1f} | {r.gbps:.0f} | {r.pct_hbm:.0f} | {r.tflops:.1f} | "
        f"{r.pct_roofline:.0f} | {'-' if r.floor_us is None else f'{r.floor_us:.1f}'} | {r.goal} |\n"
        for r in rows
    )
    return head + body


def run(args) -> int:
    import json
    import os

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench kernels needs a CUDA GPU")
    if args.tune:  # this GPU's picks first, so that the table below runs with them
        from expertstream.kernels.codec import forget_tuned, user_tuned_path

        path = user_tuned_path()
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        print(f"sweeping launch shapes on {torch.cuda.get_device_name()} (a few minutes)", flush=True)
        from expertstream.bench.sweep import SWEPT, sweep_configs

        sweep_configs(path, SWEPT)
        forget_tuned()
        print(f"recorded the picks in {path}; the engine reads them from there", flush=True)
    rows, device = run_benchmarks()
    if args.json:
        print(json.dumps({"device": device, "rows": [asdict(r) for r in rows]}, indent=1))
    else:
        print(table(rows, device))
    if args.out:
        from expertstream.bench.cli import append_markdown

        append_markdown(args.out, "Kernels", device["name"], table(rows, device))
    return 0
